"""Rules about the requester's packets: PSN order, opcode sequences, sizes, retransmissions.

Every request is classified against the PSN the next new request must carry:

* equal: a **new** packet. It must continue the opcode sequence (9.4: FIRST, MIDDLE...,
  LAST or ONLY; nothing else starts before LAST), have the right size for the path MTU,
  and it moves the expected PSN on by one (a READ by one per response packet it asks for).
* ahead: packets are missing. Reported (PSN-SEQ), then taken as new, so one gap is one
  violation rather than one per following packet; a missing packet that turns up later
  is reordering, already reported. (With ``lossy``, a gap is only reported if its PSNs are
  never resent: they may have been lost before the capture point.)
* behind, on RC: a **retransmission** (go-back-N). It must resend what was sent at that
  PSN, and a go-back that starts at a SEND or WRITE must start at a PSN not yet
  acknowledged. Once started, a burst may run on past an ACK that arrives meanwhile: rxe's
  requester sends the whole go-back before its completer handles the ACK
  (pcaps/linux-rxe/rc_pingpong.pcap, frames 35-40 and 58-64, shows it twice). UC never
  retransmits, so there it is a PSN-SEQ violation.

The first request of a flow in the capture sets the baseline; a capture that starts in the
middle of a message may begin with MIDDLE or LAST.
"""

from __future__ import annotations

from typing import Any

from ..qp.psn import psn_add, psn_diff
from .decode import Packet
from .rules import Sink
from .state import FlowState, Gap, Read, read_packets

__all__ = ["on_request", "at_end", "check_size", "NEW", "RETRY", "BURST"]

NEW = "new"
RETRY = "retry"  # a resend that starts a go-back (or a late packet of a reported gap)
BURST = "burst"  # a resend that continues the go-back under way
_IGNORED_ON_RETRY = ("ackreq", "psn", "fecn", "becn")  # may differ on a resend


def on_request(st: FlowState, p: Packet, sink: Sink) -> str:
    """Judge one request packet; return NEW, RETRY or BURST."""
    psn = p.psn
    if st.next_psn is not None:
        d = psn_diff(psn, st.next_psn)
        if d < 0 and psn in st.missing:
            st.sent.setdefault(psn, p)
            if st.lossy:
                _repair(st, p)
                return RETRY
            # a packet of a reported gap, arriving late: reordering, already reported
            st.missing.discard(psn)
            if p.info.write and p.info.middle:
                st.msg_bytes += p.bth.payload_len  # its bytes still count for WRITE-LEN
            return RETRY
        if d < 0 and st.rc:
            burst = st.retry_next is not None and psn == st.retry_next
            _retry(st, p, sink, burst)
            return BURST if burst else RETRY
        if d > 0 and st.lossy:
            # maybe lost before the capture point: judged at the end, by whether the
            # requester resends them; the message they cut is not judged
            gap = Gap(p.frame, st.next_psn, psn, {psn_add(st.next_psn, i)
                                                  for i in range(min(d, 4096))})
            st.gaps.append(gap)
            st.missing |= gap.missing
            st.in_msg, st.msg_len = "?", None
        elif d:
            what = (f"{d} PSN(s) skipped" if d > 0 else
                    f"went back {-d} (UC never retransmits)")
            sink.add("PSN-SEQ", p.frame, f"PSN {psn}, expected {st.next_psn}: {what}",
                     st.flow.label)
            if 0 < d <= 64:
                st.missing.update(psn_add(st.next_psn, i) for i in range(d))
    _new(st, p, sink)
    return NEW


