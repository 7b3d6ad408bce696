"""The ``softrdma`` command line.

Each subcommand lives in a small function. Whatever the user gets wrong ends with exactly one
line on stderr, never a traceback: a bad option or value is a usage error (status 2, checked
by argparse where the mirrored tool checks it while parsing its options); a failure at run
time (an unknown device, a peer that cannot be reached, a file that cannot be written) is
status 1. ``dissect`` keeps status 2 for a file it cannot read (1 is for bad frames).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn, Sequence

__all__ = ["main"]


class CliError(Exception):
    """An error to report in one line, exit status 2: a usage error found after parsing
    (options that do not go together), or dissect's unreadable file."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the option and what is wrong with it), not
    the usage text and then the error; ``--help`` still shows the usage."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _cmd_dissect(args: argparse.Namespace) -> int:
    from .wire.dissect import DissectStats, dissect_records, format_record
    from .wire.pcap import PcapError, read_pcap

    stats = DissectStats()
    failed = False
    out = sys.stdout
    try:
        with open(args.pcap, "rb") as f:
            for rec in dissect_records(read_pcap(f), stats):
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
                out.write((json.dumps(rec) if args.json else format_record(rec)) + "\n")
    except FileNotFoundError:
        raise CliError(f"{args.pcap}: no such file")
    except IsADirectoryError:
        raise CliError(f"{args.pcap}: is a directory")
    except PermissionError:
        raise CliError(f"{args.pcap}: permission denied")
    except PcapError as e:
        raise CliError(f"{args.pcap}: {e}")
    except BrokenPipeError:
        return 0
    if not args.quiet:
        print(stats.summary(), file=sys.stderr)
    return 1 if failed else 0


#: the largest RDMA WRITE payload one UDP datagram can carry: 65507 bytes of UDP payload
#: (IPv4) less BTH (12), RETH (16) and ICRC (4)
MAX_BENCH_PAYLOAD = 65507 - 12 - 16 - 4


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "qps":
        from .bench import QP_TARGET_BYTES, QP_TARGET_COUNT, QP_TARGET_SECONDS, run_qp_bench

        r = run_qp_bench(n=args.qps, depth=args.depth)
        scale = args.qps / QP_TARGET_COUNT
        ok = r["create_seconds"] < QP_TARGET_SECONDS * scale and \
            r["traced_bytes"] < QP_TARGET_BYTES * scale
        return 0 if ok else 1
    from .bench import run_wire_bench

    run_wire_bench(payload=args.size, seconds=args.seconds)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .tools.argtypes import int_range, positive_float
    p = _Parser(prog="softrdma", description="A pure-Python software RoCEv2 stack.")
    p.add_argument("--version", action="version", version=f"softrdma {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("dissect", help="decode the RoCEv2 frames of a pcap/pcapng file",
                       description="One line per RoCEv2 frame (UDP port 4791). Exit status 1 "
                                   "if a RoCE frame does not decode (or, with --verify, has a "
                                   "bad ICRC), 2 if the file cannot be read.")
    d.add_argument("pcap", help="capture file (pcap or pcapng)")
    d.add_argument("--json", action="store_true", help="one JSON object per frame (docs/dissect.md)")
    d.add_argument("--verify", action="store_true", help="fail (exit 1) on any bad ICRC")
    d.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    d.set_defaults(func=_cmd_dissect)

    from .tools.devinfo import add_parsers as _devinfo_parsers
    from .tools.pingpong import add_parser as _pingpong_parser
    _devinfo_parsers(sub)
    _pingpong_parser(sub)
    from .tools.perf import add_parser as _perf_parser
    _perf_parser(sub)
    from .tools.demo import add_parser as _demo_parser
    _demo_parser(sub)
    from .tools.labcmd import add_parser as _lab_parser
    _lab_parser(sub)
    from .tools.fuzz import add_parser as _fuzz_parser
    _fuzz_parser(sub)

    b = sub.add_parser("bench", help="benchmark the wire layer against bare zlib.crc32, or "
                                     "QP memory and creation time (--what qps)",
                       description="--what wire (default): parse/build + ICRC against bare "
                                   "zlib.crc32. --what qps: memory per idle RC QP and the time "
                                   "and memory to create --qps of them (exit 1 if a target is "
                                   "missed: 10,000 QPs in 200 MB and 10 s, scaled).")
    b.add_argument("--what", choices=["wire", "qps"], default="wire",
                   help="what to measure (default: wire)")
    b.add_argument("--size", type=int_range(0, MAX_BENCH_PAYLOAD), default=4096,
                   help=f"wire: payload bytes, 0..{MAX_BENCH_PAYLOAD} (default 4096)")
    b.add_argument("--seconds", type=positive_float, default=1.0,
                   help="wire: time per measurement (> 0)")
    b.add_argument("--qps", type=int_range(1, None), default=10_000,
                   help="qps: how many QPs (default 10000)")
    b.add_argument("--depth", type=int_range(0, None), default=128,
                   help="qps: max_send_wr and max_recv_wr of each QP (default 128)")
    b.set_defaults(func=_cmd_bench)

    sub.add_parser("run", help="run an unchanged pyverbs program on softrdma "
                               "(softrdma run prog.py [args]; docs/pyverbs.md)", add_help=False)
    return p


def _version() -> str:
    from . import __version__
    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after "run" belongs to the program
        from .run import main as run_main
        return run_main(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # rdma-core tools take the server name after the options: "pingpong rc -n 5 HOST"
    if extra and getattr(args, "servername", "x") is None and len(extra) == 1 \
            and not extra[0].startswith("-"):
        args.servername = extra[0]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .errors import PyverbsRDMAError
    from .tools.common import ToolError
    try:
        return args.func(args)
    except CliError as e:
        print(f"softrdma {args.command}: {e}", file=sys.stderr)
        return 2
    except (ToolError, PyverbsRDMAError) as e:
        print(f"softrdma {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head: not an error of ours
        try:
            sys.stdout.close()
        except BrokenPipeError:
            pass
        return 0
    except Exception as e:  # the last resort: options are validated before this can happen
        if os.environ.get("SOFTRDMA_DEBUG"):
            raise
        if isinstance(e, OSError) and e.strerror:
            what = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
        elif isinstance(e, MemoryError):
            what = "out of memory"
        else:
            what = f"unexpected error: {type(e).__name__}: {e}"
        print(f"softrdma {args.command}: {what} (SOFTRDMA_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
