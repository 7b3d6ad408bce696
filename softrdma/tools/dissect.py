"""``softrdma dissect FILE``: one line (or JSON object) per RoCEv2 frame of a capture.

MADs on QP1 are decoded as CM messages (:mod:`softrdma.cm.dissect`).

Exit status 1 if a RoCE frame does not decode (or, with ``--verify``, has a bad ICRC); 2 if
the file cannot be read (a usage error of this command, reported in one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..cm.dissect import CM_DISSECTOR
from ..wire.dissect import DissectStats, dissect_records, format_record
from ..wire.pcap import read_pcap
from .common import capture_file_errors

__all__ = ["add_parser", "run"]

#: The payload decoders ``softrdma dissect`` runs.
PAYLOAD = (CM_DISSECTOR,)


def add_parser(sub: Any) -> None:
    d = sub.add_parser("dissect", help="decode the RoCEv2 frames of a pcap/pcapng file",
                       description="One line per RoCEv2 frame (UDP port 4791). Exit status 1 "
                                   "if a RoCE frame does not decode (or, with --verify, has a "
                                   "bad ICRC), 2 if the file cannot be read.")
    d.add_argument("pcap", help="capture file (pcap or pcapng)")
    d.add_argument("--json", action="store_true", help="one JSON object per frame (docs/dissect.md)")
    d.add_argument("--verify", action="store_true", help="fail (exit 1) on any bad ICRC")
    d.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    stats = DissectStats()
    failed = False
    out = sys.stdout
    try:
        with capture_file_errors(args.pcap), open(args.pcap, "rb") as f:
            for rec in dissect_records(read_pcap(f), stats, PAYLOAD):
                if "error" in rec:
                    failed = True
                    if args.json:
                        out.write(json.dumps(rec) + "\n")
                    else:
                        out.write(f"{rec['index']:5d} {rec['src']} > {rec['dst']} "
                                  f"DECODE ERROR ({rec['reason']}): {rec['error']}\n")
                    continue
                if args.verify and not rec["icrc_ok"]:
                    failed = True
                out.write((json.dumps(rec) if args.json else format_record(rec, PAYLOAD)) + "\n")
    except BrokenPipeError:
        return 0
    if not args.quiet:
        print(stats.summary(), file=sys.stderr)
    return 1 if failed else 0
