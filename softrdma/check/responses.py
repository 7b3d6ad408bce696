"""Rules about the responder's answers: AETH syndromes, ACK PSNs, the MSN, coalesced ACKs,
NAKs, and what a NAK obliges the requester to do.

Every response with an AETH acknowledges the requests up to a PSN ("upto"): the response's
own PSN for an ACK, a READ response or an atomic ACK (9.7.5.1.2: a response implicitly
acknowledges everything before it), the PSN before it for a NAK (the NAK'd request itself
is not done). A response whose upto is older than what was already acknowledged is a
duplicate answer (rxe re-ACKs duplicate requests, replays READ responses and atomic ACKs)
and moves nothing.

The MSN counts the messages the responder has completed: a SEND or WRITE at its LAST or
ONLY packet, a READ or atomic when it is accepted (C9-148). Messages are counted in PSN
order, so a message whose packets were lost and resent counts once, where its PSNs say:
between two responses the MSN must grow by exactly the number of messages that end in
between. A responder that executes a duplicate again counts it twice, and every answer
after that one shows it.

The responder sees only what passed the capture point, so it is judged by that: it NAKs a
PSN-sequence gap once (rxe's ``sent_psn_nak``), and may NAK the same PSN again only after
the capture shows the requester going back (softrdma NAKs once per go-back; rxe never does
until the expected PSN arrives). A NAK for a PSN the capture already carried tells that
the packet was lost after the capture point.
"""

from __future__ import annotations

from collections import Counter

from ..wire.headers import AETH_ACK_UNLIMITED, AethType, aeth_syndrome_name
from ..wire.opcodes import Opcode
from .decode import Packet
from .rules import Sink
from .state import FlowState, Gap, Nak

__all__ = ["is_duplicate", "on_response", "at_end", "note_request"]

_ACK = int(Opcode.RC_ACKNOWLEDGE)
_ATOMIC_ACK = int(Opcode.RC_ATOMIC_ACKNOWLEDGE)
_MSN_MASK = 0xFFFFFF
_BASE_VOTES = 16  # responses that elect the MSN before the capture's first message
_DUP_WINDOW = 5e-6
_RECENT = 16  # responses remembered to recognise the network's duplicates


def _wire(apsn: int) -> int:
    return apsn & 0xFFFFFF


def is_duplicate(st: FlowState, p: Packet) -> bool:
    """A response the network delivered twice (the same bytes with the same IP ID, or within
    microseconds). Recorded; it must not count as a second answer (a second NAK, say)."""
    st.n_resp += 1
    sig = (p.bth.opcode, p.psn, hash(bytes(p.bth.buf[:len(p.bth.buf) - 4])))
    seen = st.last_resp.get(sig)
    st.last_resp[sig] = (p.ip.ip_id, p.ts, st.n_req)
    if len(st.last_resp) > _RECENT:
        del st.last_resp[next(iter(st.last_resp))]
    if seen is None:
        return False
    ip_id, ts, n_req = seen
    # without IP IDs: within microseconds, and no request in between (a responder answers
    # each duplicate request it gets with the same ACK: that is not the network's)
    dup = bool(p.ip.ip_id and p.ip.ip_id == ip_id) or (
        not p.ip.ip_id and p.ts - ts < _DUP_WINDOW and n_req == st.n_req)
    if dup:
        st.rec.add("duplicate", p.frame, p.ts, p.psn, 1, f"{p.info.name} PSN {p.psn} captured "
                   "twice (the network duplicated it)", "responses")
        st.rec.duplicated(p.bth.payload_len)
    return dup


def note_request(st: FlowState, a: int) -> None:
    """A new request at ``a`` (unwrapped): it settles an ACK seen earlier for a PSN
    beyond every request captured then."""
    ab = st.ack_beyond
    if ab is None:
        return
    frame, apsn, text = ab
    if a <= apsn:
        st.ack_beyond = None
        st.violation_later = ("ACK-PSN", frame, text)
    elif a > apsn:
        st.ack_beyond = None  # the requests it acknowledged are in a hole
        st.rec.add("not-captured", frame, 0.0, _wire(apsn), 1,
                   f"an ACK for PSN {_wire(apsn)}, before the requester's packet at that PSN "
                   "was captured", "responses")


