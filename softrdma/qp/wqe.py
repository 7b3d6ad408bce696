"""Work queue entries: what post_send and post_recv leave for the engines.

A :class:`SendWqe` is rxe's ``rxe_send_wqe``: the work request as posted plus the
requester's progress through it (``state``, PSN range, bytes sent). A :class:`RecvWqe` is a
posted receive buffer list.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["WqeState", "SendWqe", "RecvWqe"]


class WqeState(enum.IntEnum):
    POSTED = 0  # waiting for the requester
    PROCESSING = 1  # partly sent
    PENDING = 2  # fully sent, waiting for its ACK / response (RC)
    DONE = 3  # completed (successfully or not), awaiting retirement by the completer
    ERROR = 4


class SendWqe:
    __slots__ = ("wr_id", "opcode", "send_flags", "signaled", "sges", "inline", "length",
                 "imm", "remote_addr", "rkey", "compare_add", "swap", "av", "remote_qpn",
                 "remote_qkey", "mw", "bind_info", "bind_rkey", "state", "first_psn",
                 "last_psn", "offset", "status", "npkts", "read_bytes", "has_rd_atomic",
                 "flush_type", "flush_level")

    def __init__(self, wr_id: int, opcode: int, send_flags: int, signaled: bool,
                 sges: list[tuple[int, int, int]], inline: bytes | None, length: int) -> None:
        self.wr_id = wr_id
        self.opcode = opcode
        self.send_flags = send_flags
        self.signaled = signaled
        self.sges = sges  # (addr, length, lkey)
        self.inline = inline  # the data itself for IBV_SEND_INLINE (copied at post time)
        self.length = length
        self.imm = 0  # immediate data, or the rkey to invalidate for SEND_WITH_INV/LOCAL_INV
        self.remote_addr = 0
        self.rkey = 0
        self.compare_add = 0
        self.swap = 0
        self.av: Any = None  # UD: AddressVector of the AH
        self.remote_qpn = 0
        self.remote_qkey = 0
        self.mw: Any = None
        self.bind_info: Any = None
        self.bind_rkey = 0
        self.state = WqeState.POSTED
        self.first_psn = 0
        self.last_psn = 0
        self.offset = 0  # bytes already packetised
        self.npkts = 0
        self.status = 0
        self.read_bytes = 0  # read/atomic: response bytes placed
        self.has_rd_atomic = False  # holds one of the max_rd_atomic initiator credits
        # FLUSH: the FETH's placement type (ibv_placement_type bits) and selectivity level
        # (ibv_selectivity_level); ``length`` is the RETH's DMA length, ``inline`` None.
        # ATOMIC WRITE keeps its 8 bytes in ``inline`` (librxe's wqe->dma.atomic_wr).
        self.flush_type = 0
        self.flush_level = 0

    def __repr__(self) -> str:
        return (f"<SendWqe wr_id={self.wr_id} op={self.opcode} len={self.length} "
                f"state={WqeState(self.state).name} psn={self.first_psn}..{self.last_psn}>")


class RecvWqe:
    __slots__ = ("wr_id", "sges", "length")

    def __init__(self, wr_id: int, sges: list[tuple[int, int, int]], length: int) -> None:
        self.wr_id = wr_id
        self.sges = sges
        self.length = length

    def __repr__(self) -> str:
        return f"<RecvWqe wr_id={self.wr_id} len={self.length}>"
