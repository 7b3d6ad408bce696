"""librdmacm through ctypes: the structs of ``<rdma/rdma_cma.h>`` and the exported functions.

Everything mirrors rdma_cma.h of rdma-core 44 on x86_64 (the public structs have not moved
since rdma-core 1). :func:`check_layouts` compiles a C program printing ``offsetof``,
``sizeof`` and ``_Alignof`` of every member against the installed header and compares
(``tests/test_rdmacm_hw_layout.py``), as :mod:`.layout` does for verbs.h.

The library is loaded lazily by :func:`lib` (``CDLL("librdmacm.so.1", use_errno=True)``);
an absent library gives ``None`` and :func:`load_error` says why. librdmacm reports an
error as ``-1`` with ``errno`` set (``rdma_seterrno``); :func:`call` turns that into
:class:`PyverbsRDMAError` with the errno.
"""

from __future__ import annotations

import ctypes
import errno
from ctypes import (POINTER, Structure, Union, c_char, c_char_p, c_int, c_size_t, c_uint8,
                    c_uint16, c_uint32, c_ulong, c_void_p)
from typing import Any

from ..errors import PyverbsRDMAError
from . import layout
from .ffi import ibv_ah_attr, ibv_gid, ibv_qp_attr

__all__ = ["lib", "load_error", "call", "STRUCTS", "check_layouts", "sockaddr_in",
           "sockaddr_in6", "sockaddr_storage", "rdma_cm_id", "rdma_cm_event",
           "rdma_conn_param", "rdma_ud_param", "rdma_event_channel", "ibv_sa_path_rec",
           "AF_INET", "AF_INET6", "need", "header_missing"]

AF_INET, AF_INET6 = 2, 10  # Linux


# -- sockaddr (glibc, <netinet/in.h>) ---------------------------------------------------------

class sockaddr(Structure):
    _fields_ = [("sa_family", c_uint16), ("sa_data", c_char * 14)]


class in_addr(Structure):
    _fields_ = [("s_addr", c_uint32)]  # network order


class sockaddr_in(Structure):
    _fields_ = [("sin_family", c_uint16), ("sin_port", c_uint16), ("sin_addr", in_addr),
                ("sin_zero", c_uint8 * 8)]


class sockaddr_in6(Structure):
    # sin6_addr is a union of byte/u16/u32 arrays in C: u32[4] has its size and alignment
    _fields_ = [("sin6_family", c_uint16), ("sin6_port", c_uint16),
                ("sin6_flowinfo", c_uint32), ("sin6_addr", c_uint32 * 4),
                ("sin6_scope_id", c_uint32)]


class sockaddr_storage(Structure):
    _fields_ = [("ss_family", c_uint16), ("__ss_padding", c_char * 118),
                ("__ss_align", c_ulong)]


# -- rdma_cma.h -------------------------------------------------------------------------------

class rdma_ib_addr(Structure):
    _fields_ = [("sgid", ibv_gid), ("dgid", ibv_gid), ("pkey", c_uint16)]


class _src_u(Union):
    _fields_ = [("src_addr", sockaddr), ("src_sin", sockaddr_in), ("src_sin6", sockaddr_in6),
                ("src_storage", sockaddr_storage)]


class _dst_u(Union):
    _fields_ = [("dst_addr", sockaddr), ("dst_sin", sockaddr_in), ("dst_sin6", sockaddr_in6),
                ("dst_storage", sockaddr_storage)]


class _ib_u(Union):
    _fields_ = [("ibaddr", rdma_ib_addr)]


class rdma_addr(Structure):
    _anonymous_ = ("_src", "_dst")
    _fields_ = [("_src", _src_u), ("_dst", _dst_u), ("addr", _ib_u)]


class ibv_sa_path_rec(Structure):  # <infiniband/sa.h>, what rdma_route.path_rec points to
    _fields_ = [("dgid", ibv_gid), ("sgid", ibv_gid), ("dlid", c_uint16), ("slid", c_uint16),
                ("raw_traffic", c_int), ("flow_label", c_uint32), ("hop_limit", c_uint8),
                ("traffic_class", c_uint8), ("reversible", c_int), ("numb_path", c_uint8),
                ("pkey", c_uint16), ("sl", c_uint8), ("mtu_selector", c_uint8),
                ("mtu", c_uint8), ("rate_selector", c_uint8), ("rate", c_uint8),
                ("packet_life_time_selector", c_uint8), ("packet_life_time", c_uint8),
                ("preference", c_uint8)]


class rdma_route(Structure):
    _fields_ = [("addr", rdma_addr), ("path_rec", c_void_p), ("num_paths", c_int)]


class rdma_event_channel(Structure):
    _fields_ = [("fd", c_int)]


class rdma_cm_id(Structure):
    _fields_ = [("verbs", c_void_p), ("channel", POINTER(rdma_event_channel)),
                ("context", c_void_p), ("qp", c_void_p), ("route", rdma_route), ("ps", c_int),
                ("port_num", c_uint8), ("event", c_void_p), ("send_cq_channel", c_void_p),
                ("send_cq", c_void_p), ("recv_cq_channel", c_void_p), ("recv_cq", c_void_p),
                ("srq", c_void_p), ("pd", c_void_p), ("qp_type", c_int)]


