"""perftest_resources: the verbs resources of a test (context, PD, MR, CQs, QPs), their
connection, and waiting for the device while a loop has nothing to do."""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

from ...readiness import SPIN_MIN, BusyPoll, readable
from ...enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE, IBV_QPT_RC, IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE, IBV_WR_SEND, wc_status_str,
)
from ...verbs_api import (
    CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
)
from ..common import ToolError
from .communication import Dest, PerftestComm
from .parameters import DEF_HOP_LIMIT, MIN_RNR_TIMER

__all__ = ["Perf", "pattern", "cache_line_size", "page_size", "inc", "SIGNALED", "INLINE",
           "OPCODES"]

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


def cache_line_size() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index0/coherency_line_size") as f:
            n = int(f.read().strip())
            return n if n > 0 else 64
    except (OSError, ValueError):
        return 64


def page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4096


def inc(size: int, cache_line: int) -> int:
    """perftest's INC(): a message's slot in the cycle buffer, rounded up to a cache line."""
    return (size + cache_line - 1) // cache_line * cache_line



class Perf:
    """The resources of one perftest-style test, either role (perftest's
    ``pingpong_context``); the loops, reports and checks are functions of it."""

    def __init__(self, a: argparse.Namespace, dev: Any, server: bool) -> None:
        self.a = a
        self.dev = dev
        self.server = server
        self.verb = a.verb
        self.lat = a.lat
        self.tcp: Any = None
        self.link: Any = None  # -R: the CmLink
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
        # how long wait_one polls each CQ before it sleeps, from the turnarounds measured
        self.busy: dict[int, BusyPoll] = {}

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
        readable(fds, timeout)
        self.service()

    def service(self) -> None:
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
        r = readable(fds, timeout)
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
        if self.link is not None and self.link.peer_disconnected():
            if not self.eof_ok:
                raise ToolError("the peer disconnected during the test")
            if not self.peer_gone:
                self.peer_gone = time.monotonic()
        if self.peer_gone and time.monotonic() - self.peer_gone > 5:
            raise ToolError("the peer closed the connection and the test did not complete")
        self.service()

    # -- setup -----------------------------------------------------------------------------------
    def setup(self, size: int, buff: int, cycle_buffer: int, cache_line: int, curr_mtu: int,
              out_reads: int, make_qps: bool = True) -> list[Dest]:
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
        self.gid = self.ctx.query_gid(a.ib_port, a.gid_index).raw
        if not make_qps:  # -R: rdma_cm makes them (CmLink.connect_data), then make_dests
            return []
        qp_access = int(IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE |
                        IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)
        for i in range(nq):
            qp = QP(self.pd, self.qp_init_attr())
            qp.to_init(QPAttr(pkey_index=0, port_num=a.ib_port, qp_access_flags=qp_access))
            self.qps.append(qp)
        return self.make_dests()

    def qp_init_attr(self) -> QPInitAttr:
        a = self.a
        cap = QPCap(max_send_wr=max(a.tx_depth, 1), max_recv_wr=max(a.rx_depth, 1),
                    max_send_sge=1, max_recv_sge=1,
                    max_inline_data=max(0, min(a.inline_size, self.dev.limits.max_inline_data)))
        return QPInitAttr(qp_type=IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap, sq_sig_all=0)

    def make_dests(self) -> list[Dest]:
        """set_up_connection: each QP's record (its PSN is random; with -R it is only
        printed, rdma_cm chose the real ones)."""
        nq = len(self.qps)
        self.my = [Dest(lid=0, out_reads=self.out_reads, qpn=qp.qp_num,
                        psn=self.rng.getrandbits(24), rkey=self.mr.rkey,
                        vaddr=self.mr.buf + (nq + i) * self.buff, gid=self.gid, srqn=0)
                   for i, qp in enumerate(self.qps)]
        return self.my

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

    # -- completions -----------------------------------------------------------------------------
    def bad_completion(self, wc: Any, where: str) -> ToolError:
        return ToolError(f"Completion with error at {where}: Failed status "
                         f"{wc_status_str(wc.status)} ({wc.status}) for wr_id {wc.wr_id}")

    def wait_one(self, cq: Any) -> Any:
        """The next completion of ``cq``, making progress while there is none: polling,
        as perftest does (``cq.poll`` reads the socket on this thread, so an answer is
        seen without a sleep and a wake-up), for the CQ's busy-poll window -- derived from
        how long its recent waits took (:class:`softrdma.readiness.BusyPoll`;
        ``SOFTRDMA_BUSY_POLL=0``: a fixed 2 ms) -- then sleeping in :meth:`idle` until
        something arrives. The bookkeeping stays off the answer's path: the wait's length
        is taken at its last empty poll, filed when the next wait starts, and the window
        looked up only once :data:`SPIN_MIN` is spent, the least any window is."""
        n, wcs = cq.poll(1)
        if not n:
            busy = self.busy.get(id(cq))
            if busy is None:
                busy = self.busy[id(cq)] = BusyPoll()
            clock = time.perf_counter
            start = now = clock()
            busy.settle()
            spin_end = start + SPIN_MIN
            windowed = False
            while True:
                n, wcs = cq.poll(1)
                if n:
                    busy.last = now - start
                    break
                now = clock()
                if now > spin_end:
                    if not windowed:
                        windowed = True
                        spin_end = start + busy.window()
                        if now <= spin_end:
                            continue
                    self.idle()
                    now = clock()
                    spin_end = now + busy.window()
        wc = wcs[0]
        if wc.status:
            raise self.bad_completion(wc, "client" if not self.server else "server")
        return wc

    def wait_send(self) -> Any:
        return self.wait_one(self.scq)

    def wait_recv(self) -> Any:
        return self.wait_one(self.rcq)

    # -- address cycling (increase_rem_addr / increase_loc_addr) ---------------------------------
    def slots(self, size: int) -> tuple[int, int]:
        """(slot size, slots) a size cycles through; 1 slot when it does not cycle."""
        if size <= self.cycle_buffer // 2:
            step = inc(size, self.cache_line)
            return step, max(1, self.cycle_buffer // step)
        return 0, 1

    def drain(self) -> None:
        """Duration mode's end: wait until every QP's send queue is empty (all acked)."""
        deadline = time.monotonic() + 30
        while any(len(qp.sq) for qp in self.qps):
            if time.monotonic() > deadline:
                raise ToolError("the last work requests did not complete in 30 s")
            self.idle(0.01)

    # -- receives of the send tests (ctx_set_recv_wqes) --------------------------------------
    def post_recvs(self, size: int, iters: int) -> None:
        """ctx_set_recv_wqes: min(rx_depth, iters) receives per QP, at cycling offsets."""
        nq = len(self.qps)
        self.rposted = [0] * nq
        self.rsize = size
        n = min(self.a.rx_depth, iters) if iters else self.a.rx_depth
        for q in range(nq):
            for _ in range(n):
                self.post_one_recv(q, size)

    def post_one_recv(self, q: int, size: int) -> None:
        step, nslots = self.slots(size)
        k = self.rposted[q]
        addr = self.mr.buf + (len(self.qps) + q) * self.buff + (k % nslots) * step
        self.qps[q].post_recv(RecvWR(q, sg=[SGE(addr, size, self.mr.lkey)]))
        self.rposted[q] = k + 1

    def close(self) -> None:
        self.ctx.close()
