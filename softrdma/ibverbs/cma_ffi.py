"""librdmacm through ctypes: the structs of ``<rdma/rdma_cma.h>`` and the exported functions.

The structs are :mod:`softrdma.ibverbs.cdecls`'s, the one description of rdma-core 44's
structures (x86_64) shared with :mod:`softrdma.exec` (the public structs have not moved
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
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint8, c_void_p
from typing import Any

from ..errors import PyverbsRDMAError
from . import cdecls, layout
from .ffi import ibv_qp_attr

__all__ = ["lib", "load_error", "call", "STRUCTS", "check_layouts", "sockaddr_in",
           "sockaddr_in6", "sockaddr_storage", "rdma_cm_id", "rdma_cm_event",
           "rdma_conn_param", "rdma_ud_param", "rdma_event_channel", "ibv_sa_path_rec",
           "AF_INET", "AF_INET6", "need", "header_missing"]

AF_INET, AF_INET6 = 2, 10  # Linux


# -- the structs: glibc's sockaddrs and rdma_cma.h's, from the one description -------------

_T = cdecls.ctypes_types()
sockaddr = _T["struct sockaddr"]
sockaddr_in = _T["struct sockaddr_in"]
sockaddr_in6 = _T["struct sockaddr_in6"]
sockaddr_storage = _T["struct sockaddr_storage"]
ibv_sa_path_rec = _T["struct ibv_sa_path_rec"]  # <infiniband/sa.h>: rdma_route.path_rec
rdma_event_channel = _T["struct rdma_event_channel"]
rdma_cm_id = _T["struct rdma_cm_id"]
rdma_conn_param = _T["struct rdma_conn_param"]
rdma_ud_param = _T["struct rdma_ud_param"]
rdma_cm_event = _T["struct rdma_cm_event"]

# what the layout check compares with rdma_cma.h (RDMA_CMA_H)
STRUCTS: dict[str, type] = {
    name: t for name, t in _T.items()
    if name.startswith(("struct sockaddr", "struct in", "struct rdma_"))}

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
