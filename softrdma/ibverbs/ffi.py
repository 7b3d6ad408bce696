"""libibverbs through ctypes: struct layouts, exported prototypes, ``ibv_context.ops`` callers.

The structs are :mod:`softrdma.ibverbs.cdecls`'s, the one description of rdma-core 44's
structures (x86_64) that :mod:`softrdma.exec` builds its preload library from too; every
later release only grows them at their ends (``verbs_context`` at its front).
:mod:`softrdma.ibverbs.layout` checks each layout against the installed header with a
generated C program.

The library is loaded lazily by :func:`lib`: ``CDLL("libibverbs.so.1", use_errno=True)``
the first time a verb is needed. An absent library gives ``None`` (no output, no
exception): the caller falls back to the soft device. ctypes binds the default version of
each symbol (``@@IBVERBS_1.1``, never the pre-1.1 ``@IBVERBS_1.0`` ABI).

The data-path verbs (``ibv_post_send``, ``ibv_poll_cq``, ``ibv_req_notify_cq``,
``ibv_post_recv``, ``ibv_post_srq_recv``, ``ibv_alloc_mw``, ``ibv_bind_mw``,
``ibv_dealloc_mw``) are ``static inline`` in verbs.h and are not exported: they call the
provider through ``context->ops``. :class:`Ops` reads those slots once per context and
wraps each as a ``CFUNCTYPE`` taking plain ``void*`` ints (cheaper than typed pointers).
``ibv_query_port`` is a macro calling ``verbs_context->query_port`` with the caller's
``sizeof``; :func:`query_port` does the same container_of step, checking ``abi_compat``
and ``sz`` as ``verbs_get_ctx_op`` does.
"""

from __future__ import annotations

import ctypes
import errno
from ctypes import (CFUNCTYPE, POINTER, c_int, c_size_t, c_uint8, c_uint16, c_uint32, c_uint64,
                    c_void_p, sizeof)
from typing import Any

from . import cdecls

__all__ = ["lib", "load_error", "STRUCTS", "Ops", "query_port", "UINTPTR_MAX"]

UINTPTR_MAX = (1 << 64) - 1 if sizeof(c_void_p) == 8 else (1 << 32) - 1
IBV_SYSFS_NAME_MAX = cdecls.CONSTANTS["IBV_SYSFS_NAME_MAX"]
IBV_SYSFS_PATH_MAX = cdecls.CONSTANTS["IBV_SYSFS_PATH_MAX"]

# The structs, from the one description both directions share (softrdma.ibverbs.cdecls).
# Every pointer member is a plain address (c_void_p): the data path stores ints, ~10x
# cheaper than ctypes.cast; assign an address, read an int (or None for NULL).
_T = cdecls.ctypes_types()
ibv_device = _T["struct ibv_device"]
ibv_context_ops = _T["struct ibv_context_ops"]
ibv_context = _T["struct ibv_context"]
verbs_context = _T["struct verbs_context"]
ibv_device_attr = _T["struct ibv_device_attr"]
ibv_device_attr_ex = _T["struct ibv_device_attr_ex"]
ibv_port_attr = _T["struct ibv_port_attr"]
ibv_gid = _T["union ibv_gid"]
ibv_gid_entry = _T["struct ibv_gid_entry"]
ibv_pd = _T["struct ibv_pd"]
ibv_mr = _T["struct ibv_mr"]
ibv_mw = _T["struct ibv_mw"]
ibv_mw_bind_info = _T["struct ibv_mw_bind_info"]
ibv_mw_bind = _T["struct ibv_mw_bind"]
ibv_comp_channel = _T["struct ibv_comp_channel"]
ibv_cq = _T["struct ibv_cq"]
ibv_cq_ex = _T["struct ibv_cq_ex"]
ibv_srq = _T["struct ibv_srq"]
ibv_srq_attr = _T["struct ibv_srq_attr"]
ibv_srq_init_attr = _T["struct ibv_srq_init_attr"]
ibv_qp = _T["struct ibv_qp"]
ibv_qp_ex = _T["struct ibv_qp_ex"]
ibv_ah = _T["struct ibv_ah"]
ibv_global_route = _T["struct ibv_global_route"]
ibv_ah_attr = _T["struct ibv_ah_attr"]
ibv_qp_cap = _T["struct ibv_qp_cap"]
ibv_qp_init_attr = _T["struct ibv_qp_init_attr"]
ibv_qp_init_attr_ex = _T["struct ibv_qp_init_attr_ex"]
ibv_qp_attr = _T["struct ibv_qp_attr"]
ibv_sge = _T["struct ibv_sge"]
ibv_send_wr = _T["struct ibv_send_wr"]
ibv_recv_wr = _T["struct ibv_recv_wr"]
ibv_wc = _T["struct ibv_wc"]
ibv_async_event = _T["struct ibv_async_event"]

