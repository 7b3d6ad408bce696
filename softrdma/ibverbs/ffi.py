"""libibverbs through ctypes: struct layouts, exported prototypes, ``ibv_context.ops`` callers.

Everything here mirrors ``/usr/include/infiniband/verbs.h`` of rdma-core 44 on x86_64 (and
every later release: the structs used here only grow at their ends, or, for
``verbs_context``, at the front). :mod:`softrdma.ibverbs.layout` checks each layout against
the installed header with a generated C program.

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
from ctypes import (CFUNCTYPE, POINTER, Structure, Union, c_char, c_int, c_size_t, c_uint8,
                    c_uint16, c_uint32, c_uint64, c_void_p, sizeof)
from typing import Any

__all__ = ["lib", "load_error", "STRUCTS", "Ops", "query_port", "UINTPTR_MAX"]

UINTPTR_MAX = (1 << 64) - 1 if sizeof(c_void_p) == 8 else (1 << 32) - 1
IBV_SYSFS_NAME_MAX, IBV_SYSFS_PATH_MAX = 64, 256

# pthread types are opaque here; only their size and alignment matter (x86_64 glibc)
pthread_mutex_t = c_uint64 * 5
pthread_cond_t = c_uint64 * 6


class _ibv_device_ops(Structure):
    _fields_ = [("_dummy1", c_void_p), ("_dummy2", c_void_p)]


class ibv_device(Structure):
    _fields_ = [("_ops", _ibv_device_ops), ("node_type", c_int), ("transport_type", c_int),
                ("name", c_char * IBV_SYSFS_NAME_MAX), ("dev_name", c_char * IBV_SYSFS_NAME_MAX),
                ("dev_path", c_char * IBV_SYSFS_PATH_MAX),
                ("ibdev_path", c_char * IBV_SYSFS_PATH_MAX)]


# the 32 slots of struct ibv_context_ops; only the named live ones are ever called
_OPS_SLOTS = ("_compat_query_device", "_compat_query_port", "_compat_alloc_pd",
              "_compat_dealloc_pd", "_compat_reg_mr", "_compat_rereg_mr", "_compat_dereg_mr",
              "alloc_mw", "bind_mw", "dealloc_mw", "_compat_create_cq", "poll_cq",
              "req_notify_cq", "_compat_cq_event", "_compat_resize_cq", "_compat_destroy_cq",
              "_compat_create_srq", "_compat_modify_srq", "_compat_query_srq",
              "_compat_destroy_srq", "post_srq_recv", "_compat_create_qp", "_compat_query_qp",
              "_compat_modify_qp", "_compat_destroy_qp", "post_send", "post_recv",
              "_compat_create_ah", "_compat_destroy_ah", "_compat_attach_mcast",
              "_compat_detach_mcast", "_compat_async_event")


class ibv_context_ops(Structure):
    _fields_ = [(n, c_void_p) for n in _OPS_SLOTS]


class ibv_context(Structure):
    _fields_ = [("device", POINTER(ibv_device)), ("ops", ibv_context_ops), ("cmd_fd", c_int),
                ("async_fd", c_int), ("num_comp_vectors", c_int), ("mutex", pthread_mutex_t),
                ("abi_compat", c_void_p)]


# struct verbs_context: function pointers growing towards lower addresses, then sz and the
# embedded ibv_context. Named as in verbs.h so the layout check can compare each offset.
_VCTX_SLOTS = ("query_port", "advise_mr", "alloc_null_mr", "read_counters",
               "attach_counters_point_flow", "create_counters", "destroy_counters",
               "reg_dm_mr", "alloc_dm", "free_dm", "modify_flow_action_esp",
               "destroy_flow_action", "create_flow_action_esp", "modify_qp_rate_limit",
               "alloc_parent_domain", "dealloc_td", "alloc_td", "modify_cq", "post_srq_ops",
               "destroy_rwq_ind_table", "create_rwq_ind_table", "destroy_wq", "modify_wq",
               "create_wq", "query_rt_values", "create_cq_ex", "priv", "query_device_ex",
               "ibv_destroy_flow", "ABI_placeholder2", "ibv_create_flow", "ABI_placeholder1",
               "open_qp", "create_qp_ex", "get_srq_num", "create_srq_ex", "open_xrcd",
               "close_xrcd")


class verbs_context(Structure):
    _fields_ = [(n, c_void_p) for n in _VCTX_SLOTS] + [
        ("_ABI_placeholder3", c_uint64), ("sz", c_size_t), ("context", ibv_context)]


class ibv_device_attr(Structure):
    _fields_ = [("fw_ver", c_char * 64), ("node_guid", c_uint64), ("sys_image_guid", c_uint64),
                ("max_mr_size", c_uint64), ("page_size_cap", c_uint64), ("vendor_id", c_uint32),
                ("vendor_part_id", c_uint32), ("hw_ver", c_uint32), ("max_qp", c_int),
                ("max_qp_wr", c_int), ("device_cap_flags", c_uint32), ("max_sge", c_int),
                ("max_sge_rd", c_int), ("max_cq", c_int), ("max_cqe", c_int), ("max_mr", c_int),
                ("max_pd", c_int), ("max_qp_rd_atom", c_int), ("max_ee_rd_atom", c_int),
                ("max_res_rd_atom", c_int), ("max_qp_init_rd_atom", c_int),
                ("max_ee_init_rd_atom", c_int), ("atomic_cap", c_int), ("max_ee", c_int),
                ("max_rdd", c_int), ("max_mw", c_int), ("max_raw_ipv6_qp", c_int),
                ("max_raw_ethy_qp", c_int), ("max_mcast_grp", c_int),
                ("max_mcast_qp_attach", c_int), ("max_total_mcast_qp_attach", c_int),
                ("max_ah", c_int), ("max_fmr", c_int), ("max_map_per_fmr", c_int),
                ("max_srq", c_int), ("max_srq_wr", c_int), ("max_srq_sge", c_int),
                ("max_pkeys", c_uint16), ("local_ca_ack_delay", c_uint8),
                ("phys_port_cnt", c_uint8)]


class ibv_port_attr(Structure):
    """v44's 52 bytes; newer libraries append fields and copy only our ``sizeof``."""

    _fields_ = [("state", c_int), ("max_mtu", c_int), ("active_mtu", c_int),
                ("gid_tbl_len", c_int), ("port_cap_flags", c_uint32), ("max_msg_sz", c_uint32),
                ("bad_pkey_cntr", c_uint32), ("qkey_viol_cntr", c_uint32),
                ("pkey_tbl_len", c_uint16), ("lid", c_uint16), ("sm_lid", c_uint16),
                ("lmc", c_uint8), ("max_vl_num", c_uint8), ("sm_sl", c_uint8),
                ("subnet_timeout", c_uint8), ("init_type_reply", c_uint8),
                ("active_width", c_uint8), ("active_speed", c_uint8), ("phys_state", c_uint8),
                ("link_layer", c_uint8), ("flags", c_uint8), ("port_cap_flags2", c_uint16)]