class rdma_conn_param(Structure):
    _fields_ = [("private_data", c_void_p), ("private_data_len", c_uint8),
                ("responder_resources", c_uint8), ("initiator_depth", c_uint8),
                ("flow_control", c_uint8), ("retry_count", c_uint8),
                ("rnr_retry_count", c_uint8), ("srq", c_uint8), ("qp_num", c_uint32)]


class rdma_ud_param(Structure):
    _fields_ = [("private_data", c_void_p), ("private_data_len", c_uint8),
                ("ah_attr", ibv_ah_attr), ("qp_num", c_uint32), ("qkey", c_uint32)]


class _param_u(Union):
    _fields_ = [("conn", rdma_conn_param), ("ud", rdma_ud_param)]


class rdma_cm_event(Structure):
    _fields_ = [("id", c_void_p), ("listen_id", c_void_p), ("event", c_int),
                ("status", c_int), ("param", _param_u)]


STRUCTS: dict[str, type] = {
    "struct sockaddr": sockaddr, "struct sockaddr_in": sockaddr_in,
    "struct sockaddr_in6": sockaddr_in6, "struct sockaddr_storage": sockaddr_storage,
    "struct rdma_ib_addr": rdma_ib_addr, "struct rdma_addr": rdma_addr,
    "struct ibv_sa_path_rec": ibv_sa_path_rec, "struct rdma_route": rdma_route,
    "struct rdma_event_channel": rdma_event_channel,
    "struct rdma_cm_id": rdma_cm_id, "struct rdma_conn_param": rdma_conn_param,
    "struct rdma_ud_param": rdma_ud_param, "struct rdma_cm_event": rdma_cm_event,
}


# -- the exported functions -------------------------------------------------------------------

P = c_void_p
_PROTOS: dict[str, tuple[Any, list[Any]]] = {
    "rdma_create_event_channel": (P, []),
    "rdma_destroy_event_channel": (None, [P]),
    "rdma_create_id": (c_int, [P, POINTER(c_void_p), P, c_int]),
    "rdma_destroy_id": (c_int, [P]),
    "rdma_bind_addr": (c_int, [P, P]),
    "rdma_resolve_addr": (c_int, [P, P, P, c_int]),
    "rdma_resolve_route": (c_int, [P, c_int]),
    "rdma_listen": (c_int, [P, c_int]),
    "rdma_connect": (c_int, [P, POINTER(rdma_conn_param)]),
    "rdma_accept": (c_int, [P, POINTER(rdma_conn_param)]),
    "rdma_establish": (c_int, [P]),
    "rdma_reject": (c_int, [P, P, c_uint8]),
    "rdma_disconnect": (c_int, [P]),
    "rdma_get_cm_event": (c_int, [P, POINTER(c_void_p)]),
    "rdma_ack_cm_event": (c_int, [P]),
    "rdma_event_str": (c_char_p, [c_int]),
    "rdma_set_option": (c_int, [P, c_int, c_int, P, c_size_t]),
    "rdma_migrate_id": (c_int, [P, P]),
    "rdma_init_qp_attr": (c_int, [P, POINTER(ibv_qp_attr), POINTER(c_int)]),
}

LIBNAME = "librdmacm.so.1"
_lib: Any = None
_tried = False
_error: str | None = None


def lib() -> Any:
    """The loaded librdmacm (prototypes set), or None; loaded on the first call only."""
    global _lib, _tried, _error
    if not _tried:
        _tried = True
        try:
            cdll = ctypes.CDLL(LIBNAME, use_errno=True)
            for name, (res, args) in _PROTOS.items():
                f = getattr(cdll, name)
                f.restype, f.argtypes = res, args
            _lib = cdll
        except (OSError, AttributeError) as e:
            _error = f"{LIBNAME} cannot be loaded ({e})"
    return _lib


def load_error() -> str | None:
    """Why :func:`lib` returned None (None if it loaded or was not tried)."""
    return _error


def need() -> Any:
    """The library, or ENODEV naming why it cannot be loaded."""
    cdll = lib()
    if cdll is None:
        raise PyverbsRDMAError(f"rdma_cm on a real device: {_error}", errno.ENODEV)
    return cdll


def call(what: str, name: str, *args: Any) -> int:
    """``name(*args)``; a negative result raises PyverbsRDMAError with errno."""
    rc = getattr(need(), name)(*args)
    if rc is not None and rc < 0:
        raise PyverbsRDMAError(what, ctypes.get_errno() or errno.EIO)
    return rc


# -- layout check against rdma_cma.h ----------------------------------------------------------

RDMA_CMA_H = ("netinet/in.h", "rdma/rdma_cma.h")


def check_layouts(structs: dict[str, type] | None = None) -> tuple[int, list[str]]:
    """``(number of checks, mismatches)`` of the ctypes layouts against the installed
    ``<rdma/rdma_cma.h>`` (gcc and librdmacm-dev needed: :class:`layout.LayoutError`
    otherwise): :func:`layout.check` with that header."""
    return layout.check(STRUCTS if structs is None else structs, RDMA_CMA_H, "librdmacm-dev")


def header_missing() -> str | None:
    """Why the layout check cannot run here (no gcc, no rdma_cma.h), or None."""
    return layout.toolchain_missing(RDMA_CMA_H, "librdmacm-dev")
