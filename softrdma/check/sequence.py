"""Rules about the requester's packets: PSN order, opcode sequences, sizes, retransmissions,
and what the capture says about requests lost before or after it.

Every request is classified against the PSN the next new request must carry:

* equal: a **new** packet; it moves the expected PSN on by one (a READ by one per response
  packet it asks for).
* ahead: a **hole**. The PSNs skipped were lost between the requester and the capture point
  (or are late). Not a fault: recorded for the recovery report, and the packet is new.
* behind, filling a hole: the missing packet, **resent** after its loss (a go-back that
  starts there, or continues through it) or merely **late** (reordered).
* behind, at a PSN already captured: the **network duplicated** it (the same bytes, the same
  IP ID, or within microseconds), or, on RC, the requester **resent** it (go-back-N): a
  resend that starts a go-back (RETRY) or continues one (BURST). It must resend what was
  sent at that PSN. UC never resends, so there it is a PSN-SEQ fault.

The structure of messages is judged in PSN order, not capture order, so a hole does not
break it: each packet is checked against its PSN neighbours once both were captured (9.4:
FIRST, MIDDLE..., LAST or ONLY; nothing else starts before LAST), an RDMA WRITE's bytes add
up to its RETH length once all its packets were, and every packet has the right size for
the path MTU.

What caused a go-back decides how it is judged: a NAK the requester evidently acted on
(it went back to the NAK'd PSN promptly), an implied NAK, a missing READ response, or its
retransmit timer (after a silence). The requester is held to what it evidently knew: once
it acted on a NAK for PSN p, everything before p was acknowledged to it, and a later
go-back to such a PSN is RETRY-RANGE. An ACK it may never have received (lost after the
capture point) binds it to nothing.
"""

from __future__ import annotations

from typing import Any

from ..qp.params import RNR_NAK_USEC
from ..wire.crc import crc32
from ..wire.opcodes import OPCODES
from ..wire.packet import parse
from .decode import Packet
from .rules import Sink
from .state import Atomic, FlowState, Gap, Read, Req, read_packets

__all__ = ["on_request", "at_end", "check_size", "NEW", "FILL", "RETRY", "BURST", "DUP"]

NEW = "new"
FILL = "fill"  # a hole's PSN, captured late (resent, or reordered)
RETRY = "retry"  # a resend that starts a go-back
BURST = "burst"  # a resend that continues the go-back under way
DUP = "dup"  # the network's duplicate of a captured packet
_DUP_WINDOW = 5e-6  # two copies this close, bytes equal: the network's, not a resend
_SMALL = 256  # payloads kept whole (for the offset of a difference); larger: a CRC
_SLACK = 2e-6  # pcap timestamps are microseconds: forgive their rounding
_HOLE_MAX = 1 << 16
_BURST_SKIP = 16  # a go-back burst that jumps this far ahead lost packets on the way


def _react(st: FlowState) -> float:
    """How soon after a NAK a requester that acts on it goes back, as the capture point
    sees it: two of its round trips, and never less than 5 ms (rxe in emulated guests
    answers within about 1 ms at its own NIC). Retransmit timers are longer (rxe:
    4.096 us x 2^timeout, 67 ms at perftest's and ibv_rc_pingpong's 14; rxe's
    timer is kicked, not reset, so some fire sooner). Measured on the lab's lossy
    captures: at the requester's NIC the go-backs that follow a NAK within this bound are
    as many as rxe's rcvd_seq_err counter says (pcaps/linux-rxe/lossy)."""
    return max(2 * (st.rtt or 0.0), 0.005)


def _wire(apsn: int) -> int:
    return apsn & 0xFFFFFF


def _kind(info: Any) -> str | None:
    """The multi-packet operation an opcode belongs to."""
    if info.send:
        return "send"
    if info.write:
        return "write"
    return None


def _masked_header(p: Packet) -> bytes:
    """The packet's headers with the fields a resend may change (AckReq, PSN, FECN, BECN)
    cleared: what a resend must repeat."""
    h = bytearray(p.bth.buf[:p.info.length])
    h[4] &= 0x3F
    h[8] &= 0x7F
    h[9:12] = b"\0\0\0"
    return bytes(h)


