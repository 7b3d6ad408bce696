"""``softrdma bench exec``: the cost of crossing from C into Python, in one run.

The same tests -- perftest's RDMA WRITE bandwidth, 64 B and 64 KiB, and its 64-byte SEND
latency, between two processes on two loopback addresses -- run two ways, in interleaved
rounds:

- **ib_write_bw / ib_send_lat under softrdma exec**: Debian's perftest binaries,
  unmodified, at both ends (:mod:`softrdma.exec`): every verb they call,
  ``ibv_post_send`` and ``ibv_poll_cq`` included, crosses from C into the library's
  Python;
- **softrdma perf write / perf send --lat**: softrdma's own perftest-compatible tool, the
  same options and the same soft device, but Python end to end (the baseline).

The devices, the packets and the protocol are the same; what differs is the program
around them: C calling through the verbs ABI (``struct ibv_send_wr`` read from the
program's memory, ``struct ibv_wc`` written into it, a cffi callback per call) against
Python calling softrdma's verbs directly. 64-byte writes measure the per-call cost
(messages per second), 64 KiB writes the data path (MB/s as perftest prints it). Each
round gives a ratio (exec / perf for the rates, perf / exec for the latency: above 1 is
exec doing better either way); the median and the spread of the rounds are reported
beside the target (:data:`GOALS`, issue 30: each >= 0.8), so load on the machine hits
both sides of each ratio alike. :func:`run_exec_goals` returns them for another bench
(``softrdma bench udp``) to print.

Where the time goes inside the C program: ``softrdma exec --profile FILE``
(:mod:`softrdma.exec.profile`); docs/exec.md has the recipe and a profile.
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

__all__ = ["run_exec_bench", "run_exec_goals", "exec_send_lat", "perf_send_lat", "SIZES",
           "GOALS"]

#: (label, bytes) of the two tests
SIZES = (("64 B", 64), ("64 KiB", 65536))
# perftest's result row: bytes, iterations, BW peak, BW average (MB/s), MsgRate (Mpps)
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
# perftest's latency row: bytes, iterations, t_min, t_max, t_typical, t_avg, t_stdev, 99 %,
# 99.9 % (microseconds)
_LAT_ROW = re.compile(r"^\s*(\d+)\s+(\d+)" + r"\s+([\d.]+)" * 7 + r"\s*$")
#: (key, what, target): each ratio is "higher is better for exec" and must reach its target
GOALS = (("write_64_ratio", "ib_write_bw 64 B msgs/s, exec / perf", 0.8),
         ("write_64k_ratio", "ib_write_bw 64 KiB MB/s, exec / perf", 0.8),
         ("send_lat_ratio", "ib_send_lat 64 B t_typical, perf / exec", 0.8))


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


def _lat_result(stdout: str, size: int) -> dict[str, float]:
    for line in stdout.splitlines():
        m = _LAT_ROW.match(line)
        if m and int(m[1]) == size:
            return {"t_typical": float(m[5]) * 1e-6, "t_avg": float(m[6]) * 1e-6}
    tail = stdout.strip().splitlines()
    raise RuntimeError(f"no latency row for {size} bytes: {tail[-1] if tail else 'no output'}")


def _pair(server: list[str], client: list[str], port: int, size: int,
          timeout: float, parse: Callable[[str, int], dict[str, float]] = _result
          ) -> dict[str, float]:
    """Start ``server``, run ``client`` once the server listens on ``port``; the
    client's result row."""
    srv = subprocess.Popen(server, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not _listening(port) and srv.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cli = subprocess.run(client, capture_output=True, text=True, timeout=timeout)
        if cli.returncode and srv.poll() is None:
            srv.kill()  # the client failed: its server would wait for it until the timeout
        sout, serr = srv.communicate(timeout=timeout)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    if cli.returncode or srv.returncode:
        raise RuntimeError(f"{' '.join(client)} failed (exit {cli.returncode}/{srv.returncode})"
                           f":\n{cli.stdout[-400:]}{cli.stderr[-800:]}{serr[-800:]}")
    return parse(cli.stdout, size)


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


def exec_send_lat(size: int, iters: int, ips: tuple[str, str], port: int,
                  timeout: float = 300.0) -> dict[str, float]:
    """ib_send_lat, both ends under ``softrdma exec``: the client's t_typical and t_avg
    (seconds; perftest's half round trip)."""
    argv = ["ib_send_lat", "-d", "softrdma0", "-s", str(size), "-n", str(iters),
            "-p", str(port), "-F"]
    base = [sys.executable, "-m", "softrdma", "exec"]
    return _pair(base + ["--addr", ips[0], "--"] + argv,
                 base + ["--addr", ips[1], "--"] + argv + [ips[0]], port, size, timeout,
                 _lat_result)


def perf_send_lat(size: int, iters: int, ips: tuple[str, str], port: int,
                  timeout: float = 300.0) -> dict[str, float]:
    """softrdma perf send --lat, the same test: the client's t_typical and t_avg (s)."""
    base = [sys.executable, "-m", "softrdma", "perf", "send", "--lat", "-s", str(size),
            "-n", str(iters), "-p", str(port), "-F"]
    return _pair(base + ["--addr", ips[0]], base + ["--addr", ips[1], ips[0]], port, size,
                 timeout, _lat_result)


def _ratio(x: float) -> str:
    """A ratio to two decimals, rounded down: a ratio below its target never prints as the
    target (0.797 shows as 0.79, not as a 0.80 beside "MISSED")."""
    return f"{math.floor(x * 100 + 1e-9) / 100:.2f}" if math.isfinite(x) else f"{x}"


def _spread(each: list[float]) -> str:
    return f"{_ratio(min(each))}-{_ratio(max(each))}"


def run_exec_goals(rounds: int = 3, small_iters: int = 5000, big_iters: int = 1000,
                   lat_iters: int = 3000, port: int = 20800,
                   ips: tuple[str, str] = ("127.0.0.244", "127.0.0.245"),
                   timeout: float = 300.0, out: Any = None,
                   quiet: bool = False) -> dict[str, Any]:
    """Issue 30's exec goals, measured in ``rounds`` interleaved rounds (each test under
    exec, then the same test with softrdma perf, on the next TCP port): ib_write_bw 64 B
    (msgs/s) and 64 KiB (MB/s), ib_send_lat 64 B (t_typical). Uses ``port`` .. ``port +
    6 * rounds``. Prints every value and every ratio with its spread and target unless
    ``quiet``. Returns::

        {"write_64_ratio": median, "write_64_ratio_runs": [per round], ...  (GOALS' keys)
         "exec": {"write_64": [msgs/s], "write_64k": [MB/s], "send_lat": [t_typical s]},
         "perf": {... the same keys ...}, "targets_met": bool}
    """
    out = out or sys.stdout
    tests = (("write_64", "write_64_ratio"), ("write_64k", "write_64k_ratio"),
             ("send_lat", "send_lat_ratio"))
    r: dict[str, Any] = {"exec": {t: [] for t, _ in tests}, "perf": {t: [] for t, _ in tests}}
    runs: dict[str, list[float]] = {k: [] for _, k in tests}
    if not quiet:
        print(f"perftest under softrdma exec vs softrdma perf, both ends on loopback "
              f"({ips[0]}, {ips[1]}): {rounds} rounds; ib_write_bw 64 B x {small_iters}, "
              f"64 KiB x {big_iters}; ib_send_lat 64 B x {lat_iters}", file=out, flush=True)
    p = port
    for _ in range(rounds):
        for size, iters, test in ((64, small_iters, "write_64"), (65536, big_iters, "write_64k")):
            key = "msg_per_s" if size == 64 else "MBps"
            e = exec_write_bw(size, iters, ips, p, timeout)[key]
            f = perf_write(size, iters, ips, p + 1, timeout)[key]
            r["exec"][test].append(e)
            r["perf"][test].append(f)
            runs[test + "_ratio"].append(e / f if f > 0 else float("nan"))
            p += 2
        e = exec_send_lat(64, lat_iters, ips, p, timeout)["t_typical"]
        f = perf_send_lat(64, lat_iters, ips, p + 1, timeout)["t_typical"]
        r["exec"]["send_lat"].append(e)
        r["perf"]["send_lat"].append(f)
        runs["send_lat_ratio"].append(f / e if e > 0 else float("nan"))
        p += 2
    met = True
    for key, _what, target in GOALS:
        r[key] = statistics.median(runs[key])
        r[key + "_runs"] = runs[key]
        met = met and r[key] >= target
    r["targets_met"] = met
    if quiet:
        return r
    rows = (("write_64", "ib_write_bw 64 B", "msgs/s", ",.0f", 1.0),
            ("write_64k", "ib_write_bw 64 KiB", "MB/s", ",.1f", 1.0),
            ("send_lat", "ib_send_lat 64 B t_typical", "us", ",.2f", 1e6))
    print(f"{'test (median of the rounds)':<48}{'value':>12}  (each round)", file=out)
    for test, label, unit, fmt, scale in rows:
        for path, name in (("exec", "under softrdma exec"), ("perf", "softrdma perf")):
            vals = [v * scale for v in r[path][test]]
            each = ", ".join(format(v, fmt) for v in vals)
            print(f"{label + ', ' + name:<48}{format(statistics.median(vals), fmt):>12} "
                  f"{unit:<7}({each})", file=out)
    print(f"{'goal (ratio: median of the rounds, spread)':<48}{'ratio':>7}  {'spread':<11} "
          f"target", file=out)
    for key, what, target in GOALS:
        ok = r[key] >= target
        print(f"{what:<48}{_ratio(r[key]):>7}  {_spread(runs[key]):<11} >= {target}: "
              f"{'met' if ok else 'MISSED'}", file=out)
    print("(the same device and protocol both ways: the difference is C calling the verbs "
          "ABI through the library, against Python calling softrdma's verbs)", file=out)
    return r


def run_exec_bench(small_iters: int = 5000, big_iters: int = 1000, rounds: int = 3,
                   port: int = 20800, ips: tuple[str, str] = ("127.0.0.244", "127.0.0.245"),
                   timeout: float = 300.0, out: Any = None,
                   lat_iters: int = 3000) -> dict[str, Any]:
    """``softrdma bench exec``: :func:`run_exec_goals`, printed."""
    return run_exec_goals(rounds, small_iters, big_iters, lat_iters, port, ips, timeout, out)
