#!/usr/bin/env python3
"""Record pyverbs' names of every rdma-core release into softrdma/pyverbs_compat/_manifest.py.

    python scripts/gen_pyverbs_manifest.py --rdma-core /path/to/rdma-core[.git] \
        [--first 44 --last 64]

The input is rdma-core's own git repository (a bare mirror is enough): for every release
tag vN.0 in the range, the script takes that release's tree (``git archive``) and reads, as
rdma-core's build does:

* the modules: ``pyverbs/CMakeLists.txt`` and ``pyverbs/providers/*/CMakeLists.txt`` name
  the Cython (``rdma_cython_module``) and Python (``rdma_python_module``) sources; each
  ``.pyx``/``.py`` named there is a module ``pyverbs.<dir>.<name>``;
* the enums: Cython exports every ``cpdef enum`` of a module's ``.pyx`` and of the
  ``.pxd`` of the same name (rdma-core 44's ``enums.pyx`` is a symlink to
  ``libibverbs_enums.pxd``, later ones declare them in ``libibverbs_enums.pxd``); a named
  ``cpdef enum X:`` becomes an enum class, an anonymous ``cpdef enum:`` module-level ints;
  module-level ``_NAME = NAME`` lines of a ``.pyx`` export a C constant under another name;
* the values: Cython takes them from the C headers (``cdef extern from '<...h>'``), so the
  script does too: it compiles, per release, a small C program of ours that includes that
  release's public headers (laid out as its ``publish_headers`` calls install them) and
  prints every name's value;
* classes (``cdef class``/``class`` at top level, with their first base) and functions
  (``def``/``cpdef`` at top level) of each module;
* the import lines (``import pyverbs...``/``from pyverbs... import ...``) of the release's
  ``tests/``, kept as data so tests/test_pyverbs_names.py can check that each resolves.

A name's value is its newest release's; ``SPAN`` records the first and last release of
every module and name (omitted when it is the whole range), ``CHANGED`` the names whose
value differs between releases. Nothing of rdma-core's is copied: only names and numbers.
"""
from __future__ import annotations

import argparse
import ast
import os
import pprint
import re
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "softrdma" / "pyverbs_compat" / "_manifest.py"
# the installed headers a pyverbs .pxd reads its enums from (driver.h, rdma-core's internal
# provider interface, does not build outside rdma-core: header_enum_values reads it)
PUBLIC = re.compile(r"^(infiniband|rdma)/[\w.-]+\.h$")


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True,
                          text=True).stdout


def release_tags(repo: str, first: int, last: int) -> list[str]:
    tags = set(git(repo, "tag").split())
    return [f"v{n}.0" for n in range(first, last + 1) if f"v{n}.0" in tags]


def checkout(repo: str, tag: str, dest: Path) -> None:
    dest.mkdir(parents=True)
    arch = subprocess.run(["git", "-C", repo, "archive", tag], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)


def include_tree(src: Path, inc: Path) -> None:
    """Lay the release's headers out as its publish_headers calls install them."""
    call = re.compile(r"publish(?:_internal)?_headers\(\s*(\"[^\"]*\"|\S+)([^)]*)\)", re.S)
    for cm in src.rglob("CMakeLists.txt"):
        for m in call.finditer(cm.read_text(errors="replace")):
            dest = m.group(1).strip('"')
            for f in m.group(2).split():
                p = cm.parent / f
                if p.suffix == ".h" and p.exists():
                    t = inc / dest / p.name
                    t.parent.mkdir(parents=True, exist_ok=True)
                    if not t.exists():
                        os.symlink(p.resolve(), t)


def modules(src: Path) -> dict[str, Path]:
    """pyverbs module name -> its source (.pyx or .py), from the CMakeLists."""
    out = {}
    for cm in [src / "pyverbs" / "CMakeLists.txt", *sorted((src / "pyverbs" / "providers")
                                                         .glob("*/CMakeLists.txt"))]:
        if not cm.exists():
            continue
        text = re.sub(r"#.*", "", cm.read_text())
        rel = cm.parent.relative_to(src / "pyverbs")
        pkg = "" if str(rel) == "." else str(rel).replace("/", ".") + "."
        for f in re.findall(r"([\w]+\.pyx|[\w]+\.py)\b", text):
            p = cm.parent / f
            name = f.rsplit(".", 1)[0]
            if p.exists() or p.is_symlink():
                out[pkg + name] = p
            if name == "__init__" and pkg:
                out[pkg[:-1]] = p
    return out


