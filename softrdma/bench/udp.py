"""``softrdma bench udp``: softrdma over real UDP against bare Python UDP, every speed goal
in one invocation, each as a ratio to its baseline measured in the same rounds.

Between two processes on loopback, in interleaved rounds:

=================================  ================================================  ========
softrdma                           baseline (bare Python UDP, same packet sizes)     goal
=================================  ================================================  ========
``perf write -s 65536 -D S``       a sender/receiver of 4112-byte datagrams (BTH 12  >= 1.0x
                                   + 4096 + ICRC 4: a full packet at path MTU 4096)
``perf send -s 65536 -D S``        the same                                          >= 1.0x
``perf send --lat -s 64``: the     a ping-pong of 80-byte datagrams (a 64-byte       <= 1.2x
round trip (2 x t_typical:         SEND_ONLY): its median round trip
perftest reports half of it)
``perf write -s 64 -D S``:         a sender/receiver of 96-byte datagrams (a 64-byte >= 0.5x
messages/s                         WRITE_ONLY with its RETH): datagrams/s received
=================================  ================================================  ========

Then, in the same invocation, the per-packet goals of :mod:`softrdma.bench.wire` (build +
ICRC and parse + ICRC check of a 4 KiB packet, each under 1.5x the bare ``zlib.crc32`` of
the packet) and, where perftest is installed, those of :mod:`softrdma.bench.cexec`
(perftest's binaries under ``softrdma exec`` within 0.8x of ``softrdma perf``).

Throughput is what the receiver got; the ratios are per round, reported as the median
and the spread (lowest, highest) of the rounds, so load on the machine hits both sides of
each ratio alike. Two options run the softrdma side again per round, with switches off,
for a before/after in the same run: ``--packets`` with packet trains off
(``SOFTRDMA_GSO=0 SOFTRDMA_GRO=0``), ``--before`` with every fast path of the second
speed step off (:data:`BEFORE_ENV`: zlib's CRC, copies, a flush per post).
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from ..wire.crc import CRC_IMPL
from . import cexec
from .wire import run_wire_bench

__all__ = ["run_udp_bench", "BULK_DATAGRAM", "LAT_DATAGRAM"]

BULK_DATAGRAM = 12 + 4096 + 4  # BTH + one path-MTU payload + ICRC: UDP payload of a full packet
LAT_DATAGRAM = 12 + 64 + 4  # BTH + 64 bytes + ICRC: a SEND_ONLY of 64 bytes
RATE_DATAGRAM = 12 + 16 + 64 + 4  # BTH + RETH + 64 bytes + ICRC: a WRITE_ONLY of 64 bytes
# (key, what, target, "min" if the ratio must reach it, "max" if it must stay below)
GOALS = (("write_ratio", "RC WRITE 64 KiB / bare UDP throughput", 1.0, "min"),
         ("send_ratio", "RC SEND 64 KiB / bare UDP throughput", 1.0, "min"),
         ("rtt_ratio", "64 B SEND round trip / bare UDP RTT", 1.2, "max"),
         ("rate_ratio", "64 B WRITE msg rate / bare UDP datagram rate", 0.5, "min"))
#: the per-packet goal of softrdma.bench.wire: each row below this many bare CRCs
WIRE_TARGET = 1.5
WIRE_GOALS = (("build + ICRC", "build + ICRC, 4 KiB / bare zlib.crc32"),
              ("parse + ICRC check", "parse + ICRC check, 4 KiB / bare zlib.crc32"))
NO_TRAINS = {"SOFTRDMA_GSO": "0", "SOFTRDMA_GRO": "0"}
#: every fast path of the second speed step switched off: the "before" of ``--before``
BEFORE_ENV = {"SOFTRDMA_CRC": "zlib", "SOFTRDMA_ZEROCOPY": "0", "SOFTRDMA_DOORBELL": "0",
              "SOFTRDMA_ACK_COALESCE": "0", "SOFTRDMA_BUSY_POLL": "0",
              "SOFTRDMA_SMALL_MSG": "0"}
#: the optional softrdma runs: (key suffix, label, environment)
SIDES = {"packets": ("_packets", "trains off", NO_TRAINS),
         "before": ("_before", "step-2 paths off", BEFORE_ENV)}

_REPORT = re.compile(r"^ (\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")
_LAT = re.compile(r"^ (\d+)\s+(\d+)" + r"\s+([\d.]+)" * 7 + r"\s*$")


# -- the bare UDP roles (run in child processes) -------------------------------------------------

def _sink(ip: str, port: int, seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # as softrdma's sockets
    s.bind((ip, port))
    print("ready", flush=True)
    buf = bytearray(65536)
    n = nbytes = 0
    t0 = t1 = 0.0
    s.settimeout(seconds + 5)
    while True:
        try:
            k = s.recv_into(buf)
        except socket.timeout:
            break
        if k == 1:  # the sender's end marker
            break
        t1 = time.perf_counter()
        if n == 0:
            t0 = t1
            s.settimeout(1.0)
        n += 1
        nbytes += k
    print(f"{n} {nbytes} {max(t1 - t0, 1e-9)}", flush=True)


def _source(src: str, ip: str, port: int, seconds: float, size: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    s.bind((src, 0))
    data = bytes(size)
    addr = (ip, port)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(64):
            s.sendto(data, addr)
    time.sleep(0.05)
    for _ in range(20):
        s.sendto(b"x", addr)
        time.sleep(0.005)


def _echo(ip: str, port: int, seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, port))
    print("ready", flush=True)
    s.settimeout(seconds + 5)
    buf = bytearray(2048)
    while True:
        try:
            k, addr = s.recvfrom_into(buf)
        except socket.timeout:
            return
        if k == 1:
            return
        s.sendto(buf[:k], addr)


def _ping(src: str, ip: str, port: int, iters: int, size: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((src, 0))
    s.settimeout(5)
    data = bytes(size)
    addr = (ip, port)
    rtts = []
    clock = time.perf_counter
    for _ in range(iters):
        t = clock()
        s.sendto(data, addr)
        s.recv(2048)
        rtts.append(clock() - t)
    s.sendto(b"x", addr)
    print(f"{statistics.median(rtts)} {statistics.mean(rtts)}", flush=True)


# -- the driver -------------------------------------------------------------------------------------

def _py(*args: str) -> list[str]:
    return [sys.executable, "-m", "softrdma.bench.udp", *args]


def _ready(p: subprocess.Popen) -> None:
    line = p.stdout.readline() if p.stdout else ""
    if line.strip() != "ready":
        raise RuntimeError(f"bench helper did not start: {line!r} {p.stderr.read() if p.stderr else ''}")


def bare_udp_throughput(seconds: float, ips: tuple[str, str], port: int,
                        size: int = BULK_DATAGRAM) -> tuple[float, float]:
    """(bytes, datagrams) per second of UDP a bare Python receiver takes from a bare
    sender of ``size``-byte datagrams."""
    sink = subprocess.Popen(_py("_sink", ips[0], str(port), str(seconds)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _ready(sink)
        subprocess.run(_py("_source", ips[1], ips[0], str(port), str(seconds),
                           str(size)), check=True, timeout=seconds + 30)
        out, _ = sink.communicate(timeout=30)
    finally:
        sink.kill()
    n, nbytes, dt = out.split()
    return int(nbytes) / float(dt), int(n) / float(dt)


def bare_udp_rtt(iters: int, ips: tuple[str, str], port: int) -> float:
    """Median round trip (seconds) of a bare Python UDP ping-pong."""
    echo = subprocess.Popen(_py("_echo", ips[0], str(port), "30"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _ready(echo)
        out = subprocess.run(_py("_ping", ips[1], ips[0], str(port), str(iters),
                                 str(LAT_DATAGRAM)), capture_output=True, text=True, check=True,
                             timeout=120).stdout
        echo.wait(timeout=10)
    finally:
        echo.kill()
    return float(out.split()[0])


def _perf(args: list[str], ips: tuple[str, str], port: int, timeout: float = 300,
          env: dict[str, str] | None = None) -> tuple[str, str]:
    base = [sys.executable, "-m", "softrdma", "perf", *args, "-p", str(port)]
    full_env = {**os.environ, **(env or {})}
    srv = subprocess.Popen(base + ["--addr", ips[0]], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=full_env)
    try:
        cli = subprocess.run(base + ["--addr", ips[1], ips[0]], capture_output=True, text=True,
                             timeout=timeout, env=full_env)
        sout, serr = srv.communicate(timeout=60)
    finally:
        srv.kill()
    if cli.returncode or srv.returncode:
        raise RuntimeError(f"softrdma perf {' '.join(args)} failed:\n{cli.stderr}{serr}")
    return cli.stdout, sout


def perf_bw(verb: str, seconds: float, ips: tuple[str, str], port: int, size: int = 65536,
            env: dict[str, str] | None = None) -> tuple[float, float]:
    """(bytes, messages) per second: perftest's BW average (MB = 2^20 bytes) and MsgRate."""
    out, _ = _perf([verb, "-s", str(size), "-D", str(int(seconds))], ips, port, env=env)
    for ln in out.splitlines():
        m = _REPORT.match(ln)
        if m:
            return float(m[4]) * 0x100000, float(m[5]) * 1e6
    raise RuntimeError(f"no report line in:\n{out}")


