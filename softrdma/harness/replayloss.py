"""What a replay can tell, from one conversation's capture alone, about packets lost,
duplicated or resent around the capture point; and so what the replayed endpoint
evidently received.

A capture is taken at one point of the path. A packet lost *before* that point never
shows; one lost *after* it shows, but never reached its receiver. Replay must feed
softrdma what the replayed endpoint received, not what the capture shows, and it must not
call a difference what only a loss explains. The evidence used here is small and local
(the general inference is ``softrdma check``'s):

* a gap in a sender's new PSNs: packets lost before the capture point;
* a PSN sequence NAK from the replayed endpoint naming PSN p: it had everything up to
  p-1 and not p, so every captured transmission of p before the NAK was lost after the
  point (it is not fed to softrdma);
* a go-back by the replayed endpoint to PSN q that no NAK or RNR NAK explains: it timed
  out, so a captured response covering q (an ACK of q or later, a READ response or an
  atomic ACK at q or later) did not reach it (not fed);
* a resend by the peer: its first transmission, or the endpoint's answer, did not arrive
  in time. Which, the capture does not say (rxe's timers also fire spuriously): the
  first is fed, and an answer softrdma gives to both is not judged;
* a READ response gap: responses lost before the point;
* copies: the same packet twice with the same IPv4 ID. rxe numbers its IPv4 packets, so
  a retransmission has a new ID and a copy with the same ID was made by the network (a
  copy of the replayed endpoint's packet is not judged as one it sent). Where the sender
  does not number its packets (softrdma's sockets send ID 0), the same bytes twice in a
  row are noted (a copy, or sent twice: a burst of answers to resends looks the same) and
  each is judged as sent.

Each finding is a :class:`LossEvent`; :class:`Evidence` holds them and the frames the
replayed endpoint evidently did not receive.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from ..qp.psn import psn_diff

__all__ = ["Evidence", "LossEvent", "infer", "rnr_frames"]

_NAK, _RNR, _ACK = 3, 1, 0  # AETH syndrome bits 6:5
_NAK_SEQ = 0x60  # PSN sequence error
#: the kinds of finding that say a packet was lost or copied (an RNR NAK and the retry
#: after it are flow control, no loss)
LOSS_KINDS = frozenset({"lost-before", "lost-after", "nak", "go-back", "duplicate",
                        "unresolved"})


@dataclass(frozen=True)
class LossEvent:
    """One finding: at capture ``frame``, ``kind`` ("lost-before", "lost-after", "nak",
    "rnr-nak", "go-back", "duplicate", "unresolved") about PSN ``psn`` (``count``
    packets), with a short sentence."""

    frame: int
    kind: str
    psn: int
    count: int
    text: str


@dataclass
class Evidence:
    """The findings of :func:`infer` on one conversation, seen from one endpoint."""

    events: list[LossEvent] = field(default_factory=list)
    #: frames of packets to the endpoint that it evidently did not receive -> why
    undelivered: dict[int, str] = field(default_factory=dict)
    #: frames that are network copies of an earlier frame -> that frame (and how told)
    copies: dict[int, int] = field(default_factory=dict)
    copy_how: dict[int, str] = field(default_factory=dict)
    #: (first frame, last frame, why): stretches where the endpoint's answers depend on
    #: which of the peer's packets reached it, which the capture does not show (after
    #: the peer resent, until the endpoint acknowledges all it had sent)
    uncertain: list[tuple[int, int, str]] = field(default_factory=list)

    #: frames of findings that what the capture shows of the peer's packets is not what
    #: reached the endpoint (they were lost, copied or resent after the capture point)
    input_events: list[tuple[int, str]] = field(default_factory=list)

    def input_before(self, frame: int) -> str | None:
        """Why, at ``frame``, what reached the endpoint is not known exactly (the last
        such finding at or before it), or None."""
        best = max((e for e in self.input_events if e[0] <= frame), default=None)
        return None if best is None else (f"after frame {best[0]} ({best[1]}), what reached "
                                          "the endpoint is not known exactly")

    #: (frame, first PSN, highest PSN sent) of each go-back of the peer's (not after an
    #: RNR NAK): it never got the answers to those PSNs
    peer_resends: list[tuple[int, int, int]] = field(default_factory=list)

    def answer_lost(self, psn: int, after: int) -> str | None:
        """Why an answer of the endpoint's to PSN ``psn``, sent at frame ``after`` and absent
        from the capture, is evidently lost before the capture point (the peer went back
        over ``psn`` later), or None."""
        for f, lo, hi in self.peer_resends:
            if f >= after and psn_diff(psn, lo) >= 0 and psn_diff(hi, psn) >= 0:
                return (f"the peer went back to PSN {lo} at frame {f}: it never got this "
                        "answer (lost before the capture point)")
        return None

    def uncertain_at(self, frame: int) -> str | None:
        """Why what the endpoint answered at ``frame`` is not known to follow from what
        the capture shows reaching it, or None."""
        for lo, hi, why in self.uncertain:
            if lo <= frame <= hi:
                return why
        return None

    def __post_init__(self) -> None:
        self._frames: list[int] = []
        self._loss: list[LossEvent] = []
        self._n = -1

    def _index(self) -> list[int]:
        if self._n != len(self.events):
            self._n = len(self.events)
            self.events.sort(key=lambda e: e.frame)
            self._loss = [e for e in self.events if e.kind in LOSS_KINDS]
            self._frames = [e.frame for e in self._loss]
        return self._frames

    def before(self, frame: int) -> LossEvent | None:
        """The last finding of a loss at or before ``frame`` (None: the capture is whole so
        far; RNR NAKs and their retries are no loss)."""
        frames = self._index()
        i = bisect.bisect_right(frames, frame)
        return self._loss[i - 1] if i else None

    def first_loss(self) -> LossEvent | None:
        """The first finding that a packet was lost or copied (a go-back alone is none:
        rxe's retransmit timer also fires when nothing was lost)."""
        self._index()
        return next((e for e in self._loss if e.kind != "go-back"), None)

    @property
    def lossy(self) -> bool:
        return self.first_loss() is not None


def _span(pkt: Any, mtu: int) -> int:
    """How many PSNs a request takes: a READ one per response packet, others one."""
    if pkt.info.read and pkt.info.is_request:
        return max(1, -(-(pkt.dma_len or 0) // mtu))
    return 1


def _covers(resp: Any, q: int) -> bool:
    """Whether a response tells the requester that PSN ``q`` is done."""
    if resp.info.read or resp.info.atomic:
        return psn_diff(resp.psn, q) >= 0
    syn = resp.syndrome
    return syn is not None and syn >> 5 == _ACK and psn_diff(resp.psn, q) >= 0


def infer(capture: list[Any], me: bytes, mtu: int) -> Evidence:
    """The evidence about the conversation ``capture`` (CapturedPackets, in capture order)
    seen from the endpoint at address ``me``; ``mtu`` is the path MTU in bytes."""
    ev = Evidence()
    seen: dict[tuple, int] = {}
    numbered = _numbers_packets(capture)
    prev: Any = None  # the previous frame of the conversation
    for c in capture:
        last, prev = prev, c
        if numbered.get(c.src):
            key = (c.src, c.ip_id, c.roce)
            if key in seen:
                _copy(ev, c, seen[key], "same IPv4 ID", me)
                continue
            seen[key] = c.index
        elif last is not None and last.src == c.src and last.roce == c.roce:
            # no IPv4 ID to tell by: the same bytes twice in a row may be a copy or sent
            # twice (answers to a burst of resends); it is paired if softrdma sent it twice
            ev.events.append(LossEvent(last.index, "duplicate", c.pkt.psn, 1,
                                       f"frame {c.index} repeats frame {last.index}: a copy "
                                       "made by the network, or sent twice"))
    _request_streams(capture, me, mtu, ev)
    _responses(capture, me, mtu, ev)
    return ev


def _numbers_packets(capture: list[Any]) -> dict[bytes, bool]:
    """Per sender, whether it numbers its IPv4 packets (Linux does for rxe: each packet the
    ID after the last), so that a repeated ID marks a copy. softrdma's sockets send ID 0
    and the simulated network numbers only the packets of a train, from 0."""
    ids: dict[bytes, list[int]] = {}
    for c in capture:
        ids.setdefault(c.src, []).append(c.ip_id)

    def counter(v: list[int]) -> bool:
        # a counter: (almost) no ID 0, and (almost) every next packet a little higher
        # (packets lost before the capture point skip a few)
        steps = sum(1 for a, b in zip(v, v[1:]) if 0 < (b - a) % 65536 <= 64)
        return len(v) > 1 and v.count(0) <= 0.02 * len(v) and steps >= 0.9 * (len(v) - 1)
    return {s: counter(v) for s, v in ids.items()}


def _copy(ev: Evidence, c: Any, of: int, how: str, me: bytes) -> None:
    ev.copies[c.index] = of
    ev.copy_how[c.index] = how
    ev.events.append(LossEvent(of, "duplicate", c.pkt.psn, 1,
                               f"frame {c.index} is a copy of frame {of} ({how}): made by "
                               "the network"))
    if c.src != me:
        ev.input_events.append((of, f"frame {c.index} copies it"))


def _request_streams(capture: list[Any], me: bytes, mtu: int, ev: Evidence) -> None:
    """Gaps and go-backs in each sender's requests; what the endpoint's NAKs and go-backs
    say it did not receive."""
    highest: dict[bytes, int] = {}
    nxt: dict[bytes, int] = {}
    resending: dict[bytes, bool] = {}
    lowest: dict[bytes, int] = {}  # each sender's first PSN in the capture
    first_tx: dict[tuple[bytes, int], int] = {}  # (sender, psn) -> position of its first
    last_to_me: Any = None  # the last packet the peer sent to the endpoint
    rnr_psn: dict[bytes, int] = {}  # sender -> the PSN of its RNR NAK still in force
    for pos, c in enumerate(capture):
        if c.index in ev.copies:
            continue
        p = c.pkt
        if c.dst == me:
            last_to_me = c
        _track_rnr(rnr_psn, c)
        if not p.info.is_request:
            continue
        s = c.src
        if s not in highest:
            highest[s], nxt[s], resending[s] = p.psn, (p.psn + _span(p, mtu)) & 0xFFFFFF, False
            first_tx[(s, p.psn)] = pos
            lowest[s] = p.psn
            continue
        gap = psn_diff(p.psn, nxt[s])
        if gap >= 0:
            if gap > 0:
                ev.events.append(LossEvent(c.index, "lost-before", nxt[s], gap,
                                           f"{gap} packet(s) from PSN {nxt[s]} never captured "
                                           "(lost before the capture point)"))
            highest[s], nxt[s], resending[s] = p.psn, (p.psn + _span(p, mtu)) & 0xFFFFFF, False
            first_tx.setdefault((s, p.psn), pos)
            continue
        if resending[s] or psn_diff(p.psn, lowest[s]) < 0:
            continue  # (a PSN before any this sender sent is no resend: judged as it is)
        resending[s] = True  # the first packet of a go-back
        rnr = rnr_psn.get(c.dst) == p.psn
        ev.events.append(LossEvent(c.index, "rnr-retry" if rnr else "go-back", p.psn, 1,
                                   f"{'the endpoint' if s == me else 'the peer'} resends from "
                                   f"PSN {p.psn}{' after an RNR NAK' if rnr else ''}"))
        start = first_tx.get((s, p.psn))
        if start is None and s == me:
            continue
        if s == me:
            _my_go_back(capture, start, pos, p.psn, last_to_me, me, ev)
        elif not rnr:
            _uncertain(capture, pos, highest[s], me, ev)
            ev.peer_resends.append((c.index, p.psn, highest[s]))


def _uncertain(capture: list[Any], pos: int, top: int, me: bytes, ev: Evidence) -> None:
    """The peer resent at ``capture[pos]`` with PSNs up to ``top`` sent: which of them
    reached the endpoint the first time is not known until it acknowledges ``top``."""
    g = capture[pos]
    end = capture[-1].index
    for c in capture[pos + 1:]:
        p = c.pkt
        if c.src == me and p.info.is_response and _covers(p, top):
            end = c.index
            break
    ev.uncertain.append((g.index, end, f"the peer resent from PSN {g.pkt.psn} at frame "
                                       f"{g.index}: which of its packets up to PSN {top} "
                                       "reached the endpoint before is not known"))


def _my_go_back(capture: list[Any], start: int, pos: int, q: int, last_to_me: Any,
                me: bytes, ev: Evidence) -> None:
    """The endpoint went back to PSN ``q`` at ``capture[pos]``: unless a NAK or RNR NAK
    for ``q`` explains it, it timed out, and the responses covering ``q`` captured since
    its first transmission did not reach it."""
    lp = last_to_me.pkt if last_to_me is not None else None
    if lp is not None and lp.syndrome is not None and lp.syndrome >> 5 in (_NAK, _RNR) \
            and lp.psn == q and not lp.info.read and not lp.info.atomic:
        return
    for k in range(start, pos):
        o = capture[k]
        if o.dst == me and o.pkt.info.is_response and _covers(o.pkt, q) \
                and o.index not in ev.undelivered:
            ev.undelivered[o.index] = (f"the endpoint went back to PSN {q} at frame "
                                       f"{capture[pos].index}: this answer never reached it")
            ev.input_events.append((o.index, ev.undelivered[o.index]))
            ev.events.append(LossEvent(o.index, "lost-after", o.pkt.psn, 1,
                                       ev.undelivered[o.index]))


def _responses(capture: list[Any], me: bytes, mtu: int, ev: Evidence) -> None:
    """NAKs (and what the endpoint's own say it lacked) and READ response gaps."""
    read_next: dict[bytes, int] = {}
    rnr_psn: dict[bytes, int] = {}
    rnr = rnr_frames(capture, me)  # requests the endpoint did receive (it RNR NAKed them)
    to_me: dict[int, list[Any]] = {}  # PSN -> the peer's captured requests with it
    for c in capture:
        if c.dst == me and c.pkt.info.is_request:
            to_me.setdefault(c.pkt.psn, []).append(c)
    # the endpoint's responder, as the capture shows it: the PSN it expects next and the
    # transmission of each PSN it would have taken in sequence
    epsn: int | None = None
    taken: dict[int, int] = {}
    for c in capture:
        p = c.pkt
        if c.index in ev.copies:
            continue
        if c.dst == me and p.info.is_request:
            if epsn is None:
                epsn = p.psn
            if p.psn == epsn and c.index not in rnr:
                taken[p.psn] = c.index
                epsn = (p.psn + _span(p, mtu)) & 0xFFFFFF
            continue
        if not p.info.is_response:
            continue
        if c.src == me and (p.info.read or p.info.atomic or (p.syndrome or 0) >> 5 == _ACK) \
                and (epsn is None or psn_diff(p.psn, epsn) >= 0):
            epsn = (p.psn + 1) & 0xFFFFFF  # it had more than the capture shows
        syn = p.syndrome
        after_rnr = rnr_psn.get(c.src) == p.psn
        _track_rnr(rnr_psn, c)
        if p.info.read:
            want = read_next.get(c.src)
            if not p.info.first and want is not None and psn_diff(p.psn, want) > 0:
                n = psn_diff(p.psn, want)
                ev.events.append(LossEvent(c.index, "lost-before", want, n,
                                           f"{n} READ response(s) from PSN {want} never "
                                           "captured"))
            read_next[c.src] = (p.psn + 1) & 0xFFFFFF
            continue
        if syn is None or syn >> 5 not in (_NAK, _RNR):
            continue
        # (rxe NAKs the packets after one it RNR NAKed as out of sequence: no loss)
        kind = "nak" if syn >> 5 == _NAK and not after_rnr else "rnr-nak"
        who = "the endpoint" if c.src == me else "the peer"
        explained = True
        if c.src == me and syn == _NAK_SEQ and kind == "nak":
            # a sequence NAK answers a later PSN than the one it names: without one in
            # the capture it is no evidence of a loss (and is judged as it is)
            explained = _later_arrived(to_me, p.psn, c.index)
            kind = "nak" if explained else "unexplained-nak"
        ev.events.append(LossEvent(c.index, kind, p.psn, 1,
                                   f"{who} {'RNR NAKs' if kind == 'rnr-nak' else 'NAKs'} "
                                   f"PSN {p.psn}"))
        if c.src == me and syn == _NAK_SEQ and kind == "nak":
            # it had up to p.psn-1 and not p.psn: the transmission of p.psn it would have
            # taken in sequence (if the capture shows one) never reached it
            o = taken.get(p.psn)
            if o is not None and epsn is not None and psn_diff(epsn, p.psn) > 0:
                ev.undelivered[o] = (f"the endpoint NAKs PSN {p.psn} at frame {c.index}: "
                                     "lost after the capture point")
                ev.input_events.append((o, ev.undelivered[o]))
                ev.events.append(LossEvent(o, "lost-after", p.psn, 1, ev.undelivered[o]))
            epsn = p.psn
            taken = {q: f for q, f in taken.items() if psn_diff(q, p.psn) < 0}


def _later_arrived(to_me: dict[int, list[Any]], psn: int, before: int) -> bool:
    """Whether the capture shows, before frame ``before``, a request to the endpoint with a
    PSN after ``psn`` sent after ``psn`` first was: what a PSN sequence NAK of ``psn``
    answers. (A NAK without one is not explained by a loss: it is judged as it is.)"""
    first = min((o.index for o in to_me.get(psn, ())), default=0)
    return any(first < o.index < before and 0 < psn_diff(q, psn) < 1 << 22
               for q, lst in to_me.items() for o in lst)


def _track_rnr(rnr_psn: dict[bytes, int], c: Any) -> None:
    """Keep, per sender, the PSN of the RNR NAK it sent last, until it acknowledges."""
    p = c.pkt
    if not p.info.is_response:
        return
    if p.syndrome is not None and p.syndrome >> 5 == _RNR:
        rnr_psn[c.src] = p.psn
    elif p.info.read or p.info.atomic or (p.syndrome is not None and p.syndrome >> 5 == _ACK):
        rnr_psn.pop(c.src, None)


def rnr_frames(capture: list[Any], me: bytes) -> set[int]:
    """Frames of the peer's requests the endpoint answered with an RNR NAK (it received
    them, and had no receive posted): the same PSN RNR NAKed before the peer sent that
    PSN again."""
    out: set[int] = set()
    waiting: dict[int, int] = {}  # PSN -> frame of the peer's latest request with it
    for c in capture:
        p = c.pkt
        if c.dst == me and p.info.is_request:
            waiting[p.psn] = c.index
        elif c.src == me and p.syndrome is not None and p.syndrome >> 5 == _RNR \
                and not p.info.read and not p.info.atomic and p.psn in waiting:
            out.add(waiting.pop(p.psn))
    return out
