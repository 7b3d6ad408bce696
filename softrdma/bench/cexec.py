"""``softrdma bench exec``: the cost of crossing from C into Python, in one run.

The same test -- perftest's RDMA WRITE bandwidth, 64 B and 64 KiB, between two
processes on two loopback addresses -- runs two ways, in interleaved rounds:

- **ib_write_bw under softrdma exec**: Debian's perftest binary, unmodified, at both
  ends (:mod:`softrdma.exec`): every verb it calls, ``ibv_post_send`` and ``ibv_poll_cq``
  included, crosses from C into the library's Python;
- **softrdma perf write**: softrdma's own perftest-compatible tool, the same options and
  the same soft device, but Python end to end (the baseline).

The devices, the packets and the protocol are the same; what differs is the program
around them: C calling through the verbs ABI (``struct ibv_send_wr`` read from the
program's memory, ``struct ibv_wc`` written into it, a cffi callback per call) against
Python calling softrdma's verbs directly. 64-byte writes measure the per-call cost
(messages per second), 64 KiB writes the data path (MB/s as perftest prints it). Each
round gives a ratio (exec / perf); the median and the spread of the rounds are reported,
so load on the machine hits both sides of each ratio alike.

Where the time goes inside the C program: ``softrdma exec --profile FILE``
(:mod:`softrdma.exec.profile`); docs/exec.md has the recipe and a profile.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["run_exec_bench", "SIZES"]

#: (label, bytes) of the two tests
SIZES = (("64 B", 64), ("64 KiB", 65536))
# perftest's result row: bytes, iterations, BW peak, BW average (MB/s), MsgRate (Mpps)
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def _listening(port: int) -> bool:
    """A TCP socket of this host listens on ``port`` (perftest's out-of-band exchange):
    read from /proc, since a probing connect would be the server's one client."""
    want = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for line in rows:
            fields = line.split()
            if fields[1].endswith(want) and fields[3] == "0A":
                return True
    return False


def _result(stdout: str, size: int) -> dict[str, float]:
    for line in stdout.splitlines():
        m = _ROW.match(line)
        if m and int(m[1]) == size:
            return {"MBps": float(m[4]), "msg_per_s": float(m[5]) * 1e6}
    tail = stdout.strip().splitlines()
    raise RuntimeError(f"no result row for {size} bytes: {tail[-1] if tail else 'no output'}")


def _pair(server: list[str], client: list[str], port: int, size: int,
          timeout: float) -> dict[str, float]:
    """Start ``server``, run ``client`` once the server listens on ``port``; the
    client's result row."""
    srv = subprocess.Popen(server, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not _listening(port) and srv.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cli = subprocess.run(client, capture_output=True, text=True, timeout=timeout)
        sout, serr = srv.communicate(timeout=timeout)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    if cli.returncode or srv.returncode:
        raise RuntimeError(f"{' '.join(client)} failed (exit {cli.returncode}/{srv.returncode})"
                           f":\n{cli.stdout[-400:]}{cli.stderr[-800:]}{serr[-800:]}")
    return _result(cli.stdout, size)


def exec_write_bw(size: int, iters: int, ips: tuple[str, str], port: int,
                  timeout: float = 300.0) -> dict[str, float]:
    """ib_write_bw, both ends under ``softrdma exec``: the client's MB/s and msgs/s."""
    argv = ["ib_write_bw", "-d", "softrdma0", "-s", str(size), "-n", str(iters),
            "-p", str(port), "-F"]
    base = [sys.executable, "-m", "softrdma", "exec"]
    return _pair(base + ["--addr", ips[0], "--"] + argv,
                 base + ["--addr", ips[1], "--"] + argv + [ips[0]], port, size, timeout)


def perf_write(size: int, iters: int, ips: tuple[str, str], port: int,
               timeout: float = 300.0) -> dict[str, float]:
    """softrdma perf write, the same test: the client's MB/s and msgs/s."""
    base = [sys.executable, "-m", "softrdma", "perf", "write", "-s", str(size),
            "-n", str(iters), "-p", str(port), "-F"]
    return _pair(base + ["--addr", ips[0]], base + ["--addr", ips[1], ips[0]], port, size,
                 timeout)


def run_exec_bench(small_iters: int = 5000, big_iters: int = 1000, rounds: int = 3,
                   port: int = 20800, ips: tuple[str, str] = ("127.0.0.244", "127.0.0.245"),
                   timeout: float = 300.0, out: Any = None) -> dict[str, Any]:
    """Run both paths at both sizes ``rounds`` times, interleaved, and print a table:
    per size, each path's median (and every round), then the ratio exec / perf (median
    of the rounds' ratios, and their spread). Returns
    ``{"exec": {size: [result, ...]}, "perf": {...}, "ratio": {size: [r, ...]}}``."""
    out = out or sys.stdout
    iters = {64: small_iters, 65536: big_iters}
    runs: dict[str, Any] = {"exec": {s: [] for _, s in SIZES},
                            "perf": {s: [] for _, s in SIZES},
                            "ratio": {s: [] for _, s in SIZES}}
    print(f"ib_write_bw under softrdma exec vs softrdma perf write, both ends on loopback "
          f"({ips[0]}, {ips[1]}): {rounds} rounds, 64 B x {small_iters}, 64 KiB x {big_iters}",
          file=out, flush=True)
    p = port
    for _ in range(rounds):
        for _label, size in SIZES:
            key = "msg_per_s" if size == 64 else "MBps"
            e = exec_write_bw(size, iters[size], ips, p, timeout)
            f = perf_write(size, iters[size], ips, p + 1, timeout)
            runs["exec"][size].append(e)
            runs["perf"][size].append(f)
            runs["ratio"][size].append(e[key] / f[key] if f[key] > 0 else float("nan"))
            p += 2
    print(f"{'test (median of the rounds)':<44}{'value':>14}  (each round)", file=out)
    for label, size in SIZES:
        key, unit, fmt = ("msg_per_s", "msgs/s", ",.0f") if size == 64 else \
            ("MBps", "MB/s", ",.1f")
        for path, name in (("exec", "ib_write_bw under softrdma exec"),
                           ("perf", "softrdma perf write")):
            vals = [r[key] for r in runs[path][size]]
            each = ", ".join(format(v, fmt) for v in vals)
            print(f"{name + ', ' + label:<44}{format(statistics.median(vals), fmt):>14} "
                  f"{unit:<7}({each})", file=out)
    print(f"{'ratio exec / perf (median, spread)':<44}{'ratio':>14}  spread", file=out)
    for label, size in SIZES:
        each = runs["ratio"][size]
        print(f"{'  ' + label:<44}{statistics.median(each):>14.2f}  "
              f"{min(each):.2f}-{max(each):.2f}", file=out)
    print("(the same device and protocol both ways: the difference is C calling the verbs "
          "ABI through the library, against Python calling softrdma's verbs)", file=out)
    return runs