def _taken(st: FlowState, p: Packet) -> int | None:
    """PSNs a new request takes (None: a READ whose size in PSNs is unknown)."""
    if not p.info.read:
        return 1
    mtu = st.mtu
    if mtu is None:
        # no FIRST/MIDDLE anywhere: the responses are ONLY, unless none were captured
        return 1 if (p.bth.dma_len <= 256 or st.flow.responses) else None
    return read_packets(p.bth.dma_len, mtu)


def on_request(st: FlowState, p: Packet, sink: Sink) -> str:
    """Judge one request packet; return NEW, FILL, RETRY, BURST or DUP."""
    kind = _classify(st, p, sink)
    a = st.unwrap(p.psn)
    if st.rc and a == st.in_order:
        # what a go-back-N responder right behind the capture point would have taken in
        # order (rxe drops what comes ahead of the PSN it expects, and does not buffer it)
        r = st.find_read(a) if p.info.read else None
        st.in_order = a + (r.n - (a - r.psn) if r is not None and r.n else 1)
    return kind


def _ip_id(st: FlowState, p: Packet) -> int:
    """The request's IPv4 ID where the flow's IDs order its packets (rxe's counter), else
    0, which every rule reads as "no ID" (softrdma's trains number their segments from 0
    in each train: an ID then says nothing about what was sent first)."""
    return p.ip.ip_id if st.numbered else 0


def _classify(st: FlowState, p: Packet, sink: Sink) -> str:
    if st.numbered and not p.ip.ip_id and p.ip.ip_version == 4:
        st.numbered = False
    st.rec.span(p.ts)
    a = st.unwrap(p.psn)
    silence = p.ts - max(st.last_req_ts if st.last_req_ts is not None else p.ts,
                         st.last_resp_ts if st.last_resp_ts is not None else float("-inf"))
    st.last_req_ts = p.ts
    st.n_req += 1
    if st.first is None:
        st.first = a
    old = st.reqs.get(a)
    ip_id, newest = _ip_id(st, p), st.max_ip_id
    older = bool(ip_id) and newest is not None and 0 < (newest - ip_id) & 0xFFFF < 0x8000
    if not older and ip_id:
        st.max_ip_id = ip_id
    if st.next is None or a == st.next:
        if old is None:
            return _new(st, p, a, sink)
    elif a > st.next:
        _hole(st, p, a)
        return _new(st, p, a, sink)
    elif a in st.missing:
        return _fill(st, p, a, sink, silence)
    if old is not None and a in st.late and _late(st, old, p, a):
        _seen(st, old, p, a)  # the responder may get this copy
        return DUP
    if old is not None and older and st.rc and not _is_duplicate(st, old, p):
        # rxe numbers the IPv4 packets it sends: one older than a packet already captured
        # was sent before it and arrived late (reordered), not a new go-back
        _seen(st, old, p, a)
        st.rec.resent(p.bth.payload_len)
        st.rec.add("reordered", p.frame, p.ts, p.psn, 1, f"resent PSN {p.psn} arrived late "
                   "(an older IPv4 ID than packets captured before it)")
        return BURST
    if old is not None and st.retry_next != a and _is_duplicate(st, old, p):
        st.rec.add("duplicate", p.frame, p.ts, p.psn, 1, f"{p.info.name} PSN {p.psn} "
                   f"captured twice (frame {old.seen_frame}; the network duplicated it)")
        st.rec.duplicated(p.bth.payload_len)
        _seen(st, old, p, a)  # the responder may get this copy
        return DUP
    if not st.rc:
        sink.add("PSN-SEQ", p.frame, f"PSN {p.psn}, expected {_wire(st.next or a)}: went back "
                                     f"{(st.next or a) - a} (UC never retransmits)",
                 st.flow.label)
        return DUP
    return _resend(st, p, a, old, sink, silence)


