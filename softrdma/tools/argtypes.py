"""argparse types for the tools' options: numbers read as the C tools read them, with ranges.

rdma-core's examples and perftest read numbers with ``strtol(optarg, NULL, 0)``: decimal,
``0x`` hex or a leading-``0`` octal. :func:`c_int` does the same, but refuses what strtol would
silently turn into 0 or a huge unsigned value (``abc``, ``-5`` for an unsigned option); the
range types then name the option and its bounds in argparse's one-line usage error.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
from typing import Callable

from ..data import find_capture
from ..soft.faultrules import FaultError
from ..soft.faultspec import parse_spec

__all__ = ["c_int", "int_range", "choice_int", "positive_float", "ip_address", "perftest_size",
           "fault_spec", "qp_number", "capture_file", "CAPTURE_HELP"]


def c_int(text: str) -> int:
    """An integer as ``strtol(text, NULL, 0)`` reads it: ``4096``, ``0x1000``, ``010`` (8)."""
    s = text.strip()
    body = s[1:] if s[:1] in "+-" else s
    try:
        if body[:2].lower() == "0x":
            v = int(body[2:], 16) if body[2:] else None
        elif len(body) > 1 and body[0] == "0":
            v = int(body[1:], 8)
        else:
            v = int(body, 10) if body.isdigit() else None
    except ValueError:
        v = None
    if v is None:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
    return -v if s.startswith("-") else v


def int_range(lo: int | None, hi: int | None, what: str | None = None) -> Callable[[str], int]:
    """A :func:`c_int` in ``lo..hi`` (either end open when None)."""

    def conv(text: str) -> int:
        v = c_int(text)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            if what:
                raise argparse.ArgumentTypeError(what.format(v=text, lo=lo, hi=hi))
            if hi is None:
                bound = "positive" if lo == 1 else f"at least {lo}"
                raise argparse.ArgumentTypeError(f"{text} is not {bound}")
            raise argparse.ArgumentTypeError(f"{text} is not between {lo} and {hi}")
        return v

    conv.__name__ = "integer"
    return conv


#: a 24-bit QP number (decimal or 0x hex), as the BTH carries it
qp_number = int_range(0, 0xFFFFFF, "{v} is not a QP number (0 to 0xffffff)")


def choice_int(values: tuple[int, ...]) -> Callable[[str], int]:
    def conv(text: str) -> int:
        v = c_int(text)
        if v not in values:
            raise argparse.ArgumentTypeError(
                f"{text} is not one of {', '.join(str(x) for x in values)}")
        return v

    conv.__name__ = "integer"
    return conv


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return v


def ip_address(text: str) -> str:
    """An IPv4 or IPv6 address, as given (normalised)."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address") from None


#: perftest's -s: 1 .. UINT_MAX/2, with a K or M suffix (perftest_parameters.c)
PERFTEST_MAX_SIZE_ARG = 0xFFFFFFFF // 2


def perftest_size(text: str) -> int:
    """perftest's ``-s``: ``strtol`` of the number with an optional ``K``/``M`` suffix, in
    1 .. UINT_MAX/2 (" Message Size should be between 1 and 2147483647")."""
    factor = 1
    s = text
    if s.endswith("K"):
        s, factor = s[:-1], 1024
    elif s.endswith("M"):
        s, factor = s[:-1], 1024 * 1024
    v = c_int(s) * factor
    if not 1 <= v <= PERFTEST_MAX_SIZE_ARG:
        raise argparse.ArgumentTypeError(
            f"Message Size should be between 1 and {PERFTEST_MAX_SIZE_ARG} (got {text})")
    return v


def fault_spec(text: str) -> str:
    """A fault spec (``tx:loss=0.05;seed=7``, docs/faults.md), checked now so that a bad
    one is a one-line usage error naming the token; kept as text (each device parses it
    again: rules count per device)."""
    try:
        parse_spec(text)
    except FaultError as e:
        raise argparse.ArgumentTypeError(f"bad fault spec: {e}") from None
    return text


#: what a capture argument takes, for the tools' help pages
CAPTURE_HELP = ("a pcap/pcapng file, or the name of a capture shipped with softrdma "
                "(linux-rxe/rc_pingpong.pcap: softrdma.data)")


def capture_file(text: str) -> str:
    """A capture argument of dissect, check, replay and diagram: the file as given if it is
    there, else the capture shipped with softrdma of that name (``linux-rxe/NAME.pcap``, or
    ``pcaps/linux-rxe/NAME.pcap`` as a checkout spells it), so the guides' commands run
    from an installed softrdma too. Anything else is returned as given: the tool says
    "no such file" when it opens it."""
    try:
        return str(find_capture(text))
    except FileNotFoundError:
        return text
