"""Memory windows (rxe_mw.c): bind, invalidate and unbind, on the key table's entries.

A window is an entry of the key table (:class:`~softrdma.qp.memory.MemEntry` of kind MW)
that, once bound, points into a range of an MR with its own rkey and rights. Type 1
windows are bound by the verbs call ``bind_mw`` and unbound by a zero-length bind; type 2
windows are bound by a BIND_MW work request through a QP, tied to that QP, and invalidated
by LOCAL_INV or SEND_WITH_INV. Everything here works on entries, never on verbs objects:
the verbs layer resolves its MW and MR objects to entries when the work is posted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..enums import ibv_access_flags as A, ibv_wc_status as WCS
from .memory import KeyTable, MemEntry, MemKind

__all__ = ["BindRequest", "bind_mw", "invalidate_rkey", "unbind"]

_REMOTE = int(A.IBV_ACCESS_REMOTE_READ | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_ATOMIC)
_NEEDS_LOCAL_WRITE = int(A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_ATOMIC)


@dataclass
class BindRequest:
    """What a bind asks for (``ibv_mw_bind_info``), with the MR already resolved."""

    mr: MemEntry | None
    addr: int
    length: int
    access: int


def unbind(mw: MemEntry) -> None:
    """Detach a window from its MR: the MR's count of bound windows drops, the rkey dies."""
    if mw.mr is not None:
        mw.mr.refs -= 1
    mw.mr = None
    mw.valid = False
    mw.qp = None


def bind_mw(keys: KeyTable, pd: Any, qp: Any, mw: MemEntry | None, req: BindRequest | None,
            rkey: int) -> int:
    """rxe_bind_mw for a window ``mw`` through a QP of protection domain ``pd``; returns the
    WC status (IBV_WC_MW_BIND_ERR for every check that fails, as rxe)."""
    if mw is None or req is None or not keys.holds(mw):
        return WCS.IBV_WC_MW_BIND_ERR
    if mw.pd is not pd:
        return WCS.IBV_WC_MW_BIND_ERR
    if mw.mw_type == 2 and mw.valid:
        return WCS.IBV_WC_MW_BIND_ERR  # a bound type 2 window must be invalidated first
    if req.length == 0 and mw.mw_type == 1:
        unbind(mw)  # a zero-length bind of a type 1 window unbinds it
        mw.key = rkey & 0xFF
        return WCS.IBV_WC_SUCCESS
    mr = req.mr
    if mr is None or mr.kind is not MemKind.MR or not mr.valid or not keys.holds(mr):
        return WCS.IBV_WC_MW_BIND_ERR
    if mr.pd is not pd or not mr.access & A.IBV_ACCESS_MW_BIND:
        return WCS.IBV_WC_MW_BIND_ERR
    if req.access & _NEEDS_LOCAL_WRITE and not mr.access & A.IBV_ACCESS_LOCAL_WRITE:
        return WCS.IBV_WC_MW_BIND_ERR
    if req.addr < mr.iova or req.addr + req.length > mr.iova + mr.length:
        return WCS.IBV_WC_MW_BIND_ERR
    unbind(mw)
    mw.mr = mr
    mr.refs += 1
    mw.iova = req.addr
    mw.length = req.length
    mw.access = int(req.access) & _REMOTE
    mw.key = rkey & 0xFF
    mw.qp = qp if mw.mw_type == 2 else None
    mw.valid = True
    return WCS.IBV_WC_SUCCESS


def invalidate_rkey(keys: KeyTable, pd: Any, rkey: int) -> bool:
    """rxe invalidate_rkey: only type 2 windows bound through protection domain ``pd`` can
    be invalidated (user MRs are not fast-register MRs)."""
    e = keys.get(rkey)
    if e is None or e.kind is not MemKind.MW or e.mw_type != 2 or not e.valid:
        return False
    if e.pd is not pd and (e.mr is None or e.mr.pd is not pd):
        return False
    unbind(e)
    return True