def perf_lat(iters: int, ips: tuple[str, str], port: int,
             env: dict[str, str] | None = None) -> tuple[float, float]:
    """(t_typical, t_avg) in seconds: perftest's SEND latency, half a round trip."""
    out, _ = _perf(["send", "--lat", "-s", "64", "-n", str(iters)], ips, port, env=env)
    for ln in out.splitlines():
        m = _LAT.match(ln)
        if m:
            return float(m[5]) / 1e6, float(m[6]) / 1e6
    raise RuntimeError(f"no report line in:\n{out}")


def _softrdma_round(r: dict[str, list[float]], suffix: str, seconds: float,
                    ips: tuple[str, str], p: int, lat_iters: int,
                    env: dict[str, str] | None) -> None:
    r["write_bw" + suffix].append(perf_bw("write", seconds, ips, p + 2, env=env)[0])
    r["send_bw" + suffix].append(perf_bw("send", seconds, ips, p + 3, env=env)[0])
    lat, _avg = perf_lat(lat_iters, ips, p + 5, env=env)
    r["send_rtt" + suffix].append(2 * lat)
    r["write_rate" + suffix].append(perf_bw("write", seconds, ips, p + 6, size=64, env=env)[1])


def run_udp_bench(seconds: float = 2.0, lat_iters: int = 3000, port: int = 20600,
                  rounds: int = 3, ips: tuple[str, str] = ("127.0.0.250", "127.0.0.251"),
                  packets: bool = False, before: bool = False, wire: bool = True,
                  exec_goals: bool = True) -> dict[str, Any]:
    """Run everything ``rounds`` times, interleaved (bare UDP, softrdma, ...), print each
    goal's ratio (median of the rounds' ratios, and their spread) beside its target, and
    return the numbers. ``seconds`` is whole seconds (perftest's ``-D``), for the bare UDP
    runs too. ``packets`` / ``before``: softrdma also runs with trains off / with the second
    step's fast paths off (:data:`SIDES`), in the same rounds. ``wire`` adds the per-packet
    goals (softrdma.bench.wire), ``exec_goals`` those of perftest under ``softrdma exec``
    (softrdma.bench.cexec; reported as not run where perftest is not installed)."""
    seconds = max(1, int(seconds))
    bare_ips = ("127.0.0.252", "127.0.0.253")
    extra = [SIDES[name] for name, on in (("packets", packets), ("before", before)) if on]
    sides = [("", "", None)] + extra
    keys = ["udp_bw", "udp_rate", "udp_rtt"] + [k + x for x, _, _ in sides
                                                for k in ("write_bw", "send_bw", "send_rtt",
                                                          "write_rate")]
    runs: dict[str, list[float]] = {k: [] for k in keys}
    print(f"softrdma over UDP on loopback vs bare Python UDP: {rounds} rounds of {seconds} s "
          f"per throughput run and {lat_iters} round trips (CRC-32: {CRC_IMPL})", flush=True)
    p = port
    for _ in range(rounds):
        runs["udp_bw"].append(bare_udp_throughput(seconds, bare_ips, p + 1)[0])
        runs["udp_rtt"].append(bare_udp_rtt(lat_iters, bare_ips, p + 4))
        runs["udp_rate"].append(bare_udp_throughput(seconds, bare_ips, p + 7,
                                                    size=RATE_DATAGRAM)[1])
        for k, (x, _label, env) in enumerate(sides):
            _softrdma_round(runs, x, seconds, ips, p + 10 * k, lat_iters, env)
        p += 10 * (len(sides) + 1)
    r: dict[str, Any] = {k: statistics.median(v) for k, v in runs.items()}
    r["runs"] = runs
    for x, _, _ in sides:
        for key, num, den in (("write_ratio", "write_bw", "udp_bw"),
                              ("send_ratio", "send_bw", "udp_bw"),
                              ("rtt_ratio", "send_rtt", "udp_rtt"),
                              ("rate_ratio", "write_rate", "udp_rate")):
            each = [a / b for a, b in zip(runs[num + x], runs[den])]
            r[key + x] = statistics.median(each)
            r[key + x + "_runs"] = each

    def row(name: str, key: str, scale: float, unit: str) -> None:
        each = ", ".join(f"{v * scale:,.1f}" for v in runs[key])
        print(f"{name:<48}{r[key] * scale:>12,.1f} {unit:<9} ({each})")

    print(f"{'measurement (median of the rounds)':<48}{'value':>22} (each round)")
    row(f"bare UDP, {BULK_DATAGRAM}-byte datagrams", "udp_bw", 1e-6, "MB/s")
    row(f"bare UDP, {RATE_DATAGRAM}-byte datagrams", "udp_rate", 1, "dgrams/s")
    row(f"bare UDP ping-pong RTT, {LAT_DATAGRAM}-byte datagrams", "udp_rtt", 1e6, "us")
    for x, label, _ in sides:
        tag = f" ({label})" if label else ""
        row(f"softrdma perf write, 64 KiB{tag}", "write_bw" + x, 1e-6, "MB/s")
        row(f"softrdma perf send, 64 KiB{tag}", "send_bw" + x, 1e-6, "MB/s")
        row(f"softrdma send --lat 64 B round trip{tag}", "send_rtt" + x, 1e6, "us")
        row(f"softrdma perf write, 64 B{tag}", "write_rate" + x, 1, "msgs/s")
    goals: list[tuple[str, float, float, float, float, str]] = []  # name, v, lo, hi, target, kind
    for x, label, _ in sides:
        for key, what, target, kind in GOALS:
            each = r[key + x + "_runs"]
            name = what + (f" ({label})" if label else "")
            goals.append((name, r[key + x], min(each), max(each), target, kind))
    met = all(_ok(v, t, kind) for name, v, _, _, t, kind in goals[:len(GOALS)])
    if wire:
        print("per-packet goals (softrdma bench wire, in this process):", flush=True)
        w = run_wire_bench(rounds=rounds, seconds=0.3)
        r["wire"] = w
        for row_name, what in WIRE_GOALS:
            x = w[row_name]
            goals.append((what, x["ratio"], x["lo"], x["hi"], WIRE_TARGET, "max"))
            met = met and _ok(x["ratio"], WIRE_TARGET, "max")
    if exec_goals:
        print("unmodified perftest under softrdma exec (softrdma bench exec):", flush=True)
        e = cexec.run_exec_goals(rounds=rounds, port=p + 40)
        r["exec"] = e
        for what, v, lo, hi, target, kind in e.get("goals", ()):
            goals.append((what, v, lo, hi, target, kind))
            met = met and _ok(v, target, kind)
        if e.get("skipped"):
            print(f"  not run: {e['skipped']}")
    print(f"{'goal (ratio: median of the rounds, spread)':<52}{'ratio':>7}  {'spread':<13} "
          f"target")
    for name, v, lo, hi, target, kind in goals:
        print(f"{name:<52}{v:>7.2f}  {lo:.2f}-{hi:<8.2f} "
              f"{'>=' if kind == 'min' else '<='} {target}: "
              f"{'met' if _ok(v, target, kind) else 'MISSED'}")
    r["goals"] = goals
    r["targets_met"] = met
    return r


def _ok(v: float, target: float, kind: str) -> bool:
    return v >= target if kind == "min" else v <= target


def main(argv: list[str] | None = None) -> int:
    """The bare UDP roles, run as ``python -m softrdma.bench.udp _ROLE ARGS`` in child
    processes (``softrdma bench udp`` is the command)."""
    argv = sys.argv[1:] if argv is None else argv
    role, rest = (argv[0], argv[1:]) if argv else ("", [])
    if role == "_sink":
        _sink(rest[0], int(rest[1]), float(rest[2]))
    elif role == "_source":
        _source(rest[0], rest[1], int(rest[2]), float(rest[3]), int(rest[4]))
    elif role == "_echo":
        _echo(rest[0], int(rest[1]), float(rest[2]))
    elif role == "_ping":
        _ping(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
    else:
        print("usage: softrdma bench udp (this module runs its helper roles)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
