"""Rules about atomics: each is answered by an ATOMIC ACKNOWLEDGE at its PSN carrying the
original value, and a duplicate is answered with the *same* original value (the responder
keeps the result and replays it; executing the atomic twice would add twice).
"""

from __future__ import annotations

from ..wire.headers import AethType
from ..wire.opcodes import Opcode
from .decode import Packet
from .rules import Sink
from .sequence import NEW
from .state import Atomic, FlowState

__all__ = ["on_request", "on_response", "at_end"]

_ACK = int(Opcode.RC_ACKNOWLEDGE)
_ATOMIC_ACK = int(Opcode.RC_ATOMIC_ACKNOWLEDGE)


def on_request(st: FlowState, p: Packet, kind: str) -> None:
    """Register an atomic first seen as a resend (the first copy may be from before the
    capture); new ones are registered with the request (sequence)."""
    if p.info.atomic and kind != NEW:
        a = st.unwrap(p.psn)
        if a not in st.atomics:
            st.atomics[a] = Atomic(a, p.frame, resent=True)
            st.open_answers.add(a)


def on_response(st: FlowState, p: Packet, sink: Sink) -> bool:
    """Judge an ATOMIC ACKNOWLEDGE, or a plain ACK at an atomic's PSN. False if it answers
    no atomic."""
    if st.first is None:
        return True
    b, label = p.bth, st.flow.label
    apsn = st.unwrap(p.psn)
    if b.opcode == _ATOMIC_ACK:
        a = st.atomics.get(apsn)
        if a is None:
            if not st.seen(apsn) or apsn in st.missing or apsn not in st.reqs:
                return True  # the ACK-PSN rule speaks for PSNs never sent
            sink.add("ATOMIC-ACK", p.frame, f"ATOMIC ACKNOWLEDGE at PSN {p.psn}, but the "
                                            "request there is no atomic", label)
            return False
        if not st.blocked(apsn):
            st.open_answers.discard(apsn)  # taken, unless an earlier answer is missing
        if a.orig is None:
            a.orig, a.ack_frame = b.orig, p.frame
        elif b.orig != a.orig:
            sink.add("ATOMIC-REPLAY", p.frame, f"original value 0x{b.orig:x} for PSN "
                                               f"{p.psn}, expected 0x{a.orig:x} as first "
                                               f"answered (frame {a.ack_frame})", label)
        a.answered = True
    elif b.opcode == _ACK and (b.syndrome or 0) & 0x60 == AethType.ACK:
        a = st.atomics.get(apsn)
        if a is not None and not a.answered and st.last_resend_frame > a.frame:
            # a resend came after the atomic: a responder re-ACKs a duplicate SEND/WRITE at
            # the last PSN it took (rxe_resp.c duplicate_request: prev_psn), which may be
            # this atomic's; that plain ACK is not the atomic's answer
            pass
        elif a is not None and not a.answered:
            sink.add("ATOMIC-ACK", p.frame, f"plain ACKNOWLEDGE for the atomic at PSN "
                                            f"{p.psn} (frame {a.frame}), expected an ATOMIC "
                                            "ACKNOWLEDGE with its original value", label)
            a.answered = True  # reported once
            st.open_answers.discard(apsn)
    return True


def at_end(st: FlowState, sink: Sink) -> None:
    for a in st.atomics.values():
        if not a.answered and st.acked is not None and st.acked > a.psn:
            sink.add("ATOMIC-ACK", a.frame, f"atomic at PSN {a.psn & 0xFFFFFF} never answered "
                                            "by an ATOMIC ACKNOWLEDGE, though later requests "
                                            f"were acknowledged (up to PSN "
                                            f"{st.acked & 0xFFFFFF})",
                     st.flow.label)
