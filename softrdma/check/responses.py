"""Rules about the responder's answers: AETH syndromes, ACK PSNs, the MSN, coalesced ACKs,
and what a NAK obliges the requester to do.

Every response with an AETH acknowledges the requests up to a PSN ("upto"): the response's
own PSN for an ACK, a READ response or an atomic ACK (9.7.5.1.2: a response implicitly
acknowledges everything before it), the PSN before it for a NAK (the NAK'd request itself
is not done). A response whose upto is older than what was already acknowledged is a
duplicate answer (rxe re-ACKs duplicate requests, replays READ responses and atomic ACKs)
and moves nothing.

The MSN counts the messages the responder has completed: a SEND or WRITE at its LAST or
ONLY packet, a READ or atomic when it is accepted (C9-148). So between two responses the
MSN must grow by exactly the number of messages that end in between: every response's MSN
minus the messages completed up to its PSN is the same number.
"""

from __future__ import annotations

import bisect
from collections import Counter

from ..qp.params import RNR_NAK_USEC
from ..qp.psn import psn_add, psn_diff
from ..wire.headers import AETH_ACK_UNLIMITED, AethType, aeth_syndrome_name
from ..wire.opcodes import Opcode
from .decode import Packet
from .rules import Sink
from .sequence import NEW, RETRY
from .state import FlowState, Nak

__all__ = ["on_request", "on_response", "at_end"]

_ACK = int(Opcode.RC_ACKNOWLEDGE)
_ATOMIC_ACK = int(Opcode.RC_ATOMIC_ACKNOWLEDGE)
_MSN_MASK = 0xFFFFFF
_SLACK = 2e-6  # pcap timestamps are microseconds: forgive their rounding


def on_request(st: FlowState, p: Packet, kind: str, sink: Sink) -> None:
    """Follow a pending NAK: the next go-back must start at (or before) the NAK'd PSN, and
    not too early after an RNR NAK. New requests, and resends that continue a go-back
    burst already under way (BURST), were in flight when the NAK was sent."""
    if st.fatal is not None and p.psn == st.fatal.psn and kind != NEW:
        sink.add("NAK-FATAL", p.frame, f"resends PSN {p.psn}, NAK'd at frame {st.fatal.frame} "
                                       "with a fatal code: the requester's QP is in error",
                 st.flow.label)
    nak = st.nak
    if nak is None:
        return
    if kind != RETRY:
        nak.new_after += kind == NEW  # sent before the NAK reached the requester
        return
    st.nak = None
    if psn_diff(p.psn, nak.psn) > 0 and not st.lossy:  # (the resend may be lost too)
        # going back further is allowed (a READ with a response missing is re-read from
        # there); starting after the NAK'd PSN skips what the responder never got
        sink.add("NAK-RETRY", p.frame, f"resend starts at PSN {p.psn} after the NAK of frame "
                                       f"{nak.frame}, expected PSN {nak.psn} or earlier",
                 st.flow.label)
        return
    if nak.rnr_timer is not None:
        wait = RNR_NAK_USEC[nak.rnr_timer] * 1e-6
        waited = p.ts - nak.ts
        if waited + _SLACK < wait:
            sink.add("RNR-WAIT", p.frame, f"resent PSN {p.psn} {waited * 1e6:.0f} us after the "
                                          f"RNR NAK of frame {nak.frame}, expected at least "
                                          f"{wait * 1e6:.0f} us (timer {nak.rnr_timer})",
                     st.flow.label)