# Every struct the layout check compares with the libibverbs headers (layout.VERBS_H): all
# of the description but glibc's and librdmacm's, which cma_ffi.STRUCTS checks against
# rdma_cma.h. Nested anonymous types are reached through their parents.
STRUCTS: dict[str, type] = {
    name: t for name, t in _T.items()
    if not name.startswith(("struct sockaddr", "struct in", "struct rdma_"))}

# -- the exported functions -------------------------------------------------------------------

P = c_void_p  # every object pointer crosses as a plain int: cheaper, and no casts needed
_PROTOS: dict[str, tuple[Any, list[Any]]] = {
    "ibv_get_device_list": (P, [POINTER(c_int)]),
    "ibv_free_device_list": (None, [P]),
    "ibv_get_device_name": (ctypes.c_char_p, [P]),
    "ibv_get_device_guid": (c_uint64, [P]),
    "ibv_open_device": (P, [P]),
    "ibv_close_device": (c_int, [P]),
    "ibv_query_device": (c_int, [P, POINTER(ibv_device_attr)]),
    "ibv_query_gid": (c_int, [P, c_uint8, c_int, POINTER(ibv_gid)]),
    "_ibv_query_gid_ex": (c_int, [P, c_uint32, c_uint32, POINTER(ibv_gid_entry), c_uint32,
                                  c_size_t]),
    "ibv_query_pkey": (c_int, [P, c_uint8, c_int, POINTER(c_uint16)]),
    "ibv_alloc_pd": (P, [P]),
    "ibv_dealloc_pd": (c_int, [P]),
    "ibv_reg_mr_iova2": (P, [P, P, c_size_t, c_uint64, ctypes.c_uint]),
    "ibv_rereg_mr": (c_int, [P, c_int, P, P, c_size_t, c_int]),
    "ibv_dereg_mr": (c_int, [P]),
    "ibv_create_comp_channel": (P, [P]),
    "ibv_destroy_comp_channel": (c_int, [P]),
    "ibv_create_cq": (P, [P, c_int, P, P, c_int]),
    "ibv_resize_cq": (c_int, [P, c_int]),
    "ibv_destroy_cq": (c_int, [P]),
    "ibv_get_cq_event": (c_int, [P, POINTER(c_void_p), POINTER(c_void_p)]),
    "ibv_ack_cq_events": (None, [P, ctypes.c_uint]),
    "ibv_create_srq": (P, [P, POINTER(ibv_srq_init_attr)]),
    "ibv_modify_srq": (c_int, [P, POINTER(ibv_srq_attr), c_int]),
    "ibv_query_srq": (c_int, [P, POINTER(ibv_srq_attr)]),
    "ibv_destroy_srq": (c_int, [P]),
    "ibv_create_qp": (P, [P, POINTER(ibv_qp_init_attr)]),
    "ibv_modify_qp": (c_int, [P, POINTER(ibv_qp_attr), c_int]),
    "ibv_query_qp": (c_int, [P, POINTER(ibv_qp_attr), c_int, POINTER(ibv_qp_init_attr)]),
    "ibv_destroy_qp": (c_int, [P]),
    "ibv_attach_mcast": (c_int, [P, POINTER(ibv_gid), c_uint16]),
    "ibv_detach_mcast": (c_int, [P, POINTER(ibv_gid), c_uint16]),
    "ibv_create_ah": (P, [P, POINTER(ibv_ah_attr)]),
    "ibv_destroy_ah": (c_int, [P]),
    "ibv_get_async_event": (c_int, [P, POINTER(ibv_async_event)]),
    "ibv_ack_async_event": (None, [POINTER(ibv_async_event)]),
}

