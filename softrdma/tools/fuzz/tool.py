"""``softrdma fuzz``: fire mutated RoCE frames at live soft devices, then check they survived.

Two soft devices are bound to UDP 4791 on loopback addresses (127.0.10.1 and 127.0.10.2 by
default) with their progress threads, and connected by one QP pair of each kind: RC, UC,
UD, and RC whose receive side is an SRQ. Each device owns an *arena*: one bytearray out of
which its MRs are carved, each MR between guard areas, plus MRs that peers may not write
(remote read only, local write only, no access, full access but in another PD) and a
stretch that is never registered. Only three ranges of an arena may change: the MR the
peer may write (remote write/atomic), the receive buffers and the sink that RDMA READ and
atomic results land in. Everything else is filled with a seeded pattern and compared byte
for byte at the end.

Seed frames are every RoCE packet in the captures under ``pcaps/`` (a source checkout's;
installed, the reference captures shipped with softrdma, softrdma.data). Each frame sent is a
seed retargeted at a live QP (its QPN, PSNs at or near the one expected, the rkey and
addresses of a real MR some of the time, so the responder's and completer's deep paths are
reached), mutated field by field (PSN, QPN, RETH va/rkey/length, AETH, atomic operands,
DETH, pad, payload size, opcode) and byte by byte (bit flips, byte values, truncation,
extension), given a correct ICRC most of the time and a broken one otherwise, and sent over
real UDP from a socket bound to the peer device's address (so the source-address check
passes) or from a stranger's. Legitimate traffic runs alongside, so requests are in flight
when forged responses arrive; QPs the fuzzing legitimately moves to ERR are reset and
reconnected, as a user would.

At the end: the progress threads are alive and no thread raised; the sentinels are
unchanged; threads, descriptors, allocated memory blocks and RSS are flat against a
baseline taken after a warm-up; and every QP pair (re-created if the fuzzing broke it)
completes a normal RDMA WRITE, SEND and READ in both directions (UC: WRITE and SEND; UD:
SEND). Exit status 0 if every check passed, 1 otherwise with one line naming the check.

With ``--icrc auto`` (the default) devices receive through a raw socket when the process
may open one (root or CAP_NET_RAW), which is the only way an IPv4 device sees the IP ID and
can verify ICRCs; otherwise ICRCs go unchecked (``icrc_unchecked``) and the summary says so.

``--target cm`` fires mutated CM MADs (REQ, MRA, REP, RTU, REJ, DREQ, DREP, SIDR_REQ/REP,
from the captures and built; aimed at live comm IDs, fields at their edges, timeouts 0/31,
retries 15, broken cma headers and hellos, wrong attribute IDs, MADs not 256 bytes) at QP1
of two devices, one listening with rdma_cm and both holding an established connection;
it checks that no exception was caught by a device, the CM ids are back near their
baseline, every rdma_cm event was read, the connection (or its replacement) moves data
and a fresh one is made in time. ``--target records`` sends forged socket-layer hellos and
records over real connections to a ``softrdma.socket.Receiver`` while a legitimate sender
uses it (and gives clients damaged hellos in a forged server's REP); it checks that the
sender is heard, dropped connections end with a ConnectionError, none is kept, and
``recv`` raises nothing unexpected. Both also check threads, memory and descriptors.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from ..common import ToolError
from .checks import check_flat, check_memory, check_pairs, exercise, measure
from .fuzzer import SELF_TESTS, TARGETS, Fuzzer, FuzzConfig
from .cmtarget import run_cm
from .rectarget import run_records
from .report import print_report
from .seeds import default_pcap_dir, load_seeds

__all__ = ["add_parser", "run", "run_fuzz"]


#: the help page's text (the module docstring is for readers of the code)
DESCRIPTION = """\
Fire mutated RoCE frames at live soft devices, then check they survived.

Two soft devices are bound to UDP 4791 on loopback addresses (127.0.10.1 and 127.0.10.2 by
default) with their progress threads, and connected by one QP pair of each kind: RC, UC,
UD, and RC whose receive side is an SRQ. Each device owns an arena: one bytearray out of
which its MRs are carved, each MR between guard areas, plus MRs that peers may not write
(remote read only, local write only, no access, full access but in another PD) and a
stretch that is never registered. Only three ranges of an arena may change: the MR the
peer may write (remote write/atomic), the receive buffers and the sink that RDMA READ and
atomic results land in. Everything else is filled with a seeded pattern and compared byte
for byte at the end.