def on_response(st: FlowState, p: Packet, valid: bool, sink: Sink) -> None:
    """Judge one response. ``valid`` is False when the READ or atomic rules found it answers
    nothing, so it must not move the acknowledged PSN or the MSN."""
    b, label = p.bth, st.flow.label
    syn = b.syndrome
    kind = None
    st.rec.span(p.ts)
    st.last_resp_ts = p.ts
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
    if st.first is None or syn is None or not valid:
        return  # nothing captured to judge it against, a READ MIDDLE, or already reported
    a = st.unwrap(p.psn)
    if (kind == AethType.NAK and syn & 0x1F == 0 and a < st.first
            and st.first - a <= 4096 and st.acked is None):
        # the responder expects a PSN before the capture's first request: those were
        # lost before the capture point (or sent before it started)
        st.add_missing(range(a, st.first))
        st.gaps.appendleft(Gap(p.frame, p.ts, a, st.first))
        st.rec.add("lost-before", p.frame, p.ts, p.psn, st.first - a,
                   f"{st.first - a} request packet(s) from PSN {p.psn}, before the capture's "
                   "first request, never captured (lost before the capture point)")
        st.rec.open(a, p.ts)
        st.first = a
    if b.opcode in (_ACK, _ATOMIC_ACK):
        if a < st.first:
            return  # answers a request from before the capture
        if st.top is None or a > st.top:
            if st.ack_beyond is None:
                st.ack_beyond = (p.frame, a, f"{aeth_syndrome_name(syn).split()[0]} for PSN "
                                             f"{p.psn}, but the requester has sent PSNs up to "
                                             f"{_wire(st.top or 0)} only")
            return
    upto = a if kind == AethType.ACK else a - 1
    if kind == AethType.ACK and b.opcode == _ACK:
        req = st.reqs.get(a)
        if req is not None and p.ts >= req.seen_ts:
            rtt = p.ts - req.seen_ts
            st.rtt = rtt if st.rtt is None else min(st.rtt, rtt)
    if st.acked is not None and upto < st.acked:
        if kind == AethType.NAK and syn & 0x1F == 0:
            st.rec.add("nak", p.frame, p.ts, p.psn, 1, f"NAK for PSN {p.psn}, captured after "
                       "a later acknowledgement (reordered)")
        return  # a duplicate answer
    _holes_answered(st, p, upto, sink)
    if not _replay(st, p, upto):
        _msn(st, p, upto, sink)
    st.acked, st.acked_frame = upto, p.frame
    if st.in_order is None or st.in_order <= upto:
        # the responder has everything up to here (more than the capture showed in order,
        # or the first word from it: until then what it expects is unknown)
        st.in_order = upto + 1
    st.rec.close_upto(upto, p.ts)
    if st.pending_after:
        _late_not_lost(st, upto)
    if st.suspect is not None and upto >= st.suspect[1]:
        frame, npsn, nframe = st.suspect
        st.suspect = None
        req = st.reqs.get(npsn)
        if req is not None and req.seen_frame < nframe and not st.lossy_capture:
            sink.add("NAK-RETRY", frame, f"resend starts after PSN {_wire(npsn)}, NAK'd at frame "
                                         f"{nframe}; that PSN was never resent, yet frame "
                                         f"{p.frame} acknowledges it", label)
    nak = st.nak
    if nak is not None and upto >= nak.due:
        # a later ACK overtook the NAK (the missing packet was only late): the resend is
        # now due from after what this ACK covers, or not at all
        nak.due = upto + 1
        if st.top is not None and upto >= st.top:
            st.nak = None
    if b.opcode == _ACK and kind == AethType.ACK and st.blocked(a):
        st.implied = min(st.open_answers)  # an implied NAK for the oldest unanswered
    for q in [q for q in st.need_ack if q <= upto]:
        del st.need_ack[q]
    if kind == AethType.RNR_NAK or (kind == AethType.NAK and syn & 0x1F == 0):
        _nak(st, p, a, kind, syn, sink)
    elif kind == AethType.NAK and 1 <= syn & 0x1F <= 3:
        st.fatal = Nak(p.frame, p.ts, a, None)