class _gid_global(Structure):
    _fields_ = [("subnet_prefix", c_uint64), ("interface_id", c_uint64)]


class ibv_gid(Union):
    # the __be64 view makes its alignment 8, which matters inside ibv_global_route
    _fields_ = [("raw", c_uint8 * 16), ("global", _gid_global)]


class ibv_gid_entry(Structure):
    _fields_ = [("gid", ibv_gid), ("gid_index", c_uint32), ("port_num", c_uint32),
                ("gid_type", c_uint32), ("ndev_ifindex", c_uint32)]


class ibv_pd(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("handle", c_uint32)]


class ibv_mr(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("pd", POINTER(ibv_pd)), ("addr", c_void_p),
                ("length", c_size_t), ("handle", c_uint32), ("lkey", c_uint32),
                ("rkey", c_uint32)]


class ibv_mw(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("pd", POINTER(ibv_pd)), ("rkey", c_uint32),
                ("handle", c_uint32), ("type", c_int)]


class ibv_mw_bind_info(Structure):
    _fields_ = [("mr", c_void_p), ("addr", c_uint64), ("length", c_uint64),
                ("mw_access_flags", c_uint32)]


class ibv_mw_bind(Structure):
    _fields_ = [("wr_id", c_uint64), ("send_flags", c_uint32), ("bind_info", ibv_mw_bind_info)]


class ibv_comp_channel(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("fd", c_int), ("refcnt", c_int)]


class ibv_cq(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("channel", POINTER(ibv_comp_channel)),
                ("cq_context", c_void_p), ("handle", c_uint32), ("cqe", c_int),
                ("mutex", pthread_mutex_t), ("cond", pthread_cond_t),
                ("comp_events_completed", c_uint32), ("async_events_completed", c_uint32)]


