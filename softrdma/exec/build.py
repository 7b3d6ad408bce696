"""The preload library: its C description, its build, and where built copies are kept.

The description has two halves, as cffi's embedding mode wants them:

* the exported functions: every function of :data:`softrdma.exec.abi.ABI_NAMES`, with the
  installed headers' prototypes -- the C compiler sees both, so a prototype that differs
  (``__be64`` is ``unsigned long long``, not ``uint64_t``) fails the build instead of the
  program. Each is answered in Python by one of :data:`PARTS`, or by a stub;
* the types: the structures and enums the Python side touches, declared partially
  (``...``) by the part that reads them: cffi takes sizes and offsets from the installed
  header, never from us.

verbs.h turns some names into macros (``ibv_get_device_list`` becomes
``__ibv_get_device_list``, an inline wrapper); the source ``#undef``s each one.

Built copies live in ``$XDG_CACHE_HOME/softrdma/exec/<key>/`` (default ``~/.cache``), the
key a hash of everything that decides the binary: the sources of this package, the
header, the Python and cffi versions. A build takes a few seconds, once.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from ..ibverbs import cdecls
from . import abi, process

__all__ = ["PARTS", "MODULE", "library_path", "build_library", "cache_dir", "implemented"]

#: the cffi module name of the library (what the embedded code imports its ffi from)
MODULE = "_softrdma_exec"
VERBS_H = Path("/usr/include/infiniband/verbs.h")

#: the modules that answer the ABI, each with ``IMPLEMENTS`` (function names of
#: :data:`softrdma.exec.abi.ABI_NAMES`), optional ``TYPES`` and ``CALLBACKS`` (cffi
#: declarations) and ``install(ffi, lib)``; what none implements gets a stub
PARTS = ("devices", "verbs", "queues", "misc", "extended", "cma_addr", "cma", "cma_conn",
         "cma_qp", "rsocket")


def parts() -> list[Any]:
    import importlib
    return [importlib.import_module(f"softrdma.exec.{p}") for p in PARTS]


def implemented() -> dict[str, str]:
    """ABI name -> the part that implements it."""
    out: dict[str, str] = {}
    for mod in parts():
        for name in mod.IMPLEMENTS:
            if name not in abi.ABI_NAMES:
                raise ValueError(f"{mod.__name__} implements {name}, not in the ABI")
            if name in out:
                raise ValueError(f"{name} implemented by {out[name]} and {mod.__name__}")
            out[name] = mod.__name__
    return out


def cdefs() -> tuple[str, str]:
    """(types and callbacks, exported prototypes) for cffi. The structures are
    :mod:`softrdma.ibverbs.cdecls`'s, the description the ctypes backend is built from
    too; the parts add enums with the constants they use, and glibc's types."""
    types = [cdecls.CFFI_TYPEDEFS, abi.TYPES] + [getattr(m, "TYPES", "") for m in parts()]
    enums = set(re.findall(r"\benum\s+(\w+)\s*\{", "\n".join(types)))
    types.append(cdecls.cffi_cdef(declared_enums=enums, typedefs=False))
    types += [abi.CALLBACKS] + [getattr(m, "CALLBACKS", "") for m in parts()]
    decl = abi.declarations(abi.PROTOTYPES)
    return "\n".join(types), "\n".join(decl[n] + ";" for n in decl)


SOURCE = ("".join(f"#include <{h}>\n" for h in abi.HEADERS)
          + "".join(f"#undef {m}\n" for m in abi.MACROS) + abi.EXTRA_C)


def package_root() -> str:
    """The directory softrdma is imported from (what ``SOFTRDMA_EXEC_PATH`` names)."""
    return str(Path(__file__).resolve().parents[2])


#: run by the embedded interpreter when the program first calls in (after
#: :mod:`.process`'s glue started it, or found the program's own): the ``softrdma``
#: package imported from its root -- ``SOFTRDMA_EXEC_PATH``, else the root the library was
#: built from -- by location, so nothing else of that directory (its ``tests`` package:
#: rdma-core's suite has one too) lands on a Python program's sys.path; then the shim
#: defines every function
INIT_TEMPLATE = """
import importlib.util, os, sys
if "softrdma" not in sys.modules:
    for root in [p for p in os.environ.get("SOFTRDMA_EXEC_PATH", "").split(os.pathsep)
                 if p] or [{root!r}]:
        pkg = os.path.join(root, "softrdma")
        if os.path.exists(os.path.join(pkg, "__init__.py")):
            spec = importlib.util.spec_from_file_location(
                "softrdma", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
            mod = importlib.util.module_from_spec(spec)
            sys.modules["softrdma"] = mod
            spec.loader.exec_module(mod)
            break
from {module} import ffi, lib
from softrdma.exec import shim
shim.install(ffi, lib)
"""
INIT = INIT_TEMPLATE.format(root=package_root(), module=MODULE)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "softrdma" / "exec"


def _key() -> str:
    import cffi
    from . import shim
    h = hashlib.sha256()
    sources = [Path(__file__), Path(shim.__file__), Path(abi.__file__), Path(process.__file__),
               Path(__file__).with_name("libdir.py"), Path(cdecls.__file__)]
    sources += [Path(m.__file__) for m in parts()]
    for part in ([p.read_bytes() for p in sources] + [
                 VERBS_H.read_bytes() if VERBS_H.exists() else b"",
                 sys.version.encode(), cffi.__version__.encode(),
                 # baked into the library: the Python a C host starts, softrdma's root
                 sys.executable.encode(), package_root().encode()]):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def build_library(target: Path, link_args: list[str] | None = None) -> Path:
    """Build the library at ``target`` (gcc, the installed headers, this Python's
    libpython; ``link_args`` for the linker: :mod:`.libdir`'s version script); OSError
    with the compiler's complaint if it cannot."""
    import cffi
    if not VERBS_H.exists():
        raise OSError(2, f"softrdma exec: {VERBS_H} is missing (Debian: libibverbs-dev)")
    ffi = cffi.FFI()
    types, exports = cdefs()
    ffi.cdef(types)
    ffi.embedding_api(exports)
    import _cffi_backend
    ffi.set_source(MODULE, SOURCE + process.c_source(sys.executable, _cffi_backend.__file__),
                   # verbs.h's eth_mac[6]; a struct member of another type than the header's
                   extra_compile_args=["-Wno-array-parameter", *cdecls.CFFI_COMPILE_ARGS],
                   extra_link_args=link_args or [])
    ffi.embedding_init_code(INIT)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"build-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        out = ffi.compile(tmpdir=str(tmp), target=str(tmp / target.name), verbose=False)
    except Exception as e:  # cffi's VerificationError carries gcc's complaint
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(5, f"softrdma exec: building the preload library failed: {e}") from None
    try:
        os.replace(out, target)  # atomic: a concurrent launcher sees all or nothing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def library_path(rebuild: bool = False) -> Path:
    """The preload library for this installation, built on first use."""
    target = cache_dir() / _key() / "libsoftrdma_exec.so"
    if rebuild or not target.exists():
        build_library(target)
    return target