LIBNAME = "libibverbs.so.1"
_lib: Any = None
_tried = False
_error: str | None = None


def lib() -> Any:
    """The loaded libibverbs (prototypes set), or None if it cannot be loaded. Loaded on
    first call only; a missing library is remembered, and says why in :func:`load_error`."""
    global _lib, _tried, _error
    if not _tried:
        _tried = True
        try:
            cdll = ctypes.CDLL(LIBNAME, use_errno=True)
            for name, (res, args) in _PROTOS.items():
                f = getattr(cdll, name)
                f.restype, f.argtypes = res, args
            _lib = cdll
        except (OSError, AttributeError) as e:  # absent, or too old for reg_mr_iova2 (1.8)
            _error = f"{LIBNAME} cannot be loaded ({e})"
    return _lib


def reset(libname: str = "libibverbs.so.1") -> None:
    """Forget the loaded library and load ``libname`` on the next :func:`lib` (tests use
    a name that does not exist to play a machine without libibverbs)."""
    global _lib, _tried, _error, LIBNAME
    _lib, _tried, _error, LIBNAME = None, False, None, libname


def load_error() -> str | None:
    """Why :func:`lib` returned None (None if it loaded or was not tried)."""
    return _error


def loaded() -> bool:
    """Whether libibverbs was loaded into this process by this module."""
    return _lib is not None


# -- the ops table --------------------------------------------------------------------------

# the ops slots' C signatures, every pointer as void* (ints in, ints out)
_POST = CFUNCTYPE(c_int, P, P, P, use_errno=True)
_OPS_TYPES = {
    "alloc_mw": CFUNCTYPE(P, P, c_int, use_errno=True),
    "bind_mw": CFUNCTYPE(c_int, P, P, P, use_errno=True),
    "dealloc_mw": CFUNCTYPE(c_int, P, use_errno=True),
    "poll_cq": CFUNCTYPE(c_int, P, c_int, P, use_errno=True),
    "req_notify_cq": CFUNCTYPE(c_int, P, c_int, use_errno=True),
    "post_srq_recv": _POST, "post_send": _POST, "post_recv": _POST,
}


class Ops:
    """The live provider entry points of one ``ibv_context``, each a ctypes callable taking
    ints (``ops.post_send(qp_addr, wr_addr, bad_addr)``). A NULL slot is None (the provider
    does not implement it: ``alloc_mw`` on a device without windows)."""

    __slots__ = tuple(_OPS_TYPES)

    def __init__(self, ctx: ibv_context) -> None:
        ops = ctx.ops
        for name, proto in _OPS_TYPES.items():
            ptr = getattr(ops, name)
            setattr(self, name, proto(ptr) if ptr else None)


_QUERY_PORT = CFUNCTYPE(c_int, P, c_uint8, POINTER(ibv_port_attr), c_size_t, use_errno=True)
_VCTX_OFF = verbs_context.context.offset


def verbs_ctx(ctx: ibv_context) -> Any:
    """``verbs_get_ctx``: the ``verbs_context`` around an ``ibv_context``, or None when the
    context is not one (``abi_compat`` is not UINTPTR_MAX)."""
    if ctx.abi_compat != UINTPTR_MAX:
        return None
    return verbs_context.from_address(ctypes.addressof(ctx) - _VCTX_OFF)


def query_port(ctx: ibv_context, port: int, attr: ibv_port_attr) -> int:
    """``ibv_query_port`` as verbs.h's inline does it: ``verbs_context->query_port`` with our
    own ``sizeof`` (a newer library fills only that much). Returns the C result (an errno);
    EOPNOTSUPP when the context has no such slot."""
    vctx = verbs_ctx(ctx)
    if vctx is None or vctx.sz < sizeof(verbs_context) - verbs_context.query_port.offset \
            or not vctx.query_port:
        return errno.EOPNOTSUPP
    return _QUERY_PORT(vctx.query_port)(ctypes.addressof(ctx), port, ctypes.byref(attr),
                                        sizeof(attr))

