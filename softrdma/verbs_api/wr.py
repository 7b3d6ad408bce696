"""Work requests and work completions: ``SGE``, ``SendWR``, ``RecvWR``, ``WC``.

Same constructors as pyverbs::

    sge = SGE(mr.buf, 1024, mr.lkey)
    wr = SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge])
    wr.set_wr_rdma(rkey=peer_rkey, addr=peer_addr)

Differences from pyverbs, for convenience: ``num_sge`` defaults to ``len(sg)``; WRs can be
chained with ``next_wr`` as in C, or passed as a list to ``post_send``. Leaving ``sg`` out
makes a WR without SGEs (a zero-length message); ``sg=None`` is refused at post time, as
pyverbs refuses it.

These are plain records, like the C structs: the constructors and setters store what they
are given, and ``post_send``/``post_recv`` check every field (types, widths, known flag
bits, object classes) before anything is queued, naming the field that is wrong::

    Failed to post send: wr[1].remote_addr 18446744073709551616 is not a 64-bit value
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .enums import ibv_send_flags, ibv_wr_opcode

__all__ = ["SGE", "SendWR", "RecvWR", "WC", "MWBindInfo"]


def _default_num_sge(sg_list: Any) -> int:
    return len(sg_list) if isinstance(sg_list, list) else 0


@dataclass
class SGE:
    """A scatter/gather element: ``addr`` (an address inside an MR), ``length``, ``lkey``."""

    addr: int = 0
    length: int = 0
    lkey: int = 0


@dataclass
class MWBindInfo:
    """``ibv_mw_bind_info``: bind a window to ``[addr, addr+length)`` of ``mr``."""

    mr: Any = None
    addr: int = 0
    length: int = 0
    mw_access_flags: int = 0


def _sg_list(sg: Any) -> Any:
    """The WR's list of SGEs: a copy of a list or tuple; anything else (None included) is
    kept as given, for post_send/post_recv to refuse with the field's name."""
    if isinstance(sg, (list, tuple)):
        return list(sg)
    return sg


class RecvWR:
    """``ibv_recv_wr``: ``wr_id`` (64-bit), ``sg`` (a list of :class:`SGE`), ``num_sge``
    (defaults to ``len(sg)``), ``next_wr``."""

    def __init__(self, wr_id: int = 0, num_sge: int | None = None, sg: Sequence[SGE] = (),
                 next_wr: "RecvWR | None" = None) -> None:
        self.wr_id = wr_id
        self.sg_list = _sg_list(sg)
        self.num_sge = _default_num_sge(self.sg_list) if num_sge is None else num_sge
        self.next_wr = next_wr

    def __repr__(self) -> str:
        return f"RecvWR(wr_id={self.wr_id!r}, sg={self.sg_list!r})"


class SendWR:
    """``ibv_send_wr``. The union members are plain attributes, set directly or with
    :meth:`set_wr_rdma`, :meth:`set_wr_atomic`, :meth:`set_wr_ud`, :meth:`set_bind_wr`."""

    def __init__(self, wr_id: int = 0, opcode: int = ibv_wr_opcode.IBV_WR_SEND,
                 num_sge: int | None = None, imm_data: int = 0, sg: Sequence[SGE] = (),
                 send_flags: int = ibv_send_flags.IBV_SEND_SIGNALED,
                 next_wr: "SendWR | None" = None) -> None:
        self.wr_id = wr_id
        self.opcode = opcode
        self.sg_list = _sg_list(sg)
        self.num_sge = _default_num_sge(self.sg_list) if num_sge is None else num_sge
        self.imm_data = imm_data  # also invalidate_rkey for SEND_WITH_INV (a union in C)
        self.send_flags = send_flags
        self.next_wr = next_wr
        # wr union
        self.remote_addr = 0
        self.rkey = 0
        self.compare_add = 0
        self.swap = 0
        self.ah: Any = None
        self.remote_qpn = 0
        self.remote_qkey = 0
        # the data of an IBV_SEND_INLINE WR given as bytes instead of SGEs (what
        # ibv_wr_set_inline_data copies; the soft device only): None reads the SGEs
        self.inline_data: bytes | None = None
        # ATOMIC WRITE: the 8 bytes to place (librxe copies them into the WQE); None reads
        # them from the SGEs (one 8-byte local buffer)
        self.atomic_wr: bytes | None = None
        # FLUSH: placement type (ibv_placement_type bits), selectivity level and length
        self.flush_type = 0
        self.flush_level = 0
        self.flush_length = 0
        # bind_mw
        self.mw: Any = None
        self.bind_rkey = 0
        self.bind_info: MWBindInfo | None = None

    @property
    def invalidate_rkey(self) -> int:
        return self.imm_data

    @invalidate_rkey.setter
    def invalidate_rkey(self, v: int) -> None:
        self.imm_data = v

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey = rkey
        self.remote_addr = addr

    def set_wr_atomic(self, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
        self.rkey = rkey
        self.remote_addr = addr
        self.compare_add = compare_add
        self.swap = swap

    def set_wr_atomic_write(self, rkey: int, addr: int, atomic_wr: bytes) -> None:
        """IBV_WR_ATOMIC_WRITE (IBTA 1.5 A19): place the 8 bytes ``atomic_wr`` at ``addr``
        (8-byte aligned) in one indivisible store, after every earlier operation of the
        QP, as ``ibv_wr_atomic_write`` does."""
        self.opcode = ibv_wr_opcode.IBV_WR_ATOMIC_WRITE
        self.rkey = rkey
        self.remote_addr = addr
        self.atomic_wr = bytes(atomic_wr)

    def set_wr_flush(self, rkey: int, addr: int, length: int, ptype: int, level: int) -> None:
        """IBV_WR_FLUSH (IBTA 1.5 A19): make what earlier operations placed in
        ``[addr, addr + length)`` (``level`` IBV_FLUSH_RANGE) or in the whole MR of ``rkey``
        (IBV_FLUSH_MR) globally visible (``ptype`` IBV_FLUSH_GLOBAL) or persistent
        (IBV_FLUSH_PERSISTENT), as ``ibv_wr_flush`` does."""
        self.opcode = ibv_wr_opcode.IBV_WR_FLUSH
        self.rkey = rkey
        self.remote_addr = addr
        self.flush_length = length
        self.flush_type = ptype
        self.flush_level = level

    def set_wr_ud(self, ah: Any, rqpn: int, rqkey: int) -> None:
        self.ah = ah
        self.remote_qpn = rqpn
        self.remote_qkey = rqkey

    def set_bind_wr(self, mw: Any, bind_info: MWBindInfo, rkey: int | None = None) -> None:
        self.mw = mw
        self.bind_info = bind_info
        # The window's rkey after the bind; by default ibv_inc_rkey(mw.rkey) (the index
        # stays, the low byte moves on), as pyverbs' set_bind_wr does. Without a usable
        # mw.rkey the value stays None and post_send refuses the WR, naming wr.mw.
        if rkey is None:
            cur = getattr(mw, "rkey", None)
            rkey = (cur & ~0xFF) | ((cur + 1) & 0xFF) if type(cur) is int else None
        self.bind_rkey = rkey

    def __repr__(self) -> str:
        try:
            op = ibv_wr_opcode(self.opcode).name
        except Exception:  # repr must work on a WR that post_send would refuse
            op = repr(self.opcode)
        return f"SendWR(wr_id={self.wr_id!r}, opcode={op}, sg={self.sg_list!r})"


from ..completion import WC  # noqa: E402  (defined with the core, re-exported here)