class ibv_srq(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("srq_context", c_void_p),
                ("pd", POINTER(ibv_pd)), ("handle", c_uint32), ("mutex", pthread_mutex_t),
                ("cond", pthread_cond_t), ("events_completed", c_uint32)]


class ibv_srq_attr(Structure):
    _fields_ = [("max_wr", c_uint32), ("max_sge", c_uint32), ("srq_limit", c_uint32)]


class ibv_srq_init_attr(Structure):
    _fields_ = [("srq_context", c_void_p), ("attr", ibv_srq_attr)]


class ibv_qp(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("qp_context", c_void_p),
                ("pd", POINTER(ibv_pd)), ("send_cq", POINTER(ibv_cq)),
                ("recv_cq", POINTER(ibv_cq)), ("srq", POINTER(ibv_srq)), ("handle", c_uint32),
                ("qp_num", c_uint32), ("state", c_int), ("qp_type", c_int),
                ("mutex", pthread_mutex_t), ("cond", pthread_cond_t),
                ("events_completed", c_uint32)]


class ibv_ah(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("pd", POINTER(ibv_pd)), ("handle", c_uint32)]


class ibv_global_route(Structure):
    _fields_ = [("dgid", ibv_gid), ("flow_label", c_uint32), ("sgid_index", c_uint8),
                ("hop_limit", c_uint8), ("traffic_class", c_uint8)]


class ibv_ah_attr(Structure):
    _fields_ = [("grh", ibv_global_route), ("dlid", c_uint16), ("sl", c_uint8),
                ("src_path_bits", c_uint8), ("static_rate", c_uint8), ("is_global", c_uint8),
                ("port_num", c_uint8)]


class ibv_qp_cap(Structure):
    _fields_ = [("max_send_wr", c_uint32), ("max_recv_wr", c_uint32), ("max_send_sge", c_uint32),
                ("max_recv_sge", c_uint32), ("max_inline_data", c_uint32)]


class ibv_qp_init_attr(Structure):
    _fields_ = [("qp_context", c_void_p), ("send_cq", POINTER(ibv_cq)),
                ("recv_cq", POINTER(ibv_cq)), ("srq", POINTER(ibv_srq)), ("cap", ibv_qp_cap),
                ("qp_type", c_int), ("sq_sig_all", c_int)]


class ibv_qp_attr(Structure):
    _fields_ = [("qp_state", c_int), ("cur_qp_state", c_int), ("path_mtu", c_int),
                ("path_mig_state", c_int), ("qkey", c_uint32), ("rq_psn", c_uint32),
                ("sq_psn", c_uint32), ("dest_qp_num", c_uint32), ("qp_access_flags", c_uint32),
                ("cap", ibv_qp_cap), ("ah_attr", ibv_ah_attr), ("alt_ah_attr", ibv_ah_attr),
                ("pkey_index", c_uint16), ("alt_pkey_index", c_uint16),
                ("en_sqd_async_notify", c_uint8), ("sq_draining", c_uint8),
                ("max_rd_atomic", c_uint8), ("max_dest_rd_atomic", c_uint8),
                ("min_rnr_timer", c_uint8), ("port_num", c_uint8), ("timeout", c_uint8),
                ("retry_cnt", c_uint8), ("rnr_retry", c_uint8), ("alt_port_num", c_uint8),
                ("alt_timeout", c_uint8), ("rate_limit", c_uint32)]


# The pointers of work requests (next, sg_list, ud.ah, bind_mw.mw, bind_info.mr) are
# declared void*: the data path stores plain addresses, ~10x cheaper than ctypes.cast.


class ibv_sge(Structure):
    _fields_ = [("addr", c_uint64), ("length", c_uint32), ("lkey", c_uint32)]


class _wr_rdma(Structure):
    _fields_ = [("remote_addr", c_uint64), ("rkey", c_uint32)]


class _wr_atomic(Structure):
    _fields_ = [("remote_addr", c_uint64), ("compare_add", c_uint64), ("swap", c_uint64),
                ("rkey", c_uint32)]


class _wr_ud(Structure):
    _fields_ = [("ah", c_void_p), ("remote_qpn", c_uint32), ("remote_qkey", c_uint32)]