def joined_lines(text: str) -> list[str]:
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def parse_enums(text: str) -> tuple[dict, list, list]:
    """(named cpdef enums {class: [members]}, anonymous members, extern headers)."""
    named: dict[str, list[str]] = {}
    anon: list[str] = []
    headers = re.findall(r"cdef extern from ['\"]<?([^'\">]+)>?['\"]", text)
    cur, indent = None, -1
    for line in joined_lines(text):
        s = line.split("#")[0].rstrip()
        if not s.strip():
            continue
        ind = len(s) - len(s.lstrip())
        m = re.match(r"\s*cpdef enum(?:\s+(\w+))?\s*:", s)
        if m:
            cur = named.setdefault(m.group(1), []) if m.group(1) else anon
            indent = ind
            continue
        if cur is not None and ind > indent:
            mm = re.match(r"\s*(\w+)", s)
            if mm and mm.group(1) not in cur:
                cur.append(mm.group(1))
            continue
        cur = None
    return named, anon, headers


def parse_pyx(text: str) -> tuple[dict, list, dict]:
    """(classes {name: first base}, functions, exported C constants {py name: C name})."""
    classes, funcs, consts = {}, [], {}
    for line in joined_lines(text):
        m = re.match(r"(?:cdef\s+)?class\s+(\w+)\s*(?:\(([^)]*)\))?\s*:", line)
        if m:
            classes[m.group(1)] = (m.group(2) or "").split(",")[0].strip().split(".")[-1]
            continue
        m = re.match(r"(?:def|cpdef)\s+(?:[\w.]+\s+)?(\w+)\s*\(", line)
        if m:
            funcs.append(m.group(1))
            continue
        m = re.match(r"(\w+)\s*=\s*(?:<\s*(\w+)\s*>\s*)?(?:\w+\.)?([A-Z_][A-Z0-9_]*)\s*$",
                     line)
        if m and m.group(1) != m.group(3) or (m and m.group(2)):
            consts[m.group(1)] = (m.group(3), m.group(2) or "")
            continue
        m = re.match(r"(\w+)\s*=\s*(0[xX][0-9a-fA-F]+|\d+)\s*(?:#.*)?$", line)
        if m:
            consts[m.group(1)] = (m.group(2), "literal")
            continue
        m = re.match(r"from\s+[\w.]+\s+import\s+\(?([\w\s,]+)\)?\s*$", line)
        if m:  # a Python import at module level: the name is the module's too
            funcs += [n.split(" as ")[-1].strip() for n in m.group(1).split(",") if n.strip()]
    return classes, funcs, consts


