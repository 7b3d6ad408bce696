"""``softrdma diagram PCAP -o OUT``: draw what happened between the endpoints of a capture.

The output's suffix picks the format: ``.html`` (a page with the diagram and the packets
as a table), ``.svg`` (the picture alone), ``.mmd`` (Mermaid text, for documentation);
``--format`` overrides it, and without ``-o`` Mermaid goes to standard output.
``--frames A-B`` / ``--time T0-T1`` draw a stretch of a long capture (read only up to its
end); ``--recovery`` marks the arrows with the checker's recovery report (losses, NAKs,
go-backs, timeouts, duplicates) and its violations.
Exit status 0 when written, 2 when the capture cannot be read or an option is wrong (one
line on stderr), 1 when the output cannot be written. docs/diagrams.md explains the
pictures.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..diagram import FORMATS, format_for, render
from ..diagram.annotate import Mark, annotate, recovery_marks
from ..diagram.capture import ConversationError, from_capture, load
from ..diagram.stretch import Stretch
from .argtypes import CAPTURE_HELP, capture_file, int_range, qp_number
from .common import UsageError, capture_file_errors

__all__ = ["add_parser", "run"]

DEFAULT_MAX_PACKETS = 200

#: the help page's text (the module docstring is for readers of the code)
DESCRIPTION = (
    "Draw what happened between the endpoints of a capture. The output's suffix picks the "
    "format: .html (a page with the diagram and the packets as a table), .svg (the picture "
    "alone), .mmd (Mermaid text, for documentation); --format overrides it, and without -o "
    "Mermaid goes to standard output. --frames A-B / --time T0-T1 draw a stretch of a long "
    "capture (read only up to its end); --recovery marks the arrows with the checker's "
    "recovery report (losses, NAKs, go-backs, timeouts, duplicates) and its violations. "
    "Exit status 0 when written, 2 when the capture cannot be read or an option is wrong "
    "(one line on stderr), 1 when the output cannot be written. docs/diagrams.md explains "
    "the pictures.")



def add_parser(sub: Any) -> None:
    d = sub.add_parser("diagram", help="draw a capture as a sequence diagram (HTML, SVG, Mermaid)",
                       description=DESCRIPTION)
    d.add_argument("pcap", type=capture_file, help=CAPTURE_HELP)
    d.add_argument("-o", "--output", metavar="OUT",
                   help="file to write; .html, .svg or .mmd picks the format (default: "
                        "Mermaid on standard output)")
    d.add_argument("--format", choices=sorted(FORMATS), help="the format, whatever the suffix")
    d.add_argument("--conversation", type=int_range(1, None), metavar="N",
                   help="only the N-th conversation (a pair of QPs; --list shows them)")
    d.add_argument("--qpn", type=qp_number, help="only conversations with an end of this QP number")
    d.add_argument("--max-packets", type=int_range(0, None), default=DEFAULT_MAX_PACKETS,
                   metavar="N", help=f"draw at most N packets, the first ones; 0: all "
                                     f"(default {DEFAULT_MAX_PACKETS}; the picture says what "
                                     f"was left out)")
    d.add_argument("--frames", type=_stretch(Stretch.parse_frames), metavar="A-B",
                   help="draw frames A to B only (as tshark numbers them); the capture is "
                        "read up to B and no further")
    d.add_argument("--time", type=_stretch(Stretch.parse_time), metavar="T0-T1",
                   help="draw the packets T0 to T1 seconds after the capture's first one")
    d.add_argument("--recovery", action="store_true",
                   help="mark the arrows with softrdma check's recovery report (losses, "
                        "NAKs, go-backs, timeouts, duplicates) and its violations, with a "
                        "summary under the title")
    d.add_argument("--list", action="store_true", help="list the conversations and exit")
    d.set_defaults(func=run)


def _stretch(parse: Any) -> Any:
    def convert(text: str) -> Stretch:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def _stretch_of(args: argparse.Namespace) -> Stretch | None:
    frames, time = getattr(args, "frames", None), getattr(args, "time", None)
    if frames is None or time is None:
        return frames or time
    return frames.also(time)


def check_marks(path: str, stretch: Stretch | None) -> list[Mark]:
    """The checker's recovery events and violations as marks, judged on the capture up
    to the stretch's end (the history before the stretch counts; what follows it is not
    read, so a repair after the stretch is not known)."""
    from ..check import check_records
    from ..wire.pcap import read_pcap
    records = read_pcap(path)
    result = check_records(records if stretch is None else stretch.prefix(records))
    marks = recovery_marks(result)
    marks += [Mark(v.frame, "violation", f"{v.rule}: {v.message}")
              for v in getattr(result, "violations", [])]
    return marks


def run(args: argparse.Namespace) -> int:
    fmt = args.format
    if fmt is None:
        if args.output is None or args.output == "-":
            fmt = "mermaid"
        else:
            fmt = format_for(args.output)
            if fmt is None:
                raise UsageError(f"{args.output}: the suffix names no format (.html, .svg, "
                                 f".mmd) and --format is not given")
    trace = _read_trace(args.pcap)
    if trace is not None:  # a JSON-lines trace (softrdma --trace-format json), not a pcap
        if _stretch_of(args) is not None or getattr(args, "recovery", False):
            raise UsageError(f"{args.pcap}: --frames, --time and --recovery are for "
                             f"captures, and this is a trace")
        from ..diagram import from_trace
        d = from_trace(trace, title=os.path.basename(args.pcap))
        return _emit(d, fmt, args)
    stretch = _stretch_of(args)
    with capture_file_errors(args.pcap):
        cap = load(args.pcap, stretch)
    if args.list:
        for i, cv in enumerate(cap.conversations, 1):
            print(f"{i:3d}  {cv.describe()}")
        return 0
    try:
        d = from_capture(cap, conversation=args.conversation, qpn=args.qpn)
    except ConversationError as e:
        raise UsageError(f"{args.pcap}: {e}") from None
    if getattr(args, "recovery", False):
        with capture_file_errors(args.pcap):
            marks = check_marks(args.pcap, stretch)
        annotate(d, marks, heading="recovery")
    return _emit(d, fmt, args)


def _read_trace(path: str) -> list[dict] | None:
    """The records of a JSON-lines trace, or None when ``path`` is not one (a capture)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1)
    except OSError:
        return None  # (capture_file_errors reports it)
    if head != b"{":
        return None
    import json
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError as e:
                    raise UsageError(f"{path}: line {n} is not JSON ({e})") from None
    return out


def _emit(d: Any, fmt: str, args: argparse.Namespace) -> int:
    if not d.arrows:
        raise UsageError(f"{args.pcap}: no RoCE packets to draw")
    d = d.truncate(args.max_packets or None)
    for r in d.remarks:
        print(f"softrdma diagram: {r}", file=sys.stderr)
    text = render(d, fmt)
    if args.output is None or args.output == "-":
        sys.stdout.write(text)
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"{args.output}: {fmt}, {len(d.arrows)} packets between {len(d.lanes)} endpoints")
    return 0
