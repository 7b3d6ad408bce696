"""``softrdma dissect [-r] FILE...``: one line (or JSON object) per RoCEv2 frame of a capture,
in the manner of ``tshark -r FILE``: frame numbers from 1, a time column (``-t``), a display
filter (``-Y``, :mod:`softrdma.wire.dfilter`) and, with ``--wireshark-names``, Wireshark's
opcode names.

MADs on QP1 are decoded as CM messages (:mod:`softrdma.cm.dissect`). Several files are
captures of one conversation taken at several points: they are merged by time
(:mod:`softrdma.wire.pcapmerge`) and each line says which points (A, B, ...) saw the packet;
after the frames, what each point saw alone and the clock offsets found.

Exit status 1 if a RoCE frame does not decode (or, with ``--verify``, has a bad ICRC); 2 if
the file cannot be read (a usage error of this command, reported in one line). The filter
chooses the lines printed; the status and the summary still judge every frame.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from typing import Any, Iterable, Iterator

from ..cm.dissect import CM_DISSECTOR
from ..wire.dfilter import DisplayFilter, FilterError, compile_filter
from ..wire.dissect import DissectStats, dissect_records, format_record
from ..wire.pcap import PcapRecord, read_pcap
from ..wire.pcapmerge import MergedRecord, MergeReport, merge_captures, point_name
from .argtypes import CAPTURE_HELP, capture_file, int_range
from .common import UsageError, capture_file_errors

__all__ = ["add_parser", "run", "TIME_FORMATS", "format_time"]

#: The payload decoders ``softrdma dissect`` runs.
PAYLOAD = (CM_DISSECTOR,)

#: tshark's ``-t`` formats softrdma dissect takes, and what each shows.
TIME_FORMATS = {
    "r": "seconds since the first frame (the default)",
    "a": "absolute local time of day",
    "ad": "absolute local date and time",
    "u": "absolute UTC time of day",
    "ud": "absolute UTC date and time",
    "d": "seconds since the previous frame of the capture",
    "dd": "seconds since the previous frame shown",
    "e": "seconds since the epoch",
}

_DESCRIPTION = """One line per RoCEv2 frame (UDP port 4791), as tshark -r FILE prints them: the frame number
(from 1, counting every frame of the file), the time, the addresses, the opcode and the
headers, the ICRC checked. Exit status 1 if a RoCE frame does not decode (or, with --verify,
has a bad ICRC), 2 if the file cannot be read or an option is wrong."""

_EPILOG = """display filter (-Y), as in Wireshark:
  fields   frame.number (frame), infiniband.bth.destqp (qp),
           infiniband.bth.opcode (opcode), infiniband.bth.psn (psn)
  compare  == != < <= > >= (or eq ne lt le gt ge) with a number (17, 0x11)
           or an opcode name (RC_SEND_FIRST or "RC Send First")
  combine  && (and), || (or), ! (not), parentheses
examples:
  softrdma dissect -r run.pcap -Y 'qp == 0x11 && psn >= 100 && psn <= 200'
  softrdma dissect -r run.pcap -Y 'opcode == "RC Acknowledge" || frame <= 10'
  softrdma dissect -r run.pcap -t e --wireshark-names
