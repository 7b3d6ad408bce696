"""``softrdma bench wire|engines|qps|udp|socket|verbs``: the benchmarks of :mod:`softrdma.bench`, each
printing its numbers beside a baseline measured in the same run."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.engines import run_engine_bench
from ..bench.socket import run_socket_bench
from ..bench.qps import QP_TARGET_BYTES, QP_TARGET_COUNT, QP_TARGET_SECONDS, run_qp_bench
from ..bench.udp import run_udp_bench
from ..bench.verbs import run_verbs_bench
from ..bench.wire import MAX_PAYLOAD, run_wire_bench
from .argtypes import int_range, positive_float

__all__ = ["add_parser"]

def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks beside their baselines: wire, engines, qps, "
                                     "udp, socket, verbs", description=__doc__)
    b = p.add_subparsers(dest="bench_cmd", metavar="{wire,engines,qps,udp,socket,verbs}",
                         required=True)

    w = b.add_parser("wire", help="parse/build + ICRC beside bare zlib.crc32",
                     description="parse + ICRC check and build + ICRC of an RC_RDMA_WRITE_ONLY "
                                 "packet, beside bare zlib.crc32 over the same bytes, in "
                                 "rounds; the ratios against the 2x target.")
    w.add_argument("--size", type=int_range(0, MAX_PAYLOAD), default=4096,
                   help=f"payload bytes, 0..{MAX_PAYLOAD} (default 4096)")
    w.add_argument("--seconds", type=positive_float, default=0.5,
                   help="time per row in each round (> 0, default 0.5)")
    w.add_argument("--rounds", type=int_range(1, None), default=5,
                   help="rounds; the median ratio and its range are reported (default 5)")
    w.set_defaults(func=_wire)

    e = b.add_parser("engines", help="RC WRITE/SEND through the engines, no sockets",
                     description="RC WRITE and SEND, 64 B and 64 KiB, over the in-memory "
                                 "simulated link in one process: messages/s and MB/s, beside "
                                 "zlib.crc32 over the same bytes.")
    e.add_argument("--seconds", type=positive_float, default=2.0,
                   help="time per case (> 0, default 2)")
    e.set_defaults(func=_engines)

    q = b.add_parser("qps", help="memory and creation time of idle RC QPs",
                     description="Memory per idle RC QP and the time and memory to create "
                                 "--qps of them (exit 1 if a target is missed: 10,000 QPs in "
                                 "200 MB and 10 s, scaled).")
    q.add_argument("--qps", type=int_range(1, None), default=10_000,
                   help="how many QPs (default 10000)")
    q.add_argument("--depth", type=int_range(0, None), default=128,
                   help="max_send_wr and max_recv_wr of each QP (default 128)")
    q.set_defaults(func=_qps)

    u = b.add_parser("udp", help="softrdma perf on loopback beside bare Python UDP",
                     description="softrdma perf write/send (64 KiB) and send --lat (64 B) "
                                 "between two processes on loopback, beside a bare Python UDP "
                                 "sender/receiver and ping-pong, in interleaved rounds (exit 1 "
                                 "if a target is missed: WRITE >= 50 %% of bare UDP, latency "
                                 "<= 2x its RTT).")
    u.add_argument("--seconds", type=int_range(1, None), default=2,
                   help="per bandwidth run, whole seconds like perf -D (default 2)")
    u.add_argument("--lat-iters", type=int_range(5, None), default=3000,
                   help="latency iterations (default 3000)")
    u.add_argument("--rounds", type=int_range(1, None), default=3,
                   help="rounds; medians are reported (default 3)")
    u.add_argument("--port", type=int_range(1, 65535 - 40), default=20600,
                   help="first TCP/UDP port used (default 20600)")
    u.set_defaults(func=_udp)

    k = b.add_parser("socket", help="softrdma.socket beside Python TCP sockets",
                     description="Messages of 64 B, 4 KiB and 1 MiB streamed through "
                                 "softrdma.socket and through a Python TCP socket with a "
                                 "4-byte length prefix, each to a server process: messages/s "
                                 "and MB/s side by side.")
    k.add_argument("--seconds", type=positive_float, default=2.0,
                   help="per size and kind (> 0, default 2)")
    k.add_argument("--port", type=int_range(1, 65534), default=20700,
                   help="TCP port, and the rdma_cm port + 1 (default 20700)")
    k.set_defaults(func=_socket)

    v = b.add_parser("verbs", help="one RDMA WRITE loop: softrdma, pyverbs, ib_write_bw",
                     description="The same pyverbs RDMA WRITE loop (two RC QPs in loopback, "
                                 "64 B and 64 KiB) through softrdma (on the backend the device "
                                 "selects), through Debian's pyverbs and beside perftest's "
                                 "ib_write_bw, on one device, in one run.")
    v.add_argument("-d", "--device", default="softrdma0",
                   help="device name (default softrdma0; rxe0 in a lab guest)")
    v.add_argument("-g", "--gid-index", type=int_range(0, 255), default=None,
                   help="GID index (default 1 on a real device, 0 on a soft one)")
    v.add_argument("--small-iters", type=int_range(1, None), default=5000,
                   help="64-byte writes (default 5000)")
    v.add_argument("--big-iters", type=int_range(1, None), default=1000,
                   help="64 KiB writes (default 1000)")
    v.set_defaults(func=_verbs)


def _verbs(a: argparse.Namespace) -> int:
    r = run_verbs_bench(a.device, a.gid_index, a.small_iters, a.big_iters)
    return 1 if any("error" in x for x in r["softrdma"].values()) else 0


def _socket(a: argparse.Namespace) -> int:
    run_socket_bench(seconds=a.seconds, port=a.port)
    return 0


def _wire(a: argparse.Namespace) -> int:
    run_wire_bench(payload=a.size, seconds=a.seconds, rounds=a.rounds)
    return 0


def _engines(a: argparse.Namespace) -> int:
    run_engine_bench(seconds=a.seconds)
    return 0


def _qps(a: argparse.Namespace) -> int:
    r = run_qp_bench(n=a.qps, depth=a.depth)
    scale = a.qps / QP_TARGET_COUNT
    ok = r["create_seconds"] < QP_TARGET_SECONDS * scale and \
        r["traced_bytes"] < QP_TARGET_BYTES * scale
    return 0 if ok else 1


def _udp(a: argparse.Namespace) -> int:
    r = run_udp_bench(a.seconds, a.lat_iters, a.port, a.rounds)
    return 0 if r["targets_met"] else 1