Seed frames are every RoCE packet in the captures under pcaps/ (a source checkout's;
installed, the reference captures shipped with softrdma) or --pcaps. Each frame sent is a
seed retargeted at a live QP (its QPN, PSNs at or near the one expected, the rkey and
addresses of a real MR some of the time, so the responder's and completer's deep paths are
reached), mutated field by field (PSN, QPN, RETH va/rkey/length, AETH, atomic operands,
DETH, pad, payload size, opcode) and byte by byte (bit flips, byte values, truncation,
extension), given a correct ICRC most of the time and a broken one otherwise, and sent over
real UDP from a socket bound to the peer device's address (so the source-address check
passes) or from a stranger's. Legitimate traffic runs alongside, so requests are in flight
when forged responses arrive; QPs the fuzzing legitimately moves to ERR are reset and
reconnected, as a user would.

At the end: the progress threads are alive and no thread raised; the sentinels are
unchanged; threads, descriptors, allocated memory blocks and RSS are flat against a
baseline taken after a warm-up; and every QP pair (re-created if the fuzzing broke it)
completes a normal RDMA WRITE, SEND and READ in both directions (UC: WRITE and SEND; UD:
SEND). Exit status 0 if every check passed, 1 otherwise with one line naming the check.

With --icrc auto (the default) devices receive through a raw socket when the process
may open one (root or CAP_NET_RAW), which is the only way an IPv4 device sees the IP ID and
can verify ICRCs; otherwise ICRCs go unchecked (icrc_unchecked) and the summary says so.

--target cm fires mutated CM MADs (REQ, MRA, REP, RTU, REJ, DREQ, DREP, SIDR_REQ/REP,
from the captures and built; aimed at live comm IDs, fields at their edges, timeouts 0/31,
retries 15, broken cma headers and hellos, wrong attribute IDs, MADs not 256 bytes) at QP1
of two devices, one listening with rdma_cm and both holding an established connection;
it checks that no exception was caught by a device, the CM ids are back near their
baseline, every rdma_cm event was read, the connection (or its replacement) moves data
and a fresh one is made in time. --target records sends forged socket-layer hellos and
records over real connections to a softrdma.socket.Receiver while a legitimate sender
uses it (and gives clients damaged hellos in a forged server's REP); it checks that the
sender is heard, dropped connections end with a ConnectionError, none is kept, and
recv raises nothing unexpected. Both also check threads, memory and descriptors."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fuzz", help="fire mutated frames from pcaps/ at live devices, then "
                                    "check they still work and nothing leaked or changed",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=TARGETS, default="data",
                   help="data: RoCE frames at live QPs (default); cm: CM MADs at QP1 of "
                        "devices with a listener and an established connection; records: "
                        "the socket layer's hello and records at a Receiver")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--seconds", type=float, default=None,
                   help="fuzz for this long (default 10 unless --count is given)")
    p.add_argument("--count", type=int, default=None, help="stop after this many frames")
    p.add_argument("--addrs", nargs=2, default=["127.0.10.1", "127.0.10.2"], metavar="IP",
                   help="the two devices' loopback addresses (127.0.10.1 127.0.10.2)")
    p.add_argument("--stranger", default=None, metavar="IP",
                   help="an address that is no device's peer (default: the second address + 1)")
    p.add_argument("--pcaps", default=None, metavar="DIR",
                   help="directory searched recursively for seed captures (default: a "
                        "checkout's pcaps/, else the captures installed with softrdma)")
    p.add_argument("--icrc", choices=["auto", "raw", "off"], default="auto",
                   help="raw: receive through a raw socket so ICRCs are verified (needs "
                        "CAP_NET_RAW); off: plain UDP sockets; auto: raw when allowed")
    p.add_argument("--warmup", type=float, default=0.15,
                   help="fraction of the run fuzzed before the baseline is taken (0.15)")
    p.add_argument("--crash-pcap", default=None, metavar="FILE",
                   help="on failure, write the last frames sent here (default: a temp file)")
    p.add_argument("--self-test", choices=SELF_TESTS, default=None,
                   help="deliberately break one thing (a sentinel byte, a guard byte, an "
                        "unregistered byte, leak memory, leak a descriptor, start a thread) to "
                        "prove the corresponding check fails")
    p.add_argument("-v", "--verbose", action="store_true", help="print progress every second")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    cfg = FuzzConfig(seed=a.seed, seconds=a.seconds, count=a.count, addrs=tuple(a.addrs),
                     stranger=a.stranger, pcaps=a.pcaps, icrc=a.icrc, warmup=a.warmup,
                     crash_pcap=a.crash_pcap, self_test=a.self_test, verbose=a.verbose,
                     target=a.target)
    return run_fuzz(cfg)