def _nak(st: FlowState, p: Packet, a: int, kind: int, syn: int, sink: Sink) -> None:
    rec, label = st.rec, st.flow.label
    rnr = kind == AethType.RNR_NAK
    st.nak = Nak(p.frame, p.ts, a, syn & 0x1F if rnr else None)
    if rnr:
        rec.add("rnr-nak", p.frame, p.ts, p.psn, 1, f"RNR NAK for PSN {p.psn} (timer "
                                                    f"{syn & 0x1F}): the receive queue was "
                                                    "empty")
        return
    last = st.last_seq_nak
    # A go-back the responder got after its first NAK justifies a second (softrdma). Where
    # the capture sits decides whether that go-back shows before or after the first NAK:
    # at the requester, one sent just before the NAK arrived is captured before it. So a
    # go-back that started up to a round trip before the first NAK counts (one that
    # started earlier reached the responder before it sent that NAK), give or take 1 ms.
    window = (st.rtt or 0.0) + 1e-3
    went_back = st.last_go_back_ts is not None and last is not None \
        and st.last_go_back_ts >= last[2] - window
    if last is not None and last[0] == a and not went_back:
        sink.add("NAK-ONCE", p.frame, f"a second PSN sequence error NAK for PSN {p.psn} "
                                      f"(first at frame {last[1]}) with no go-back captured "
                                      "in between: a responder NAKs a gap once", label)
    st.last_seq_nak = (a, p.frame, p.ts)
    req = st.reqs.get(a)
    lost_after = req is not None and st.in_order is not None and st.in_order > a
    st.in_order = a  # what the responder expects, from the horse's mouth
    if lost_after:
        # a responder that got every captured request would have it, in order
        rec.add("lost-after", req.seen_frame, req.seen_ts, p.psn, 1,
                f"request PSN {p.psn} (frame {req.seen_frame}) never reached the responder: "
                f"it NAKs it at frame {p.frame} (lost after the capture point)")
        rec.open(a, req.seen_ts)
        if rec.events and rec.events[-1].kind == "lost-after":
            st.pending_after[a] = (rec.events[-1], p.frame)
        text = f"NAK: the responder expected PSN {p.psn}, lost after the capture point"
    elif req is not None:
        text = (f"NAK: the responder expected PSN {p.psn}, which it had dropped out of sequence "
                f"(frame {req.seen_frame} came while an earlier PSN was missing)")
    else:
        text = f"NAK: the responder expected PSN {p.psn}, lost before the capture point"
    rec.add("nak", p.frame, p.ts, p.psn, 1, text)


def _late_not_lost(st: FlowState, upto: int) -> None:
    """An ACK covers a PSN the responder NAK'd after the capture point carried it, before
    any resend of it was captured: the packet reached the responder after all, late
    (reordered after the capture point), not lost."""
    for a in [q for q in st.pending_after if q <= upto]:
        ev, nak_frame = st.pending_after.pop(a)
        req = st.reqs.get(a)
        if req is not None and req.seen_frame < nak_frame:
            st.rec.lost_after["requests"] -= 1
            st.rec.reordered += 1
            ev.kind = "reordered"
            ev.text = (f"request PSN {ev.psn} (frame {ev.frame}) reached the responder late, "
                       "after it NAK'd it (reordered after the capture point)")


def _holes_answered(st: FlowState, p: Packet, upto: int, sink: Sink) -> None:
    """The responder acknowledged PSNs the capture never carried. Nothing lost on the path
    reaches a responder, so either the requester skipped them and the responder took what
    came next (PSN-SEQ, at the hole), or the capture itself dropped them (with ``lossy``:
    an observation)."""
    if not st.missing:
        return
    gone = [q for q in st.missing if q <= upto]
    if not gone:
        return
    st.missing.difference_update(gone)
    if st.rec.lost_before["requests"] >= len(gone):
        st.rec.lost_before["requests"] -= len(gone)
    if st.lossy_capture:
        st.rec.add("not-captured", p.frame, p.ts, _wire(min(gone)), len(gone),
                   f"frame {p.frame} acknowledges {len(gone)} request packet(s) from PSN "
                   f"{_wire(min(gone))} that the capture never carried (the capture missed "
                   "them)")
        return
    lo = min(gone)
    for g in st.gaps:
        if g.start <= lo < g.end:
            sink.add("PSN-SEQ", g.frame, f"PSN {_wire(g.end)}, expected {_wire(g.start)}: "
                                         f"{g.end - g.start} PSN(s) skipped, never sent, yet "
                                         f"acknowledged at frame {p.frame} (if the capture "
                                         "dropped packets: --lossy)", st.flow.label)
            break


def _replay(st: FlowState, p: Packet, upto: int) -> bool:
    """An answer to a READ or atomic the requester asked again: the responder replays it
    with its MSN of now, which may count requests accepted since (rxe_resp.c
    duplicate_request), so its MSN proves nothing."""
    if p.bth.opcode == _ACK:
        return False
    a = upto
    if st.msn_upto is not None and a <= st.msn_upto:
        return True
    op = st.a19.get(a)  # an ATOMIC WRITE or FLUSH, answered like a READ
    if op is not None:
        return op.resent
    if p.info.read:
        r = st.find_read(a)
        return r is not None and bool(r.restarts)
    at = st.atomics.get(a)
    return at is not None and at.resent