class _wr_union(Union):
    _fields_ = [("rdma", _wr_rdma), ("atomic", _wr_atomic), ("ud", _wr_ud)]


class _wr_xrc(Structure):
    _fields_ = [("remote_srqn", c_uint32)]


class _wr_qp_type(Union):
    _fields_ = [("xrc", _wr_xrc)]


class _wr_bind_mw(Structure):
    _fields_ = [("mw", c_void_p), ("rkey", c_uint32), ("bind_info", ibv_mw_bind_info)]


class _wr_tso(Structure):
    _fields_ = [("hdr", c_void_p), ("hdr_sz", c_uint16), ("mss", c_uint16)]


class _wr_imm(Union):
    _fields_ = [("imm_data", c_uint32), ("invalidate_rkey", c_uint32)]


class _wr_ext(Union):
    _fields_ = [("bind_mw", _wr_bind_mw), ("tso", _wr_tso)]


class ibv_send_wr(Structure):
    pass


ibv_send_wr._anonymous_ = ("_u_imm", "_u_ext")
ibv_send_wr._fields_ = [("wr_id", c_uint64), ("next", c_void_p), ("sg_list", c_void_p),
                        ("num_sge", c_int), ("opcode", c_int),
                        ("send_flags", c_uint32), ("_u_imm", _wr_imm), ("wr", _wr_union),
                        ("qp_type", _wr_qp_type), ("_u_ext", _wr_ext)]


class ibv_recv_wr(Structure):
    pass


ibv_recv_wr._fields_ = [("wr_id", c_uint64), ("next", c_void_p), ("sg_list", c_void_p),
                        ("num_sge", c_int)]


class _wc_imm(Union):
    _fields_ = [("imm_data", c_uint32), ("invalidated_rkey", c_uint32)]


class ibv_wc(Structure):
    _anonymous_ = ("_u_imm",)
    _fields_ = [("wr_id", c_uint64), ("status", c_int), ("opcode", c_int),
                ("vendor_err", c_uint32), ("byte_len", c_uint32), ("_u_imm", _wc_imm),
                ("qp_num", c_uint32), ("src_qp", c_uint32), ("wc_flags", c_uint32),
                ("pkey_index", c_uint16), ("slid", c_uint16), ("sl", c_uint8),
                ("dlid_path_bits", c_uint8)]


class _async_element(Union):
    _fields_ = [("cq", POINTER(ibv_cq)), ("qp", POINTER(ibv_qp)), ("srq", POINTER(ibv_srq)),
                ("wq", c_void_p), ("port_num", c_int)]


class ibv_async_event(Structure):
    _fields_ = [("element", _async_element), ("event_type", c_int)]


# Every struct the layout check compares with verbs.h: C name -> ctypes type. Helper
# types for anonymous or nested members are reached through their parents.
STRUCTS: dict[str, type] = {
    "struct ibv_device": ibv_device, "struct ibv_context_ops": ibv_context_ops,
    "struct ibv_context": ibv_context, "struct verbs_context": verbs_context,
    "struct ibv_device_attr": ibv_device_attr, "struct ibv_port_attr": ibv_port_attr,
    "union ibv_gid": ibv_gid, "struct ibv_gid_entry": ibv_gid_entry, "struct ibv_pd": ibv_pd,
    "struct ibv_mr": ibv_mr, "struct ibv_mw": ibv_mw,
    "struct ibv_mw_bind_info": ibv_mw_bind_info, "struct ibv_mw_bind": ibv_mw_bind,
    "struct ibv_comp_channel": ibv_comp_channel, "struct ibv_cq": ibv_cq,
    "struct ibv_srq": ibv_srq, "struct ibv_srq_attr": ibv_srq_attr,
    "struct ibv_srq_init_attr": ibv_srq_init_attr, "struct ibv_qp": ibv_qp,
    "struct ibv_ah": ibv_ah, "struct ibv_global_route": ibv_global_route,
    "struct ibv_ah_attr": ibv_ah_attr, "struct ibv_qp_cap": ibv_qp_cap,
    "struct ibv_qp_init_attr": ibv_qp_init_attr, "struct ibv_qp_attr": ibv_qp_attr,
    "struct ibv_sge": ibv_sge, "struct ibv_send_wr": ibv_send_wr,
    "struct ibv_recv_wr": ibv_recv_wr, "struct ibv_wc": ibv_wc,
    "struct ibv_async_event": ibv_async_event,
}

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

