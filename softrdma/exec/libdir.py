"""The ``LD_LIBRARY_PATH`` form: a directory holding ``libibverbs.so.1`` and
``librdmacm.so.1`` that *are* softrdma, for launchers that cannot preload.

With ``LD_LIBRARY_PATH=DIR`` the dynamic linker finds the program's ``libibverbs.so.1``
and ``librdmacm.so.1`` in DIR instead of the system's, so the real libraries are never
loaded at all. Programs reference libibverbs' functions by *version*
(``ibv_get_device_list@IBVERBS_1.1``, ``rdma_connect@RDMACM_1.0``), and the linker checks
that the library it found defines every version the program needs -- a library without
them loads with a warning per program, and one defining the wrong ones does not load.
So DIR's library is the preload library built again with a version script made from the
installed libraries themselves (their version definitions, and the version each function
is exported under by default: :func:`version_script`). One object serves both names:
``librdmacm.so.1`` is a symbolic link to ``libibverbs.so.1``, and the dynamic linker,
which recognises a file it has already loaded, maps it once (one interpreter, one set of
handles, whichever name the program asked for). Programs that link a provider library
themselves (perftest: libmlx5, libefa) also need what libibverbs exports to providers
only; those symbols are defined inert (:func:`private_stubs`).

The compatibility versions libibverbs keeps for programs linked before 2006
(``ibv_get_device_list@IBVERBS_1.0``, the old structure layouts) are not defined: such a
program stops at load time with "version ... not found", as it would with a
libibverbs built without them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
from pathlib import Path

from . import abi

__all__ = ["REAL_LIBRARIES", "real_library", "exports", "version_script", "private_stubs",
           "library_dir"]

#: the sonames the directory provides, first the one the built file is named after
REAL_LIBRARIES = ("libibverbs.so.1", "librdmacm.so.1")


def real_library(soname: str) -> Path:
    """Where the installed ``soname`` is (the multiarch directories Debian uses)."""
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    for d in (f"/lib/{arch}", f"/usr/lib/{arch}", "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        p = Path(d) / soname
        if p.exists():
            return p.resolve()
    raise OSError(2, f"softrdma exec: {soname} is not installed (Debian: "
                     f"{'libibverbs1' if 'verbs' in soname else 'librdmacm1'})")


_VERDEF = re.compile(r"^\s*\d+\s+0x00\s+0x[0-9a-f]+\s+(\S+)\s*$")
_EXPORT = re.compile(r"\s(DF|DO)\s+(\S+)\s+([0-9a-f]+)\s+(\S+)\s+(\S+)\s*$")


def _objdump(*args: str) -> str:
    try:
        return subprocess.run(["objdump", *args], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise OSError(5, f"softrdma exec: objdump {' '.join(args)}: {e}") from None


def exports(libraries: list[Path] | None = None) -> dict[str, dict[str, tuple[str, int]]]:
    """version node -> {name: (kind, size)} of what the installed ``libraries`` export by
    default (``name@@VERSION``; kind ``DF`` a function, ``DO`` an object of ``size``
    bytes), every version node they define included, in their order."""
    libraries = libraries or [real_library(s) for s in REAL_LIBRARIES]
    nodes: dict[str, dict[str, tuple[str, int]]] = {}
    for lib in libraries:
        for line in _objdump("-p", str(lib)).split("Version definitions:")[-1] \
                .split("Version References:")[0].splitlines():
            m = _VERDEF.match(line)
            if m:
                nodes.setdefault(m.group(1), {})
        for line in _objdump("-T", str(lib)).splitlines():
            m = _EXPORT.search(line)
            # *UND*: imported; "(VERSION)": a compatibility version, not the default
            if m and m.group(2) not in ("*UND*", "*ABS*") and not m.group(4).startswith("("):
                nodes.setdefault(m.group(4), {})[m.group(5)] = (m.group(1), int(m.group(3), 16))
    return nodes


def _private(node: str) -> bool:
    return "PRIVATE" in node


def version_script(nodes: dict[str, dict[str, tuple[str, int]]] | None = None) -> str:
    """A linker version script giving each function of the ABI the version it has by
    default in the installed libraries, and each provider-private symbol
    (:func:`private_stubs`) its version, with every version node they define, in their
    order; everything else of the library is local."""
    nodes = nodes if nodes is not None else exports()
    ours = set(abi.ABI_NAMES)
    out = []
    for i, (node, syms) in enumerate(nodes.items()):
        names = sorted(n for n in syms if n in ours or _private(node))
        body = "".join(f" {n};" for n in names)
        out.append(f"{node} {{{' global:' + body if body else ''}"
                   f"{' local: *;' if i == 0 else ''} }};")
    return "\n".join(out) + "\n"


def private_stubs(nodes: dict[str, dict[str, tuple[str, int]]] | None = None) -> str:
    """C for the symbols libibverbs exports only to its providers (``IBVERBS_PRIVATE_34``:
    ``verbs_register_driver_34``, ``ibv_cmd_*``, ...). Programs that link a provider
    directly (perftest links libmlx5 and libefa for their direct verbs) load it with
    every symbol bound at once, so these must exist; no softrdma device is ever a
    provider's, so none does anything: each function fails with EOPNOTSUPP (the
    ``ibv_cmd_*`` commands return it, the rest return NULL or 0; a provider's
    constructor registering its driver is ignored), each object is zeroes."""
    nodes = nodes if nodes is not None else exports()
    out = ["/* softrdma.exec.libdir: provider-private symbols, inert (glue, not logic) */",
           "#include <errno.h>"]
    for node, syms in nodes.items():
        if not _private(node):
            continue
        for name, (kind, size) in sorted(syms.items()):
            if name in abi.ABI_NAMES or name == node:
                continue
            if kind == "DO":
                out.append(f"char {name}[{max(size, 1)}];")
            elif name.startswith("ibv_cmd_") or name == "execute_ioctl":  # return errnos
                out.append(f"int {name}(void) {{ errno = EOPNOTSUPP; return EOPNOTSUPP; }}")
            else:  # pointers (NULL), void, counts
                out.append(f"long {name}(void) {{ errno = EOPNOTSUPP; return 0; }}")
    return "\n".join(out) + "\n"


def library_dir(rebuild: bool = False) -> Path:
    """The directory for ``LD_LIBRARY_PATH``, built on first use beside the preload
    library (same cache key: same sources, same Python)."""
    from .build import build_library, library_path
    base = library_path().parent / "lib"
    target = base / REAL_LIBRARIES[0]
    if rebuild or not target.exists():
        base.mkdir(parents=True, exist_ok=True)
        nodes = exports()
        script = base / f"versions-{os.getpid()}.map"
        stubs = base / f"private-{os.getpid()}.c"
        obj = stubs.with_suffix(".o")
        script.write_text(version_script(nodes))
        stubs.write_text(private_stubs(nodes))
        try:
            r = subprocess.run(["gcc", "-c", "-fPIC", "-O1", str(stubs), "-o", str(obj)],
                               capture_output=True, text=True)
            if r.returncode:
                raise OSError(5, f"softrdma exec: compiling {stubs.name}: {r.stderr.strip()}")
            build_library(target, link_args=[f"-Wl,--version-script={script}",
                                              f"-Wl,-soname,{REAL_LIBRARIES[0]}", str(obj)])
        finally:
            for f in (script, stubs, obj):
                f.unlink(missing_ok=True)
    for other in REAL_LIBRARIES[1:]:
        link = base / other
        if not link.is_symlink():
            tmp = base / f".{other}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(REAL_LIBRARIES[0])
            os.replace(tmp, link)  # atomic, as the build's rename
    return base
