"""``softrdma bench capture``: reading a long capture, by softrdma's tools and by tshark.

One capture file (``--file``, or a long capture made by :mod:`.capgen` from the real rxe
captures), read in one run by each of:

- ``read_pcap``: :func:`softrdma.wire.pcap.read_pcap` alone, the floor of every tool;
- ``softrdma dissect``: decode every frame, one line each (to /dev/null);
- ``softrdma check``: the conformance checker;
- ``tshark -r F``: Wireshark's one-line summaries (its RoCE dissector decodes UDP 4791);
- ``tshark -r F -V``: Wireshark's full decode;

each in its own process, whose peak resident memory is reported beside the packets per
second of its wall time. A Python interpreter that only imports softrdma's tools is the
baseline of the memory column. tshark is optional: without it the lines say "not
installed".

The peak memory is GNU time's (``/usr/bin/time -f %M``): the kernel's ``ru_maxrss`` of the
command, which time forks from its own small image. Read with ``wait4`` from a child of
this Python process instead, it would start at this process's size: Linux carries the
memory high-water mark of the image a process replaces over ``exec``. Without GNU time
that is the fallback, and the lines say so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..wire.pcap import read_pcap
from .capgen import DEFAULT_TEMPLATES, write_long_capture
from .caploss import LossStats

__all__ = ["ToolRun", "measure", "capture_commands", "run_capture_bench", "count_records"]

_READ_ONLY = ("import sys\nfrom softrdma.wire.pcap import read_pcap\n"
              "n = 0\nfor r in read_pcap(sys.argv[1]):\n    n += 1\nprint(n)\n")
_IMPORTS = "import softrdma.tools.check, softrdma.tools.dissect\n"


@dataclass(frozen=True, slots=True)
class ToolRun:
    """One tool's run over the capture: wall seconds, peak RSS, exit status; ``exact``
    is False when the RSS came from ``wait4`` (it then counts this process's size too)."""

    name: str
    seconds: float
    max_rss_bytes: int
    returncode: int
    exact: bool = True


#: GNU time, which reports a command's own peak RSS (see the module's text)
GNU_TIME = "/usr/bin/time"


def measure(name: str, argv: Sequence[str]) -> ToolRun:
    """Run ``argv`` (output to /dev/null) and measure its wall time and peak RSS."""
    if not os.access(GNU_TIME, os.X_OK):
        return _measure_wait4(name, argv)
    with tempfile.NamedTemporaryFile("r", prefix="softrdma-time-") as out:
        t0 = time.perf_counter()
        rc = subprocess.call([GNU_TIME, "-f", "%M", "-o", out.name, *argv],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        kib = int(out.read().split()[-1])  # after "Command exited with non-zero status"
    return ToolRun(name, seconds, kib * 1024, rc)


def _measure_wait4(name: str, argv: Sequence[str]) -> ToolRun:
    t0 = time.perf_counter()
    p = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(p.pid, 0)
    seconds = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    # ru_maxrss is in KiB on Linux, and starts at this process's size (module text)
    return ToolRun(name, seconds, usage.ru_maxrss * 1024, p.returncode, exact=False)


def capture_commands(path: str | os.PathLike[str]) -> list[tuple[str, list[str] | None]]:
    """The runs of the bench, in order: ``(name, argv)``, argv None if not installed."""
    py = sys.executable
    f = os.fspath(path)
    tshark = shutil.which("tshark")
    return [
        ("python (imports only)", [py, "-c", _IMPORTS]),
        ("read_pcap", [py, "-c", _READ_ONLY, f]),
        ("softrdma dissect", [py, "-m", "softrdma", "dissect", "-q", f]),
        ("softrdma check", [py, "-m", "softrdma", "check", f]),
        ("tshark -r F", [tshark, "-n", "-r", f] if tshark else None),
        ("tshark -r F -V", [tshark, "-n", "-r", f, "-V"] if tshark else None),
    ]


def count_records(path: str | os.PathLike[str]) -> int:
    """Frames in a capture (streamed)."""
    n = 0
    for _ in read_pcap(path):
        n += 1
    return n


def _line(run: ToolRun, packets: int, baseline: bool) -> str:
    rss = f"peak RSS {run.max_rss_bytes / 2**20:7.1f} MiB"
    if not run.exact:
        rss += " (no GNU time: wait4, counting the bench's own size)"
    if baseline:  # the interpreter's start, included in every other line's seconds
        return f"{run.name:<22} {run.seconds:10.2f} s  {'':>16}  {rss}"
    status = "" if run.returncode == 0 else f"  (exit status {run.returncode})"
    return (f"{run.name:<22} {run.seconds:10.2f} s  {packets / run.seconds:10,.0f} pkts/s  "
            f"{rss}{status}")


def run_capture_bench(packets: int = 100_000, file: str | os.PathLike[str] | None = None,
                      templates: Sequence[str | os.PathLike[str]] = DEFAULT_TEMPLATES,
                      out=None, loss_every: int = 0) -> dict[str, ToolRun | None]:
    """Make (or take) the capture, run every tool of :func:`capture_commands` on it and
    print a line per tool; returns the runs by name (None: not installed)."""
    out = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="softrdma-bench-") as tmp:
        if file is None:
            path = Path(tmp) / "long.pcap"
            t0 = time.perf_counter()
            losses = LossStats()
            write_long_capture(path, packets, templates, loss_every=loss_every, losses=losses)
            dt = time.perf_counter() - t0
            print(f"capture: {packets:,} packets made from "
                  f"{', '.join(Path(t).stem for t in templates)} in {dt:.1f} s "
                  f"({packets / dt:,.0f} pkts/s), {path.stat().st_size / 2**20:,.1f} MiB"
                  + (f"; {losses.text()}" if loss_every else ""), file=out)
        else:
            path = Path(file)
            packets = count_records(path)
            print(f"capture: {path}: {packets:,} packets, "
                  f"{path.stat().st_size / 2**20:,.1f} MiB", file=out)
        out.flush()
        runs: dict[str, ToolRun | None] = {}
        for name, argv in capture_commands(path):
            if argv is None:
                runs[name] = None
                print(f"{name:<22} not installed", file=out)
            else:
                runs[name] = r = measure(name, argv)
                print(_line(r, packets, baseline=name.startswith("python")), file=out)
            out.flush()
    return runs
