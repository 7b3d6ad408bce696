"""``softrdma bench udp``: softrdma over real UDP against bare Python UDP, in one invocation.

Runs, between two processes on loopback:

- ``softrdma perf write`` and ``softrdma perf send`` with 64 KiB messages (``-D`` seconds):
  RC bandwidth, every byte through the engines, the ICRC and a UDP socket;
- ``softrdma perf send --lat`` with 64-byte messages: perftest's latency (half the
  round trip, its median ``t_typical``);

and beside them, with datagrams the size of softrdma's packets:

- a bare Python UDP sender and receiver: 4112-byte datagrams, the UDP payload of a full RoCE
  packet at path MTU 4096 on loopback (BTH 12 + 4096 bytes + ICRC 4; the first packet of
  a WRITE also has a 16-byte RETH); the receiver's goodput is the baseline;
- a bare Python UDP ping-pong: 80-byte datagrams (BTH 12 + 64 + ICRC 4); its median round
  trip is the baseline.

It prints the ratios against the targets: RC WRITE bandwidth >= 50 % of the bare UDP
throughput, SEND latency <= 2x the bare UDP round trip. The bare UDP and softrdma runs come
after each other in rounds, and the medians are compared, so load on the machine hits both.
"""

from __future__ import annotations

import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["run_udp_bench", "BULK_DATAGRAM", "LAT_DATAGRAM"]

BULK_DATAGRAM = 12 + 4096 + 4  # BTH + one path-MTU payload + ICRC: UDP payload of a full packet
LAT_DATAGRAM = 12 + 64 + 4  # BTH + 64 bytes + ICRC: a SEND_ONLY of 64 bytes
WRITE_TARGET = 0.5
LAT_TARGET = 2.0

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


