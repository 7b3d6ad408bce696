"""Merge captures of one conversation taken at several points into one stream by time.

Two captures taken at different places (each host's own NIC, a NIC and the bridge) see the
same packets at different times on different clocks. :func:`merge_captures` finds the
packets they share, estimates how far apart their clocks are, and yields one
:class:`MergedRecord` per distinct packet in time order on the first capture's clock,
saying which capture points saw it and under which frame number in each file. A packet the
sender's point saw and the receiver's did not was lost between the two: that locates a
loss exactly (:func:`seen_not`).

**Matching.** Two frames are the same packet when they have the same IP source and
destination, UDP ports and UDP payload (for RoCEv2: every byte from the BTH to the ICRC).
Fields routers may rewrite (TTL, IPv4 checksum, the link layer) are not compared; frames
that are not IP/UDP are compared whole. rxe gives every packet a new IPv4 ID and the ICRC
covers it, so a retransmission is a different packet from its original; a duplicate made
by the network is the same packet twice, and the copies are matched in order. A frame
matches only a sighting from another point within ``tolerance`` of it (clocks corrected).

**Clock offset.** Capture ``j``'s clock is ``offset_j`` ahead of capture 0's. For a packet
both saw, ``d = t_j - t_0`` is ``offset_j + delay`` if it passed point 0 first, ``offset_j -
delay`` if it passed point ``j`` first, with ``delay >= 0``. Packets of one IP direction
all pass the points in the same order, so each direction's ``d`` lies on one side of the
offset: the directions seen later at ``j`` bound it from above (their least ``d``), the
others from below (their greatest). The estimate is the middle of that feasible interval,
as NTP takes the middle of the round trip; it assumes the least delay is the same both
ways. With timestamp jitter larger than the delays the interval is empty; its middle is
still the estimate and the report says by how much the bounds cross. The offset is
estimated from the packets the first ``calibrate`` frames of each capture share, then
followed (a clock drifts) from every block of matched packets.

**Bounded memory.** The captures are read as streams; a packet waits for its sightings
at the other points for ``tolerance`` (the spread of the delays seen when calibrating, a
few milliseconds on a LAN) and is then emitted, seen by the points that saw it so far.
Memory holds the calibration frames and the packets of one tolerance window.

    >>> from softrdma.wire.pcapmerge import MergeReport, merge_captures
    >>> report = MergeReport()
    >>> # for rec in merge_captures(["host0.pcap", "host1.pcap"], report): rec.seen, rec.frames
"""

from __future__ import annotations

import heapq
import os
import struct
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain
from typing import BinaryIO, Hashable, Iterable, Iterator, Sequence

from .frames import LINKTYPE_ETHERNET, FrameError, decode_frame
from .icrc import IPPROTO_UDP
from .pcap import PcapError, PcapRecord, read_pcap

__all__ = ["MergedRecord", "MergeReport", "OffsetEstimate", "estimate_offset", "packet_key",
           "merge_captures", "seen_not", "CALIBRATE", "MIN_TOLERANCE_NS", "DRIFT_BLOCK"]

_U16 = struct.Struct("!H")
_PORTS = struct.Struct("!HH")

#: frames of each capture read before the first offset estimate
CALIBRATE = 10_000
#: the least matching tolerance: a packet waits this long for its other sightings
MIN_TOLERANCE_NS = 2_000_000
#: matched packets per re-estimate of a capture's offset (clock drift)
DRIFT_BLOCK = 512


@dataclass(slots=True)
class MergedRecord(PcapRecord):
    """A packet of the merged stream. ``index`` is its frame number in the merged stream,
    ``ts_ns`` its time on capture 0's clock (capture 0's own time if it saw it), ``data``
    and ``linktype`` the frame as the first point that saw it captured it. ``seen`` lists
    the captures that saw it; ``frames[i]`` is its frame number in capture ``i`` and
    ``times_ns[i]`` the time there on that capture's own clock (None where not seen)."""

    seen: tuple[int, ...] = ()
    frames: tuple[int | None, ...] = ()
    times_ns: tuple[int | None, ...] = ()


@dataclass(frozen=True, slots=True)
class OffsetEstimate:
    """How far a capture's clock is ahead of capture 0's, in nanoseconds.

    ``low_ns``/``high_ns``: the feasible interval (``low_ns > high_ns`` when jitter makes
    the bounds cross); ``bounded`` is False when only one direction was matched, so the
    offset is the middle of that direction's spread, not bounded both ways."""

    offset_ns: int
    low_ns: int
    high_ns: int
    matched: int
    bounded: bool

    def text(self) -> str:
        if not self.matched:
            return "no packet in common: offset taken as 0"
        s = f"{self.offset_ns / 1e9:+.6f} s from {self.matched} packets"
        if not self.bounded:
            return s + " (one direction only: not bounded)"
        width = self.high_ns - self.low_ns
        if width >= 0:
            return s + f", feasible within +/-{width / 2e9:.6f} s"
        return s + f", bounds cross by {-width / 1e9:.6f} s (timestamp jitter)"


