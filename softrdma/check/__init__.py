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

One module per job: :mod:`.decode` (records to packets), :mod:`.conversation` (pairing the
two directions of each connection, grouping UD), :mod:`.frame` (per-packet rules),
:mod:`.invariants` (per-QP constants), :mod:`.sequence` (the requester's PSNs and opcode
sequences), :mod:`.responses` (ACK/NAK/MSN), :mod:`.reads`, :mod:`.atomics`, :mod:`.ud`,
:mod:`.flows` (the walk that drives them), :mod:`.report` (text and JSON).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import BinaryIO, Iterable

from ..wire.opcodes import Transport
from ..wire.pcap import PcapRecord, read_pcap
from .conversation import addr, reconstruct
from .decode import decode
from .flows import walk
from .frame import check_frame
from .invariants import check_invariants
from .rules import RULES, Rule, Sink, Violation
from .ud import check_ud

__all__ = ["RULES", "Rule", "Violation", "QpSummary", "CheckResult", "check_records",
           "check_pcap"]


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

    @property
    def clean(self) -> bool:
        return not self.violations


def check_records(records: Iterable[PcapRecord], *, mtu: int | None = None,
                  rules: Iterable[str] | None = None, lossy: bool = False) -> CheckResult:
    """Check a capture given as pcap records. ``mtu`` fixes the path MTU (otherwise
    inferred per flow from its FIRST and MIDDLE packets); ``rules`` keeps only those rule
    ids (ValueError for an unknown one). ``lossy``: the capture may have been taken behind a
    lossy hop (on a responder's host, say), so skipped PSNs that are resent later are
    losses, and what the requester received cannot be known (docs/check.md). Violations
    come sorted by frame."""
    keep = None
    if rules is not None:
        keep = set(rules)
        unknown = keep - set(RULES)
        if unknown:
            raise ValueError(f"unknown rule(s): {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(RULES)})")
    sink = Sink()
    packets, frames = decode(records, sink)
    for p in packets:
        check_frame(p, sink)
    conv = reconstruct(packets)
    check_invariants(conv, sink)
    check_ud(conv, sink, mtu, lossy)
    owner: dict[int, QpSummary] = {}
    summaries = []
    for c in conv.connections:
        for flow in c.flows():
            st = walk(flow, sink, mtu, lossy)
            s = QpSummary(flow.label, flow.transport.name, len(flow.requests),
                          len(flow.responses), st.mtu)
            summaries.append(s)
            for p in flow.requests + flow.responses:
                owner[p.frame] = s
    for (src, sqp), group in conv.ud_senders.items():
        s = QpSummary(f"{addr(src)} QP 0x{sqp:06x}", Transport.UD.name, len(group), 0, mtu)
        summaries.append(s)
        for p in group:
            owner[p.frame] = s
    found = sorted((v for v in sink.violations if keep is None or v.rule in keep),
                   key=lambda v: (v.frame, list(RULES).index(v.rule)))
    for v in found:
        if v.frame in owner:
            owner[v.frame].violations += 1
    return CheckResult(frames, len(packets), found, summaries)


def check_pcap(source: str | os.PathLike[str] | BinaryIO, *, mtu: int | None = None,
               rules: Iterable[str] | None = None, lossy: bool = False) -> CheckResult:
    """:func:`check_records` over a pcap or pcapng file (path or binary file object).
    Raises :class:`~softrdma.wire.pcap.PcapError` or OSError if it cannot be read."""
    return check_records(read_pcap(source), mtu=mtu, rules=rules, lossy=lossy)
