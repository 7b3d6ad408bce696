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
    struct ibv_context *ibv_open_device(struct ibv_device *device);
    int ibv_close_device(struct ibv_context *context);
    int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr);
    int ibv_query_port(struct ibv_context *context, uint8_t port_num,
                       struct _compat_ibv_port_attr *port_attr);
    int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index,
                      union ibv_gid *gid);
    int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num,
                           unsigned int index, int *type);
    int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size);
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
    struct ibv_context { struct ibv_device *device; int cmd_fd; int async_fd;
                         int num_comp_vectors; void *abi_compat; ...; };
    struct ibv_device_attr { char fw_ver[...]; unsigned long long node_guid;
        unsigned long long sys_image_guid; uint64_t max_mr_size; uint64_t page_size_cap;
        uint32_t vendor_id; uint32_t vendor_part_id; uint32_t hw_ver; int max_qp;
        int max_qp_wr; unsigned int device_cap_flags; int max_sge; int max_sge_rd;
        int max_cq; int max_cqe; int max_mr; int max_pd; int max_qp_rd_atom;
        int max_ee_rd_atom; int max_res_rd_atom; int max_qp_init_rd_atom;
        int max_ee_init_rd_atom; int atomic_cap; int max_ee; int max_rdd; int max_mw;
        int max_raw_ipv6_qp; int max_raw_ethy_qp; int max_mcast_grp;
        int max_mcast_qp_attach; int max_total_mcast_qp_attach; int max_ah; int max_fmr;
        int max_map_per_fmr; int max_srq; int max_srq_wr; int max_srq_sge;
        uint16_t max_pkeys; uint8_t local_ca_ack_delay; uint8_t phys_port_cnt; ...; };
    struct ibv_port_attr { int state; int max_mtu; int active_mtu; int gid_tbl_len;
        uint32_t port_cap_flags; uint32_t max_msg_sz; uint32_t bad_pkey_cntr;
        uint32_t qkey_viol_cntr; uint16_t pkey_tbl_len; uint16_t lid; uint16_t sm_lid;
        uint8_t lmc; uint8_t max_vl_num; uint8_t sm_sl; uint8_t subnet_timeout;
        uint8_t init_type_reply; uint8_t active_width; uint8_t active_speed;
        uint8_t phys_state; uint8_t link_layer; ...; };
    struct _compat_ibv_port_attr;
    union ibv_gid { uint8_t raw[16]; ...; };
"""

#: names verbs.h defines as macros over inline wrappers: undefined before cffi's code
MACROS = ("ibv_get_device_list", "ibv_query_port")

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
