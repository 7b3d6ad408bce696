"""Work completions and async events: the records the engines hand to users.

Defined here, below both the protocol core and the verbs API, so the engines can create
them without importing the verbs API; :mod:`softrdma.verbs_api` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .enums import ibv_event_type, ibv_wc_opcode, ibv_wc_status, ibv_wr_opcode as W, wc_status_str

__all__ = ["WC", "AsyncEvent", "wc_opcode_of", "WC_RECV", "WC_RECV_RDMA_WITH_IMM"]

# The completion opcode of each send work request opcode (rxe's wr_to_wc_opcode), as plain
# ints: the completer looks one up per completed WQE.
_WC_OF_WR = {int(k): int(v) for k, v in {
    W.IBV_WR_SEND: ibv_wc_opcode.IBV_WC_SEND,
    W.IBV_WR_SEND_WITH_IMM: ibv_wc_opcode.IBV_WC_SEND,
    W.IBV_WR_SEND_WITH_INV: ibv_wc_opcode.IBV_WC_SEND,
    W.IBV_WR_RDMA_WRITE: ibv_wc_opcode.IBV_WC_RDMA_WRITE,
    W.IBV_WR_RDMA_WRITE_WITH_IMM: ibv_wc_opcode.IBV_WC_RDMA_WRITE,
    W.IBV_WR_RDMA_READ: ibv_wc_opcode.IBV_WC_RDMA_READ,
    W.IBV_WR_ATOMIC_CMP_AND_SWP: ibv_wc_opcode.IBV_WC_COMP_SWAP,
    W.IBV_WR_ATOMIC_FETCH_AND_ADD: ibv_wc_opcode.IBV_WC_FETCH_ADD,
    W.IBV_WR_BIND_MW: ibv_wc_opcode.IBV_WC_BIND_MW,
    W.IBV_WR_LOCAL_INV: ibv_wc_opcode.IBV_WC_LOCAL_INV,
    W.IBV_WR_FLUSH: ibv_wc_opcode.IBV_WC_FLUSH,
    W.IBV_WR_ATOMIC_WRITE: ibv_wc_opcode.IBV_WC_ATOMIC_WRITE,
}.items()}
WC_RECV = int(ibv_wc_opcode.IBV_WC_RECV)
WC_RECV_RDMA_WITH_IMM = int(ibv_wc_opcode.IBV_WC_RECV_RDMA_WITH_IMM)


def wc_opcode_of(wr_opcode: int) -> int:
    """The ``ibv_wc_opcode`` a completed send WR of ``wr_opcode`` reports."""
    return _WC_OF_WR.get(wr_opcode, 0)


@dataclass
class AsyncEvent:
    """An asynchronous event (``ibv_async_event``): ``element`` is the QP, CQ or SRQ it is
    about, or the port number for port events."""

    event_type: int
    element: Any

    def ack(self) -> None:
        """ibv_ack_async_event: nothing to release in softrdma, kept for symmetry."""

    def __str__(self) -> str:
        return f"{ibv_event_type(self.event_type).name} on {self.element!r}"


class WC:
    """A work completion (``ibv_wc``)."""

    __slots__ = ("wr_id", "status", "opcode", "vendor_err", "byte_len", "qp_num", "src_qp",
                 "imm_data", "wc_flags", "pkey_index", "slid", "sl", "dlid_path_bits",
                 "invalidated_rkey")

    def __init__(self, wr_id: int = 0, status: int = 0, opcode: int = 0, vendor_err: int = 0,
                 byte_len: int = 0, qp_num: int = 0, src_qp: int = 0, imm_data: int = 0,
                 wc_flags: int = 0, pkey_index: int = 0, slid: int = 0, sl: int = 0,
                 dlid_path_bits: int = 0) -> None:
        self.wr_id = wr_id
        self.status = status
        self.opcode = opcode
        self.vendor_err = vendor_err
        self.byte_len = byte_len
        self.qp_num = qp_num
        self.src_qp = src_qp
        self.imm_data = imm_data
        self.wc_flags = wc_flags
        self.pkey_index = pkey_index
        self.slid = slid
        self.sl = sl
        self.dlid_path_bits = dlid_path_bits
        self.invalidated_rkey = 0

    def __repr__(self) -> str:
        try:
            op = ibv_wc_opcode(self.opcode).name
        except ValueError:
            op = str(self.opcode)
        st = ibv_wc_status(self.status).name if self.status in ibv_wc_status._value2member_map_ else self.status
        return (f"WC(wr_id={self.wr_id}, status={st}, opcode={op}, byte_len={self.byte_len}, "
                f"qp_num={self.qp_num}, src_qp={self.src_qp}, imm_data=0x{self.imm_data:x}, "
                f"wc_flags=0x{self.wc_flags:x})")

    def __str__(self) -> str:
        return repr(self) if self.status == 0 else f"{repr(self)} ({wc_status_str(self.status)})"
