"""Work requests to C: linked ``ibv_recv_wr`` arrays, calling a post verb, and
softrdma's ``bad_wr`` reporting (the WRs before a refused one stay posted)."""

from __future__ import annotations

import struct
from ctypes import addressof, c_void_p, sizeof
from typing import Any

from ..errors import PyverbsRDMAError
from ..verbs_api._check import U64, as_int, require
from ..verbs_api.posting import check_wr_arg, mark_bad, sge_list, wr_chain
from ..verbs_api.wr import RecvWR
from . import ffi
from .common import fail

__all__ = ["recv_chain", "post", "posted_list", "raise_at", "sge_array"]

_SGE = struct.Struct("=QII")  # struct ibv_sge: addr, length, lkey


def sge_array(sges: list[tuple[int, int, int]]) -> Any:
    """An ``ibv_sge`` array holding ``(addr, length, lkey)`` tuples (packed in one go:
    several times cheaper than building it element by element)."""
    return (ffi.ibv_sge * len(sges)).from_buffer_copy(b"".join(_SGE.pack(*s) for s in sges))


def recv_chain(wrs: list[Any], max_sge: int, what: str) -> tuple[Any, list[Any]]:
    """C ``ibv_recv_wr`` array (linked) for checked RecvWRs, and what keeps it alive."""
    arr = (ffi.ibv_recv_wr * len(wrs))()
    keep: list[Any] = [arr]
    base = addressof(arr)
    size = sizeof(ffi.ibv_recv_wr)
    for i, w in enumerate(wrs):
        f = f"wr[{i}]"
        try:
            require(w, RecvWR, what, f)
            wr_id = as_int(w.wr_id, what, f"{f}.wr_id", U64)
            sges, _ = sge_list(w, max_sge, what, f)
        except PyverbsRDMAError as e:
            e.index = i  # type: ignore[attr-defined]
            raise
        c = arr[i]
        c.wr_id = wr_id
        if sges:
            sg = sge_array(sges)
            keep.append(sg)
            c.sg_list = addressof(sg)
        c.num_sge = len(sges)
        if i + 1 < len(wrs):
            c.next = base + (i + 1) * size
    return arr, keep


def post(fn: Any, obj_addr: int, arr: Any, size: int, wrs: list[Any], bad_wr: Any,
          what: str) -> None:
    """Call a post verb and turn its result into softrdma's error (``bad_wr_index``)."""
    bad = c_void_p()
    rc = fn(obj_addr, addressof(arr), addressof(bad))
    if rc:
        # rxe may leave bad NULL (and still queue the WR): report the first WR then
        i = (bad.value - addressof(arr)) // size if bad.value else 0
        e = fail(what, rc)
        mark_bad(e, wrs[i], i, bad_wr)
        raise e


def posted_list(wr: Any, bad_wr: Any, cls: type, what: str) -> list[Any]:
    check_wr_arg(wr, bad_wr, cls, what)
    return list(wr_chain(wr))


def raise_at(e: PyverbsRDMAError, wrs: list[Any], bad_wr: Any, post: Any) -> None:
    """WR ``e.index`` was refused before reaching the device: post the WRs before it (as
    the soft backend and ibv_post_send leave them posted), then raise naming it."""
    i = getattr(e, "index", 0)
    if i:
        post(wrs[:i])
    mark_bad(e, wrs[i], i, bad_wr)
    raise e