def _hole(st: FlowState, p: Packet, a: int) -> None:
    start = st.next
    assert start is not None
    d = a - start
    st.gaps.append(Gap(p.frame, p.ts, start, a, _ip_id(st, p)))
    if len(st.missing) < _HOLE_MAX:
        st.add_missing(range(start, min(a, start + _HOLE_MAX)))
    what = ("the receiver drops what they belonged to; UC never resends" if not st.rc else
            "the responder must NAK or the requester time out")
    st.rec.add("lost-before", p.frame, p.ts, _wire(start), d,
               f"PSN {_wire(start)}" + (f"-{_wire(a - 1)}" if d > 1 else "") +
               f" never captured before PSN {p.psn}: lost before the capture point ({what})")
    if st.rc:
        st.rec.open(start, p.ts)


def _new(st: FlowState, p: Packet, a: int, sink: Sink, fill: bool = False) -> str:
    info, b, label = p.info, p.bth, st.flow.label
    n = _taken(st, p)
    payload = b.payload
    small = bytes(payload) if b.payload_len <= _SMALL else None
    r = Req(p.frame, p.ts, b.opcode, _kind(info), info.first, info.last, n, b.payload_len,
            b.dma_len or 0, b.va or 0, b.rkey or 0, _masked_header(p),
            crc32(payload), _ip_id(st, p), small)
    _seen(st, r, p, a)
    st.reqs[a] = r
    if n is not None and n > 1:
        st.read_end[a + n - 1] = a
    _opseq(st, a, r, p, sink, fill)
    if r.kind is not None:
        check_size(p, st.mtu_req, sink, label)
    _write_len(st, a, r, p, sink, fill)
    if st.rc and info.last and not b.ackreq:
        sink.add("ACKREQ-LAST", p.frame, f"{info.name} ends a message without AckReq", label)
    if info.read:
        rd = Read(a, n, b.va, b.rkey, b.dma_len, p.frame)
        st.reads.append(rd)
        st.open_answers.add(a)
    if info.atomic:
        st.atomics[a] = Atomic(a, p.frame)
        st.open_answers.add(a)
    if info.last:
        st.add_end(a)  # a READ or atomic completes when accepted (C9-148)
        st.rec.messages += 1
        if st.rc and b.ackreq and not info.read and not info.atomic:
            st.need_ack[a] = p.frame
    st.rec.good(b.payload_len)
    if fill:
        for q in range(a, a + (n or 1)):
            st.missing.discard(q)
        return FILL
    if st.nak is not None:
        st.nak.new_after += 1  # sent before the NAK reached the requester
    st.retry_next = None
    if n is None:
        st.next = None  # the READ's size in PSNs is unknown: rebaseline on the next
        st.top = a if st.top is None else max(st.top, a)
    else:
        st.next = a + n
        st.top = a + n - 1 if st.top is None else max(st.top, a + n - 1)
    st.prune()
    return NEW


def _fill(st: FlowState, p: Packet, a: int, sink: Sink, silence: float) -> str:
    """A hole's PSN captured at last: resent after its loss before the capture point, or
    late (reordered)."""
    gap = next((g for g in st.gaps if g.start <= a < g.end), None)
    if gap is not None and _ip_id(st, p) and gap.ip_id:
        # rxe numbers the IPv4 packets it sends: the original of a late packet has a lower
        # IP ID than the packet that showed the hole, a resend a higher one
        resent = (_ip_id(st, p) - gap.ip_id) & 0xFFFF < 0x8000
    elif gap is None or (st.retry_next is not None and st.retry_next <= a) or (
            st.nak is not None and st.nak.due <= a):
        resent = True
    else:
        resent = p.ts - gap.ts > max(4 * (st.rtt or 0.0), 200e-6)
    if resent:
        st.rec.resent(p.bth.payload_len)
        st.last_resend_ts, st.last_resend_frame = p.ts, p.frame
        if len(st.late) < _HOLE_MAX:
            st.late.add(a)  # its original may still turn up, late
        if not _continues_burst(st, p, a):
            _go_back(st, p, a, None, sink, silence)
        n = _taken(st, p)
        st.retry_next = a + (n or 1)
    else:
        st.rec.reclassify_reordered(p.frame, p.ts, p.psn)
    n = _taken(st, p)
    if n is not None and n > 1:
        # the hole counted PSNs; this one packet (a READ) took several of them
        st.rec.lost_before["requests"] -= min(n - 1, st.rec.lost_before["requests"])
    return _new(st, p, a, sink, fill=True)


