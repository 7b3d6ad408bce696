"""The fuzzing run: live devices and QP pairs, frames fired at them over real UDP, legitimate
traffic alongside, and the upkeep of QPs the fuzzing breaks.

:class:`Fuzzer` owns everything a run makes (devices, sides, pairs, sending sockets) and
one seeded ``random.Random`` that the setup, the legitimate traffic and the frame maker
(:mod:`.frames`) draw from in turn, so a seed replays the same run as far as the devices'
timing lets it. The survival checks are in :mod:`.checks`, the summary in :mod:`.report`.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ...enums import (
    IBV_QP_STATE,
    IBV_QPS_RESET,
    IBV_QPS_RTS,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
    IBV_WR_SEND,
    ibv_wc_status,
)
from ...errors import PyverbsRDMAError
from ...soft.udp import TransportError
from ...verbs_api import SRQ, QPAttr, RecvWR, SendWR, SrqAttr, SrqInitAttr
from ...verbs_api.device import add_device, find_device, unregister_device
from ...wire.frames import encode_frame
from ...wire.headers import ROCE_V2_UDP_DPORT
from ...wire.pcap import PcapWriter
from ..common import ToolError
from .frames import FrameMaker, SendSocket
from .live import KINDS, QP_DEPTH, RECV_TARGET, SLOT, UD_QKEY, End, Pair, Side, connect
from .stats import Stats

__all__ = ["FuzzConfig", "Check", "Fuzzer", "SELF_TESTS", "TARGETS", "raw_allowed", "ip_int",
           "next_ip"]

SELF_TESTS = ("sentinel", "guard", "unregistered", "leak", "fd", "thread")
#: what ``--target`` fires at: RoCE frames at live QPs (data), CM MADs at QP1 (cm), the
#: socket layer's hello and records over a real connection (records)
TARGETS = ("data", "cm", "records")


@dataclass
class FuzzConfig:
    seed: int = 1
    seconds: float | None = None
    count: int | None = None
    addrs: tuple[str, str] = ("127.0.10.1", "127.0.10.2")
    stranger: str | None = None
    pcaps: str | None = None
    icrc: str = "auto"
    warmup: float = 0.15
    crash_pcap: str | None = None
    self_test: str | None = None
    verbose: bool = False
    target: str = "data"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def raw_allowed() -> bool:
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    except OSError:
        return False
    s.close()
    return True


class Fuzzer:
    """One fuzzing run (:func:`softrdma.tools.fuzz.run_fuzz` drives it)."""

    def __init__(self, cfg: FuzzConfig, out: Any = None) -> None:
        self.cfg = cfg
        self.out = out or sys.stdout
        self.rng = random.Random(cfg.seed)
        self.stats = Stats()
        self.devs: list[Any] = []
        self.sides: list[Side] = []
        self.pairs: list[Pair] = []
        self.srqs: list[Any] = []
        self.srq_posted = [0, 0]
        self.socks: list[SendSocket] = []  # sock, src ip, bound to the peer's?, target
        self.ring: deque[tuple[bytes, bytes, int, bytes]] = deque(maxlen=256)
        self.thread_errors: list[str] = []
        self.checks: list[Check] = []
        self.raw = False
        self._leak: list[bytes] = []
        self._wrid = 0
        self._rcvd0 = self._sent0 = self._lost = 0
        self.frames = FrameMaker(self.rng, self.stats, self.sides, self.pairs, self.socks,
                                 cfg.addrs)

    def setup(self) -> None:
        cfg = self.cfg
        if cfg.icrc == "raw" and not raw_allowed():
            raise ToolError("--icrc raw needs a raw socket (root or CAP_NET_RAW)")
        self.raw = cfg.icrc == "raw" or (cfg.icrc == "auto" and raw_allowed())
        for ip in cfg.addrs:
            name = f"softrdma-fuzz-{ip}"
            if find_device(name) is not None:
                raise ToolError(f"device {name} already exists")
            dev = add_device(ip, name=name, seed=self.rng.randrange(1 << 30))
            try:
                dev.attach_udp(thread=True, raw_rx=self.raw)
            except TransportError as e:
                unregister_device(name)
                raise ToolError(f"cannot bind {ip}: {e.args[1] if len(e.args) > 1 else e}")
            self.devs.append(dev)
        self.sides.extend(Side(d, self.rng) for d in self.devs)
        for s in self.sides:
            srq = SRQ(s.pd, SrqInitAttr(attr=SrqAttr(max_wr=QP_DEPTH, max_sge=1)))
            self.srqs.append(srq)
        for i, kind in enumerate(KINDS):
            self.pairs.append(self.make_pair(kind, i))
        # sending sockets: two bound to each device's address (the peer of the other), one
        # to the stranger address and one to 127.0.0.1; all with DF and so IP ID 0, which
        # is what the ICRC we compute assumes
        stranger = cfg.stranger or next_ip(max(cfg.addrs, key=ip_int))
        for i, ip in enumerate(cfg.addrs):
            for _ in range(2):
                self.socks.append((self._sock(ip), socket.inet_aton(ip), True, 1 - i))
        for ip in (stranger, "127.0.0.1"):
            for t in (0, 1):
                self.socks.append((self._sock(ip), socket.inet_aton(ip), False, t))
        self._old_hook = threading.excepthook

        def hook(args: Any) -> None:
            self.thread_errors.append(
                f"{args.thread.name if args.thread else '?'}: "
                + "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                     args.exc_traceback)).strip())
            self._old_hook(args)
        threading.excepthook = hook

    @staticmethod
    def _sock(ip: str) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            s.bind((ip, 0))
        except OSError as e:
            s.close()
            raise ToolError(f"cannot bind a sending socket to {ip}: {e.strerror}") from None
        s.setblocking(False)
        return s

    def make_pair(self, kind: str, i: int) -> Pair:
        ends = []
        for k, s in enumerate(self.sides):
            ends.append(End(s, kind, i, self.srqs[k] if kind == "SRQ" else None))
        p = Pair(kind, ends[0], ends[1])
        self._reconnect(p)
        return p

    def _reconnect(self, p: Pair) -> None:
        for e in p.ends:
            self.drain(e)  # counts the error completions that broke the pair
            if e.qp.qp_state != IBV_QPS_RESET:
                e.qp.modify(QPAttr(qp_state=IBV_QPS_RESET), IBV_QP_STATE)
            self.drain(e)
            e.posted = 0
            e.sends_out = 0
        pa, pb = self.rng.randrange(1 << 24), self.rng.randrange(1 << 24)
        connect(p.a, p.b, pa, pb)
        connect(p.b, p.a, pb, pa)
        for e in p.ends:
            self.top_up(e)


    # -- legitimate traffic alongside, and the QPs' upkeep ---------------------------------
    def next_wrid(self) -> int:
        """A fresh work request ID (every WR of the run has its own)."""
        self._wrid += 1
        return self._wrid

    def _post_recv(self, e: End, n: int = 1) -> bool:
        extra = 40 if e.kind == "UD" else 0
        sge = e.side.sge("recv", e.slot * SLOT, SLOT if not extra else 1024 + extra)
        tgt = self.srqs[self.sides.index(e.side)] if e.srq is not None else e.qp
        try:
            for _ in range(n):
                tgt.post_recv(RecvWR(self.next_wrid(), sg=[sge]))
        except PyverbsRDMAError:
            return False
        return True

    def top_up(self, e: End) -> None:
        if e.srq is not None:
            # an SRQ receive a QP had started to fill is gone without a completion when the
            # QP is reset (rxe does the same), so count what the SRQ holds, not what we posted
            k = self.sides.index(e.side)
            have = len(e.srq.rq) if hasattr(e.srq, "rq") else self.srq_posted[k]
            if have < RECV_TARGET and self._post_recv(e, RECV_TARGET - have):
                self.srq_posted[k] = RECV_TARGET
            return
        if e.posted < RECV_TARGET and self._post_recv(e, RECV_TARGET - e.posted):
            e.posted = RECV_TARGET

    def drain(self, e: End) -> list[Any]:
        wcs = e.rcq.poll_all() if len(e.rcq) else []
        if wcs:
            if e.srq is not None:
                k = self.sides.index(e.side)
                self.srq_posted[k] = max(0, self.srq_posted[k] - len(wcs))
            else:
                e.posted = max(0, e.posted - len(wcs))
        if len(e.scq):
            swcs = e.scq.poll_all()
            e.sends_out = max(0, e.sends_out - len(swcs))
            wcs_all = wcs + swcs
        else:
            wcs_all = wcs
        for w in wcs_all:
            if w.status:
                k = _wc_status_name(w.status)
                self.stats.wc_errors[k] = self.stats.wc_errors.get(k, 0) + 1
        return wcs

    def _legit_op(self) -> None:
        """One ordinary operation on a random pair, so forged responses meet requests in
        flight. Sources are the rw MR, targets the peer's rw MR or our sink: permitted."""
        p = self.rng.choice(self.pairs)
        e, peer = (p.a, p.b) if self.rng.random() < 0.5 else (p.b, p.a)
        if e.sends_out >= QP_DEPTH // 2:
            return
        r = self.rng
        prw = peer.side.mrs["rw"]
        if p.kind == "UD":
            op = IBV_WR_SEND
        elif p.kind == "UC":
            op = r.choice((IBV_WR_SEND, IBV_WR_RDMA_WRITE))
        else:
            op = r.choice((IBV_WR_SEND, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ,
                           IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_ATOMIC_CMP_AND_SWP))
        wrid = self.next_wrid()
        if op == IBV_WR_SEND:
            n = r.randrange(1, 1024 if p.kind == "UD" else SLOT)
            wr = SendWR(wrid, opcode=op, sg=[e.side.sge("rw", 0, n)])
            if p.kind == "UD":
                wr.set_wr_ud(e.ah, peer.qpn, UD_QKEY)
        elif op in (IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ):
            n = r.randrange(1, 8192)
            off = r.randrange(0, prw.length - n)
            src = e.side.sge("rw" if op == IBV_WR_RDMA_WRITE else "sink",
                             r.randrange(0, 32 << 10), n)
            wr = SendWR(wrid, opcode=op, sg=[src])
            wr.set_wr_rdma(prw.rkey, prw.buf + off)
        else:
            off = r.randrange(0, prw.length // 8) * 8
            wr = SendWR(wrid, opcode=op,
                        sg=[e.side.sge("sink", r.randrange(0, 4096) * 8, 8)])
            wr.set_wr_atomic(prw.rkey, prw.buf + off, r.getrandbits(64), r.getrandbits(64))
        try:
            e.qp.post_send(wr)
            e.sends_out += 1
            self.stats.legit_ops += 1
        except PyverbsRDMAError:
            pass
        except Exception:  # a verbs call must fail with PyverbsRDMAError or not at all
            self.thread_errors.append("main thread (post_send): " + traceback.format_exc().strip())

    def _recover(self) -> None:
        """Reset and reconnect the pairs a forged packet moved to ERR (cheap: states only)."""
        for p in self.pairs:
            if p.a.qp.qp_state != IBV_QPS_RTS or p.b.qp.qp_state != IBV_QPS_RTS:
                self.stats.recoveries[p.kind] = self.stats.recoveries.get(p.kind, 0) + 1
                self._reconnect(p)

    def _async_events(self) -> None:
        """Read the async events, as a program must: like uverbs, a context queues them
        until they are read (QP_FATAL, LAST_WQE_REACHED... from every broken QP)."""
        for s in self.sides:
            for _ in range(10_000):
                ev = s.ctx.get_async_event(block=False)
                if ev is None:
                    break
                k = getattr(ev.event_type, "name", str(ev.event_type)).replace("IBV_EVENT_", "")
                self.stats.async_events[k] = self.stats.async_events.get(k, 0) + 1

    def housekeeping(self) -> None:
        self._async_events()
        for p in self.pairs:
            for e in p.ends:
                self.drain(e)
            broken = [e for e in p.ends if e.qp.qp_state != IBV_QPS_RTS]
            if broken:
                self.stats.recoveries[p.kind] = self.stats.recoveries.get(p.kind, 0) + 1
                self._reconnect(p)
            for e in p.ends:
                self.top_up(e)


    # -- running --------------------------------------------------------------------------
    def start_counting(self) -> None:
        """From here on, what the devices receive beyond what they send each other is ours
        (the pacing counts the backlog of our frames from this point)."""
        self._rcvd0 = self.received()
        self._sent0 = sum(d.counters.sent_pkts for d in self.devs)
    def received(self) -> int:
        return sum(d.counters.rcvd_pkts for d in self.devs)

    def _send(self, data: bytes, sock_i: int, t: int) -> None:
        sock, src, _, _ = self.socks[sock_i]
        dst = self.cfg.addrs[t]
        self.ring.append((data, src, sock.getsockname()[1], socket.inet_aton(dst)))
        try:
            sock.sendto(data, (dst, ROCE_V2_UDP_DPORT))
            self.stats.sent += 1
            if self.socks[sock_i][2]:
                self.stats.from_peer += 1
        except OSError:
            self.stats.send_errors += 1

    def fuzz(self, seeds: list[bytes], seconds: float | None, count: int | None,
             on_tick: Callable[[], None] | None = None) -> float:
        """Send frames until ``seconds`` passed or ``count`` frames were sent."""
        by_op: dict[int, list[bytes]] = {}
        for s in seeds:
            by_op.setdefault(s[0], []).append(s)
        ops = sorted(by_op)
        t0 = time.monotonic()
        end = t0 + seconds if seconds is not None else None
        sent0 = self.stats.sent
        last_print = t0
        i = 0
        max_frames = count if count is not None else 1 << 62
        while i < max_frames:
            if end is not None and time.monotonic() >= end:
                break
            i += 1
            data, sock_i, _ = self.frames.make(by_op, ops)
            t = self.socks[sock_i][3]
            self._send(data, sock_i, t)
            if self.cfg.self_test == "leak":
                self._leak.append([bytes(200)])  # two objects a frame: the check must see it
            if i % 32 == 0:
                self._legit_op()
            if i % 16 == 0:
                self._recover()
            if i % 128 == 0:
                self.housekeeping()
                self._pace()
                if on_tick:
                    on_tick()
                now = time.monotonic()
                if self.cfg.verbose and now - last_print >= 1.0:
                    last_print = now
                    print(f"  {self.stats.sent} frames, {self.received()} received by the "
                          f"devices", file=self.out, flush=True)
        self.housekeeping()
        return time.monotonic() - t0 if self.stats.sent > sent0 else 0.0

    def _pace(self) -> None:
        """Keep at most ~2,000 of our frames queued for the devices: beyond that the kernel
        drops them and they would test nothing. Bounded: at most 0.5 s per call; frames
        still missing then are taken as lost (kernel drops) and not waited for again."""
        deadline = time.monotonic() + 0.5
        while True:
            # the devices also receive what they send each other (ACKs, responses, the
            # legitimate traffic): every packet a device sends goes to the other one
            sent_by_devs = sum(d.counters.sent_pkts for d in self.devs) - self._sent0
            fuzz_rcvd = self.received() - self._rcvd0 - sent_by_devs
            backlog = self.stats.sent - fuzz_rcvd - self._lost
            if backlog <= 2000:
                return
            if time.monotonic() > deadline:
                self._lost += backlog - 2000
                return
            time.sleep(0.002)

    def settle(self, seconds: float = 0.5) -> None:
        """Let in-flight frames and retransmissions play out, then tidy the QPs."""
        end = time.monotonic() + seconds
        last = -1
        while time.monotonic() < end:
            n = self.received()
            if n == last:
                break
            last = n
            time.sleep(0.1)
        self.housekeeping()

    def apply_self_test(self) -> None:
        st = self.cfg.self_test
        s = self.sides[0]
        if st == "sentinel":
            r = s.arena.regions["ro"]
            s.arena.buf[r.start + 1234] ^= 0x40
        elif st == "guard":
            r = s.arena.regions["rw"]
            s.arena.buf[r.start + r.length + 7] ^= 0x01  # the byte after the rw MR
        elif st == "unregistered":
            s.loose[1][99] ^= 0xFF
        elif st == "fd":
            self._leaked_fd = os.open(os.devnull, os.O_RDONLY)
        elif st == "thread":
            ev = threading.Event()
            self._leaked_ev = ev
            threading.Thread(target=ev.wait, args=(30,), daemon=True,
                             name="fuzz-self-test").start()

    def write_crash_pcap(self) -> str:
        path = self.cfg.crash_pcap
        if not path:
            fd, path = tempfile.mkstemp(prefix="softrdma-fuzz-", suffix=".pcap")
            os.close(fd)
        with PcapWriter(path) as w:
            for data, src, sport, dst in self.ring:
                w.write(encode_frame(data, src=src, dst=dst, sport=sport, fill_icrc=False))
        return path

    def close(self) -> None:
        if hasattr(self, "_old_hook"):
            threading.excepthook = self._old_hook
        if hasattr(self, "_leaked_ev"):
            self._leaked_ev.set()
        if hasattr(self, "_leaked_fd"):
            os.close(self._leaked_fd)
        for s, *_ in self.socks:
            s.close()
        for s in self.sides:
            try:
                s.ctx.close()
            except Exception:
                pass
        for d in self.devs:
            d.detach()
            unregister_device(d.name)


def _wc_status_name(status: int) -> str:
    try:
        return ibv_wc_status(status).name.replace("IBV_WC_", "")
    except ValueError:
        return str(status)


def ip_int(ip: str) -> int:
    return struct.unpack("!I", socket.inet_aton(ip))[0]


def next_ip(ip: str) -> str:
    return socket.inet_ntoa(struct.pack("!I", ip_int(ip) + 1))
