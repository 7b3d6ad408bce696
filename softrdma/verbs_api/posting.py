"""What post_send and post_recv share, for QPs and SRQs: walking a WR list or chain,
checking a scatter/gather list and a receive WR, and reporting the WR that failed
(``bad_wr``), as ibv_post_send/ibv_post_recv do."""

from __future__ import annotations

import errno
from typing import Any, Iterable

from ..errors import PyverbsRDMAError
from ..qp.wqe import RecvWqe
from ._check import U32, U64, as_bits, as_int, require
from .wr import SGE, RecvWR, SendWR

__all__ = ["wr_chain", "sge_list", "recv_wqe", "check_wr_arg", "mark_bad", "check_send_scalars",
           "SEND_FLAGS", "MAX_MSG"]

MAX_MSG = 1 << 31
SEND_FLAGS = 0x1F  # FENCE | SIGNALED | SOLICITED | INLINE | IP_CSUM


def wr_chain(wr: Any) -> Iterable[Any]:
    """A WR, a ``next_wr`` chain of WRs, or a list of WRs, in order."""
    if isinstance(wr, (list, tuple)):
        yield from wr
        return
    while wr is not None:
        yield wr
        wr = getattr(wr, "next_wr", None) if isinstance(wr, (SendWR, RecvWR)) else None


def sge_list(wr: Any, max_sge: int, what: str, f: str) -> tuple[list[tuple[int, int, int]], int]:
    """Check ``wr``'s scatter/gather list (``f`` names the WR, e.g. ``wr[2]``) and return it
    as ``(addr, length, lkey)`` int tuples with the total length. The keys themselves are
    checked when the data moves, as rxe does; here only the shape and the C widths."""
    sg = wr.sg_list
    if not isinstance(sg, (list, tuple)):
        raise PyverbsRDMAError(f"{what}: {f}.sg_list must be a list of SGEs, not "
                               f"{'None' if sg is None else type(sg).__name__} (leave sg out "
                               f"for a message without SGEs)", errno.EINVAL)
    n = as_int(wr.num_sge, what, f"{f}.num_sge", U32)
    if n > len(sg):
        raise PyverbsRDMAError(f"{what}: {f}.num_sge {n} but {len(sg)} SGEs in {f}.sg_list",
                               errno.EINVAL)
    if n > max_sge:
        raise PyverbsRDMAError(f"{what}: {f}.num_sge {n} exceeds the QP's max_sge {max_sge}",
                               errno.EINVAL)
    out = []
    total = 0
    for j in range(n):
        s = sg[j]
        if type(s) is SGE:
            addr, length, lkey = s.addr, s.length, s.lkey
            # fast path: plain ints in range (a post is one per message: keep it cheap)
            if not (type(addr) is int and type(length) is int and type(lkey) is int
                    and 0 <= addr <= U64 and 0 <= length <= U32 and 0 <= lkey <= U32):
                addr, length, lkey = _check_sge(s, what, f"{f}.sg_list[{j}]")
        else:
            addr, length, lkey = _check_sge(s, what, f"{f}.sg_list[{j}]")
        out.append((addr, length, lkey))
        total += length
    if total > MAX_MSG:
        raise PyverbsRDMAError(f"{what}: {f}: message of {total} bytes (the sum of "
                               f"sg_list[*].length) exceeds 2^31", errno.EINVAL)
    return out, total


def _check_sge(s: Any, what: str, g: str) -> tuple[int, int, int]:
    """The named checks of one SGE: each wrong field raises PyverbsRDMAError naming it."""
    require(s, SGE, what, g)
    return (as_int(s.addr, what, f"{g}.addr", U64, desc="not a 64-bit address"),
            as_int(s.length, what, f"{g}.length", U32, desc="not a 32-bit length"),
            as_int(s.lkey, what, f"{g}.lkey", U32, desc="not a 32-bit key"))


def recv_wqe(device: Any, pd: Any, wr: Any, max_sge: int, what: str, i: int = 0) -> RecvWqe:
    """Check receive WR number ``i`` and make its WQE (QP and SRQ post_recv)."""
    what = f"Failed to post receive to {what}"
    f = f"wr[{i}]"
    require(wr, RecvWR, what, f)
    wr_id = as_int(wr.wr_id, what, f"{f}.wr_id", U64)
    sges, total = sge_list(wr, max_sge, what, f)
    return RecvWqe(wr_id, sges, total)


def check_wr_arg(wr: Any, bad_wr: Any, cls: type, what: str) -> None:
    """post_send/post_recv's own arguments: a WR, a chain or a non-empty list; ``bad_wr``
    None or a WR of the same class (it is filled in on failure)."""
    require(bad_wr, cls, what, "bad_wr", optional=True)
    if wr is None or (isinstance(wr, (list, tuple)) and not wr):
        raise PyverbsRDMAError(f"{what}: wr is {'None' if wr is None else 'an empty list'}: "
                               f"pass a {cls.__name__}, a next_wr chain or a list of them",
                               errno.EINVAL)


def mark_bad(e: PyverbsRDMAError, w: Any, i: int, bad_wr: Any) -> None:
    e.bad_wr = w  # type: ignore[attr-defined]
    e.bad_wr_index = i  # type: ignore[attr-defined]
    if bad_wr is not None and type(w) is type(bad_wr):
        bad_wr.__dict__.update(w.__dict__)


def check_send_scalars(w: Any, what: str, f: str) -> tuple[int, ...]:
    """The named checks of a send WR's scalar fields, for both backends' slow path (the
    fast path tests plain ints in range at once): each wrong one raises PyverbsRDMAError
    naming it. Returns ``(opcode, send_flags, wr_id, imm_data, remote_addr, rkey,
    compare_add, swap)`` as ints."""
    two = " (for two's complement use value & (2**64 - 1))"
    return (as_int(w.opcode, what, f"{f}.opcode", U32),
            as_bits(w.send_flags, what, f"{f}.send_flags", SEND_FLAGS, noun="send_flags bits"),
            as_int(w.wr_id, what, f"{f}.wr_id", U64),
            as_int(w.imm_data, what, f"{f}.imm_data", U32),
            as_int(w.remote_addr, what, f"{f}.remote_addr", U64, desc="not a 64-bit address"),
            as_int(w.rkey, what, f"{f}.rkey", U32, desc="not a 32-bit key"),
            as_int(w.compare_add, what, f"{f}.compare_add", U64,
                   desc="not a 64-bit unsigned value" + two),
            as_int(w.swap, what, f"{f}.swap", U64, desc="not a 64-bit unsigned value" + two))