def bare_udp_throughput(seconds: float, ips: tuple[str, str], port: int) -> float:
    """Bytes per second of UDP payload a bare Python receiver takes from a bare sender."""
    sink = subprocess.Popen(_py("_sink", ips[0], str(port), str(seconds)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _ready(sink)
        subprocess.run(_py("_source", ips[1], ips[0], str(port), str(seconds),
                           str(BULK_DATAGRAM)), check=True, timeout=seconds + 30)
        out, _ = sink.communicate(timeout=30)
    finally:
        sink.kill()
    n, nbytes, dt = out.split()
    return int(nbytes) / float(dt)


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


def _perf(args: list[str], ips: tuple[str, str], port: int, timeout: float = 300) -> tuple[str, str]:
    base = [sys.executable, "-m", "softrdma", "perf", *args, "-p", str(port)]
    srv = subprocess.Popen(base + ["--addr", ips[0]], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        cli = subprocess.run(base + ["--addr", ips[1], ips[0]], capture_output=True, text=True,
                             timeout=timeout)
        sout, serr = srv.communicate(timeout=60)
    finally:
        srv.kill()
    if cli.returncode or srv.returncode:
        raise RuntimeError(f"softrdma perf {' '.join(args)} failed:\n{cli.stderr}{serr}")
    return cli.stdout, sout


def perf_bw(verb: str, seconds: float, ips: tuple[str, str], port: int) -> float:
    """Bytes per second of RDMA payload (perftest reports MB = 2^20 bytes)."""
    out, _ = _perf([verb, "-s", "65536", "-D", str(int(seconds))], ips, port)
    for ln in out.splitlines():
        m = _REPORT.match(ln)
        if m:
            return float(m[4]) * 0x100000
    raise RuntimeError(f"no report line in:\n{out}")


def perf_lat(iters: int, ips: tuple[str, str], port: int) -> tuple[float, float]:
    """(t_typical, t_avg) in seconds: perftest's SEND latency, half a round trip."""
    out, _ = _perf(["send", "--lat", "-s", "64", "-n", str(iters)], ips, port)
    for ln in out.splitlines():
        m = _LAT.match(ln)
        if m:
            return float(m[5]) / 1e6, float(m[6]) / 1e6
    raise RuntimeError(f"no report line in:\n{out}")


def run_udp_bench(seconds: float = 2.0, lat_iters: int = 3000, port: int = 20600,
                  rounds: int = 3,
                  ips: tuple[str, str] = ("127.0.0.250", "127.0.0.251")) -> dict[str, Any]:
    """Run everything ``rounds`` times, interleaved (bare UDP, softrdma, bare UDP, ...), print
    the medians and the ratios of the medians, return the numbers. ``seconds`` is whole
    seconds (perftest's ``-D``), for the bare UDP runs too."""
    seconds = max(1, int(seconds))
    bare_ips = ("127.0.0.252", "127.0.0.253")
    runs: dict[str, list[float]] = {k: [] for k in ("udp_bw", "udp_rtt", "write_bw", "send_bw",
                                                    "send_lat", "send_lat_avg")}
    print(f"softrdma over UDP on loopback vs bare Python UDP: {rounds} rounds of {seconds:.1f} s "
          f"per bandwidth run and {lat_iters} latency iterations", flush=True)
    p = port
    for i in range(rounds):
        runs["udp_bw"].append(bare_udp_throughput(seconds, bare_ips, p + 1))
        runs["write_bw"].append(perf_bw("write", seconds, ips, p + 2))
        runs["send_bw"].append(perf_bw("send", seconds, ips, p + 3))
        runs["udp_rtt"].append(bare_udp_rtt(lat_iters, bare_ips, p + 4))
        lat, avg = perf_lat(lat_iters, ips, p + 5)
        runs["send_lat"].append(lat)
        runs["send_lat_avg"].append(avg)
        p += 10
    r: dict[str, Any] = {k: statistics.median(v) for k, v in runs.items()}
    r["runs"] = runs
    r["write_ratio"] = r["write_bw"] / r["udp_bw"]
    r["send_ratio"] = r["send_bw"] / r["udp_bw"]
    r["lat_ratio"] = r["send_lat"] / r["udp_rtt"]

    def row(name: str, key: str, scale: float, unit: str) -> None:
        each = ", ".join(f"{x * scale:.1f}" for x in runs[key])
        print(f"{name:<44}{r[key] * scale:>9.1f} {unit:<5} ({each})")

    print(f"{'measurement (median of the rounds)':<44}{'value':>15} (each round)")
    row(f"bare UDP, {BULK_DATAGRAM}-byte datagrams", "udp_bw", 1e-6, "MB/s")
    row("softrdma perf write, 64 KiB messages", "write_bw", 1e-6, "MB/s")
    row("softrdma perf send, 64 KiB messages", "send_bw", 1e-6, "MB/s")
    row(f"bare UDP ping-pong RTT, {LAT_DATAGRAM}-byte datagrams", "udp_rtt", 1e6, "us")
    row("softrdma perf send --lat, 64 B: t_typical", "send_lat", 1e6, "us")
    row("  t_avg (a round trip is 2 x the latency)", "send_lat_avg", 1e6, "us")
    ok_w = r["write_ratio"] >= WRITE_TARGET
    ok_l = r["lat_ratio"] <= LAT_TARGET
    print(f"RC WRITE BW / bare UDP throughput : {r['write_ratio']:6.2f}  (target >= {WRITE_TARGET}: "
          f"{'met' if ok_w else 'MISSED'})")
    print(f"RC SEND BW / bare UDP throughput  : {r['send_ratio']:6.2f}")
    print(f"SEND latency / bare UDP RTT       : {r['lat_ratio']:6.2f}  (target <= {LAT_TARGET}: "
          f"{'met' if ok_l else 'MISSED'}; softrdma round trip / UDP RTT: "
          f"{2 * r['lat_ratio']:.2f})")
    r["targets_met"] = ok_w and ok_l
    return r


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