@dataclass
class MergeReport:
    """What a merge found; filled while :func:`merge_captures` runs, complete at its end.

    ``offsets[j]``: capture ``j``'s clock offset as first estimated (``offsets[0]`` is
    zero), ``final_offsets[j]`` as last followed; ``frames[j]`` frames read from capture
    ``j``, ``matched[j]`` of them seen by another point too, ``only[j]`` seen there only;
    ``missed[(i, j)]``: packets capture ``i`` saw and capture ``j`` did not."""

    names: list[str] = field(default_factory=list)
    offsets: list[OffsetEstimate] = field(default_factory=list)
    final_offsets: list[int] = field(default_factory=list)
    tolerance_ns: int = 0
    packets: int = 0
    frames: list[int] = field(default_factory=list)
    matched: list[int] = field(default_factory=list)
    only: list[int] = field(default_factory=list)
    missed: dict[tuple[int, int], int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The report as text, a line per fact."""
        out = [f"{self.packets} distinct packets from {len(self.names)} captures "
               f"(matching tolerance {self.tolerance_ns / 1e6:.3f} ms)"]
        for j, name in enumerate(self.names):
            share = self.matched[j] / self.frames[j] if self.frames[j] else 0.0
            clock = "reference clock" if j == 0 else (
                f"clock {self.offsets[j].text()}; last {self.final_offsets[j] / 1e9:+.6f} s")
            out.append(f"[{point_name(j)}] {name}: {self.frames[j]} frames, "
                       f"{self.matched[j]} ({share:.1%}) seen elsewhere too, "
                       f"{self.only[j]} only here; {clock}")
        for (i, j), n in sorted(self.missed.items()):
            out.append(f"seen at {point_name(i)} not at {point_name(j)}: {n}")
        return out


def point_name(i: int) -> str:
    """The letter of capture point ``i`` (A, B, C...) in merged output."""
    return chr(ord("A") + i) if i < 26 else f"P{i}"


def packet_key(data: bytes, linktype: int) -> tuple[Hashable, ...]:
    """What two captures of one packet have in common: ``(addresses, ports, payload)``
    for IP/UDP (the source and destination IP addresses, the UDP ports, the UDP payload
    as a view of ``data``, which is not copied); ``(link type, whole frame)`` for any
    other frame."""
    mv = memoryview(data)
    if (linktype == LINKTYPE_ETHERNET and data[12:14] == b"\x08\x00" and data[14] == 0x45
            and data[23] == IPPROTO_UDP and not data[20] & 0x3F and not data[21]):
        # untagged Ethernet, IPv4 without options, UDP, not a fragment: rxe's frames
        end = 14 + _U16.unpack_from(data, 16)[0]
        if 42 <= end <= len(data):
            return data[26:34], data[34:38], mv[42:end]
    try:
        f = decode_frame(mv, linktype)
    except FrameError:
        f = None
    if f is None:
        return linktype, mv
    return f.ip_src + f.ip_dst, _PORTS.pack(f.sport, f.dport), f.payload


def _direction(key: tuple[Hashable, ...]) -> Hashable:
    return key[0] if len(key) == 3 else None  # (source IP, destination IP)


def estimate_offset(spans: dict[Hashable, tuple[int, int, int]]) -> OffsetEstimate:
    """The offset from per-direction spreads of ``d = t_j - t_0``: ``{direction: (least
    d, greatest d, count)}``. The directions are split into those seen earlier at ``j``
    (their greatest ``d`` bounds the offset from below) and those seen later (their least
    ``d`` bounds it from above), choosing the split that leaves the widest interval."""
    n = sum(c for _, _, c in spans.values())
    if not spans:
        return OffsetEstimate(0, 0, 0, 0, False)
    groups = sorted(spans.values(), key=lambda g: g[0] + g[1])
    if len(groups) == 1:
        lo, hi, _ = groups[0]
        return OffsetEstimate((lo + hi) // 2, lo, hi, n, False)
    best = None
    for s in range(1, len(groups)):
        low = max(g[1] for g in groups[:s])
        high = min(g[0] for g in groups[s:])
        if best is None or high - low > best[1] - best[0]:
            best = (low, high)
    low, high = best
    return OffsetEstimate((low + high) // 2, low, high, n, True)


class _Seen:
    """A packet waiting for its sightings at the other points."""

    __slots__ = ("t0", "key", "frames", "times", "rec", "ts", "first")

    def __init__(self, t0: int, key: tuple, n: int, first: int) -> None:
        self.first = first  # the point that saw it first
        self.t0 = t0  # corrected time of the first sighting (capture 0's clock)
        self.key = key
        self.frames: list[int | None] = [None] * n
        self.times: list[int | None] = [None] * n
        self.rec: PcapRecord | None = None
        self.ts = t0  # on capture 0's clock: capture 0's own time once it sees it


_Item = tuple[PcapRecord, tuple]


def _keyed(records: Iterable[PcapRecord], name: str) -> Iterator[_Item]:
    try:
        for r in records:
            yield r, packet_key(r.data, r.linktype)
    except PcapError as e:  # say which of the captures it is
        raise PcapError(f"{name}: {e}") from None


def _calibrate(prefixes: list[list[_Item]]) -> tuple[list[OffsetEstimate], int, dict]:
    """Offsets from the packets each capture's prefix shares with capture 0 (or, failing
    that, with a capture already placed), unambiguous ones only; the tolerance; and the
    typical delay between two points per direction (see :func:`_merge`)."""
    n = len(prefixes)
    counts = [Counter(k for _, k in p) for p in prefixes]
    firsts = [{k: r.ts_ns for r, k in p if counts[i][k] == 1} for i, p in enumerate(prefixes)]
    est: list[OffsetEstimate | None] = [OffsetEstimate(0, 0, 0, 0, True)] + [None] * (n - 1)
    spread = 0
    expect: dict[tuple[int, int, Hashable], float] = {}
    for _ in range(n):
        for j in range(1, n):
            if est[j] is not None:
                continue
            for i in (k for k in range(n) if est[k] is not None):
                spans: dict[Hashable, list[int]] = {}
                for k, tj in firsts[j].items():
                    ti = firsts[i].get(k)
                    if ti is None:
                        continue
                    d = tj - ti
                    g = spans.setdefault(_direction(k), [d, d, 0])
                    g[0] = min(g[0], d)
                    g[1] = max(g[1], d)
                    g[2] += 1
                if spans:
                    e = estimate_offset({g: tuple(v) for g, v in spans.items()})
                    base = est[i].offset_ns
                    est[j] = OffsetEstimate(e.offset_ns + base, e.low_ns + base,
                                            e.high_ns + base, e.matched, e.bounded)
                    spread = max([spread] + [abs(v[x] - e.offset_ns) for v in spans.values()
                                             for x in (0, 1)])
                    for g, (lo, hi, _) in spans.items():
                        expect[(i, j, g)] = (lo + hi) / 2 - e.offset_ns
                        expect[(j, i, g)] = -expect[(i, j, g)]
                    break
    out = [e if e is not None else OffsetEstimate(0, 0, 0, 0, False) for e in est]
    return out, max(MIN_TOLERANCE_NS, 4 * spread), expect


def merge_captures(sources: Sequence[str | os.PathLike[str] | BinaryIO],
                   report: MergeReport | None = None, *, calibrate: int = CALIBRATE,
                   tolerance_ns: int | None = None) -> Iterator[MergedRecord]:
    """Merge captures of one conversation taken at several points (see the module's
    text): one :class:`MergedRecord` per distinct packet, in time order on the first
    capture's clock. ``report`` (a :class:`MergeReport`) is filled as the merge goes.
    ``tolerance_ns``: how far apart (clocks corrected) two sightings of one packet may be;
    by default four times the spread seen when calibrating, at least 2 ms."""
    if len(sources) < 1:
        raise ValueError("no capture to merge")
    report = report if report is not None else MergeReport()
    n = len(sources)
    report.names = [s if isinstance(s, str) else os.fspath(s) if isinstance(s, os.PathLike)
                    else getattr(s, "name", f"capture {i}") for i, s in enumerate(sources)]
    report.frames, report.matched, report.only = [0] * n, [0] * n, [0] * n
    report.missed = {(i, j): 0 for i in range(n) for j in range(n) if i != j}
    streams = [_keyed(read_pcap(s), name) for s, name in zip(sources, report.names)]
    prefixes = [[item for _, item in zip(range(calibrate), s)] for s in streams]
    offsets, tol, expect = _calibrate(prefixes)
    tol = tolerance_ns if tolerance_ns is not None else tol
    report.offsets = offsets
    report.tolerance_ns = tol
    theta = [e.offset_ns for e in offsets]
    report.final_offsets = theta
    feeds = [chain(p, s) for p, s in zip(prefixes, streams)]
    del prefixes
    yield from _merge(feeds, theta, tol, report, expect)


def _merge(feeds: list[Iterator[_Item]], theta: list[int], tol: int, report: MergeReport,
           expect: dict[tuple[int, int, Hashable], float]) -> Iterator[MergedRecord]:
    """The merge proper. A sighting at point ``j`` of a packet first seen at point ``i``
    matches the waiting copy whose distance in time is nearest the typical delay from
    ``i`` to ``j`` in its direction (``expect``, followed as packets match): a network
    duplicate's copies pair in order, and a retransmission that repeats its original
    byte for byte (a stack that sends IPv4 ID 0) pairs with the sighting of its own
    time, not with the original's."""
    n = len(feeds)
    heads: list[_Item | None] = [next(f, None) for f in feeds]
    pending: dict[tuple, deque[_Seen]] = {}
    fifo: deque[_Seen] = deque()  # open packets, by first sighting
    ready: list[tuple[int, int, _Seen]] = []  # closed packets: a heap by (time, arrival)
    drift: list[dict[Hashable, list[int]]] = [{} for _ in range(n)]
    seq = 0
    index = 0

    def emit(e: _Seen) -> MergedRecord:
        nonlocal index
        index += 1
        seen = tuple(i for i in range(n) if e.frames[i] is not None)
        for i in seen:
            report.frames[i] += 1
            if len(seen) > 1:
                report.matched[i] += 1
            else:
                report.only[i] += 1
            for j in range(n):
                if e.frames[j] is None:
                    report.missed[(i, j)] += 1
        report.packets += 1
        r = e.rec
        return MergedRecord(index, e.ts, r.linktype, r.data, r.orig_len, seen,
                            tuple(e.frames), tuple(e.times))

    def close(e: _Seen) -> None:
        nonlocal seq
        q = pending[e.key]
        if q[0] is e:
            q.popleft()
        else:
            q.remove(e)
        if not q:
            del pending[e.key]
        seq += 1
        heapq.heappush(ready, (e.ts, seq, e))

    while True:
        j, best = -1, None
        for i, h in enumerate(heads):  # the next frame by corrected time
            if h is not None:
                t = h[0].ts_ns - theta[i]
                if best is None or t < best:
                    j, best = i, t
        if j < 0:
            break
        rec, key = heads[j]
        heads[j] = next(feeds[j], None)
        t = best
        while fifo and fifo[0].t0 + tol < t:
            close(fifo.popleft())
        while ready and ready[0][0] < t - 2 * tol:
            yield emit(heapq.heappop(ready)[2])
        e = None
        cands = pending.get(key)
        if cands is not None:
            best = tol + 1.0
            for c in cands:
                dt = t - c.t0
                if c.frames[j] is None and -tol <= dt <= tol:
                    err = abs(dt - expect.get((c.first, j, key[0]), 0.0))
                    if err < best:
                        e, best = c, err
            if e is not None:
                k = (e.first, j, key[0])
                old = expect.get(k)
                d = t - e.t0
                expect[k] = d if old is None else old + (d - old) / 8
        if e is None:
            e = _Seen(t, key, n, j)
            e.rec = rec
            fifo.append(e)
            pending.setdefault(key, deque()).append(e)
        elif j != 0 and e.times[0] is not None:
            _follow(drift, theta, j, key, rec.ts_ns - e.times[0])
        e.frames[j] = rec.index
        e.times[j] = rec.ts_ns
        if j == 0:
            e.ts = rec.ts_ns
            e.rec = rec
            for i in range(1, n):
                if e.times[i] is not None:
                    _follow(drift, theta, i, key, e.times[i] - rec.ts_ns)
    while fifo:
        close(fifo.popleft())
    while ready:
        yield emit(heapq.heappop(ready)[2])


def _follow(drift: list[dict[Hashable, list[int]]], theta: list[int], j: int, key: tuple,
            d: int) -> None:
    """Count one matched packet of capture ``j`` (``d = t_j - t_0``); after a block of
    them in both directions, move ``theta[j]`` to the block's estimate (clock drift)."""
    spans = drift[j]
    g = spans.get(_direction(key))
    if g is None:
        spans[_direction(key)] = [d, d, 1]
    else:
        if d < g[0]:
            g[0] = d
        elif d > g[1]:
            g[1] = d
        g[2] += 1
    if sum(v[2] for v in spans.values()) >= DRIFT_BLOCK:
        e = estimate_offset({k: tuple(v) for k, v in spans.items()})
        if e.bounded:
            theta[j] = e.offset_ns
        spans.clear()


def seen_not(records: Iterable[MergedRecord], i: int, j: int) -> Iterator[MergedRecord]:
    """The packets capture point ``i`` saw and point ``j`` did not. When ``i`` is on the
    sender's side of ``j`` (its NIC, or a bridge before the receiver's NIC), these were
    lost between the two points."""
    for r in records:
        if r.frames[i] is not None and r.frames[j] is None:
            yield r
