"""The preload library: its C description, its build, and where built copies are kept.

The description has two halves, as cffi's embedding mode wants them:

* ``EXPORTS``: the functions the library defines (each answered in Python by
  :mod:`softrdma.exec.shim`), with the exact prototypes of verbs.h -- the C compiler sees
  both, so a prototype that differs (``__be64`` is ``unsigned long long``, not
  ``uint64_t``) fails the build instead of the program;
* ``TYPES``: the structures and enums the Python side touches, declared partially
  (``...``): cffi takes sizes and offsets from the installed header, never from us.

verbs.h turns some names into macros (``ibv_get_device_list`` becomes
``__ibv_get_device_list``, an inline wrapper); the source ``#undef``s each one it defines.

Built copies live in ``$XDG_CACHE_HOME/softrdma/exec/<key>/`` (default ``~/.cache``), the
key a hash of everything that decides the binary: this file, the shim's source, the
header, the Python and cffi versions. A build takes a few seconds, once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

__all__ = ["EXPORTS", "TYPES", "MODULE", "library_path", "build_library", "cache_dir"]

#: the cffi module name of the library (what the embedded code imports its ffi from)
MODULE = "_softrdma_exec"
VERBS_H = Path("/usr/include/infiniband/verbs.h")

EXPORTS = """
    struct ibv_device **ibv_get_device_list(int *num_devices);
    void ibv_free_device_list(struct ibv_device **list);
    const char *ibv_get_device_name(struct ibv_device *device);
    unsigned long long ibv_get_device_guid(struct ibv_device *device);
"""

TYPES = """
    enum ibv_node_type { IBV_NODE_UNKNOWN, IBV_NODE_CA, ... };
    enum ibv_transport_type { IBV_TRANSPORT_UNKNOWN, IBV_TRANSPORT_IB, ... };
    struct ibv_device {
        enum ibv_node_type node_type;
        enum ibv_transport_type transport_type;
        char name[...];
        char dev_name[...];
        char dev_path[...];
        char ibdev_path[...];
        ...;
    };
"""

#: names verbs.h defines as macros over inline wrappers: undefined before cffi's code
MACROS = ("ibv_get_device_list",)

SOURCE = "#include <infiniband/verbs.h>\n" + "".join(f"#undef {m}\n" for m in MACROS)

#: run by the embedded interpreter when the program first calls in: make softrdma
#: importable (the launcher's sys.path), then let the shim define every function
INIT = f"""
import os, sys
for p in reversed([p for p in os.environ.get("SOFTRDMA_EXEC_PATH", "").split(os.pathsep) if p]):
    if p not in sys.path:
        sys.path.insert(0, p)
from {MODULE} import ffi, lib
from softrdma.exec import shim
shim.install(ffi, lib)
"""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "softrdma" / "exec"


def _key() -> str:
    import cffi
    from . import shim
    h = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), Path(shim.__file__).read_bytes(),
                 VERBS_H.read_bytes() if VERBS_H.exists() else b"",
                 sys.version.encode(), cffi.__version__.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def build_library(target: Path) -> Path:
    """Build the library at ``target`` (gcc, the installed headers, this Python's
    libpython); OSError with the compiler's complaint if it cannot."""
    import cffi
    if not VERBS_H.exists():
        raise OSError(2, f"softrdma exec: {VERBS_H} is missing (Debian: libibverbs-dev)")
    ffi = cffi.FFI()
    ffi.embedding_api(EXPORTS)
    ffi.cdef(TYPES)
    ffi.set_source(MODULE, SOURCE)
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
