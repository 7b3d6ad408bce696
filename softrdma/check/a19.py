"""Rules about ATOMIC WRITE and FLUSH (IBTA 1.5 annex A19; rxe since Linux 6.2).

An ATOMIC WRITE carries a RETH naming 8 bytes at an 8-byte aligned address and exactly
those 8 bytes (A19.4.2; rxe's check_rkey length rule and rxe_mr_do_atomic_write). A FLUSH
carries a FETH and a RETH and no payload (oA19-2); its FETH has the reserved bits zero, a
placement type of global visibility (1), persistence (2) or both, and a selectivity level
of the range (0) or the memory region (1) (A19.3). The responder answers both with an RDMA
READ RESPONSE ONLY without data at the request's PSN, as rxe does
(``send_read_response_ack``), and answers a duplicate the same way without executing it
again (oA19-15), which is why a plain ACK or an ATOMIC ACKNOWLEDGE at their PSN is wrong.
A missing answer is not judged: unlike a READ or an atomic, the requester completes an
ATOMIC WRITE or FLUSH on a later ACK that covers its PSN (rxe_comp.c check_psn), so a lost
answer costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.headers import FETH_RESV_MASK, AethType, feth_plt, feth_sel
from ..wire.opcodes import Opcode
from .decode import Packet
from .rules import Sink
from .sequence import NEW
from .state import FlowState

__all__ = ["A19Op", "on_request", "on_response"]

_READ_ONLY = int(Opcode.RC_RDMA_READ_RESPONSE_ONLY)
_ACK = int(Opcode.RC_ACKNOWLEDGE)
_ATOMIC_ACK = int(Opcode.RC_ATOMIC_ACKNOWLEDGE)


@dataclass
class A19Op:
    """An ATOMIC WRITE or FLUSH seen in the capture, waiting for its answer."""

    psn: int  # unwrapped
    name: str
    frame: int
    answered: bool = False
    resent: bool = False  # asked again: its answer is a replay with the MSN of then


def on_request(st: FlowState, p: Packet, kind: str, sink: Sink) -> None:
    """Judge the form of an ATOMIC WRITE or FLUSH and remember it for its answer."""
    info = p.info
    if not (info.atomic_write or info.flush):
        return
    b, label = p.bth, st.flow.label
    if info.atomic_write:
        bad = []
        if b.payload_len != 8:
            bad.append(f"{b.payload_len} bytes of payload")
        if b.dma_len != 8:
            bad.append(f"RETH DMA length {b.dma_len}")
        if (b.va or 0) & 7:
            bad.append(f"VA 0x{b.va:x} not 8-byte aligned")
        if bad:
            sink.add("ATOMIC-WRITE-FORM", p.frame, f"ATOMIC WRITE at PSN {b.psn}: "
                                                   f"{', '.join(bad)}; expected 8 bytes at "
                                                   "an aligned VA", label)
    else:
        feth = b.feth or 0
        bad = []
        if feth & FETH_RESV_MASK:
            bad.append(f"reserved FETH bits 0x{feth & FETH_RESV_MASK:x}")
        if feth_sel(feth) > 1:
            bad.append(f"selectivity level {feth_sel(feth)}")
        if not 1 <= feth_plt(feth) <= 3:
            bad.append(f"placement type {feth_plt(feth)}")
        if bad:
            sink.add("FLUSH-FORM", p.frame, f"FLUSH at PSN {b.psn}: {', '.join(bad)} (IBTA "
                                            "defines placement types 1 and 2, levels 0 and "
                                            "1)", label)
    a = st.unwrap(b.psn)
    op = st.a19.get(a)
    if op is None:
        op = st.a19[a] = A19Op(a, info.short_name, p.frame)
    if kind != NEW:
        op.resent = True


def on_response(st: FlowState, p: Packet, sink: Sink) -> bool | None:
    """Judge a response at the PSN of an ATOMIC WRITE or FLUSH: True (valid) or False
    (not an answer) if it is at one; None if it concerns none, for the other modules."""
    if st.first is None:
        return None
    b = p.bth
    op = st.a19.get(st.unwrap(b.psn))
    if op is None:
        return None
    label = st.flow.label
    if b.opcode == _READ_ONLY:
        if b.payload_len:
            sink.add("A19-RESPONSE", p.frame, f"READ RESPONSE ONLY answering the {op.name} of "
                                              f"frame {op.frame} carries {b.payload_len} "
                                              "bytes, expected none", label)
        if (b.syndrome or 0) & 0x60 == AethType.ACK:
            op.answered = True
        return True
    if b.opcode == _ATOMIC_ACK or (b.opcode == _ACK and (b.syndrome or 0) & 0x60 == AethType.ACK
                                   and not op.answered
                                   and st.last_resend_frame <= op.frame):
        # (a plain ACK after a resend may be the re-ACK of a duplicate SEND/WRITE at the
        # last PSN the responder took, rxe_resp.c duplicate_request: not this answer)
        sink.add("A19-RESPONSE", p.frame, f"{p.info.name} at the PSN of the {op.name} of "
                                          f"frame {op.frame}, expected an RDMA READ RESPONSE "
                                          "ONLY without data", label)
        op.answered = True
        return b.opcode == _ACK
    return None
