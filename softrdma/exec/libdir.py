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
handles, whichever name the program asked for).

The compatibility versions libibverbs keeps for programs linked before 2006
(``ibv_get_device_list@IBVERBS_1.0``, the old structure layouts) are not defined: such a
program stops at load time with "version ... not found", as it would with a
libibverbs built without them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

from . import abi

__all__ = ["REAL_LIBRARIES", "real_library", "version_script", "library_dir"]

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
_DEFAULT = re.compile(r"\sDF\s+\.text\s+[0-9a-f]+\s+(\S+)\s+(\S+)\s*$")


def _objdump(*args: str) -> str:
    try:
        return subprocess.run(["objdump", *args], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise OSError(5, f"softrdma exec: objdump {' '.join(args)}: {e}") from None


def version_script(libraries: list[Path] | None = None) -> str:
    """A linker version script giving each function of the ABI the version it has by
    default in the installed ``libraries`` (``name@@VERSION``), with every version node
    they define, in their order; everything else of the library is local."""
    libraries = libraries or [real_library(s) for s in REAL_LIBRARIES]
    ours = set(abi.ABI_NAMES)
    nodes: dict[str, list[str]] = {}
    for lib in libraries:
        for line in _objdump("-p", str(lib)).split("Version definitions:")[-1] \
                .split("Version References:")[0].splitlines():
            m = _VERDEF.match(line)
            if m:
                nodes.setdefault(m.group(1), [])
        for line in _objdump("-T", str(lib)).splitlines():
            m = _DEFAULT.search(line)
            # a version in parentheses is a compatibility one, not the default
            if m and not m.group(1).startswith("(") and m.group(2) in ours:
                nodes.setdefault(m.group(1), []).append(m.group(2))
    out = []
    for i, (node, names) in enumerate(nodes.items()):
        body = "".join(f" {n};" for n in sorted(set(names)))
        out.append(f"{node} {{{' global:' + body if body else ''}"
                   f"{' local: *;' if i == 0 else ''} }};")
    return "\n".join(out) + "\n"


def library_dir(rebuild: bool = False) -> Path:
    """The directory for ``LD_LIBRARY_PATH``, built on first use beside the preload
    library (same cache key: same sources, same Python)."""
    from .build import build_library, library_path
    base = library_path().parent / "lib"
    target = base / REAL_LIBRARIES[0]
    if rebuild or not target.exists():
        base.mkdir(parents=True, exist_ok=True)
        script = base / f"versions-{os.getpid()}.map"
        script.write_text(version_script())
        try:
            build_library(target, link_args=[f"-Wl,--version-script={script}",
                                              f"-Wl,-soname,{REAL_LIBRARIES[0]}"])
        finally:
            script.unlink(missing_ok=True)
    for other in REAL_LIBRARIES[1:]:
        link = base / other
        if not link.is_symlink():
            tmp = base / f".{other}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(REAL_LIBRARIES[0])
            os.replace(tmp, link)  # atomic, as the build's rename
    return base
