"""``softrdma bench wire|engines|qps|udp|socket|verbs|exec|scale|capture``: the benchmarks of
:mod:`softrdma.bench`, each printing its numbers beside a baseline measured in the same run."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..bench.capgen import write_long_capture
from ..bench.caploss import LossStats
from ..bench.capture import run_capture_bench
from ..bench.cexec import run_exec_bench
from ..bench.engines import run_engine_bench
from ..bench.socket import run_socket_bench
from ..bench.qps import QP_TARGET_BYTES, QP_TARGET_COUNT, QP_TARGET_SECONDS, run_qp_bench
from ..bench.scale import MAX_QP, run_scale_bench
from ..bench.udp import run_udp_bench
from ..bench.verbs import is_real_device, run_verbs_bench
from ..bench.wire import MAX_PAYLOAD, run_wire_bench
from ..verbs_api.device import DEFAULT_NAME, address_of_name
from .argtypes import int_range, positive_float
from .common import UsageError, unknown_device

__all__ = ["add_parser"]

def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks beside their baselines: wire, engines, qps, "
                                     "udp, socket, verbs, exec, scale, capture",
                       description="The benchmarks of softrdma (softrdma bench wire, "
                                   "engines, qps, udp, socket, verbs, exec, scale or "
                                   "capture), each printing its numbers beside a baseline "
                                   "measured in the same run. docs/perf.md has the results.")
    b = p.add_subparsers(dest="bench_cmd",
                         metavar="{wire,engines,qps,udp,socket,verbs,exec,scale,capture}",
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

    u = b.add_parser("udp", help="every speed goal: softrdma perf on loopback beside bare "
                                 "Python UDP, and more",
                     description="softrdma perf write/send (64 KiB), send --lat (64 B round "
                                 "trip) and write (64 B message rate) between two processes "
                                 "on loopback, beside a bare Python UDP sender/receiver of the "
                                 "same packet sizes and a ping-pong, in interleaved rounds; "
                                 "then the per-packet goals (bench wire) and perftest under "
                                 "softrdma exec (bench exec). Each goal's ratio with its "
                                 "spread over the rounds; exit 1 if a goal is missed.")
    u.add_argument("--seconds", type=int_range(1, None), default=2,
                   help="per bandwidth run, whole seconds like perf -D (default 2)")
    u.add_argument("--lat-iters", type=int_range(5, None), default=3000,
                   help="latency iterations (default 3000)")
    u.add_argument("--rounds", type=int_range(1, None), default=3,
                   help="rounds; medians are reported (default 3)")
    u.add_argument("--port", type=int_range(1, 65535 - 40), default=20600,
                   help="first TCP/UDP port used (default 20600)")
    u.add_argument("--packets", action="store_true",
                   help="also run softrdma with packet trains off, in the same rounds")
    u.add_argument("--before", action="store_true",
                   help="also run softrdma with the second speed step's fast paths off "
                        "(zlib's CRC, payload copies, a flush per post), in the same rounds")
    u.add_argument("--no-wire", dest="wire", action="store_false",
                   help="skip the per-packet goals (softrdma bench wire)")
    u.add_argument("--no-exec", dest="exec_goals", action="store_false",
                   help="skip perftest under softrdma exec (softrdma bench exec)")
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
                   metavar="NAME", help="device name: softrdma0 (the default device), "
                   "softrdma-<IP> (the device on address IP) or a kernel one (rxe0 in a lab "
                   "guest)")
    v.add_argument("-g", "--gid-index", type=int_range(0, 255), default=None,
                   help="GID index (default 1 on a real device, 0 on a soft one)")
    v.add_argument("--small-iters", type=int_range(1, None), default=5000,
                   help="64-byte writes (default 5000)")
    v.add_argument("--big-iters", type=int_range(1, None), default=1000,
                   help="64 KiB writes (default 1000)")
    v.set_defaults(func=_verbs)

    x = b.add_parser("exec", help="ib_write_bw and ib_send_lat under softrdma exec beside "
                                  "softrdma perf",
                     description="perftest's ib_write_bw and ib_send_lat (Debian's binaries, "
                                 "unmodified) with both ends under softrdma exec, beside "
                                 "softrdma perf write / send --lat with the same options, "
                                 "64 B (msgs/s) and 64 KiB (MB/s) writes, 64 B SEND latency "
                                 "(t_typical), between two processes on two loopback "
                                 "addresses, in interleaved rounds: the cost of crossing from "
                                 "C into Python (ratios: median and spread of the rounds, "
                                 "against the 0.8 targets; exit 1 if one is missed).")
    x.add_argument("--small-iters", type=int_range(5, None), default=5000,
                   help="64-byte writes per run (default 5000)")
    x.add_argument("--big-iters", type=int_range(5, None), default=1000,
                   help="64 KiB writes per run (default 1000)")
    x.add_argument("--lat-iters", type=int_range(5, None), default=3000,
                   help="64-byte SEND round trips per latency run (default 3000)")
    x.add_argument("--rounds", type=int_range(1, None), default=3,
                   help="rounds; medians and spreads are reported (default 3)")
    x.add_argument("--port", type=int_range(1, 65000), default=20800,
                   help="first TCP port of the exchanges, six per round "
                        "(default 20800)")
    x.add_argument("--addrs", nargs=2, metavar=("SERVER", "CLIENT"),
                   default=("127.0.0.244", "127.0.0.245"),
                   help="the two devices' addresses (default 127.0.0.244 127.0.0.245)")
    x.set_defaults(func=_exec)

    s = b.add_parser("scale", help="1,000 QPs streaming, 65,536 QPs, timers, idle CPU",
                     description="The scale and idle goals, each beside its baseline, in "
                                 "rounds (median and spread): N QPs streaming RDMA WRITEs vs "
                                 "one QP (>= 0.8 of its throughput, no QP starved), 65,536 QPs "
                                 "in one process (< 500 MB), timer and dispatch costs with "
                                 "65,536 QPs vs one (not growing), CPU of a process with N idle "
                                 "QP pairs (< 1 %% of a core). Exit 1 if a target is missed.")
    s.add_argument("--qps", type=int_range(2, 16384), default=1000,
                   help="QPs streaming, and idle QP pairs (default 1000)")
    s.add_argument("--rounds", type=int_range(1, None), default=3,
                   help="rounds; medians and [min .. max] are reported (default 3)")
    s.add_argument("--seconds", type=positive_float, default=3.0,
                   help="per streaming run, after 1 s of warm-up (> 0, default 3)")
    s.add_argument("--size", type=int_range(1, 1 << 20), default=4096,
                   help="RDMA WRITE size in bytes (default 4096: one packet)")
    s.add_argument("--window", type=int_range(1, 16384), default=128,
                   help="outstanding WRITEs in all: the one QP's, split among the N "
                        "(at least 1 each; default 128)")
    s.add_argument("--max-qp", type=int_range(2, MAX_QP), default=MAX_QP,
                   help=f"QPs for the memory and timer measurements (default {MAX_QP})")
    s.add_argument("--idle-seconds", type=positive_float, default=3.0,
                   help="CPU measured over this idle time (> 0, default 3)")
    s.add_argument("--only", action="append", choices=("stream", "qps", "timers", "idle"),
                   help="run only this part (repeatable)")
    s.set_defaults(func=_scale)

    c = b.add_parser("capture", help="a long capture read by read_pcap, dissect, check, tshark",
                     description="One long RoCEv2 capture (--file, or --packets made from the "
                                 "real rxe captures in pcaps/linux-rxe, tiled with PSNs, MSNs, "
                                 "IP IDs and ICRCs advanced) read by read_pcap alone, softrdma "
                                 "dissect, softrdma check, tshark -r and tshark -r -V, each in "
                                 "its own process: packets/s and peak RSS. --make FILE only "
                                 "writes the capture.")
    c.add_argument("--packets", type=int_range(1, None), default=100_000,
                   help="packets of the capture made (default 100000)")
    c.add_argument("--loss-every", type=int_range(2, None), default=0, metavar="N",
                   help="in the capture made, lose one SEND/WRITE request packet in N "
                        "after the capture point, repaired by a NAK and a go-back as rxe "
                        "does (default: no loss)")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--file", help="bench this capture instead of making one")
    src.add_argument("--make", metavar="FILE",
                     help="write a capture of --packets packets to FILE and stop")
    c.set_defaults(func=_capture)


def _scale(a: argparse.Namespace) -> int:
    r = run_scale_bench(qps=a.qps, rounds=a.rounds, seconds=a.seconds, size=a.size,
                        window=a.window, max_qp=a.max_qp, idle_seconds=a.idle_seconds,
                        only=tuple(a.only or ()))
    return 0 if all(r["met"].values()) else 1


def _capture(a: argparse.Namespace) -> int:
    if a.file and not os.path.isfile(a.file):  # status 2, as dissect and check say it
        raise UsageError(f"{a.file}: " + ("is a directory" if os.path.isdir(a.file)
                                           else "no such file"))
    if a.make:
        losses = LossStats()
        n = write_long_capture(a.make, a.packets, loss_every=a.loss_every, losses=losses)
        print(f"{a.make}: {n} packets" + (f"; {losses.text()}" if a.loss_every else ""))
        return 0
    runs = run_capture_bench(packets=a.packets, file=a.file, loss_every=a.loss_every)
    # exit 1 if a tool failed, e.g. check found a violation in a capture made clean
    return 1 if any(r is not None and r.returncode for r in runs.values()) else 0


def _verbs(a: argparse.Namespace) -> int:
    # a name that is neither a soft device's nor the kernel's: one line, before any run
    if a.device != DEFAULT_NAME and address_of_name(a.device) is None \
            and not is_real_device(a.device):
        raise unknown_device(a.device)
    r = run_verbs_bench(a.device, a.gid_index, a.small_iters, a.big_iters)
    return 1 if any("error" in x for x in r["softrdma"].values()) else 0


def _exec(a: argparse.Namespace) -> int:
    r = run_exec_bench(a.small_iters, a.big_iters, a.rounds, a.port, tuple(a.addrs),
                       lat_iters=a.lat_iters)
    return 0 if r["targets_met"] else 1


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
    r = run_udp_bench(a.seconds, a.lat_iters, a.port, a.rounds, packets=a.packets,
                      before=a.before, wire=a.wire, exec_goals=a.exec_goals)
    return 0 if r["targets_met"] else 1