several files: captures of one conversation at several points, merged by time
(docs/dissect.md)."""


def _filter(text: str) -> DisplayFilter:
    try:
        return compile_filter(text)
    except FilterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: Any) -> None:
    d = sub.add_parser("dissect", help="decode the RoCEv2 frames of a pcap/pcapng file "
                                       "(like tshark -r)",
                       description=_DESCRIPTION, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("pcap", nargs="*", metavar="FILE", type=capture_file,
                   help=CAPTURE_HELP + "; several: captures of one "
                        "conversation at several points, merged by time")
    d.add_argument("-r", dest="read_file", metavar="FILE", type=capture_file,
                   help="the capture file, as tshark -r (or give it without -r)")
    d.add_argument("-Y", dest="display_filter", type=_filter, metavar="FILTER",
                   help="show only the frames that match FILTER (below)")
    d.add_argument("-t", dest="time_format", choices=list(TIME_FORMATS), default="r",
                   metavar="FORMAT",
                   help="the time column, as tshark -t: "
                        + "; ".join(f"{k}: {v}" for k, v in TIME_FORMATS.items()))
    d.add_argument("--wireshark-names", action="store_true",
                   help="opcodes named as Wireshark names them (RC Send First), not "
                        "RC_SEND_FIRST")
    d.add_argument("--json", action="store_true", help="one JSON object per frame (docs/dissect.md)")
    d.add_argument("--verify", action="store_true", help="fail (exit 1) on any bad ICRC")
    d.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    d.add_argument("--list-max", type=int_range(0, None), default=50, metavar="N",
                   help="with several files: list at most N frames seen at one point only, "
                        "per point (default 50)")
    d.set_defaults(func=run)


def format_time(fmt: str, ts_ns: int, first_ns: int, prev_ns: int | None,
                shown_ns: int | None) -> str:
    """The time column of a frame at ``ts_ns`` in tshark's ``-t fmt``: ``first_ns`` is the
    capture's first frame, ``prev_ns`` the frame before this one, ``shown_ns`` the last
    frame printed (None: there is none, the delta is 0). Microseconds, as tshark shows a
    microsecond capture."""
    if fmt in ("r", "d", "dd"):
        base = {"r": first_ns, "d": prev_ns, "dd": shown_ns}[fmt]
        return f"{_seconds(ts_ns - (ts_ns if base is None else base)):>10}"
    if fmt == "e":
        return _seconds(ts_ns)
    us = (ts_ns + 500) // 1000
    sec, frac = divmod(us, 1_000_000)
    tz = datetime.timezone.utc if fmt in ("u", "ud") else None
    when = datetime.datetime.fromtimestamp(sec, tz)
    day = f"{when:%Y-%m-%d} " if fmt in ("ad", "ud") else ""
    return f"{day}{when:%H:%M:%S}.{frac:06d}"


def _seconds(ns: int) -> str:
    """``ns`` as seconds with six decimals, rounded to the microsecond, exactly."""
    us = (abs(ns) + 500) // 1000
    return f"{'-' if ns < 0 and us else ''}{us // 1_000_000}.{us % 1_000_000:06d}"


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


def _files(args: argparse.Namespace) -> list[str]:
    """The capture files: ``-r FILE`` or the positional ones, exactly one of the two."""
    if args.read_file is not None and args.pcap:
        raise UsageError("give the capture as -r FILE or as FILE, not both "
                         "(see softrdma dissect --help)")
    if args.read_file is None and not args.pcap:
        raise UsageError("no capture file: softrdma dissect -r FILE "
                         "(see softrdma dissect --help)")
    return [args.read_file] if args.read_file is not None else list(args.pcap)


def run(args: argparse.Namespace) -> int:
    paths = _files(args)
    stats = DissectStats()
    failed = False
    out = sys.stdout
    merged = len(paths) > 1
    keep: DisplayFilter | None = args.display_filter
    fmt = args.time_format
    current: list[PcapRecord | None] = [None]
    # the capture's first frame and the frame before the current one (any frame, RoCE or
    # not: tshark's relative and delta times count them all)
    first_ns: list[int | None] = [None]
    prev_ns: list[int | None] = [None]
    shown_ns: int | None = None
    shown = 0
    report = MergeReport()
    only = _Only(len(paths), args.list_max)

    def tracked(records: Iterable[PcapRecord]) -> Iterator[PcapRecord]:
        for r in records:  # dissect_records takes one record per yield: this is its record
            if current[0] is not None:
                prev_ns[0] = current[0].ts_ns
            if first_ns[0] is None:
                first_ns[0] = r.ts_ns
            current[0] = r
            if isinstance(r, MergedRecord):
                only.note(r)
            yield r

    try:
        with contextlib.ExitStack() as stack:
            files = []
            for path in paths:
                with capture_file_errors(path):
                    files.append(stack.enter_context(open(path, "rb")))
            # a bad record: the merge's errors name their file, a single file's do not
            stack.enter_context(capture_file_errors(None if merged else paths[0]))
            if merged:
                records = tracked(merge_captures(files, report))
                if not args.json:
                    for i, name in enumerate(paths):
                        out.write(f"# {point_name(i)}: {name}\n")
            else:
                records = tracked(read_pcap(files[0]))
            for rec in dissect_records(records, stats, PAYLOAD):
                r = current[0]
                assert r is not None and first_ns[0] is not None
                bad = "error" in rec or (args.verify and not rec["icrc_ok"])
                failed = failed or bad
                if keep is not None and not keep.matches(rec):
                    continue
                shown += 1
                points = _points(r, len(paths)) if merged else ""
                if args.json:
                    line = json.dumps(_merged_keys(rec, r, merged))
                else:
                    when = format_time(fmt, r.ts_ns, first_ns[0], prev_ns[0], shown_ns)
                    if "error" in rec:
                        line = (f"{points}{rec['index']:5d} {when} {rec['src']} > {rec['dst']} "
                                f"DECODE ERROR ({rec['reason']}): {rec['error']}")
                    else:
                        line = points + format_record(rec, PAYLOAD, time=when,
                                                      wireshark_names=args.wireshark_names)
                shown_ns = r.ts_ns
                out.write(line + "\n")
            if merged:
                _finish_merge(report, only, args.json, out)
    except BrokenPipeError:
        return 0
    if not args.quiet:
        summary = stats.summary()
        if keep is not None:
            summary += f"; {shown} shown (-Y {keep.text})"
        print(summary, file=sys.stderr)
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