def _seen(st: FlowState, r: Req, p: Packet, a: int) -> None:
    """``r``'s PSN captured (again) by ``p``."""
    r.seen_frame, r.seen_ts, r.seen_resp = p.frame, p.ts, st.n_resp
    r.seen_ip_id = _ip_id(st, p)


def _late(st: FlowState, old: Req, p: Packet, a: int) -> bool:
    """A packet counted lost (a resend skipped by its burst, or a hole a resend filled)
    turns up after all: late, not lost. rxe's IPv4 IDs tell a late packet (an older ID
    than the copy captured since) from another resend; without IDs, the same bytes with no
    go-back under way do."""
    if _ip_id(st, p) and old.seen_ip_id:
        late = (old.seen_ip_id - _ip_id(st, p)) & 0xFFFF < 0x8000 and old.seen_ip_id != _ip_id(st, p)
    else:
        late = st.retry_next != a and st.nak is None and _masked_header(p) == old.key
    if not late:
        return False
    st.late.discard(a)
    st.rec.reclassify_reordered(p.frame, p.ts, p.psn)
    st.rec.resent(p.bth.payload_len)
    return True


def _continues_burst(st: FlowState, p: Packet, a: int) -> bool:
    """``a`` continues the go-back under way (the next PSN, or a little further when
    resent packets were lost before the capture point: those are counted)."""
    nxt = st.retry_next
    if nxt is None or not 0 <= a - nxt <= _BURST_SKIP:
        return False
    if a > nxt:
        # packets, not PSNs: a READ takes several (those captured before are known)
        k = sum(1 for q in range(nxt, a) if q in st.reqs) or a - nxt
        st.rec.add("lost-before", p.frame, p.ts, _wire(nxt), k,
                   f"{k} resent packet(s) from PSN {_wire(nxt)} never captured (lost "
                   "before the capture point)")
        if len(st.late) < _HOLE_MAX:
            st.late.update(range(nxt, a))  # unless they turn up late
    return True


def _is_duplicate(st: FlowState, old: Req, p: Packet) -> bool:
    """The same packet again, delivered twice by the network: equal bytes, and the same IP
    ID (rxe numbers every packet it sends, a resend included) or, without IP IDs, within
    microseconds and with no response in between (a resend answers one, or a timeout)."""
    if p.bth.payload_len != old.payload_len or _masked_header(p) != old.key:
        return False
    if crc32(p.bth.payload) != old.crc:
        return False
    if _ip_id(st, p) and _ip_id(st, p) == old.seen_ip_id:
        return True
    return (not _ip_id(st, p) and p.ts - old.seen_ts < _DUP_WINDOW
            and st.n_resp == old.seen_resp)


def _resend(st: FlowState, p: Packet, a: int, old: Req | None, sink: Sink,
            silence: float) -> str:
    label = st.flow.label
    fatal = st.fatal
    if fatal is not None and a == fatal.psn and p.ts - fatal.ts <= _react(st):
        # a resend right after the NAK answers it (a retransmit timer takes longer; a NAK
        # lost after the capture point would explain only that)
        sink.add("NAK-FATAL", p.frame, f"resends PSN {p.psn}, NAK'd at frame "
                                       f"{fatal.frame} with a fatal code: the requester's "
                                       "QP is in error", label)
    r = st.find_read(a) if old is None or OPCODES[old.opcode].read else None
    taken = 1
    if r is not None and r.n is not None:
        taken = r.n - (a - r.psn)
    burst = _continues_burst(st, p, a)
    st.retry_next = a + taken
    st.last_resend_ts, st.last_resend_frame = p.ts, p.frame
    st.rec.resent(p.bth.payload_len)
    if old is not None:
        _seen(st, old, p, a)
    if not burst:
        _go_back(st, p, a, old, sink, silence, r)
    if r is not None:  # a READ asked again (whole or from offset k): answers start over
        k = a - r.psn
        r.restarts.add(k)
        r.accepted = min(r.accepted, k)
        st.open_answers.add(r.psn)
    atomic = st.atomics.get(a)
    if atomic is not None:
        atomic.resent = True
    if old is not None and (r is None or a == r.psn):
        _same(st, p, old, sink)
    elif r is not None:
        _same_read(st, p, a, r, sink)
    return BURST if burst else RETRY


