"""The ``softrdma`` command line.

Each subcommand is a module of :mod:`softrdma.tools` with an ``add_parser(sub)``; this
module builds the parser from them and dispatches. Whatever the user gets wrong ends with
exactly one line on stderr, never a traceback: a bad option or value is a usage error
(status 2, checked by argparse where the mirrored tool checks it while parsing its options,
or :class:`~softrdma.tools.common.UsageError` after parsing); a failure at run time (an
unknown device, a peer that cannot be reached, a file that cannot be written) is status 1.
``dissect``, ``check`` and ``diagram`` keep status 2 for a file they cannot read (1 is for bad frames
or broken rules).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from . import __version__
from .errors import PyverbsRDMAError
from .run import add_parser as run_add_parser
from .tools import (
    bench, check, cmatose, demo, devinfo, diagram, dissect, exectool, fuzz, labcmd, mckey, mq,
    perf, pingpong, replay, rping, udaddy,
)
from .tools.common import ToolError, UsageError, apply_fault_options

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the option and what is wrong with it), not
    the usage text and then the error; ``--help`` still shows the usage."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: the subcommands, in the order of ``softrdma --help``: each module's ``add_parser(sub)``
#: adds its subcommand(s) and sets ``func`` to what runs it
TOOLS = (dissect, check, diagram, replay, devinfo, pingpong, perf, rping, cmatose, udaddy, mckey,
         mq, demo, labcmd, fuzz, bench, exectool)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="softrdma", description="A pure-Python software RoCEv2 stack.")
    p.add_argument("--version", action="version", version=f"softrdma {__version__}")
    t = p.add_argument_group("tracing (any tool; anywhere on the line; docs/trace.md)")
    t.add_argument("--trace", metavar="KINDS", nargs="?", const="all",
                   help="trace what the devices do: all, or a comma list of "
                        "verbs,wqe,packet,ack,timer,retry,qp,cq,event,drop")
    t.add_argument("--trace-format", choices=("text", "json"), help="text lines (default) "
                   "or JSON lines")
    t.add_argument("--trace-file", metavar="FILE", help="write the trace here, not stderr")
    t.add_argument("--trace-qpn", metavar="QPN[,QPN]", help="only these QPs' events")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for tool in TOOLS:
        tool.add_parser(sub)
    run_add_parser(sub)
    _remember_parsers(p)
    return p


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand's parser a default naming itself, so that an error found after
    parsing (an unknown option) is reported by the parser of the subcommand it belongs to:
    the innermost subcommand chosen sets the default last."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.set_defaults(_cli_parser=subparser)
                _remember_parsers(subparser)


_TRACE_OPTS = ("--trace", "--trace-format", "--trace-file", "--trace-qpn")

#: the tracing options the command line gave, by name (``softrdma exec`` hands them to its
#: program as SOFTRDMA_TRACE* variables: the tracing happens in the program's process)
trace_options: dict[str, str] = {}


def _take_trace_options(argv: list[str]) -> list[str]:
    """Remove the tracing options from anywhere on the line (they belong to every tool)
    and turn tracing on; ValueError names a bad value."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":  # the rest is a program's command line (softrdma exec -- PROG ...)
            rest += argv[i:]
            break
        name, eq, value = a.partition("=")
        if name in _TRACE_OPTS:
            if not eq:
                takes = name != "--trace" or (i + 1 < len(argv) and
                                              not argv[i + 1].startswith("-") and
                                              _looks_like_kinds(argv[i + 1]))
                if takes:
                    if i + 1 >= len(argv):
                        raise ValueError(f"{name}: expected a value")
                    value = argv[i + 1]
                    i += 1
                else:
                    value = "all"
            found[name] = value
        else:
            rest.append(a)
        i += 1
    if not found:
        return argv
    trace_options.update(found)
    from . import trace
    fmt = found.get("--trace-format", "text")
    if fmt not in ("text", "json"):
        raise ValueError(f"--trace-format: {fmt!r} is not text or json")
    try:
        qpns = [int(x, 0) for x in found["--trace-qpn"].split(",")] \
            if "--trace-qpn" in found else None
    except ValueError:
        raise ValueError(f"--trace-qpn: {found['--trace-qpn']!r} is not a QP number list")
    trace.enable(found.get("--trace", "all"), fmt=fmt, path=found.get("--trace-file"),
                 qpns=qpns)
    return rest


def _looks_like_kinds(text: str) -> bool:
    from .trace import KINDS
    return all(k in KINDS or k == "all" for k in text.split(",") if k)


def _run_position(argv: list[str]) -> int | None:
    """Where ``run`` is on a ``softrdma [tracing options] run ...`` line, else None (the
    program's own options must not be read as softrdma's)."""
    i = 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        if argv[i] == "run":
            return i
        if name not in _TRACE_OPTS:
            return None
        if eq:
            i += 1
        elif name == "--trace":  # its KINDS are optional
            i += 2 if i + 1 < len(argv) and _looks_like_kinds(argv[i + 1]) else 1
        else:
            i += 2
    return None


def _trace_options_or_status(argv: list[str], parser: argparse.ArgumentParser | None,
                             ) -> int | None:
    """Take the tracing options out of ``argv`` (in place) and turn tracing on; the exit
    status if they are wrong (one line said)."""
    try:
        argv[:] = _take_trace_options(argv)
    except ValueError as e:
        if parser is None:
            print(f"softrdma: error: {e} (see softrdma --help)", file=sys.stderr)
            return 2
        parser.error(str(e))
    except OSError as e:  # --trace-file in a directory that is not there, or not writable
        print(f"softrdma: --trace-file: {e.strerror}: {e.filename}", file=sys.stderr)
        return 1
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_at = _run_position(argv)
    if run_at is not None:  # everything after "run" belongs to the program
        status = _trace_options_or_status(argv[:run_at], None)
        if status is not None:
            return status
        from .run import main as run_main
        return run_main(argv[run_at + 1:])
    parser = build_parser()
    status = _trace_options_or_status(argv, parser)
    if status is not None:
        return status
    args, extra = parser.parse_known_args(argv)
    # rdma-core tools take the server name after the options: "pingpong rc -n 5 HOST"
    if extra and getattr(args, "servername", "x") is None and len(extra) == 1 \
            and not extra[0].startswith("-"):
        args.servername = extra[0]
    elif extra:  # the subcommand's parser reports it, so the error names its help page
        parser_of_extra = getattr(args, "_cli_parser", parser)
        command = getattr(args, "command", None)
        if command in argv and any(x in argv[:argv.index(command)] for x in extra):
            parser_of_extra = parser  # before the subcommand: softrdma's own options
        parser_of_extra.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    who = getattr(args, "_cli_parser", parser).prog  # "softrdma bench wire"
    try:
        apply_fault_options(args)
        return args.func(args)
    except UsageError as e:
        print(f"{who}: {e}", file=sys.stderr)
        return 2
    except (ToolError, PyverbsRDMAError) as e:
        print(f"{who}: {e}", file=sys.stderr)
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
        print(f"{who}: {what} (SOFTRDMA_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
