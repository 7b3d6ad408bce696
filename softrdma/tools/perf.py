"""``softrdma perf {send,write,read,atomic} [--lat]``: perftest's ib_*_bw and ib_*_lat.

The main options of perftest 4.5 with the same letters, its out-of-band exchange on TCP
(default port 18515, see :mod:`softrdma.tools.perftest_oob` for every record and which
side sends first) and its output table, so that Debian 12's ib_send_bw, ib_write_bw,
ib_read_bw, ib_atomic_bw and the _lat tools can be either peer. Between two softrdma
processes it is softrdma's benchmark tool; ``--check`` (on both sides) verifies the data.

Differences from perftest, all deliberate:

- ``-x`` (GID index) defaults to 1, the IPv4/IPv6 address of the soft device (perftest
  picks one itself on RoCE); the local address is ``--addr`` (perftest's ``-a`` is "all
  sizes" and keeps that meaning here), or ``-d softrdma-<IP>``.
- ``-R`` (rdma_cm) is refused: softrdma has no RDMA CM yet.
- ``-q`` (several QPs) is for the BW tests, as in perftest; ``-D`` too.
- ``-F`` is accepted and ignored (there is no CPU frequency to check).
- The client retries the TCP connection for 5 s (perftest tries once), so both sides can be
  started together.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import select
import struct
import time
from typing import Any

from ..enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE, IBV_QPT_RC, IBV_SEND_INLINE, IBV_SEND_SIGNALED,
    IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
    IBV_WR_SEND, mtu_to_bytes, wc_status_str,
)
from ..verbs_api import (
    CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR,
)
from .argtypes import c_int, int_range, ip_address, perftest_size
from .common import ToolError, open_device, resolve, tcp_connect, tcp_listen
from .perftest_oob import BwReport, Dest, PerftestComm

__all__ = ["add_parser", "run", "pattern"]

# perftest_parameters.h
DEF_PORT = 18515
DEF_SIZE_BW = 65536
DEF_SIZE_LAT = 2
DEF_SIZE_ATOMIC = 8
DEF_ITERS = 1000
DEF_ITERS_WB = 5000
DEF_TX_BW = 128
DEF_TX_LAT = 1
DEF_RX_SEND = 512
DEF_CQ_MOD = 100
DEF_QP_TIME = 14
MIN_ITER = 5
MAX_ITER = 100000000
MIN_TX, MAX_TX = 1, 15000
MIN_RX, MAX_RX = 1, 16384
MIN_GID_IX, MAX_GID_IX = 0, 64
MIN_QP_NUM, MAX_QP_NUM = 1, 16384
MIN_CQ_MOD, MAX_CQ_MOD = 1, 1024
MAX_INLINE = 1024
MIN_IB_PORT = 1
MAX_SL = 15
DEF_RX_RDMA = 1
MAX_SIZE = 8388608
MSG_SIZE_CQ_MOD_LIMIT = 8192
DEF_INLINE_WRITE = 220
DEF_INLINE_SEND_RC_UC = 236
MIN_RNR_TIMER = 12
DEF_HOP_LIMIT = 64
LAT_MEASURE_TAIL = 2
RESULT_LINE = "-" * 87
RESULT_FMT = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
RESULT_FMT_G = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
RESULT_FMT_LAT = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    "
                  "t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ")
TESTS = {"send": "Send", "write": "RDMA_Write", "read": "RDMA_Read", "atomic": "Atomic"}

# plain ints for the hot loops (IntFlag arithmetic is slow)
SIGNALED = int(IBV_SEND_SIGNALED)
INLINE = int(IBV_SEND_INLINE)
OPCODES = {"send": int(IBV_WR_SEND), "write": int(IBV_WR_RDMA_WRITE),
           "read": int(IBV_WR_RDMA_READ)}

_P = bytes((i * 7 + 3) & 0xFF for i in range(251))  # a prime period: misplaced data shows


def pattern(n: int, start: int = 0) -> bytes:
    """The check pattern: byte ``k`` of a region is ``_P[k % 251]``; ``n`` bytes from ``start``."""
    s = start % 251
    return (_P * ((s + n) // 251 + 1))[s:s + n]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "perf", help="perftest's ib_{send,write,read,atomic}_{bw,lat}",
        description="Bandwidth (default) or latency (--lat) of SEND, RDMA WRITE, RDMA READ or "
                    "atomics over RC, compatible with perftest 4.5's ib_*_bw and ib_*_lat in both "
                    "roles (same options, exchange and output). Without SERVER, wait for a "
                    "client.")
    p.add_argument("verb", choices=["send", "write", "read", "atomic"])
    p.add_argument("servername", nargs="?", help="connect to this server (else: be the server)")
    p.add_argument("--lat", action="store_true", help="latency test (ib_*_lat), not bandwidth")
    # perftest's parser (perftest_parameters.c, CHECK_VALUE_IN_RANGE and friends) checks
    # these while parsing: a usage error (status 1 there, 2 here like any usage error)

    def rng(lo: int, hi: int | None, name: str) -> Any:
        return int_range(lo, hi, f"{name} should be between {{lo}} and {{hi}} (got {{v}})")

    p.add_argument("-p", "--port", type=int_range(1, 65535), default=DEF_PORT,
                   help=f"listen on/connect to port (default {DEF_PORT})")
    p.add_argument("-d", "--ib-dev", help="use this device (softrdma-<IP>)")
    p.add_argument("--addr", type=ip_address,
                   help="local IP address for the soft device (perftest has none; its -a is "
                        "--all)")
    p.add_argument("-i", "--ib-port", default=1, help="port of the device (1)",
                   type=int_range(MIN_IB_PORT, 255, "IB Port can't be less than {lo} (got {v})"))
    p.add_argument("-s", "--size", type=perftest_size,
                   help=f"message size (bw {DEF_SIZE_BW}, lat {DEF_SIZE_LAT}, atomic 8 only)")
    p.add_argument("-n", "--iters", type=rng(MIN_ITER, MAX_ITER, "Iteration num"),
                   help=f"exchanges, at least {MIN_ITER} (write bw {DEF_ITERS_WB}, else {DEF_ITERS})")
    p.add_argument("-D", "--duration", help="BW tests: run for this many seconds",
                   type=int_range(1, None, "Duration period must be positive (got {v})"))
    p.add_argument("-m", "--mtu", type=c_int, default=0, help="path MTU 256..4096 (port MTU)")
    p.add_argument("-x", "--gid-index", type=rng(MIN_GID_IX, MAX_GID_IX, "Gid index"), default=1,
                   help="GID index (default 1: the device's IP address)")
    p.add_argument("-F", "--CPU-freq", action="store_true", help="ignored (perftest compatibility)")
    p.add_argument("-a", "--all", action="store_true", help="run sizes 2 .. 2^23")
    p.add_argument("-t", "--tx-depth", type=rng(MIN_TX, MAX_TX, "Tx depth"),
                   help=f"send queue depth (bw {DEF_TX_BW}, lat 1)")
    p.add_argument("-r", "--rx-depth", type=rng(MIN_RX, MAX_RX, "Rx depth"),
                   help=f"send: receives posted ({DEF_RX_SEND})")
    p.add_argument("-q", "--qp", type=rng(MIN_QP_NUM, MAX_QP_NUM, "num of Qps"), default=1,
                   help="BW tests: number of QPs (1)")
    p.add_argument("-Q", "--cq-mod", type=rng(MIN_CQ_MOD, MAX_CQ_MOD, "CQ moderation"),
                   help=f"a completion every N sends ({DEF_CQ_MOD})")
    p.add_argument("-I", "--inline_size", type=rng(0, MAX_INLINE, "Max inline"),
                   help="max size sent inline")
    p.add_argument("-A", "--atomic_type", choices=["CMP_AND_SWAP", "FETCH_AND_ADD"],
                   help="atomic: operation (FETCH_AND_ADD)")
    p.add_argument("-o", "--outs", type=c_int, help="read/atomic: outstanding (device max)")
    p.add_argument("-u", "--qp-timeout", type=int_range(0, 31), default=DEF_QP_TIME,
                   help="QP timeout 0..31 (14)")
    p.add_argument("-S", "--sl", type=int_range(0, MAX_SL, f"Only {MAX_SL + 1} Service levels "
                                                "(got {v})"), default=0,
                   help="service level (0)")
    p.add_argument("-N", "--noPeak", action="store_true", help="BW tests: no peak BW")
    p.add_argument("--report_gbits", action="store_true", help="BW in Gb/s, not MB/s")
    p.add_argument("-R", "--rdma_cm", action="store_true", help="rdma_cm: not supported yet")
    p.add_argument("--check", action="store_true",
                   help="verify the data (softrdma on both sides, both with --check)")
    p.add_argument("--counters", action="store_true", help="print the device's counters")
    p.set_defaults(func=run)


# -- helpers --------------------------------------------------------------------------------

def cx(v: int, width: int) -> str:
    """C's ``%#0<width>x``: "0x" and zero padding to ``width``, except 0 which has no "0x"."""
    if v == 0:
        return "0" * width
    return "0x" + format(v, "x").rjust(width - 2, "0")