def _repair(st: FlowState, p: Packet) -> None:
    """With ``lossy``: a skipped PSN resent, so it was lost on the way, not skipped."""
    taken = 1
    if p.info.read and st.mtu is not None:
        taken = read_packets(p.bth.dma_len, st.mtu)
        st.reads.append(Read(p.psn, taken, p.bth.va, p.bth.rkey, p.bth.dma_len, p.frame))
        st.open_answers.add(p.psn)
    if p.info.last:  # a message end the MSN must count, in PSN order
        ends = st.msg_ends
        key = psn_diff(p.psn, st.first_psn)
        i = len(ends)
        while i > st.msn_idx and psn_diff(ends[i - 1], st.first_psn) > key:
            i -= 1
        ends.insert(i, p.psn)
    got = {psn_add(p.psn, i) for i in range(taken)}
    st.missing -= got
    for g in st.gaps:
        g.missing -= got
    st.retry_next = psn_add(p.psn, taken)  # the go-back goes on from here


def at_end(st: FlowState, sink: Sink) -> None:
    for g in st.gaps:
        if g.missing:
            sink.add("PSN-SEQ", g.frame, f"PSN {g.seen}, expected {g.expected}: "
                                         f"{psn_diff(g.seen, g.expected)} PSN(s) skipped and "
                                         f"{len(g.missing)} of them never resent",
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


def _kind(info: Any) -> str | None:
    """The multi-packet operation an opcode belongs to."""
    if info.send:
        return "send"
    if info.write:
        return "write"
    return None


def _new(st: FlowState, p: Packet, sink: Sink) -> None:
    info, b, label = p.info, p.bth, st.flow.label
    psn = p.psn
    kind = _kind(info)
    # opcode sequence (9.4)
    if info.first or (kind is None):
        if st.in_msg in ("send", "write"):
            sink.add("OPSEQ", p.frame, f"{info.name} starts a new request while a "
                                       f"{st.in_msg.upper()} message is unfinished (expected "
                                       f"{st.in_msg.upper()} MIDDLE or LAST)", label)
        st.in_msg = None if info.last else kind
        st.msg_bytes = 0
        st.msg_len = b.dma_len if kind == "write" else None
    else:  # MIDDLE or LAST
        if st.in_msg not in ("?", kind):
            expected = ("FIRST or ONLY" if st.in_msg is None else
                        f"{st.in_msg.upper()} MIDDLE or LAST")
            sink.add("OPSEQ", p.frame, f"{info.name} but expected {expected}", label)
        st.in_msg = None if info.last else kind
    if kind is not None:
        check_size(p, st.mtu_req, sink, label)
    # an RDMA WRITE's bytes must add up to its RETH length
    if kind == "write":
        st.msg_bytes += b.payload_len
        if info.last and st.msg_len is not None and st.msg_bytes != st.msg_len:
            sink.add("WRITE-LEN", p.frame, f"RDMA WRITE of {st.msg_bytes} bytes, its RETH "
                                           f"says {st.msg_len}", label)
    if st.rc and info.last and not b.ackreq:
        sink.add("ACKREQ-LAST", p.frame, f"{info.name} ends a message without AckReq", label)
    # PSN accounting
    n: int | None = 1
    if info.read:
        mtu = st.mtu
        if mtu is None:
            # no FIRST/MIDDLE anywhere: the responses are ONLY, unless none were captured
            n = 1 if (b.dma_len <= 256 or st.flow.responses) else None
        else:
            n = read_packets(b.dma_len, mtu)
        st.reads.append(Read(psn, n, b.va, b.rkey, b.dma_len, p.frame))
        st.open_answers.add(psn)
    if st.first_psn is None:
        st.first_psn = psn
    st.retry_next = None
    st.sent.setdefault(psn, p)
    if info.last:
        st.msg_ends.append(psn)  # a READ or atomic completes when accepted (C9-148)
        if st.rc and b.ackreq and not info.read and not info.atomic:
            st.need_ack[psn] = p.frame
    if n is None:
        st.next_psn = None  # the READ's size in PSNs is unknown: rebaseline on the next
        st.max_psn = psn
    else:
        st.next_psn = psn_add(psn, n)
        st.max_psn = psn_add(psn, n - 1)


def _fields(p: Packet) -> dict[str, Any]:
    f = p.bth.fields()
    for k in _IGNORED_ON_RETRY:
        f.pop(k, None)
    return f


def _retry(st: FlowState, p: Packet, sink: Sink, burst: bool) -> None:
    psn, label = p.psn, st.flow.label
    orig = st.sent.get(psn)
    r = st.find_read(psn)
    taken = 1
    if r is not None and r.n is not None:
        taken = r.n - psn_diff(psn, r.psn)
    st.retry_next = psn_add(psn, taken)
    full = r is not None and r.n is not None and r.accepted >= r.n
    if r is not None:  # a READ asked again (whole or from offset k): answers start over
        k = psn_diff(psn, r.psn)
        r.restarts.add(k)
        r.accepted = min(r.accepted, k)
        st.open_answers.add(r.psn)
    atomic = st.atomics.get(psn)
    if atomic is not None:
        atomic.resent = True
    # Which go-backs are judged: a requester takes READ responses and atomic ACKs in PSN
    # order only and treats an ACK beyond an unanswered READ/atomic as an implied NAK
    # (rxe_comp.c check_psn, COMPST_ERROR_RETRY). A READ whose responses all came in order
    # was done; whether an atomic's ACK was taken depends on every answer before it, which a
    # capture cannot always show, so atomics are not judged. Sends and writes are simple: a
    # captured ACK at or beyond them completes them...
    judged = orig is not None and (orig.info.send or orig.info.write
                                   or (orig.info.read and full))
    # ... unless an unanswered READ or atomic before the ACK made it an implied NAK: only
    # ACKs the requester could take count (st.sure)
    # (with ``lossy`` not judged at all: ACKs captured may be lost before the requester)
    if not burst and judged and not st.lossy and st.sure is not None \
            and psn_diff(psn, st.sure) <= 0:
        sink.add("RETRY-RANGE", p.frame, f"{p.info.name} resends PSN {psn}, but PSNs up to "
                                         f"{st.sure} were acknowledged (frame "
                                         f"{st.sure_frame}); expected PSN "
                                         f"{psn_add(st.sure, 1)} or later", label)
    if orig is not None:
        was, now = _fields(orig), _fields(p)
        if was != now:
            diff = ", ".join(f"{k} {now.get(k)} (was {was.get(k)})"
                             for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
            sink.add("RETRY-SAME", p.frame, f"resend of PSN {psn} (frame {orig.frame}) "
                                            f"differs: {diff}", label)
            return
        x, y = bytes(orig.bth.payload), bytes(p.bth.payload)
        if len(x) != len(y):
            sink.add("RETRY-SAME", p.frame, f"resend of PSN {psn} (frame {orig.frame}) "
                                            f"carries {len(y)} bytes, was {len(x)}", label)
        elif x != y:
            at = next(i for i, (u, v) in enumerate(zip(x, y)) if u != v)
            sink.add("RETRY-SAME", p.frame, f"resend of PSN {psn} (frame {orig.frame}) "
                                            f"carries other bytes (first at offset {at})",
                     label)
        return
    if r is not None:
        k = psn_diff(psn, r.psn)
        mtu = st.mtu
        b = p.bth
        if not p.info.read:
            sink.add("RETRY-SAME", p.frame, f"{p.info.name} at PSN {psn}, inside the READ of "
                                            f"frame {r.frame}: expected a READ request", label)
        elif mtu is not None:
            want = (r.va + k * mtu, r.rkey, r.length - k * mtu)
            got = (b.va, b.rkey, b.dma_len)
            if got != want:
                sink.add("RETRY-SAME", p.frame,
                         f"re-READ from PSN {psn} ({k} responses into the READ of frame "
                         f"{r.frame}): va=0x{got[0]:x} rkey=0x{got[1]:x} len={got[2]}, "
                         f"expected va=0x{want[0]:x} rkey=0x{want[1]:x} len={want[2]}", label)
        return
    if st.seen(psn):
        sink.add("RETRY-SAME", p.frame, f"resend of PSN {psn}, but no request was sent at "
                                        "that PSN", label)
