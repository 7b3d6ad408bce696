"""``softrdma dissect FILE...``: one line (or JSON object) per RoCEv2 frame of a capture.

MADs on QP1 are decoded as CM messages (:mod:`softrdma.cm.dissect`). Several files are
captures of one conversation taken at several points: they are merged by time
(:mod:`softrdma.wire.pcapmerge`) and each line says which points (A, B, ...) saw the packet;
after the frames, what each point saw alone and the clock offsets found.

Exit status 1 if a RoCE frame does not decode (or, with ``--verify``, has a bad ICRC); 2 if
the file cannot be read (a usage error of this command, reported in one line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Iterable, Iterator

from ..cm.dissect import CM_DISSECTOR
from ..wire.dissect import DissectStats, dissect_records, format_record
from ..wire.pcap import PcapRecord, read_pcap
from ..wire.pcapmerge import MergedRecord, MergeReport, merge_captures, point_name
from .argtypes import int_range
from .common import capture_file_errors

__all__ = ["add_parser", "run"]

#: The payload decoders ``softrdma dissect`` runs.
PAYLOAD = (CM_DISSECTOR,)


def add_parser(sub: Any) -> None:
    d = sub.add_parser("dissect", help="decode the RoCEv2 frames of a pcap/pcapng file",
                       description="One line per RoCEv2 frame (UDP port 4791). Exit status 1 "
                                   "if a RoCE frame does not decode (or, with --verify, has a "
                                   "bad ICRC), 2 if the file cannot be read.")
    d.add_argument("pcap", nargs="+",
                   help="capture file (pcap or pcapng); several: captures of one "
                        "conversation at several points, merged by time")
    d.add_argument("--json", action="store_true", help="one JSON object per frame (docs/dissect.md)")
    d.add_argument("--verify", action="store_true", help="fail (exit 1) on any bad ICRC")
    d.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    d.add_argument("--list-max", type=int_range(0, None), default=50, metavar="N",
                   help="with several files: list at most N frames seen at one point only, "
                        "per point (default 50)")
    d.set_defaults(func=run)


class _Only:
    """The first ``limit`` packets each capture point saw alone, and how many in all."""

    def __init__(self, n: int, limit: int) -> None:
        self.limit = limit
        self.count = [0] * n
        self.frames: list[list[tuple[int, int]]] = [[] for _ in range(n)]

    def note(self, r: MergedRecord) -> None:
        if len(r.seen) == 1:
            i = r.seen[0]
            self.count[i] += 1
            if len(self.frames[i]) < self.limit:
                self.frames[i].append((r.index, r.frames[i]))

    def lines(self) -> list[str]:
        out = []
        for i, frames in enumerate(self.frames):
            shown = ", ".join(f"{m} ({point_name(i)} #{k})" for m, k in frames)
            more = f" and {self.count[i] - len(frames)} more" if self.count[i] > len(frames) else ""
            out.append(f"only at {point_name(i)}: {self.count[i]} packet(s)"
                       + (f": {shown}{more}" if frames else ""))
        return out


def run(args: argparse.Namespace) -> int:
    stats = DissectStats()
    failed = False
    out = sys.stdout
    merged = len(args.pcap) > 1
    current: list[PcapRecord | None] = [None]
    report = MergeReport()
    only = _Only(len(args.pcap), args.list_max)

    def tracked(records: Iterable[PcapRecord]) -> Iterator[PcapRecord]:
        for r in records:  # dissect_records takes one record per yield: this is its record
            current[0] = r
            if isinstance(r, MergedRecord):
                only.note(r)
            yield r

    try:
        with contextlib.ExitStack() as stack:
            files = []
            for path in args.pcap:
                with capture_file_errors(path):
                    files.append(stack.enter_context(open(path, "rb")))
            # a bad record: the merge's errors name their file, a single file's do not
            stack.enter_context(capture_file_errors(None if merged else args.pcap[0]))
            if merged:
                records = tracked(merge_captures(files, report))
                if not args.json:
                    for i, name in enumerate(args.pcap):
                        out.write(f"# {point_name(i)}: {name}\n")
            else:
                records = read_pcap(files[0])
            for rec in dissect_records(records, stats, PAYLOAD):
                points = _points(current[0], len(args.pcap)) if merged else ""
                if "error" in rec:
                    failed = True
                    if args.json:
                        out.write(json.dumps(_merged_keys(rec, current[0], merged)) + "\n")
                    else:
                        out.write(f"{points}{rec['index']:5d} {rec['src']} > {rec['dst']} "
                                  f"DECODE ERROR ({rec['reason']}): {rec['error']}\n")
                    continue
                if args.verify and not rec["icrc_ok"]:
                    failed = True
                line = json.dumps(_merged_keys(rec, current[0], merged)) if args.json else \
                    points + format_record(rec, PAYLOAD)
                out.write(line + "\n")
            if merged:
                _finish_merge(report, only, args.json, out)
    except BrokenPipeError:
        return 0
    if not args.quiet:
        print(stats.summary(), file=sys.stderr)
    return 1 if failed else 0


def _points(r: PcapRecord | None, n: int) -> str:
    """The column of capture points that saw ``r``: ``AB``, ``A-``, ``-B``..."""
    frames = getattr(r, "frames", ())
    return "".join(point_name(i) if i < len(frames) and frames[i] is not None else "-"
                   for i in range(n)) + " "


def _merged_keys(rec: dict[str, Any], r: PcapRecord | None, merged: bool) -> dict[str, Any]:
    if merged and isinstance(r, MergedRecord):
        rec["points"] = [point_name(i) for i in r.seen]
        rec["point_frames"] = list(r.frames)
    return rec


def _finish_merge(report: MergeReport, only: _Only, as_json: bool, out: Any) -> None:
    if as_json:
        out.write(json.dumps({"merge": {
            "captures": report.names, "packets": report.packets,
            "offsets_s": [o.offset_ns / 1e9 for o in report.offsets],
            "final_offsets_s": [o / 1e9 for o in report.final_offsets],
            "tolerance_s": report.tolerance_ns / 1e9, "frames": report.frames,
            "matched": report.matched, "only": report.only,
            "only_frames": only.frames,
            "missed": [{"seen": point_name(i), "not_seen": point_name(j), "packets": n}
                       for (i, j), n in sorted(report.missed.items())]}}) + "\n")
        return
    for line in report.lines() + only.lines():
        out.write(f"# {line}\n")
