"""softrdma.check: a conformance checker for RoCEv2 captures, sans-IO.

Give it decoded pcap records (from any implementation: rxe, a NIC, softrdma); it rebuilds
each QP's conversation and returns every transport rule the capture breaks, with the frame
number, the rule id and its IBTA section or rxe reference (:data:`RULES`), and what was
expected against what was seen. ``softrdma check PCAP`` is the command line over it
(:mod:`softrdma.tools.check`); docs/check.md lists the rules.

    >>> from softrdma.check import check_pcap
    >>> result = check_pcap("pcaps/linux-rxe/rc_pingpong.pcap")
    >>> result.violations, len(result.flows)
    ([], 2)

Losses are observations, not violations: from the capture alone the checker infers, per
flow and direction, which packets were lost before the capture point (never captured) and
which after it (captured, but their receiver acted as if it never got them), and judges
each endpoint by what it could have seen. The recovery report (:mod:`.recovery`, in
``result.recovery``) says what the losses cost.

The capture is read twice, one record at a time: a survey (who talks to whom, path MTUs,
the commonest field values), then the walk that judges every packet. Memory stays bounded
whatever the capture's length; a capture given as an iterator rather than a path or a list
is held in memory for the second pass.

One module per job: :mod:`.decode` (records to packets), :mod:`.conversation` (the survey:
pairing the two directions of each connection, grouping UD), :mod:`.frame` (per-packet
rules), :mod:`.invariants` (per-QP constants), :mod:`.sequence` (the requester's PSNs,
opcode sequences and go-backs), :mod:`.responses` (ACK/NAK/MSN), :mod:`.reads`,
:mod:`.atomics`, :mod:`.ud`, :mod:`.flows` (the walk that drives them), :mod:`.recovery`
(what was lost and what recovery cost), :mod:`.report` (text and JSON).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterable, Sequence

from ..wire.opcodes import Transport
from ..wire.pcap import PcapRecord, read_pcap
from ..wire.pcapmerge import MergeReport, merge_captures, point_name
from .conversation import Survey, addr
from .decode import Counted, decode
from .flows import FlowWalk
from .frame import check_frame
from .invariants import Invariants
from .recovery import FlowRecovery, RecoveryEvent
from .rules import RULES, Rule, Sink, Violation
from .ud import UdChecker

__all__ = ["RULES", "Rule", "Violation", "QpSummary", "CheckResult", "FlowRecovery",
           "RecoveryEvent", "check_records", "check_pcap", "check_captures"]


@dataclass
class QpSummary:
    """One line of the per-QP summary: a flow (requester → responder) or a UD sender."""

    label: str
    transport: str
    requests: int
    responses: int
    mtu: int | None
    violations: int = 0


@dataclass
class CheckResult:
    frames: int  # frames in the capture
    packets: int  # RoCE packets among them
    violations: list[Violation] = field(default_factory=list)
    flows: list[QpSummary] = field(default_factory=list)
    recovery: list[FlowRecovery] = field(default_factory=list)  # one per flow / UD sender
    merge: MergeReport | None = None  # several captures: how they were merged

    @property
    def clean(self) -> bool:
        return not self.violations


def _rules(rules: Iterable[str] | None) -> set[str] | None:
    if rules is None:
        return None
    keep = set(rules)
    unknown = keep - set(RULES)
    if unknown:
        raise ValueError(f"unknown rule(s): {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(RULES)})")
    return keep


def check_records(records: Iterable[PcapRecord], *, mtu: int | None = None,
                  rules: Iterable[str] | None = None, lossy: bool = False) -> CheckResult:
    """Check a capture given as pcap records. ``mtu`` fixes the path MTU (otherwise
    inferred per flow from its FIRST and MIDDLE packets); ``rules`` keeps only those rule
    ids (ValueError for an unknown one). ``lossy``: the capture *itself* may have missed
    packets (tcpdump reported drops), so what only a complete capture proves (that a
    go-back skipped a PSN the responder later acknowledged, that an answer has no request)
    is not judged; losses on the path need no option (docs/check.md). Violations come
    sorted by frame. The records are read twice: pass a list, or use :func:`check_pcap`
    for bounded memory."""
    if not isinstance(records, Sequence):
        records = list(records)
    seq = records
    return _check(lambda: iter(seq), mtu=mtu, keep=_rules(rules), lossy=lossy)


def check_pcap(source: str | os.PathLike[str] | BinaryIO, *, mtu: int | None = None,
               rules: Iterable[str] | None = None, lossy: bool = False) -> CheckResult:
    """:func:`check_records` over a pcap or pcapng file (path or binary file object), read
    twice as a stream: memory stays bounded whatever its length (a file object that cannot
    seek is read into memory first). Raises :class:`~softrdma.wire.pcap.PcapError` or
    OSError if it cannot be read."""
    keep = _rules(rules)
    if isinstance(source, (str, os.PathLike)):
        path = source
        return _check(lambda: read_pcap(path), mtu=mtu, keep=keep, lossy=lossy)
    f = source
    if not (hasattr(f, "seekable") and f.seekable()):
        f = io.BytesIO(f.read())
    start = f.tell()

    def again() -> Iterable[PcapRecord]:
        f.seek(start)
        return read_pcap(f)
    return _check(again, mtu=mtu, keep=keep, lossy=lossy)


def check_captures(sources: Sequence[str | os.PathLike[str] | BinaryIO], *,
                   mtu: int | None = None, rules: Iterable[str] | None = None,
                   lossy: bool = False) -> CheckResult:
    """Several captures of one conversation, taken at different points (each host's NIC, a
    bridge), merged by time (:mod:`softrdma.wire.pcapmerge`) and checked as one: the
    checker sees what any point saw, frame numbers are those of the merged stream, and
    each flow's recovery says which packets one point saw and another did not, which
    locates a loss between the two exactly. ``result.merge`` is the merge's report
    (clock offsets, packets matched). One source is :func:`check_pcap`."""
    if len(sources) == 1:
        return check_pcap(sources[0], mtu=mtu, rules=rules, lossy=lossy)
    keep = _rules(rules)
    reports: list[MergeReport] = []

    def again() -> Iterable[PcapRecord]:
        for src in sources:
            if hasattr(src, "seek"):
                src.seek(0)
        reports.append(MergeReport())
        return merge_captures(sources, reports[-1])
    result = _check(again, mtu=mtu, keep=keep, lossy=lossy, points=len(sources))
    result.merge = reports[-1]
    return result


def _check(records: Callable[[], Iterable[PcapRecord]], *, mtu: int | None,
           keep: set[str] | None, lossy: bool, points: int = 1) -> CheckResult:
    # pass 1: the survey
    survey = Survey()
    for p in decode(records(), Sink(quiet=True)):
        survey.add(p)
    conv = survey.finish(mtu)
    # pass 2: every packet judged, in frame order
    sink = Sink()
    inv = Invariants(conv)
    inv.check_ports(sink)
    ud = UdChecker(conv, mtu)
    walks = [FlowWalk(f, lossy_capture=lossy) for _c, f in conv.flows]
    resp_of = {f.resp_key: w for (_c, f), w in zip(conv.flows, walks) if f.req_key}
    counted = Counted(records())
    located = _Located(points) if points > 1 else None
    packets = 0
    owner: dict[int, object] = {}  # frame -> its flow or UD sender, for frames with violations
    for p in decode(counted, sink, conv.roce_flows):
        packets += 1
        before = len(sink.violations)
        check_frame(p, sink)
        inv.on_packet(p, sink)
        t = p.info.transport
        where: object = None
        if t == Transport.UD:
            ud.on_packet(p, sink)
            where = (p.src, p.bth.src_qp or 0)
        elif t != Transport.CNP:
            i = conv.route(p)
            if i is not None:
                w = walks[i]
                where = w
                if p.info.is_request:
                    w.request(p, sink)
                else:
                    w.response(p, sink)
            if p.info.is_request:
                # this packet's sender is the responder of the flow its half answers
                rev = resp_of.get((p.src, p.dst, p.bth.dest_qp))
                if rev is not None:
                    rev.responder_request(p.frame)
        if len(sink.violations) > before and where is not None:
            owner[p.frame] = where
        if located is not None:
            fr = where.recovery if isinstance(where, FlowWalk) else (
                ud.senders[where].rec if where in ud.senders else None)
            located.note(counted.last, p, fr)
    for w in walks:
        w.end(sink)

    found = sorted((v for v in sink.violations if keep is None or v.rule in keep),
                   key=lambda v: (v.frame, list(RULES).index(v.rule)))
    return CheckResult(counted.n, packets, found, *_summaries(conv, walks, ud, mtu, found,
                                                              owner))


def _summaries(conv, walks: list[FlowWalk], ud: UdChecker, mtu: int | None,
               found: list[Violation], owner: dict[int, object]
               ) -> tuple[list[QpSummary], list[FlowRecovery]]:
    """One summary per flow and UD sender, with the violations that belong to it: those
    labelled with it, or found at one of its packets."""
    summaries: list[QpSummary] = []
    by_owner: dict[int, QpSummary] = {}
    by_label: dict[str, QpSummary] = {}
    for w in walks:
        f = w.flow
        s = QpSummary(f.label, f.transport.name, f.requests, f.responses, w.mtu)
        summaries.append(s)
        by_owner[id(w)] = s
        by_label[f.label] = s
    recovery = [w.recovery for w in walks]
    for fr in recovery:
        fr.events.sort(key=lambda e: e.frame)  # found in walking order, listed by frame
    for (src, sqp), g in conv.ud_senders.items():
        s = QpSummary(f"{addr(src)} QP 0x{sqp:06x}", Transport.UD.name, g.packets, 0, mtu)
        summaries.append(s)
        by_owner[id(ud.senders[(src, sqp)])] = s
        by_label[f"{addr(src)} UD QP 0x{sqp:06x}"] = s
    recovery += ud.recoveries()
    for v in found:
        o = owner.get(v.frame)
        if isinstance(o, tuple):
            o = ud.senders.get(o)
        s = by_owner.get(id(o)) if o is not None else by_label.get(v.qp)
        if s is not None:
            s.violations += 1
    return summaries, recovery


class _Located:
    """With several capture points: which packets some point saw and another did not. A
    packet the point on its sender's side saw and a point further on did not was lost
    between the two (the merge's matching: docs/check.md, "Several capture points")."""

    def __init__(self, points: int) -> None:
        self.points = points

    def note(self, rec: PcapRecord | None, p, fr: FlowRecovery | None) -> None:
        seen = getattr(rec, "seen", None)
        if seen is None or fr is None or len(seen) == self.points:
            return
        way = "request(s)" if p.info.is_request else "response(s)"
        missing = ", ".join(point_name(i) for i in range(self.points) if i not in seen)
        here = ", ".join(point_name(i) for i in seen)
        fr.located[f"{way} seen at {here}, not at {missing}"] += 1