def on_response(st: FlowState, p: Packet, valid: bool, sink: Sink) -> None:
    """Judge one response. ``valid`` is False when the READ or atomic rules found it answers
    nothing, so it must not move the acknowledged PSN or the MSN."""
    b, label = p.bth, st.flow.label
    syn = b.syndrome
    kind = None
    if syn is not None:
        kind = syn & 0x60
        code = syn & 0x1F
        if kind == AethType.RESERVED or (kind == AethType.NAK and code > 4):
            sink.add("AETH-SYNDROME", p.frame, f"syndrome 0x{syn:02x} "
                                               f"({aeth_syndrome_name(syn)}) is reserved; "
                                               "expected ACK, RNR NAK or NAK codes 0-4", label)
            return
        if b.opcode != _ACK and kind != AethType.ACK:
            sink.add("AETH-SYNDROME", p.frame, f"{p.info.name} carries "
                                               f"{aeth_syndrome_name(syn)}, expected an ACK "
                                               "syndrome", label)
            return
        if kind == AethType.ACK and code != AETH_ACK_UNLIMITED:
            sink.add("ACK-CREDIT", p.frame, f"credit {code}, rxe always advertises "
                                            f"{AETH_ACK_UNLIMITED} (unlimited)", label)
    if st.first_psn is None or syn is None or not valid:
        return  # nothing captured to judge it against, a READ MIDDLE, or already reported
    if b.opcode in (_ACK, _ATOMIC_ACK):
        if psn_diff(p.psn, st.first_psn) < 0:
            return  # answers a request from before the capture
        if psn_diff(p.psn, st.max_psn) > 0:
            sink.add("ACK-PSN", p.frame, f"{aeth_syndrome_name(syn).split()[0]} for PSN "
                                         f"{p.psn}, but the requester has sent PSNs up to "
                                         f"{st.max_psn} only", label)
            return
    upto = p.psn if kind == AethType.ACK else psn_add(p.psn, -1)
    if st.acked is not None and psn_diff(upto, st.acked) < 0:
        return  # a duplicate answer
    if not _replay(st, p, upto):
        _msn(st, p, upto)
    st.acked, st.acked_frame = upto, p.frame
    if st.nak is not None and psn_diff(upto, st.nak.psn) >= 0:
        # a later ACK overtook the NAK (the missing packet was only late): the resend is
        # now due from after what this ACK covers, or not at all
        st.nak.psn = psn_add(upto, 1)
        if psn_diff(upto, st.max_psn) >= 0:
            st.nak = None
    if not st.blocked(p.psn) and (st.sure is None or psn_diff(upto, st.sure) > 0):
        st.sure, st.sure_frame = upto, p.frame
    for psn in [q for q in st.need_ack if psn_diff(q, upto) <= 0]:
        del st.need_ack[psn]
    if kind == AethType.RNR_NAK or (kind == AethType.NAK and syn & 0x1F == 0):
        st.nak = Nak(p.frame, p.ts, p.psn, syn & 0x1F if kind == AethType.RNR_NAK else None)
    elif kind == AethType.NAK and 1 <= syn & 0x1F <= 3:
        st.fatal = Nak(p.frame, p.ts, p.psn, None)


def _replay(st: FlowState, p: Packet, upto: int) -> bool:
    """An answer to a READ or atomic the requester asked again: the responder replays it
    with its MSN of now, which may count requests accepted since (rxe_resp.c
    duplicate_request), so its MSN proves nothing."""
    if p.bth.opcode == _ACK:
        return False
    if st.msn_log and psn_diff(upto, st.msn_log[-1][3]) <= 0:
        return True
    if p.info.read:
        r = st.find_read(p.psn)
        return r is not None and bool(r.restarts)
    a = st.atomics.get(p.psn)
    return a is not None and a.resent


def _msn(st: FlowState, p: Packet, upto: int) -> None:
    """Note the MSN against the number of messages that end at or before ``upto``; judged
    at the end (:func:`_judge_msn`)."""
    ends = st.msg_ends
    i = st.msn_idx
    while i < len(ends) and psn_diff(ends[i], upto) <= 0:
        i += 1
    st.msn_idx = i
    st.msn_log.append((p.frame, p.bth.msn, i, upto))


def _judge_msn(st: FlowState, sink: Sink) -> None:
    """MSN = (MSN at the start of the capture) + (messages completed since). The start value
    is unknown (a capture may begin mid-conversation), so it is the one most responses
    agree on; each response that disagrees is one violation, wherever it sits (one bad
    MSN, even the first, is one violation, not one per later response)."""
    if not st.msn_log:
        return
    base = Counter((msn - n) & _MSN_MASK for _f, msn, n, _u in st.msn_log).most_common(1)[0][0]
    for frame, msn, n, upto in st.msn_log:
        want = (base + n) & _MSN_MASK
        if msn != want:
            sink.add("MSN", frame, f"MSN {msn}, expected {want} (MSN {base} before the capture's "
                                   f"first message + {n} completed up to PSN {upto})",
                     st.flow.label)


def at_end(st: FlowState, responder_requests: list[int], sink: Sink) -> None:
    """What the capture should have shown by its end, and the MSNs (:func:`_judge_msn`).

    ACK-COVER: a capture can end before the last ACK, and a responder still answering older
    requests may just be behind. So an AckReq request left unacknowledged is reported only
    when the responder's end went on to send requests of its own after it: a live peer
    that skipped the ACK, not a capture cut short (a heuristic; docs/check.md)."""
    _judge_msn(st, sink)
    for psn, frame in st.need_ack.items():
        if bisect.bisect_right(responder_requests, frame) < len(responder_requests):
            sink.add("ACK-COVER", frame, f"AckReq request at PSN {psn} never acknowledged "
                                         f"(acknowledged up to {st.acked}), though the "
                                         "responder sent requests of its own after it",
                     st.flow.label)
    nak = st.nak
    if nak is not None and nak.new_after:
        sink.add("NAK-RETRY", nak.frame, f"the requester sent {nak.new_after} new request(s) "
                                         f"after this NAK but never resent PSN {nak.psn}",
                 st.flow.label)
