"""Check the ctypes layouts of :mod:`softrdma.ibverbs.ffi` against the installed verbs.h.

:func:`c_program` walks every field of every ctypes struct (nested structs and unions too;
an anonymous union's members are named as C names them, without the union) and writes a C
program printing ``offsetof``, ``sizeof`` and ``_Alignof`` of each, and of each struct.
:func:`check` compiles it with gcc against ``<infiniband/verbs.h>``, runs it and compares
every number with what ctypes computed. A mismatch means the binding would read or write
the wrong bytes of a libibverbs struct: the backend must not be used.

    python -m softrdma.ibverbs.layout      # prints "N checks, 0 mismatches" (exit 1 if any)
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from ctypes import Structure, Union
from typing import Iterator

__all__ = ["expected", "c_program", "check", "toolchain_missing", "LayoutError"]

Row = tuple[str, str, int, int, int]  # (C type, member path or "", offset, size, align)

# what the ibverbs structs are checked against (sa.h and the uAPI headers: path records and
# the kernel ABI structs of ibv_copy_*_kern)
VERBS_H = ("infiniband/verbs.h", "infiniband/sa.h", "rdma/ib_user_sa.h", "rdma/ib_user_verbs.h")


class LayoutError(RuntimeError):
    """gcc or the header is missing, or the program failed to build or run."""


def _walk(t: type, prefix: list[str], base: int) -> Iterator[tuple[str, int, int, int]]:
    anon = set(getattr(t, "_anonymous_", ()))
    for f in t._fields_:
        name, ft = f[0], f[1]
        off = base + getattr(t, name).offset
        path = prefix if name in anon else prefix + [name]
        if name not in anon:
            yield ".".join(path), off, ctypes.sizeof(ft), ctypes.alignment(ft)
        if isinstance(ft, type) and issubclass(ft, (Structure, Union)):
            yield from _walk(ft, path, off)


def expected(structs: dict[str, type]) -> list[Row]:
    """What ctypes says: one row per struct (path "") and per member."""
    rows: list[Row] = []
    for cname, t in structs.items():
        rows.append((cname, "", 0, ctypes.sizeof(t), ctypes.alignment(t)))
        rows += [(cname, p, o, s, a) for p, o, s, a in _walk(t, [], 0)]
    return rows


def c_program(rows: list[Row], headers: tuple[str, ...] = VERBS_H) -> str:
    """A C program printing the same rows as the compiler sees them (after ``headers``)."""
    out = ["#include <stddef.h>", "#include <stdio.h>",
           *(f"#include <{h}>" for h in headers), "int main(void) {"]
    for cname, path, *_ in rows:
        if not path:
            out.append(f'  printf("%zu %zu %zu\\n", (size_t)0, sizeof({cname}), '
                       f'(size_t)_Alignof({cname}));')
        else:
            m = f"(({cname} *)0)->{path}"
            out.append(f'  printf("%zu %zu %zu\\n", offsetof({cname}, {path}), sizeof({m}), '
                       f'(size_t)__alignof__({m}));')
    out += ["  return 0;", "}", ""]
    return "\n".join(out)


def toolchain_missing(headers: tuple[str, ...] = VERBS_H,
                      package: str = "libibverbs-dev") -> str | None:
    """Why the check cannot run here (no gcc, a header missing), or None."""
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    hdr = subprocess.run([cc, "-E", "-x", "c", "-"],
                         input="".join(f"#include <{h}>\n" for h in headers),
                         capture_output=True, text=True)
    if hdr.returncode:
        return f"{headers[-1]} not found (install {package})"
    return None


def compiled(rows: list[Row], headers: tuple[str, ...] = VERBS_H,
             package: str = "libibverbs-dev") -> list[tuple[int, int, int]]:
    """Build and run the program; its ``(offset, size, align)`` lines."""
    why = toolchain_missing(headers, package)
    if why:
        raise LayoutError(why)
    cc = os.environ.get("CC", "gcc")
    with tempfile.TemporaryDirectory(prefix="ibv-layout-") as d:
        src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
        with open(src, "w") as fh:
            fh.write(c_program(rows, headers))
        r = subprocess.run([cc, "-std=gnu11", "-o", exe, src], capture_output=True, text=True)
        if r.returncode:
            raise LayoutError(f"the layout program does not compile:\n{r.stderr[-2000:]}")
        r = subprocess.run([exe], capture_output=True, text=True, check=True)
    return [tuple(int(x) for x in line.split()) for line in r.stdout.splitlines()]  # type: ignore[misc]


def check(structs: dict[str, type] | None = None, headers: tuple[str, ...] = VERBS_H,
          package: str = "libibverbs-dev") -> tuple[int, list[str]]:
    """``(number of checks, mismatches)``; each mismatch names the struct, the member and
    both values: ``struct ibv_wc.imm_data: ctypes offset 24 size 2 align 2, C 24 4 4``.
    ``headers`` (and the Debian ``package`` that has them) default to verbs.h's."""
    if structs is None:
        from .ffi import STRUCTS as structs
    rows = expected(structs)
    got = compiled(rows, headers, package)
    bad = []
    for (cname, path, *mine), theirs in zip(rows, got):
        if tuple(mine) != theirs:
            bad.append(f"{cname}{'.' + path if path else ''}: ctypes offset {mine[0]} size "
                       f"{mine[1]} align {mine[2]}, C {theirs[0]} {theirs[1]} {theirs[2]}")
    return len(rows), bad


def main() -> int:
    try:
        n, bad = check()
    except LayoutError as e:
        print(f"layout check cannot run: {e}", file=sys.stderr)
        return 2
    for b in bad:
        print(b)
    print(f"{n} checks, {len(bad)} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