def _go_back(st: FlowState, p: Packet, a: int, old: Req | None, sink: Sink, silence: float,
             r: Read | None = None) -> None:
    """A go-back starts at ``a``: find its cause, hold the requester to what it knew."""
    label, rec = st.flow.label, st.rec
    st.last_go_back_ts = p.ts
    nak = st.nak
    cause = None
    if nak is not None:
        st.nak = None
        waited = p.ts - nak.ts
        if a > nak.due:
            # the NAK'd PSN skipped: the requester's fault, unless that resend was lost
            # before the capture point; judged when the responder shows which (responses)
            st.suspect = (p.frame, nak.psn, nak.frame)
        if nak.rnr_timer is not None and a >= nak.psn:
            cause = "rnr-nak"
            wait = RNR_NAK_USEC[nak.rnr_timer] * 1e-6
            if waited + _SLACK < wait:
                sink.add("RNR-WAIT", p.frame, f"resent PSN {p.psn} {waited * 1e6:.0f} us after "
                                              f"the RNR NAK of frame {nak.frame}, expected at "
                                              f"least {wait * 1e6:.0f} us (timer "
                                              f"{nak.rnr_timer})", label)
            text = (f"go-back to PSN {p.psn} {waited * 1e3:.2f} ms after the RNR NAK of frame "
                    f"{nak.frame}")
        elif a == nak.due and waited <= _react(st):
            cause = "nak"
            text = (f"go-back to PSN {p.psn} {waited * 1e3:.2f} ms after the NAK of frame "
                    f"{nak.frame}")
        elif a > nak.due and waited <= _react(st):
            cause = "nak"  # its first packets were not captured, or it skipped the NAK'd PSN
            text = (f"go-back from PSN {p.psn}, {waited * 1e3:.2f} ms after the NAK of frame "
                    f"{nak.frame} for PSN {_wire(nak.due)}: the packets before it were not "
                    "captured")
        elif waited <= _react(st) and (a in st.open_answers or r is not None):
            # back to an unanswered READ or atomic before the NAK'd PSN: the NAK's
            # implied acknowledgement stops there (rxe_comp.c: implied NAK)
            cause = "nak"
            text = (f"go-back to PSN {p.psn}, an unanswered READ/atomic before PSN "
                    f"{_wire(nak.psn)}, {waited * 1e3:.2f} ms after the NAK of frame "
                    f"{nak.frame}")
        else:
            cause = "timeout"
            text = (f"go-back to PSN {p.psn} after {silence * 1e3:.1f} ms of silence, "
                    f"{waited * 1e3:.1f} ms after the NAK of frame {nak.frame}: the NAK was "
                    "not acted on at once (rxe's completer ignores a NAK while a retry is "
                    "under way), or reached the requester late or not at all; the "
                    "retransmit timer fired")
        if cause in ("nak", "rnr-nak") and a <= nak.due:
            # it went back to where the NAK said (or to an unanswered READ/atomic before):
            # it acted on the NAK, and knew what precedes that PSN acknowledged
            upto = a - 1
            st.known_acked = upto if st.known_acked is None else max(st.known_acked, upto)
    elif st.implied is not None and a == st.implied:
        cause = "implied-nak"
        text = (f"go-back to PSN {p.psn}: an ACK beyond this unanswered READ/atomic was an "
                "implied NAK")
        st.implied = None
    elif r is not None and a > r.psn:
        k = a - r.psn
        cause = "re-read"
        text = (f"re-READ from PSN {p.psn}, {k} response(s) into the READ of frame {r.frame}: "
                "a response was missing")
        # (whether response k was lost after the capture point or came just after the
        # retransmit timer fired, the capture cannot tell: rxe re-reads on its timer only)
        st.known_acked = max(st.known_acked or a - 1, a - 1)
        rec.open(a, p.ts)
    else:
        cause = "timeout"
        text = (f"go-back to PSN {p.psn} after {silence * 1e3:.1f} ms of silence (retransmit "
                "timer): the request or its ACK was lost after the capture point, or was late"
                if old is not None else
                f"go-back to PSN {p.psn} after {silence * 1e3:.1f} ms of silence (retransmit "
                "timer)")
    rec.go_back(cause, p.frame, p.ts, p.psn, text, silence if cause == "timeout" else None)
    if old is not None:
        rec.open(a, old.ts)
    # the requester resends what it knew was acknowledged: a SEND or WRITE, or a READ
    # whose responses all came in order (an atomic's answer depends on every answer
    # before it, which a capture cannot always show)
    known = st.known_acked
    if cause in ("nak", "rnr-nak"):
        return  # judged against what it knew before this NAK: nothing new
    if old is not None and _ip_id(st, p) == 0 and old.seen_ip_id == 0:
        return  # a resend and a late network duplicate look alike without IP IDs
    if known is not None and a <= known and old is not None:
        rd = st.find_read(a) if OPCODES[old.opcode].read else None
        full = rd is not None and rd.n is not None and rd.accepted >= rd.n
        if old.kind is not None or full:
            sink.add("RETRY-RANGE", p.frame, f"{p.info.name} resends PSN {p.psn}, but the "
                                             f"requester had acted on an acknowledgement of "
                                             f"PSNs up to {_wire(known)}; expected PSN "
                                             f"{_wire(known + 1)} or later", label)