def _cache_line_size() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index0/coherency_line_size") as f:
            n = int(f.read().strip())
            return n if n > 0 else 64
    except (OSError, ValueError):
        return 64


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4096


def inc(size: int, cache_line: int) -> int:
    """perftest's INC(): a message's slot in the cycle buffer, rounded up to a cache line."""
    return (size + cache_line - 1) // cache_line * cache_line


def compute_peak(tposted: list[float], tcompleted: list[float], n: int, cq_mod: int) -> float:
    """print_report_bw's peak: the shortest time per message over any run of messages
    i..j ending at a completion. Exact up to ~200k steps, sampled beyond."""
    if n <= 0:
        return 0.0
    best = tcompleted[n - 1] - tposted[0]
    best /= n
    steps = n * max(1, n // cq_mod)
    stride = max(1, int(steps // 200_000))
    for i in range(0, n, stride):
        j = ((i + 1 + cq_mod - 1) // cq_mod) * cq_mod - 1
        ti = tposted[i]
        while j < n:
            t = (tcompleted[j] - ti) / (j - i + 1)
            if t < best:
                best = t
            j += cq_mod * stride
        if n % cq_mod:
            t = (tcompleted[n - 1] - ti) / (n - i)
            if t < best:
                best = t
    return best


# -- the test ----------------------------------------------------------------------------------

class Perf:
    """Resources and runs of one perftest-style test, either role."""

    def __init__(self, a: argparse.Namespace, dev: Any, server: bool) -> None:
        self.a = a
        self.dev = dev
        self.server = server
        self.verb = a.verb
        self.lat = a.lat
        self.tcp: Any = None
        self.comm: PerftestComm | None = None
        self.watch_tcp = True
        self.eof_ok = a.lat and a.verb == "write"  # write_lat.c ends without a handshake
        self.peer_gone = 0.0
        self.ctx = Context(name=dev.name)
        self.pd = PD(self.ctx)
        self.mr: MR | None = None
        self.qps: list[QP] = []
        # initial PSNs: rdma-core seeds lrand48 with getpid() * time(NULL), which anyone
        # who knows roughly when the tool started can reproduce; ours come from the OS
        self.rng = random.SystemRandom()
        self.check_msgs: list[str] = []

    # -- I/O while waiting ---------------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for an RDMA packet, a due timer or the TCP peer; handle the
        RDMA side. Used by the exchange while it waits for the peer."""
        dev = self.dev
        fds = [dev.udp.fileno()]
        if self.tcp is not None:
            fds.append(self.tcp.fileno())
        dl = dev.next_deadline()
        if dl is not None:
            timeout = max(0.0, min(timeout, dl - time.monotonic()))
        select.select(fds, [], [], timeout)
        self._service()

    def _service(self) -> None:
        """Deliver what arrived and fire due timers (the device's manual-mode poll, minus its
        own select: ours just said whether anything is there)."""
        dev = self.dev
        with dev.lock:
            dev.udp.receive_ready()
            dev.fire_timers(time.monotonic())

    def idle(self, timeout: float = 0.05) -> None:
        """Nothing to do in a run loop: wait for the device; notice a peer that went away."""
        dev = self.dev
        fds = [dev.udp.fileno()]
        tcp = self.tcp if self.watch_tcp else None
        if tcp is not None:
            fds.append(tcp.fileno())
        dl = dev.next_deadline()
        if dl is not None:
            timeout = max(0.0, min(timeout, dl - time.monotonic()))
        r = select.select(fds, [], [], timeout)[0]
        if tcp is not None and tcp.fileno() in r:
            try:
                data = tcp.recv(1, 0x2)  # MSG_PEEK
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"" and not self.eof_ok:
                raise ToolError("the peer closed the connection during the test")
            if data == b"":
                self.peer_gone = time.monotonic()  # write_lat: the peer may finish first
            self.watch_tcp = False  # the peer is ahead of us (its next handshake): fine
        if self.peer_gone and time.monotonic() - self.peer_gone > 5:
            raise ToolError("the peer closed the connection and the test did not complete")
        self._service()

    # -- setup -----------------------------------------------------------------------------------
    def setup(self, size: int, buff: int, cycle_buffer: int, cache_line: int, curr_mtu: int,
              out_reads: int) -> list[Dest]:
        a = self.a
        self.size = size
        self.buff = buff
        self.cycle_buffer = cycle_buffer
        self.cache_line = cache_line
        self.curr_mtu = curr_mtu
        self.out_reads = out_reads
        nq = a.qp
        access = int(IBV_ACCESS_LOCAL_WRITE)
        if self.verb == "write":
            access |= int(IBV_ACCESS_REMOTE_WRITE)
        elif self.verb == "read":
            access |= int(IBV_ACCESS_REMOTE_READ)
        elif self.verb == "atomic":
            access |= int(IBV_ACCESS_REMOTE_ATOMIC)
        # perftest's layout: [local buffers of every QP][remote-accessible buffers of every QP]
        total = 2 * nq * buff
        self.mr = MR(self.pd, total, access)
        mem = self.mr.mem
        local_fill = pattern(buff) if self.verb in ("write", "send") else None
        remote_fill = pattern(buff) if self.verb == "read" else None
        for i in range(nq):
            if local_fill:
                mem[i * buff:(i + 1) * buff] = local_fill
            if remote_fill:
                mem[(nq + i) * buff:(nq + i + 1) * buff] = remote_fill
        self.scq = CQ(self.ctx, max(a.tx_depth * nq, 1) + 16, None, None, 0)
        self.rcq = CQ(self.ctx, max(a.rx_depth * nq, 1) + 16, None, None, 0)
        cap = QPCap(max_send_wr=max(a.tx_depth, 1), max_recv_wr=max(a.rx_depth, 1),
                    max_send_sge=1, max_recv_sge=1,
                    max_inline_data=max(0, min(a.inline_size, self.dev.limits.max_inline_data)))
        qp_access = int(IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE |
                        IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)
        gid = self.ctx.query_gid(a.ib_port, a.gid_index).raw
        self.gid = gid
        dests = []
        for i in range(nq):
            qp = QP(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self.scq, rcq=self.rcq,
                                        cap=QPCap(**cap.__dict__), sq_sig_all=0))
            qp.to_init(QPAttr(pkey_index=0, port_num=a.ib_port, qp_access_flags=qp_access))
            self.qps.append(qp)
            dests.append(Dest(lid=0, out_reads=out_reads, qpn=qp.qp_num,
                              psn=self.rng.getrandbits(24), rkey=self.mr.rkey,
                              vaddr=self.mr.buf + (nq + i) * buff, gid=gid, srqn=0))
        self.my = dests
        return dests

    def connect(self, rem: list[Dest]) -> None:
        a = self.a
        mine_v4 = self.gid[:12] == bytes(10) + b"\xff\xff"
        if mine_v4 != (rem[0].gid[:12] == bytes(10) + b"\xff\xff"):
            raise ToolError("Found Incompatibility issue with GID types: the peer's GID is "
                            "IPv4-mapped and ours is not (or the reverse); use the same IP version")
        self.rem = rem
        rdma_rd = self.verb in ("read", "atomic")
        for qp, my, r in zip(self.qps, self.my, rem):
            gr = GlobalRoute(dgid=r.gid, sgid_index=a.gid_index, hop_limit=DEF_HOP_LIMIT)
            at = QPAttr(port_num=a.ib_port)
            at.path_mtu = self.curr_mtu
            at.dest_qp_num, at.rq_psn = r.qpn, r.psn
            at.max_dest_rd_atomic = my.out_reads if rdma_rd else 1
            at.min_rnr_timer = MIN_RNR_TIMER
            at.ah_attr = AHAttr(dlid=r.lid, sl=a.sl, port_num=a.ib_port, is_global=1, gr=gr)
            at.sq_psn, at.timeout, at.retry_cnt, at.rnr_retry = my.psn, a.qp_timeout, 7, 7
            at.max_rd_atomic = max(1, min(r.out_reads, self.dev.limits.max_qp_rd_atom)) \
                if rdma_rd else 1
            qp.to_rtr(at)
            qp.to_rts(at)

    # -- printing ----------------------------------------------------------------------------------
    def print_test_info(self) -> None:
        a = self.a
        title = f"{TESTS[self.verb]} "
        if self.verb == "atomic":
            title += f"{a.atomic_type} "
        title += "Latency " if self.lat else "BW "
        lines = [RESULT_LINE, "                    " + title + "Test",
                 f" Dual-port       : OFF\t\tDevice         : {self.dev.name}",
                 f" Number of qps   : {a.qp}\t\tTransport type : IB",
                 " Connection type : RC\t\tUsing SRQ      : OFF",
                 " PCIe relax order: ON",
                 " ibv_wr* API     : OFF"]
        if not self.server:
            lines.append(f" TX depth        : {a.tx_depth}")
        if self.verb == "send" and self.server:
            lines.append(f" RX depth        : {a.rx_depth}")
        if not self.lat:
            lines.append(f" CQ Moderation   : {a.cq_mod}")
        lines += [f" Mtu             : {mtu_to_bytes(self.curr_mtu)}[B]",
                  " Link type       : Ethernet",
                  f" GID index       : {a.gid_index}"]
        if self.verb in ("read", "atomic"):
            lines.append(f" Outstand reads  : {self.out_reads}")
        else:
            lines.append(f" Max inline data : {a.inline_size}[B]")
        lines += [" rdma_cm QPs\t : OFF", " Data ex. method : Ethernet", RESULT_LINE]
        print("\n".join(lines))

    def print_dest(self, d: Dest, side: str) -> None:
        s = f" {side} address: LID {cx(d.lid, 4)} QPN {cx(d.qpn, 6)} PSN {cx(d.psn, 6)}"
        if self.verb == "read":
            s += f" OUT {cx(d.out_reads, 4)}"
        if self.verb in ("read", "write"):
            s += f" RKey {cx(d.rkey, 8)} VAddr {cx(d.vaddr, 16)}"
        print(s)
        print(" GID: " + ":".join(f"{b:02d}" for b in d.gid))

    def print_bw_header(self) -> None:
        print(RESULT_LINE)
        print(RESULT_FMT_G if self.a.report_gbits else RESULT_FMT)

    def print_bw_report(self, r: BwReport) -> None:
        gbs = self.a.report_gbits
        if gbs and r.bw_avg < 0.1:
            print(f" {r.size:<7d}    {r.iters:<d}           {r.bw_peak:<7.6f}            "
                  f"{r.bw_avg:<7.6f}            {r.msg_rate:<7.6f}")
        else:
            print(f" {r.size:<7d}    {r.iters:<10d}       {r.bw_peak:<7.2f}            "
                  f"{r.bw_avg:<7.2f}\t\t   {r.msg_rate:<7.6f}")

    def bw_report(self, size: int, n: int, tposted: list[float], tcompleted: list[float],
                  cq_mod: int, no_peak: bool, t_total: float | None = None) -> BwReport:
        """print_report_bw: MB/s are MiB (0x100000) per second, Gb/s 10^9 bits."""
        factor = 125000000 if self.a.report_gbits else 0x100000
        if t_total is None:
            t_total = (tcompleted[n - 1] - tposted[0]) if n else 0.0
        t_total = max(t_total, 1e-9)
        bw_avg = size * n / t_total / factor
        rate = n / t_total / 1e6
        peak = 0.0
        if not no_peak and n:
            opt = compute_peak(tposted, tcompleted, n, cq_mod)
            peak = size / max(opt, 1e-12) / factor
        return BwReport(size, n, peak, bw_avg, rate)

    def print_lat_header(self) -> None:
        print(RESULT_LINE)
        print(RESULT_FMT_LAT)

    def print_lat_report(self, size: int, iters: int, tposted: list[float]) -> None:
        """print_report_lat: the gaps between consecutive posts, / 2 for ping-pongs."""
        rtt = 1 if self.verb in ("read", "atomic") else 2
        cnt = iters - 1
        delta = sorted((tposted[i + 1] - tposted[i]) * 1e6 / rtt for i in range(cnt))
        cnt -= LAT_MEASURE_TAIL
        if cnt < 1:
            cnt = 1
        median = (delta[cnt // 2] + delta[cnt // 2 - 1]) / 2 if (cnt - 1) % 2 else delta[cnt // 2]
        avg = sum(delta[:cnt]) / cnt
        stdev = math.sqrt(sum((avg - d) ** 2 for d in delta[:cnt]) / cnt)
        i99 = min(math.ceil(cnt * 0.99), len(delta) - 1)
        i999 = min(math.ceil(cnt * 0.999), len(delta) - 1)
        tmax = delta[min(cnt, len(delta) - 1)]
        print(f" {size:<7d} {iters:d}          {delta[0]:<7.2f}        {tmax:<7.2f}      "
              f"{median:<7.2f}  \t       {avg:<7.2f}     \t{stdev:<7.2f}\t\t{delta[i99]:<7.2f} "
              f"\t\t{delta[i999]:<7.2f}")

    # -- completions -----------------------------------------------------------------------------
    def _bad(self, wc: Any, where: str) -> ToolError:
        return ToolError(f"Completion with error at {where}: Failed status "
                         f"{wc_status_str(wc.status)} ({wc.status}) for wr_id {wc.wr_id}")

    def _wait_one(self, cq: Any) -> Any:
        """The next completion of ``cq``, making progress while there is none."""
        while True:
            n, wcs = cq.poll(1)
            if n:
                wc = wcs[0]
                if wc.status:
                    raise self._bad(wc, "client" if not self.server else "server")
                return wc
            self.idle()

    def wait_send(self) -> Any:
        return self._wait_one(self.scq)

    def wait_recv(self) -> Any:
        return self._wait_one(self.rcq)

    # -- address cycling (increase_rem_addr / increase_loc_addr) ---------------------------------
    def slots(self, size: int) -> tuple[int, int]:
        """(slot size, slots) a size cycles through; 1 slot when it does not cycle."""
        if size <= self.cycle_buffer // 2:
            step = inc(size, self.cache_line)
            return step, max(1, self.cycle_buffer // step)
        return 0, 1

    # -- BW: the client --------------------------------------------------------------------------
    def run_bw_client(self, size: int, iters: int, duration: float | None) -> BwReport:
        a = self.a
        self.watch_tcp = True
        nq = len(self.qps)
        buff = self.buff
        mr = self.mr
        lkey = mr.lkey
        base = mr.buf
        tx_depth = a.tx_depth
        cq_mod = a.cq_mod
        step, nslots = self.slots(size)
        verb = self.verb
        check = a.check
        flags_base = INLINE if (size <= a.inline_size and verb in ("send", "write")) else 0
        wrs = []
        for q in range(nq):
            sge = SGE(base + q * buff, size, lkey)
            if verb == "atomic":
                op = int(IBV_WR_ATOMIC_FETCH_AND_ADD) if a.atomic_type == "FETCH_AND_ADD" \
                    else int(IBV_WR_ATOMIC_CMP_AND_SWP)
                wr = SendWR(wr_id=q, opcode=op, sg=[sge], send_flags=0)
                wr.set_wr_atomic(self.rem[q].rkey, self.rem[q].vaddr,
                                 1 if op == IBV_WR_ATOMIC_FETCH_AND_ADD else 0, 0)
            else:
                wr = SendWR(wr_id=q, opcode=OPCODES[verb], sg=[sge], send_flags=0)
                if verb != "send":
                    wr.set_wr_rdma(self.rem[q].rkey, self.rem[q].vaddr)
            wrs.append(wr)
        cas_check = verb == "atomic" and a.atomic_type == "CMP_AND_SWAP" and check
        scnt = [0] * nq
        ccnt = [0] * nq
        total = iters * nq
        timed = duration is None
        tposted = [0.0] * total if timed else []
        tcompleted = [0.0] * total if timed else []
        tot_s = tot_c = 0
        clock = time.perf_counter
        end = 0.0 if timed else clock() + duration
        start = clock()
        qps = self.qps
        scq = self.scq
        rems = [(self.rem[q].vaddr, base + q * buff) for q in range(nq)]
        limit = iters if timed else 1 << 62
        mask = (1 << 40) - 1
        while True:
            posted = False
            for q in range(nq):
                wr = wrs[q]
                qp = qps[q]
                sge = wr.sg_list[0]
                rem_base, loc_base = rems[q]
                k = scnt[q]
                while k < limit and k - ccnt[q] < tx_depth:
                    sig = (k % cq_mod == cq_mod - 1) or k == iters - 1
                    wr.send_flags = flags_base | SIGNALED if sig else flags_base
                    wr.wr_id = (q << 40) | k
                    off = (k % nslots) * step
                    sge.addr = loc_base + off
                    if verb != "send":
                        wr.remote_addr = rem_base + off
                    if cas_check:
                        wr.compare_add = k // nslots
                        wr.swap = k // nslots + 1
                    if timed:
                        tposted[tot_s] = clock()
                    qp.post_send(wr)
                    k += 1
                    tot_s += 1
                    posted = True
                scnt[q] = k
            n, wcs = scq.poll(64)
            if n:
                now = clock()
                for wc in wcs:
                    if wc.status:
                        raise self._bad(wc, "client")
                    q = wc.wr_id >> 40
                    k = (wc.wr_id & mask) + 1
                    tot_c += k - ccnt[q]
                    ccnt[q] = k
                    if timed:
                        tcompleted[tot_c - 1] = now
            if timed:
                if tot_c >= total:
                    break
            elif clock() >= end:
                # -D: stop posting; wait until every WR is acked (the unsignaled tail too)
                self._drain()
                tot_c = tot_s
                break
            if not n and not posted:
                self.idle(0.05)
        t_end = clock()
        self.last_loc = (step, nslots, min(max(scnt), nslots))
        if timed:
            return self.bw_report(size, total, tposted, tcompleted, cq_mod, a.noPeak)
        return self.bw_report(size, tot_c, [], [], cq_mod, True, t_end - start)

    def _drain(self) -> None:
        """Duration mode's end: wait until every QP's send queue is empty (all acked)."""
        deadline = time.monotonic() + 30
        while any(len(qp.sq) for qp in self.qps):
            if time.monotonic() > deadline:
                raise ToolError("the last work requests did not complete in 30 s")
            self.idle(0.01)

    # -- BW: the send server ---------------------------------------------------------------------
    def post_recvs(self, size: int, iters: int) -> None:
        """ctx_set_recv_wqes: min(rx_depth, iters) receives per QP, at cycling offsets."""
        nq = len(self.qps)
        self.rposted = [0] * nq
        self.rsize = size
        n = min(self.a.rx_depth, iters) if iters else self.a.rx_depth
        for q in range(nq):
            for _ in range(n):
                self._post_one_recv(q, size)

    def _post_one_recv(self, q: int, size: int) -> None:
        step, nslots = self.slots(size)
        k = self.rposted[q]
        addr = self.mr.buf + (len(self.qps) + q) * self.buff + (k % nslots) * step
        self.qps[q].post_recv(RecvWR(q, sg=[SGE(addr, size, self.mr.lkey)]))
        self.rposted[q] = k + 1

    def run_bw_server_send(self, size: int, iters: int, duration: bool) -> BwReport:
        self.watch_tcp = True
        nq = len(self.qps)
        total = iters * nq
        rcnt = 0
        per_q = [0] * nq
        t_first = t_last = 0.0
        clock = time.perf_counter
        rcq = self.rcq
        bad_len = 0
        while duration or rcnt < total:
            n, wcs = rcq.poll(64)
            if n:
                now = clock()
                for wc in wcs:
                    if wc.status:
                        raise self._bad(wc, "server")
                    q = wc.wr_id
                    if wc.byte_len != size:
                        bad_len += 1
                    if rcnt == 0:
                        t_first = now
                    rcnt += 1
                    per_q[q] += 1
                    if duration or self.rposted[q] < iters:
                        self._post_one_recv(q, size)
                t_last = now
                continue
            if duration:
                # the client's closing handshake is the end of the run
                if select.select([self.tcp], [], [], 0)[0]:
                    break
            self.idle(0.05)
        if bad_len:
            raise ToolError(f"data check failed: {bad_len} messages were not {size} bytes")
        self.received = per_q
        t = t_last - t_first if rcnt > 1 else 0.0
        return self.bw_report(size, rcnt, [], [], 1, True, t)

    # -- latency -----------------------------------------------------------------------------------
    def run_lat_write(self, size: int, iters: int) -> list[float]:
        """run_iter_lat_write: the server writes first; each side waits for the last byte of
        its buffer to hold the count of writes received, then writes its own count."""
        self.watch_tcp = True
        a = self.a
        mem = self.mr.mem
        qp = self.qps[0]
        base = self.mr.buf
        post_off = size - 1
        poll_off = self.buff + size - 1
        flags = SIGNALED | (INLINE if size <= a.inline_size else 0)
        wr = SendWR(wr_id=0, opcode=int(IBV_WR_RDMA_WRITE), sg=[SGE(base, size, self.mr.lkey)],
                    send_flags=flags)
        wr.set_wr_rdma(self.rem[0].rkey, self.rem[0].vaddr)
        tposted = [0.0] * iters
        scnt = ccnt = rcnt = 0
        clock = time.perf_counter
        server = self.server
        while scnt < iters or ccnt < iters or rcnt < iters:
            if rcnt < iters and not (scnt < 1 and server):
                rcnt += 1
                want = rcnt & 0xFF
                while mem[poll_off] != want:
                    self.idle(0.05)
            if scnt < iters:
                tposted[scnt] = clock()
                scnt += 1
                mem[post_off] = scnt & 0xFF
                qp.post_send(wr)
            if ccnt < iters:
                self.wait_send()
                ccnt += 1
        if a.check:
            got = bytes(mem[self.buff:self.buff + size - 1])
            if got != pattern(size - 1):
                raise ToolError(f"data check failed: the {size}-byte writes received differ from "
                                f"the pattern")
            self.check_msgs.append(f"{iters} x {size} B writes received intact")
        return tposted

    def run_lat_send(self, size: int, iters: int) -> list[float]:
        """run_iter_lat_send: the client sends first; each side answers every receive."""
        self.watch_tcp = True
        a = self.a
        qp = self.qps[0]
        flags = SIGNALED | (INLINE if size <= a.inline_size else 0)
        wr = SendWR(wr_id=0, opcode=int(IBV_WR_SEND), sg=[SGE(self.mr.buf, size, self.mr.lkey)],
                    send_flags=flags)
        tposted = [0.0] * iters
        scnt = rcnt = 0
        clock = time.perf_counter
        client = not self.server
        rsge = SGE(self.mr.buf + self.buff, self.buff, self.mr.lkey)
        bad = 0
        while scnt < iters or rcnt < iters:
            if rcnt < iters and not (scnt < 1 and client):
                wc = self.wait_recv()
                rcnt += 1
                if wc.byte_len != size:
                    bad += 1
                repost = self.recv_left > 0
            else:
                repost = False
            posted = scnt < iters
            if posted:
                tposted[scnt] = clock()
                scnt += 1
                qp.post_send(wr)
            if repost:  # after the send: off the critical path (rx_depth are posted anyway)
                qp.post_recv(RecvWR(1, sg=[rsge]))
                self.recv_left -= 1
            if posted:
                self.wait_send()
        if bad:
            raise ToolError(f"data check failed: {bad} messages were not {size} bytes")
        if a.check:
            got = bytes(self.mr.mem[self.buff:self.buff + size])
            if got != pattern(size):
                raise ToolError("data check failed: the messages received differ from the pattern")
            self.check_msgs.append(f"{iters} x {size} B messages received intact")
        return tposted

    def run_lat_read(self, size: int, iters: int) -> list[float]:
        """run_iter_lat (read/atomic): post one, wait for its completion, again."""
        self.watch_tcp = True
        a = self.a
        qp = self.qps[0]
        if self.verb == "atomic":
            fa = a.atomic_type == "FETCH_AND_ADD"
            wr = SendWR(wr_id=0, opcode=int(IBV_WR_ATOMIC_FETCH_AND_ADD if fa
                                             else IBV_WR_ATOMIC_CMP_AND_SWP),
                        sg=[SGE(self.mr.buf, 8, self.mr.lkey)], send_flags=SIGNALED)
            wr.set_wr_atomic(self.rem[0].rkey, self.rem[0].vaddr, 1 if fa else 0, 0)
        else:
            wr = SendWR(wr_id=0, opcode=int(IBV_WR_RDMA_READ),
                        sg=[SGE(self.mr.buf, size, self.mr.lkey)], send_flags=SIGNALED)
            wr.set_wr_rdma(self.rem[0].rkey, self.rem[0].vaddr)
        tposted = [0.0] * iters
        clock = time.perf_counter
        cas = self.verb == "atomic" and a.atomic_type == "CMP_AND_SWAP" and a.check
        for k in range(iters):
            if cas:
                wr.compare_add, wr.swap = k, k + 1
            tposted[k] = clock()
            qp.post_send(wr)
            self.wait_send()
        if a.check and self.verb == "read":
            if bytes(self.mr.mem[0:size]) != pattern(size):
                raise ToolError("data check failed: the data read differs from the server's "
                                "pattern")
            self.check_msgs.append(f"{iters} x {size} B reads returned the server's data")
        return tposted

    # -- checks after a BW run ----------------------------------------------------------------------
    def check_remote_region(self, size: int, iters: int) -> None:
        """The server's check of what the client wrote, sent or added (sizes from the report)."""
        nq = len(self.qps)
        mem = self.mr.mem
        step, nslots = self.slots(size)
        if self.verb == "atomic":
            total = 0
            for q in range(nq):
                base = (nq + q) * self.buff
                for k in range(nslots if step else 1):
                    off = base + k * step
                    total += struct.unpack_from("<Q", mem, off)[0]
            if total != iters:
                raise ToolError(f"data check failed: the {iters} atomics left a total of {total} "
                                f"in the target slots, not {iters}")
            self.check_msgs.append(f"{iters} atomics: the counters add up to {total}")
            return
        used = min(iters // max(nq, 1), nslots) if step else 1
        if self.verb == "send":
            used = min(max(self.received) if getattr(self, "received", None) else 0, nslots) \
                if step else 1
        for q in range(nq):
            base = (nq + q) * self.buff
            for k in range(used):
                off = k * step
                if bytes(mem[base + off:base + off + size]) != pattern(size, off):
                    raise ToolError(f"data check failed: QP {q}, message slot {k} (offset {off}) "
                                    f"does not hold the {size} bytes sent")
        what = "written" if self.verb == "write" else "received"
        self.check_msgs.append(f"{iters} x {size} B {what}, every byte as sent")

    def check_read_data(self, size: int) -> None:
        step, nslots = self.slots(size)
        used = self.last_loc[2] if step else 1
        mem = self.mr.mem
        for q in range(len(self.qps)):
            base = q * self.buff
            for k in range(used):
                off = k * step
                if bytes(mem[base + off:base + off + size]) != pattern(size, off):
                    raise ToolError(f"data check failed: QP {q}, read slot {k} (offset {off}) "
                                    f"does not hold the server's data")
        self.check_msgs.append(f"{size} B reads returned the server's data")

    def print_checks(self) -> None:
        for m in self.check_msgs:
            print(f" Data check      : OK, {m}")

    def close(self) -> None:
        self.ctx.close()


# -- the command ---------------------------------------------------------------------------------

def _set_mtu(dev: Any, user_mtu: int) -> int:
    """perftest's set_mtu: the port's active MTU, or the user's (not above the port's)."""
    active = int(dev.active_mtu)
    if not user_mtu:
        return active
    table = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
    if user_mtu not in table:
        print(f" Invalid MTU - {user_mtu} ")
        print(" Please choose mtu from {256,512,1024,2048,4096}")
        print(f" Will run with the port active mtu - {active}")
        return active
    m = table[user_mtu]
    if m > active:
        print("Requested mtu is higher than active mtu ")
        print(f"Changing to active mtu - {active}")
        m = active
    return m


def _defaults(a: argparse.Namespace) -> None:
    """init_perftest_params and force_dependecies."""
    if a.rdma_cm:
        raise ToolError("-R (rdma_cm) is not supported yet: softrdma has no RDMA CM; run both "
                        "sides without -R (the Ethernet exchange)")
    if a.lat and (a.qp != 1):
        raise ToolError("-q is for the BW tests (latency tests use one QP)")
    if a.lat and a.duration:
        raise ToolError("-D is supported for the BW tests only")
    # perftest's checks of options that depend on the test (its parser, force_dependecies)
    if a.inline_size is not None and a.verb in ("read", "atomic"):
        raise ToolError("Inline feature not available on READ/Atomic verbs")
    if a.outs is not None and a.verb not in ("read", "atomic"):
        raise ToolError("Setting Outstanding reads only available on READ verb")
    if a.rx_depth is not None and a.verb != "send" and a.rx_depth > DEF_RX_RDMA:
        raise ToolError("On RDMA verbs rx depth can be only 1")
    if a.atomic_type is not None and a.verb != "atomic":
        raise ToolError("You are not running the atomic_lat/bw test! To change the atomic "
                        "action type, you must run one of the atomic tests")
    if a.atomic_type is None:
        a.atomic_type = "FETCH_AND_ADD"
    if a.duration and a.all:
        raise ToolError("Duration mode currently doesn't support running on all sizes.")
    if a.verb == "atomic":
        if a.size is not None and a.size != DEF_SIZE_ATOMIC:
            raise ToolError("Message size cannot be changed for Atomic tests ")
        if a.all:
            raise ToolError("-a is not available for the atomic tests (8-byte messages only)")
        a.size = DEF_SIZE_ATOMIC
    if a.size is None:
        a.size = DEF_SIZE_LAT if a.lat else DEF_SIZE_BW
    if not 1 <= a.size <= MAX_SIZE:
        raise ToolError(f" Message Size should be between 1 and {MAX_SIZE}")
    if a.iters is None:
        a.iters = DEF_ITERS_WB if (a.verb == "write" and not a.lat) else DEF_ITERS
    if a.tx_depth is None:
        a.tx_depth = DEF_TX_LAT if a.lat else DEF_TX_BW
    if a.rx_depth is None:
        a.rx_depth = DEF_RX_SEND if a.verb == "send" else 1
    req_cq_mod = a.cq_mod is not None
    if a.cq_mod is None:
        a.cq_mod = DEF_CQ_MOD
    if not a.duration:
        a.tx_depth = min(a.tx_depth, a.iters)
        if a.verb == "send":
            a.rx_depth = min(a.rx_depth, a.iters)
    if a.size > MSG_SIZE_CQ_MOD_LIMIT and not a.all and not req_cq_mod:
        a.cq_mod = 1
    a.cq_mod = max(1, min(a.cq_mod, a.tx_depth))
    if a.inline_size is None:
        if a.lat and a.verb == "write":
            a.inline_size = DEF_INLINE_WRITE
        elif a.lat and a.verb == "send":
            a.inline_size = DEF_INLINE_SEND_RC_UC
        else:
            a.inline_size = 0
    if a.verb in ("read", "atomic"):
        a.inline_size = 0
    if a.all:
        a.size = MAX_SIZE


def _check_device(a: argparse.Namespace, dev: Any) -> None:
    """What perftest learns from the device before it connects (the port, the GID)."""
    if a.ib_port != 1:
        raise ToolError(f"Unable to query port {a.ib_port}: the device has port 1 only")
    g = a.gid_index
    if g >= len(dev.gid_table) or not any(dev.gid_table[g]):
        raise ToolError(f"Failed to query GID index {g}: the entry is empty (the device's GIDs "
                        f"are 0..{len(dev.gid_table) - 1})")


def run(a: argparse.Namespace) -> int:
    _defaults(a)
    server = a.servername is None
    peer = resolve(a.servername) if a.servername else None
    dev = open_device(a.ib_dev, a.addr, peer=peer, mtu=None)
    perf: Perf | None = None
    try:
        _check_device(a, dev)
        if server:
            print("\n************************************\n* Waiting for client to connect... *\n"
                  "************************************", flush=True)
            ls = tcp_listen(dev.ip, a.port)
            try:
                conn, _ = ls.accept()
            finally:
                ls.close()
        else:
            conn = tcp_connect(peer, a.port, timeout=5.0)
        perf = Perf(a, dev, server)
        perf.tcp = conn
        comm = PerftestComm(conn, client=not server, pump=perf.pump)
        perf.comm = comm
        try:
            _run_test(a, perf, comm, server)
        finally:
            comm.close()
        if a.counters:
            for k, v in dev.counters.as_dict().items():
                print(f"{k}: {v}")
        return 0
    finally:
        if perf is not None:
            perf.close()
        dev.detach()


def _run_test(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool) -> None:
    comm.exchange_versions()
    cycle_buffer, cache_line = comm.check_sys_data(_page_size(), _cache_line_size())
    curr_mtu = comm.check_mtu(_set_mtu(perf.dev, a.mtu))
    out_reads = 1
    if a.verb in ("read", "atomic"):
        mx = perf.dev.limits.max_qp_rd_atom
        out_reads = mx if not a.outs or a.outs <= 0 or a.outs > mx else a.outs
    buff = max(a.size, cycle_buffer)
    my = perf.setup(a.size, buff, cycle_buffer, cache_line, curr_mtu, out_reads)
    perf.print_test_info()
    if a.duration and not server:
        print(" WARNING: BW peak won't be measured in this run.")
    sizes = [1 << i for i in range(1, 24)] if a.all else [a.size]
    if a.lat:
        _run_lat(a, perf, comm, server, my, sizes)
    elif a.verb == "send":
        _run_send_bw(a, perf, comm, server, my, sizes)
    else:
        _run_rdma_bw(a, perf, comm, server, my, sizes)
    perf.print_checks()


def _keys_connect_print(perf: Perf, comm: PerftestComm, my: list[Dest], single_before: bool,
                        single_after_connect: bool) -> list[Dest]:
    """The handshakes that carry the keys, the connection of the QPs and the address lines."""
    if single_before:
        comm.hand_shake(my[0])  # "shaking hands and gather the other side info" (lat tests)
    rem = [comm.hand_shake(d) for d in my]
    perf.connect(rem)
    if single_after_connect:
        comm.hand_shake(my[0])  # send_bw's handshake after ctx_connect
    for d in my:
        perf.print_dest(d, "local")
    for i, d in enumerate(my):
        r = comm.hand_shake(d)
        perf.print_dest(r, "remote")
    return rem


def _run_rdma_bw(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool,
                 my: list[Dest], sizes: list[int]) -> None:
    """write_bw.c / read_bw.c / atomic_bw.c, not duplex."""
    _keys_connect_print(perf, comm, my, False, False)
    comm.hand_shake(my[0])  # "An additional handshake is required after moving qp to RTR"
    perf.print_bw_header()
    if server:
        comm.hand_shake(my[0])  # the server waits here for the client to finish
        rep = comm.xchg_bw_reports(BwReport())
        perf.print_bw_report(rep)
        if a.check and perf.verb in ("write", "atomic"):
            perf.check_remote_region(rep.size, rep.iters)
        comm.close_connection(my[0])
        print(RESULT_LINE)
        return
    rep = BwReport()
    for size in sizes:
        rep = perf.run_bw_client(size, a.iters, a.duration)
        perf.print_bw_report(rep)
        if a.check and perf.verb == "read":
            perf.check_read_data(size)
    print(RESULT_LINE)
    comm.hand_shake(my[0])
    comm.xchg_bw_reports(rep)
    comm.close_connection(my[0])


def _run_send_bw(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool,
                 my: list[Dest], sizes: list[int]) -> None:
    """send_bw.c, not duplex: both sides measure, nobody exchanges reports."""
    _keys_connect_print(perf, comm, my, False, True)
    perf.print_bw_header()
    iters = 0 if a.duration else a.iters
    for size in sizes:
        if server:
            perf.post_recvs(size, iters)
        comm.hand_shake(my[0])  # every receive is posted before the first send
        if server:
            rep = perf.run_bw_server_send(size, a.iters, bool(a.duration))
        else:
            rep = perf.run_bw_client(size, a.iters, a.duration)
        perf.print_bw_report(rep)
        if server and a.check:
            perf.check_remote_region(size, rep.iters)
        if a.all:
            comm.hand_shake(my[0])
    print(RESULT_LINE)
    comm.close_connection(my[0])


def _run_lat(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool,
             my: list[Dest], sizes: list[int]) -> None:
    """write_lat.c, read_lat.c, atomic_lat.c, send_lat.c."""
    _keys_connect_print(perf, comm, my, True, False)
    if perf.verb == "send":
        n = min(a.rx_depth, a.iters)
        rsge = SGE(perf.mr.buf + perf.buff, perf.buff, perf.mr.lkey)
        for _ in range(n):
            perf.qps[0].post_recv(RecvWR(1, sg=[rsge]))
        perf.recv_left = a.iters * len(sizes) - n
    comm.hand_shake(my[0])  # after RTR (send: receives posted)
    if perf.verb in ("read", "atomic") and server:
        comm.close_connection(my[0])  # the server waits here while the client reads
        print(RESULT_LINE)
        return
    perf.print_lat_header()
    for size in sizes:
        if perf.verb == "write":
            tp = perf.run_lat_write(size, a.iters)
        elif perf.verb == "send":
            tp = perf.run_lat_send(size, a.iters)
        else:
            tp = perf.run_lat_read(size, a.iters)
        perf.print_lat_report(size, a.iters, tp)
    print(RESULT_LINE)
    if perf.verb == "write":
        return  # write_lat.c ends without ctx_close_connection
    comm.close_connection(my[0])