def _msn(st: FlowState, p: Packet, upto: int, sink: Sink) -> None:
    """Count the messages that end at or before ``upto`` and judge the MSN: it must be the
    MSN before the capture's first message (elected by the first responses) plus that
    count. One disagreeing response is one violation; if the next agrees with it rather
    than with the old count, the responder counted one message more or less for good
    (a duplicate executed again): that is still one violation."""
    ends = st.ends
    i = 0
    while i < len(ends) and ends[i] <= upto:
        i += 1
    if i:
        del ends[:i]
        st.msn_done += i
    st.msn_upto = upto
    entry = (p.frame, p.bth.msn, st.msn_done, upto)
    if st.msn_base is None:
        st.msn_pending.append(entry)
        if len(st.msn_pending) >= _BASE_VOTES:
            _elect(st, sink)
        return
    _judge(st, entry, sink)


def _elect(st: FlowState, sink: Sink) -> None:
    """The MSN before the capture's first message, from the first responses: the
    explanation of their MSNs with the fewest faults, either one count throughout (a
    response that disagrees is one fault, even the first) or one count changed for good
    at some response (that response is the fault: a message counted twice, say), plus
    responses that disagree with their part. A tie goes to one count throughout."""
    pending, st.msn_pending = st.msn_pending, []
    offs = [(msn - n) & _MSN_MASK for _f, msn, n, _u in pending]
    whole = Counter(offs).most_common(1)[0][0]
    best = (sum(o != whole for o in offs), len(offs), whole, whole)
    for j in range(1, len(offs)):
        a = Counter(offs[:j]).most_common(1)[0][0]
        b = offs[j]
        if a == b:
            continue
        cost = 1 + sum(o != a for o in offs[:j]) + sum(o != b for o in offs[j + 1:])
        if cost < best[0]:
            best = (cost, j, a, b)
    _cost, j, a, b = best
    for k, e in enumerate(pending):
        base = a if k <= j else b
        if offs[k] != base or k == j < len(offs):
            _report(st, e, a if k <= j else b, sink)
    st.msn_base, st.msn_shift = b, None


def _judge(st: FlowState, entry: tuple, sink: Sink) -> None:
    frame, msn, n, upto = entry
    base = st.msn_base
    assert base is not None
    if msn == (base + n) & _MSN_MASK:
        st.msn_shift = None
        return
    now = (msn - n) & _MSN_MASK
    if st.msn_shift is not None and st.msn_shift[1] == now:
        st.msn_base = now  # the count changed for good: reported once, at its first sign
        st.msn_shift = None
        return
    st.msn_shift = (frame, now)
    _report(st, entry, base, sink)


def _report(st: FlowState, entry: tuple, base: int, sink: Sink) -> None:
    frame, msn, n, upto = entry
    sink.add("MSN", frame, f"MSN {msn}, expected {(base + n) & _MSN_MASK} (MSN {base} before "
                           f"the capture's first message + {n} completed up to PSN "
                           f"{_wire(upto)})", st.flow.label)


def at_end(st: FlowState, sink: Sink) -> None:
    """What the capture should have shown by its end, and the MSNs still to judge.

    ACK-COVER: a capture can end before the last ACK, and a responder still answering older
    requests may just be behind. So an AckReq request left unacknowledged is reported only
    when the responder's end went on to send requests of its own after it: a live peer
    that skipped the ACK, not a capture cut short (a heuristic; docs/check.md)."""
    if st.msn_base is None and st.msn_pending:
        _elect(st, sink)
    later = st.violation_later
    if later is not None:
        sink.add(later[0], later[1], later[2], st.flow.label)
    if st.ack_beyond is not None:
        frame, apsn, text = st.ack_beyond
        sink.add("ACK-PSN", frame, text, st.flow.label)
    for q, frame in st.need_ack.items():
        if frame < st.responder_last_request:
            sink.add("ACK-COVER", frame, f"AckReq request at PSN {_wire(q)} never acknowledged "
                                         f"(acknowledged up to "
                                         f"{_wire(st.acked) if st.acked is not None else None})"
                                         ", though the responder sent requests of its own "
                                         "after it", st.flow.label)
    nak = st.nak
    if nak is not None and nak.rnr_timer is None and nak.new_after:
        st.rec.add("unresolved", nak.frame, nak.ts, _wire(nak.psn), 1,
                   f"the requester sent {nak.new_after} new request(s) after the NAK of PSN "
                   f"{_wire(nak.psn)} and the capture ends before it went back (the NAK may "
                   "have been lost after the capture point, or ignored during a retry)")