def _same(st: FlowState, p: Packet, old: Req, sink: Sink) -> None:
    """RETRY-SAME: a resend carries what was first sent at its PSN."""
    label = st.flow.label
    if _masked_header(p) != old.key:
        was = _fields(_rebuild(old))
        now = _fields(p.bth)
        diff = ", ".join(f"{k} {now.get(k)} (was {was.get(k)})"
                         for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
        sink.add("RETRY-SAME", p.frame, f"resend of PSN {p.psn} (frame {old.frame}) "
                                        f"differs: {diff}", label)
        return
    n = p.bth.payload_len
    if n != old.payload_len:
        sink.add("RETRY-SAME", p.frame, f"resend of PSN {p.psn} (frame {old.frame}) "
                                        f"carries {n} bytes, was {old.payload_len}", label)
    elif crc32(p.bth.payload) != old.crc:
        where = ""
        if old.small is not None:
            y = bytes(p.bth.payload)
            at = next(i for i, (u, v) in enumerate(zip(old.small, y)) if u != v)
            where = f" (first at offset {at})"
        sink.add("RETRY-SAME", p.frame, f"resend of PSN {p.psn} (frame {old.frame}) "
                                        f"carries other bytes{where}", label)


def _same_read(st: FlowState, p: Packet, a: int, r: Read, sink: Sink) -> None:
    """A resend inside a READ's PSN range is that READ asked again from offset k."""
    k, mtu, b, label = a - r.psn, st.mtu, p.bth, st.flow.label
    if not p.info.read:
        sink.add("RETRY-SAME", p.frame, f"{p.info.name} at PSN {p.psn}, inside the READ of "
                                        f"frame {r.frame}: expected a READ request", label)
    elif mtu is not None:
        want = (r.va + k * mtu, r.rkey, r.length - k * mtu)
        got = (b.va, b.rkey, b.dma_len)
        if got != want:
            sink.add("RETRY-SAME", p.frame,
                     f"re-READ from PSN {p.psn} ({k} responses into the READ of frame "
                     f"{r.frame}): va=0x{got[0]:x} rkey=0x{got[1]:x} len={got[2]}, "
                     f"expected va=0x{want[0]:x} rkey=0x{want[1]:x} len={want[2]}", label)


_IGNORED_ON_RETRY = ("ackreq", "psn", "fecn", "becn")


def _fields(b: Any) -> dict[str, Any]:
    f = b.fields()
    for k in _IGNORED_ON_RETRY:
        f.pop(k, None)
    return f


def _rebuild(old: Req) -> Any:
    """The first transmission's headers, parsed again (its payload is not kept)."""
    pad = -old.payload_len & 3
    return parse(old.key + bytes(old.payload_len + pad + 4))


# ---------------------------------------------------------------- message structure

def _prev(st: FlowState, a: int) -> Req | None:
    """The request whose PSN range ends just before ``a``."""
    r = st.reqs.get(a - 1)
    if r is not None and (r.n or 1) == 1:
        return r
    start = st.read_end.get(a - 1)
    return st.reqs.get(start) if start is not None else None


def _pair(prev: Req, cur: Req, cur_name: str) -> str | None:
    """What is wrong with ``cur`` following ``prev`` in PSN order (9.4), or None."""
    if prev.kind is not None and not prev.last:  # inside a SEND or WRITE message
        if cur.kind == prev.kind and not cur.first:
            return None
        k = prev.kind.upper()
        if cur.first or cur.kind is None:
            return (f"{cur_name} starts a new request while a {k} message is unfinished "
                    f"(expected {k} MIDDLE or LAST)")
        return f"{cur_name} but expected {k} MIDDLE or LAST"
    if cur.kind is not None and not cur.first:
        return f"{cur_name} but expected FIRST or ONLY"
    return None


def _opseq(st: FlowState, a: int, r: Req, p: Packet, sink: Sink, fill: bool) -> None:
    prev = _prev(st, a)
    if prev is not None:
        what = _pair(prev, r, p.info.name)
        if what:
            sink.add("OPSEQ", p.frame, what, st.flow.label)
    if fill:
        nxt = st.reqs.get(a + (r.n or 1))
        if nxt is not None:
            what = _pair(r, nxt, OPCODES[nxt.opcode].name)
            if what:
                sink.add("OPSEQ", p.frame, what, st.flow.label)


def _write_len(st: FlowState, a: int, r: Req, p: Packet, sink: Sink, fill: bool) -> None:
    """An RDMA WRITE's bytes must add up to its RETH length: counted as its packets come in
    order, or added up over its PSNs once a late packet completes it."""
    if r.kind != "write":
        if not fill:
            st.wmsg = None
        return
    if fill:
        _write_len_walk(st, a, p, sink)
        return
    if r.first:
        st.wmsg = [a, r.dma_len, 0]
    elif st.wmsg is None or _prev(st, a) is None:
        st.wmsg = None
        return
    st.wmsg[2] += r.payload_len
    if r.last:
        first, length, got = st.wmsg
        st.wmsg = None
        if got != length:
            sink.add("WRITE-LEN", p.frame, f"RDMA WRITE of {got} bytes, its RETH says {length}",
                     st.flow.label)


def _write_len_walk(st: FlowState, a: int, p: Packet, sink: Sink) -> None:
    lo = a
    while True:
        r = st.reqs.get(lo)
        if r is None or r.kind != "write":
            return  # a hole still, or the message began before the capture
        if r.first:
            break
        lo -= 1
        if a - lo > _HOLE_MAX:
            return
    hi, total = lo, 0
    while True:
        r = st.reqs.get(hi)
        if r is None or r.kind != "write" or (hi > lo and r.first):
            return
        total += r.payload_len
        if r.last:
            break
        hi += 1
        if hi - lo > _HOLE_MAX:
            return
    length = st.reqs[lo].dma_len
    if total != length:
        sink.add("WRITE-LEN", p.frame, f"RDMA WRITE of {total} bytes, its RETH says {length}",
                 st.flow.label)


def check_size(p: Packet, mtu: int | None, sink: Sink, label: str) -> None:
    """FIRST/MIDDLE carry exactly one MTU; LAST 1..MTU; ONLY at most one MTU."""
    if mtu is None:
        return
    info, n = p.info, p.bth.payload_len
    if info.only:
        ok, want = n <= mtu, f"at most {mtu}"
    elif info.last:
        ok, want = 0 < n <= mtu, f"1..{mtu}"
    else:
        ok, want = n == mtu, f"{mtu} (the path MTU)"
    if not ok:
        sink.add("MTU-SIZE", p.frame, f"{info.name} carries {n} bytes, expected {want}", label)


def at_end(st: FlowState, sink: Sink) -> None:
    """Holes never filled: on RC a repair the capture ends before (UC never repairs)."""
    if not st.rc or not st.missing:
        return
    for g in st.gaps:
        left = [q for q in range(g.start, g.end) if q in st.missing]
        if left:
            st.rec.add("unresolved", g.frame, g.ts, _wire(left[0]), len(left),
                       f"{len(left)} request packet(s) from PSN {_wire(left[0])}, lost before "
                       "the capture point, not resent before the capture ends")