def parse_py(text: str) -> tuple[dict, list, dict]:
    classes, funcs, ints = {}, [], {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef):
            b = node.bases[0] if node.bases else None
            classes[node.name] = getattr(b, "id", getattr(b, "attr", "")) if b else ""
        elif isinstance(node, ast.FunctionDef):
            funcs.append(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            funcs += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                type(node.value.value) is int:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    ints[t.id] = node.value.value
    return classes, funcs, ints


def c_values(names: set[str], headers: list[str], inc: Path, work: Path) -> dict[str, int]:
    """Compile a program of ours against the release's headers; print each name's value."""
    names = set(names)
    headers = [h for h in dict.fromkeys(headers) if (inc / h).exists() or h.startswith("sys/")]
    for _ in range(12):
        prog = ["#include <stdio.h>", "#include <stdint.h>", "#include <sys/socket.h>",
                "#include <netinet/in.h>"]
        prog += [f"#include <{h}>" for h in headers]
        prog += ["int main(void) {"]
        prog += [f'  printf("%s %lld\\n", "{n}", (long long)({n}));' for n in sorted(names)]
        prog += ["  return 0; }"]
        (work / "v.c").write_text("\n".join(prog) + "\n")
        r = subprocess.run(["gcc", "-w", "-I", str(inc), "-o", str(work / "v"),
                            str(work / "v.c")], capture_output=True, text=True)
        if r.returncode == 0:
            break
        bad = set(re.findall(r"['‘](\w+)['’] undeclared", r.stderr))
        missing = re.findall(r"fatal error: ([\w/.-]+): No such file", r.stderr)
        broken = re.findall(r"In file included from [^:]*v\.c:\d+:\d*:?\s*\n?", r.stderr)
        if missing or (not bad and headers):
            # a header that does not build outside rdma-core: drop the last one it names
            first = next((h for h in headers if h in r.stderr), headers[-1])
            headers.remove(first)
            continue
        if not bad:
            raise RuntimeError(r.stderr[-3000:])
        names -= bad
        del broken
    else:
        raise RuntimeError("could not compile the value program")
    out = subprocess.run([str(work / "v")], check=True, capture_output=True, text=True).stdout
    return {n: int(v) for n, v in (line.split() for line in out.splitlines())}


def header_enum_values(names: set[str], inc: Path) -> dict[str, int]:
    """Values of enum members in headers that do not compile outside rdma-core (driver.h):
    read the ``enum {...}`` bodies and count as C does (a member is the previous plus one
    unless given; values given as integers, shifts and names of the same header)."""
    found: dict[str, int] = {}
    for h in inc.rglob("*.h"):
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", h.read_text(errors="replace"), flags=re.S)
        for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", text):
            if not any(re.search(rf"\b{n}\b", body) for n in names - set(found)):
                continue
            nxt, local = 0, {}
            for item in body.split(","):
                item = item.strip()
                if not item:
                    continue
                name, _, expr = item.partition("=")
                name = name.strip()
                if expr.strip():
                    e = re.sub(r"(\d)[uUlL]+\b", r"\1", expr.strip())
                    try:
                        nxt = int(eval(e, {"__builtins__": {}}, dict(local)))
                    except Exception:  # noqa: BLE001 - not a constant we can count: skip
                        break
                local[name] = nxt
                nxt += 1
            found.update({k: v for k, v in local.items() if k in names})
    return found


def import_lines(src: Path) -> set[str]:
    lines = set()
    for f in sorted((src / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(errors="replace"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyverbs"):
                for a in node.names:
                    lines.add(f"from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("pyverbs"):
                        lines.add(f"import {a.name}")
    return lines


def scan_release(repo: str, tag: str, tmp: Path) -> dict:
    src = tmp / tag / "src"
    checkout(repo, tag, src)
    inc = tmp / tag / "include"
    include_tree(src, inc)
    rel = {"modules": {}, "imports": import_lines(src)}
    want: set[str] = set()
    headers: list[str] = []
    for mod, path in sorted(modules(src).items()):
        text = path.read_text(errors="replace") if not path.is_symlink() else ""
        if path.is_symlink():  # rdma-core 44: enums.pyx -> libibverbs_enums.pxd
            text = (path.parent / os.readlink(path)).read_text()
        named, anon, hdrs = {}, [], []
        classes, funcs, consts, ints = {}, [], {}, {}
        if path.suffix == ".pyx":
            pxd = path.with_suffix(".pxd")
            for t in (text, pxd.read_text() if pxd.exists() and not path.is_symlink() else ""):
                n, a, h = parse_enums(t)
                for k, v in n.items():
                    named.setdefault(k, []).extend(x for x in v if x not in named.get(k, []))
                anon += [x for x in a if x not in anon]
                hdrs += h
            classes, funcs, consts = parse_pyx(text)
        else:
            classes, funcs, ints = parse_py(text)
        headers += [h for h in hdrs if PUBLIC.match(h) or h.startswith("sys/")]
        want |= {m for v in named.values() for m in v} | set(anon) | \
            {c for c, cast in consts.values() if cast != "literal"}
        rel["modules"][mod] = dict(named=named, anon=anon, classes=classes, funcs=funcs,
                                   consts=consts, ints=ints)
    rel["values"] = c_values(want, headers, inc, tmp / tag)
    rel["values"].update(header_enum_values(want - set(rel["values"]), inc))
    return rel


def merge(tags: list[str], rels: dict[str, dict]) -> dict:
    enums: dict = {}
    ints: dict = {}
    classes: dict = {}
    funcs: dict = {}
    seen: dict[tuple, list[str]] = {}
    vals: dict[tuple, dict[str, int]] = {}

    def see(key: tuple, tag: str, value: int | None = None) -> None:
        seen.setdefault(key, []).append(tag)
        if value is not None:
            vals.setdefault(key, {})[tag] = value

    for tag in tags:  # oldest first: the newest value is written last and wins
        rel = rels[tag]
        v = rel["values"]
        for mod, d in rel["modules"].items():
            see((mod,), tag)
            for cname, members in d["named"].items():
                see((mod, cname), tag)
                cls = enums.setdefault(mod, {}).setdefault(cname, ("IntEnum", {}))[1]
                for m in members:
                    if m in v:
                        cls[m] = v[m]
                        see((mod, m), tag, v[m])
            for m in d["anon"]:
                if m in v:
                    ints.setdefault(mod, {})[m] = v[m]
                    see((mod, m), tag, v[m])
            for py, (c, cast) in d["consts"].items():
                if cast == "literal":
                    ints.setdefault(mod, {})[py] = int(c, 0)
                    see((mod, py), tag, int(c, 0))
                elif c in v:
                    x = v[c] % (1 << 64) if cast == "size_t" else v[c]
                    ints.setdefault(mod, {})[py] = x
                    see((mod, py), tag, x)
            for n, x in d["ints"].items():
                ints.setdefault(mod, {})[n] = x
                see((mod, n), tag, x)
            for n, b in d["classes"].items():
                classes.setdefault(mod, {})[n] = b
                see((mod, n), tag)
            fl = funcs.setdefault(mod, [])
            for n in d["funcs"]:
                if n not in fl:
                    fl.append(n)
                see((mod, n), tag)
    for mod in list(enums) + list(ints) + list(classes) + list(funcs):
        for t in (enums, ints, classes, funcs):
            t.setdefault(mod, {} if t is not funcs else [])
    full = (tags[0], tags[-1])
    span = {".".join(k): (s[0], s[-1]) for k, s in seen.items() if (s[0], s[-1]) != full}
    changed = {".".join(k): d for k, d in vals.items() if len(set(d.values())) > 1}
    imports = sorted(set().union(*(rels[t]["imports"] for t in tags)))
    return dict(enums=enums, ints=ints, classes=classes, funcs={k: sorted(v) for k, v in
                                                                 funcs.items()},
                span=span, changed=changed, imports=imports, tags=tags)


def write(m: dict, out: Path) -> None:
    def fmt(x: object) -> str:
        return pprint.pformat(x, width=100, sort_dicts=True)

    with open(out, "w") as f:
        f.write(f'"""Generated by scripts/gen_pyverbs_manifest.py from rdma-core\'s sources, '
                f'releases {m["tags"][0]}..{m["tags"][-1]}; do not edit."""\n\n')
        f.write(f"RELEASES = {fmt(m['tags'])}\n\n")
        f.write("# module -> enum class -> (base, {member: C value of the newest release})\n")
        f.write("ENUMS = " + fmt(m["enums"]) + "\n\n")
        f.write("# module -> integer constants that are not enum members (anonymous cpdef\n"
                "# enums, a .pyx's `_NAME = NAME` exports, a .py's int constants)\n")
        f.write("INTS = " + fmt(m["ints"]) + "\n\n")
        f.write("# module -> class -> its first base class\n")
        f.write("CLASSES = " + fmt(m["classes"]) + "\n\n")
        f.write("# module -> functions\n")
        f.write("FUNCTIONS = " + fmt(m["funcs"]) + "\n\n")
        f.write("# 'module' or 'module.name' -> (first release, last release), where not all\n")
        f.write("SPAN = " + fmt(m["span"]) + "\n\n")
        f.write("# 'module.name' -> {release: value}: names whose C value changed (newest used)\n")
        f.write("CHANGED = " + fmt(m["changed"]) + "\n\n")
        f.write("# every pyverbs import of the releases' tests/, one name per line\n")
        f.write("TEST_IMPORTS = " + fmt(m["imports"]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rdma-core", required=True, help="rdma-core git directory (bare is fine)")
    ap.add_argument("--first", type=int, default=44)
    ap.add_argument("--last", type=int, default=64)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    tags = release_tags(a.rdma_core, a.first, a.last)
    rels = {}
    with tempfile.TemporaryDirectory() as td:
        for tag in tags:
            rels[tag] = scan_release(a.rdma_core, tag, Path(td))
            print(tag, len(rels[tag]["modules"]), "modules,", len(rels[tag]["values"]),
                  "C values", file=sys.stderr)
    write(merge(tags, rels), a.out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