def run_fuzz(cfg: FuzzConfig, out: Any = None) -> int:
    out = out or sys.stdout
    if cfg.seconds is None and cfg.count is None:
        cfg.seconds = 10.0
    if cfg.seconds is not None and not 0 < cfg.seconds <= 86400:
        raise ToolError(f"--seconds must be in (0, 86400], got {cfg.seconds}")
    if cfg.count is not None and cfg.count < 1:
        raise ToolError(f"--count must be at least 1, got {cfg.count}")
    if not 0 <= cfg.warmup < 1:
        raise ToolError(f"--warmup must be in [0, 1), got {cfg.warmup}")
    for ip in cfg.addrs + ((cfg.stranger,) if cfg.stranger else ()):
        try:
            if not ip.startswith("127.") or len(socket.inet_aton(ip)) != 4 or ip.count(".") != 3:
                raise OSError
        except OSError:
            raise ToolError(f"{ip!r} is not an IPv4 loopback address (127.x.y.z)") from None
    if cfg.addrs[0] == cfg.addrs[1]:
        raise ToolError("--addrs must be two different addresses")
    if cfg.target not in TARGETS:
        raise ToolError(f"--target must be one of {', '.join(TARGETS)}, not {cfg.target!r}")
    if cfg.target != "data" and cfg.self_test not in (None, "leak"):
        raise ToolError(f"--target {cfg.target} has only --self-test leak (and its planted "
                        f"bugs in the tests)")
    if cfg.target == "cm":
        return run_cm(cfg, out)
    if cfg.target == "records":
        return run_records(cfg, out)
    root = cfg.pcaps or default_pcap_dir()
    seeds, nfiles = load_seeds(root)
    if not seeds:
        raise ToolError(f"no RoCE frames found in captures under {root}")
    fz = Fuzzer(cfg, out)
    try:
        fz.setup()
        return _run(fz, seeds, nfiles, out)
    finally:
        fz.close()


def _run(fz: Fuzzer, seeds: list[bytes], nfiles: int, out: Any) -> int:
    cfg = fz.cfg
    devs = fz.devs
    print(f"softrdma fuzz: seed {cfg.seed}, devices {devs[0].ip} and {devs[1].ip}, "
          + ("ICRC verified (raw receive)" if fz.raw else "ICRC NOT verified (" + (
              "--icrc off" if cfg.icrc == "off" else "no raw socket: needs CAP_NET_RAW") + ")"),
          file=out)
    print(f"seeds: {len(seeds)} RoCE frames from {nfiles} captures, "
          f"{len({s[0] for s in seeds})} opcodes; pairs: " + ", ".join(
              f"{p.kind} 0x{p.a.qpn:x}<->0x{p.b.qpn:x}" for p in fz.pairs), file=out, flush=True)
    # warm-up: ordinary traffic on every QP (every source-port socket gets opened), then
    # some fuzzing; the baseline is taken after it
    for p in fz.pairs:
        err = exercise(fz, p)
        if err:
            raise ToolError(f"the devices do not work before any fuzzing: {p.kind}: {err}")
    fz.start_counting()
    for s in fz.sides:
        s.arena.take_snapshot()
    if cfg.seconds is not None:
        w_sec: float | None = cfg.seconds * cfg.warmup
        m_sec: float | None = cfg.seconds - w_sec
        w_cnt = m_cnt = None
    else:
        w_sec = m_sec = None
        w_cnt = int(cfg.count * cfg.warmup)
    t_warm = fz.fuzz(seeds, w_sec, w_cnt) if (w_sec or w_cnt) else 0.0
    fz.settle()
    base = measure()
    if cfg.count is not None:
        m_cnt = cfg.count - fz.stats.sent
    t_main = fz.fuzz(seeds, m_sec, m_cnt) if m_cnt is None or m_cnt > 0 else 0.0
    fz.settle()
    fz.apply_self_test()
    now = measure()
    check_flat(fz, base, now)
    check_memory(fz)
    check_pairs(fz)
    return print_report(fz, t_warm + t_main, out)
