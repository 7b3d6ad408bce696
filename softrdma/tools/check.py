"""``softrdma check PCAP``: judge a RoCEv2 capture against the transport rules, and say
what its losses cost.

Exit status 0 if the capture breaks no rule, 1 if it breaks some (each reported with its
frame number), 2 if the file cannot be read or an option is wrong (one line on stderr).
Losses are not violations: each flow that lost packets gets a recovery paragraph (where
they were lost, NAKs, go-backs, timeouts, bytes sent twice, goodput, time lost), and
``--recovery`` lists its events. The rules are in :mod:`softrdma.check.rules` and
docs/check.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..check import RULES, check_captures
from ..check.report import json_lines, text_lines
from .common import UsageError, capture_file_errors
from .argtypes import CAPTURE_HELP, capture_file

__all__ = ["add_parser", "run"]


def _mtu(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if v not in (256, 512, 1024, 2048, 4096):
        raise argparse.ArgumentTypeError(f"{v} is not an IB path MTU (256, 512, 1024, 2048, "
                                         "4096)")
    return v


def _frames(text: str) -> tuple[int, int]:
    a, sep, b = text.partition("-")
    try:
        lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a frame range: {text!r} (A-B)")
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"not a frame range: {text!r} (1 <= A <= B)")
    return lo, hi


def add_parser(sub: Any) -> None:
    d = sub.add_parser("check", help="check a RoCEv2 capture against the transport rules",
                       description="Rebuild each QP's conversation in a pcap/pcapng capture and "
                                   "report every broken transport rule (PSNs, opcode sequences, "
                                   "ACK/NAK/MSN, READ responses, atomics, ICRC, invariant "
                                   "fields, UDP ports) with its frame number. Exit status 0 "
                                   "clean, 1 violations, 2 unreadable file. Rules: "
                                   "docs/check.md.")
    d.add_argument("pcap", nargs="*", type=capture_file,
                   help=CAPTURE_HELP + "; several captures of one conversation taken at "
                        "different points are merged by time and checked as one")
    d.add_argument("--json", action="store_true",
                   help="JSON lines: one object per violation, then per-flow summaries")
    d.add_argument("--mtu", type=_mtu, default=None,
                   help="path MTU (default: inferred per flow from FIRST/MIDDLE payloads)")
    d.add_argument("--lossy", action="store_true",
                   help="the capture itself may have missed packets (tcpdump reported "
                        "drops): do not judge what only a complete capture proves. Losses "
                        "on the network need no option: they are inferred")
    d.add_argument("--recovery", action="store_true",
                   help="list every recovery event (losses, NAKs, go-backs, timeouts, "
                        "duplicates) under its flow")
    d.add_argument("--frames", type=_frames, default=None, metavar="A-B",
                   help="with --recovery: only the events of frames A to B")
    d.add_argument("--rules", action="append", metavar="RULE[,RULE...]", default=None,
                   help="check only these rule ids, comma-separated, repeatable "
                        "(see --list-rules)")
    d.add_argument("--list-rules", action="store_true", help="list the rules and exit")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    if args.list_rules:
        for r in RULES.values():
            out.write(f"{r.id:<17} {r.statement} ({r.reference})\n")
        return 0
    if not args.pcap:
        raise UsageError("a capture file is required (softrdma check PCAP)")
    rules = None
    if args.rules:
        rules = [x for arg in args.rules for x in arg.split(",") if x]
        unknown = sorted(set(rules) - set(RULES))
        if unknown:
            raise UsageError(f"unknown rule(s): {', '.join(unknown)} (softrdma check "
                             "--list-rules lists them)")
    for path in args.pcap[1:]:
        with capture_file_errors(path):
            open(path, "rb").close()  # name the unreadable one before merging
    with capture_file_errors(args.pcap[0] if len(args.pcap) == 1 else None):
        result = check_captures(args.pcap, mtu=args.mtu, rules=rules, lossy=args.lossy)
    fmt = json_lines if args.json else text_lines
    lines = fmt(result, events=args.recovery, frames=args.frames)
    for line in lines:
        out.write(line + "\n")
    if result.merge is not None and not args.json:
        out.write("".join(f"merge: {line}\n" for line in result.merge.lines()))
    return 0 if result.clean else 1
