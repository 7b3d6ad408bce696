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

Seed frames are every RoCE packet in the captures under ``pcaps/``. Each frame sent is a
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
"""

from __future__ import annotations

import argparse
import gc
import glob
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
from dataclasses import dataclass, field
from typing import Any, Callable

from ..enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_MTU_1024,
    IBV_QP_STATE,
    IBV_QPS_RESET,
    IBV_QPS_RTS,
    IBV_QPT_RC,
    IBV_QPT_UC,
    IBV_QPT_UD,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
    IBV_WR_SEND,
    ibv_wc_status,
)
from ..errors import PyverbsRDMAError
from ..soft.udp import TransportError
from ..verbs_api import (
    AH,
    CQ,
    MR,
    PD,
    QP,
    SGE,
    SRQ,
    AHAttr,
    Context,
    GlobalRoute,
    QPAttr,
    QPCap,
    QPInitAttr,
    RecvWR,
    SendWR,
    SrqAttr,
    SrqInitAttr,
)
from ..verbs_api.device import add_device, find_device, unregister_device
from ..wire.frames import FrameError, decode_frame, encode_frame
from ..wire.headers import ROCE_V2_UDP_DPORT
from ..wire.icrc import icrc_ipv4
from ..wire.opcodes import OPCODE_LIST, Hdr, Transport
from ..wire.packet import DecodeError, build, parse
from ..wire.pcap import PcapError, PcapWriter, read_pcap
from .common import ToolError

__all__ = ["add_parser", "run", "FuzzConfig", "Fuzzer", "load_seeds"]

RW = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
    IBV_ACCESS_REMOTE_ATOMIC
UD_QKEY = 0x11111111
GUARD = 4096  # bytes of pattern before and after every region of an arena
SLOT = 8192  # receive slot per QP; a fuzzed SEND longer than this is a length error
QP_DEPTH = 64
RECV_TARGET = 16  # receives kept posted per QP (and on each SRQ)
SELF_TESTS = ("sentinel", "guard", "unregistered", "leak", "fd", "thread")


def _default_pcap_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "pcaps"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fuzz", help="fire mutated frames from pcaps/ at live devices, then "
                                    "check they still work and nothing leaked or changed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--seconds", type=float, default=None,
                   help="fuzz for this long (default 10 unless --count is given)")
    p.add_argument("--count", type=int, default=None, help="stop after this many frames")
    p.add_argument("--addrs", nargs=2, default=["127.0.10.1", "127.0.10.2"], metavar="IP",
                   help="the two devices' loopback addresses (127.0.10.1 127.0.10.2)")
    p.add_argument("--stranger", default=None, metavar="IP",
                   help="an address that is no device's peer (default: the second address + 1)")
    p.add_argument("--pcaps", default=None, metavar="DIR",
                   help="directory searched recursively for seed captures (default: pcaps/)")
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


# -- seeds ----------------------------------------------------------------------------------

def load_seeds(root: str) -> tuple[list[bytes], int]:
    """Every RoCE packet (BTH .. ICRC) that decodes, from every capture under ``root``;
    and how many capture files were read."""
    paths = sorted(p for pat in ("*.pcap", "*.pcapng")
                   for p in glob.glob(os.path.join(root, "**", pat), recursive=True))
    seeds: list[bytes] = []
    for path in paths:
        try:
            for rec in read_pcap(path):
                try:
                    fr = decode_frame(rec.data, rec.linktype)
                except FrameError:
                    continue
                if fr is None or not fr.is_roce:
                    continue
                try:
                    parse(fr.payload)
                except DecodeError:
                    continue
                seeds.append(bytes(fr.payload))
        except (OSError, PcapError):
            continue
    return seeds, len(paths)


# -- the live setup -------------------------------------------------------------------------

@dataclass
class Region:
    name: str
    start: int  # offset in the arena
    length: int
    permitted: bool  # may the fuzzing (or the legitimate traffic) change it?


class Arena:
    """One bytearray per device, regions laid out with a guard area before and after each."""

    def __init__(self, sizes: list[tuple[str, int, bool]], rng: random.Random) -> None:
        self.regions: dict[str, Region] = {}
        off = GUARD
        for name, n, permitted in sizes:
            self.regions[name] = Region(name, off, n, permitted)
            off += n + GUARD
        self.buf = bytearray(rng.randbytes(off))  # everything starts as a seeded pattern
        self.view = memoryview(self.buf)
        self.snapshot = b""

    def region(self, name: str) -> memoryview:
        r = self.regions[name]
        return self.view[r.start:r.start + r.length]

    def forbidden(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of every stretch that must not change: guards and sentinels."""
        out = []
        pos = 0
        for r in sorted(self.regions.values(), key=lambda r: r.start):
            if pos < r.start:
                out.append((f"guard before {r.name}", pos, r.start))
            if not r.permitted:
                out.append((r.name, r.start, r.start + r.length))
            pos = r.start + r.length
        out.append(("guard at the end", pos, len(self.buf)))
        return out

    def take_snapshot(self) -> None:
        self.snapshot = bytes(self.buf)

    def compare(self) -> list[str]:
        bad = []
        for name, a, b in self.forbidden():
            if self.buf[a:b] != self.snapshot[a:b]:
                i = next(i for i in range(a, b) if self.buf[i] != self.snapshot[i])
                bad.append(f"{name}: byte at arena offset {i} changed "
                           f"0x{self.snapshot[i]:02x} -> 0x{self.buf[i]:02x}")
        return bad


ARENA_LAYOUT = [  # name, size, permitted
    ("rw", 64 << 10, True),  # remote write/read/atomic: the peer may change it
    ("recv", 8 * SLOT, True),  # receive buffers (local write)
    ("sink", 64 << 10, True),  # RDMA READ and atomic results (local write)
    ("ro", 32 << 10, False),  # remote read only
    ("local", 16 << 10, False),  # local write only, never posted
    ("none", 16 << 10, False),  # no access at all
    ("otherpd", 16 << 10, False),  # every access, but in a PD no QP belongs to
    ("unreg", 16 << 10, False),  # never registered
]


class Side:
    """One device: context, PDs, the arena and its MRs."""

    def __init__(self, dev: Any, rng: random.Random) -> None:
        self.dev = dev
        self.ctx = Context(name=dev.name)
        self.pd = PD(self.ctx)
        self.pd2 = PD(self.ctx)
        self.arena = Arena(ARENA_LAYOUT, rng)
        a = self.arena
        self.mrs: dict[str, Any] = {
            "rw": MR(self.pd, access=RW, buffer=a.region("rw")),
            "recv": MR(self.pd, access=IBV_ACCESS_LOCAL_WRITE, buffer=a.region("recv")),
            "sink": MR(self.pd, access=IBV_ACCESS_LOCAL_WRITE, buffer=a.region("sink")),
            "ro": MR(self.pd, access=IBV_ACCESS_REMOTE_READ, buffer=a.region("ro")),
            "local": MR(self.pd, access=IBV_ACCESS_LOCAL_WRITE, buffer=a.region("local")),
            "none": MR(self.pd, access=0, buffer=a.region("none")),
            "otherpd": MR(self.pd2, access=RW, buffer=a.region("otherpd")),
        }
        # unregistered buffers outside the arena too
        self.loose = [bytearray(rng.randbytes(4096)) for _ in range(2)]
        self.loose_copy = [bytes(b) for b in self.loose]

    def sge(self, mr: str, off: int, n: int) -> Any:
        m = self.mrs[mr]
        return SGE(m.buf + off, n, m.lkey)


KINDS = ("RC", "UC", "UD", "SRQ")


class End:
    """One QP of a pair, with its CQs and the bookkeeping of posted receives."""

    def __init__(self, side: Side, kind: str, slot: int, srq: Any) -> None:
        self.side = side
        self.kind = kind
        self.slot = slot  # index of this QP's receive slot in the recv region
        self.srq = srq
        self.scq = CQ(side.ctx, 1024)
        self.rcq = CQ(side.ctx, 1024)
        qpt = {"RC": IBV_QPT_RC, "UC": IBV_QPT_UC, "UD": IBV_QPT_UD, "SRQ": IBV_QPT_RC}[kind]
        cap = QPCap(max_send_wr=QP_DEPTH, max_recv_wr=QP_DEPTH, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(side.pd, QPInitAttr(qp_type=qpt, scq=self.scq, rcq=self.rcq, srq=srq,
                                         cap=cap, sq_sig_all=0))
        self.posted = 0  # receives posted on our own RQ and not yet completed
        self.ah: Any = None
        self.sends_out = 0

    @property
    def qpn(self) -> int:
        return self.qp.qp_num

    def close(self) -> None:
        for o in (self.qp, self.scq, self.rcq):
            try:
                o.close()
            except Exception:
                pass


class Pair:
    def __init__(self, kind: str, a: End, b: End) -> None:
        self.kind = kind
        self.a, self.b = a, b
        self.resets = 0
        self.recreated = ""

    @property
    def ends(self) -> tuple[End, End]:
        return (self.a, self.b)


def _connect(e: End, peer: End, sq_psn: int, rq_psn: int) -> None:
    a = QPAttr(port_num=1)
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC
    a.path_mtu = IBV_MTU_1024
    a.max_dest_rd_atomic = a.max_rd_atomic = 4
    # short RC timeouts: a connection broken by forged packets fails fast (timeout 10 is
    # 4.2 ms, 7 retries) instead of holding the final check for seconds
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 1, 10, 7, 7
    gid = peer.side.ctx.query_gid(1, 1)
    a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=gid, sgid_index=1, hop_limit=64))
    a.dest_qp_num, a.rq_psn, a.sq_psn = peer.qpn, rq_psn, sq_psn
    a.qkey = UD_QKEY
    e.qp.to_rts(a)
    if e.kind == "UD" and e.ah is None:
        e.ah = AH(e.side.pd, attr=AHAttr(is_global=1, gr=GlobalRoute(dgid=gid, sgid_index=1,
                                                                      hop_limit=64)))


# -- the fuzzer -----------------------------------------------------------------------------

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


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Stats:
    sent: int = 0
    send_errors: int = 0
    good_icrc: int = 0
    from_peer: int = 0
    to_live_qp: int = 0
    real_key: int = 0
    byte_mutated: int = 0
    legit_ops: int = 0
    recoveries: dict[str, int] = field(default_factory=dict)
    wc_errors: dict[str, int] = field(default_factory=dict)
    async_events: dict[str, int] = field(default_factory=dict)
    mutations: dict[str, int] = field(default_factory=dict)

    def m(self, name: str) -> None:
        self.mutations[name] = self.mutations.get(name, 0) + 1


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


def _raw_allowed() -> bool:
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    except OSError:
        return False
    s.close()
    return True


_INTERESTING8 = (0x00, 0x01, 0x7F, 0x80, 0xFF)
_INTERESTING32 = (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFF, 0x10000)
_REQUEST_OPS = [op for op, i in enumerate(OPCODE_LIST) if i is not None and i.is_request]
_ALL_OPS = [op for op, i in enumerate(OPCODE_LIST) if i is not None]
_TRANSPORT_KIND = {Transport.RC: ("RC", "SRQ"), Transport.UC: ("UC",), Transport.UD: ("UD",)}


class Fuzzer:
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
        self.socks: list[tuple[socket.socket, bytes, bool, int]] = []  # sock, src ip, peer?, target
        self.ring: deque[tuple[bytes, bytes, int, bytes]] = deque(maxlen=256)
        self.thread_errors: list[str] = []
        self.checks: list[Check] = []
        self.raw = False
        self._leak: list[bytes] = []
        self._wrid = 0
        self._rcvd0 = self._sent0 = self._lost = 0

    # -- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if cfg.icrc == "raw" and not _raw_allowed():
            raise ToolError("--icrc raw needs a raw socket (root or CAP_NET_RAW)")
        self.raw = cfg.icrc == "raw" or (cfg.icrc == "auto" and _raw_allowed())
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
        self.sides = [Side(d, self.rng) for d in self.devs]
        for s in self.sides:
            srq = SRQ(s.pd, SrqInitAttr(attr=SrqAttr(max_wr=QP_DEPTH, max_sge=1)))
            self.srqs.append(srq)
        for i, kind in enumerate(KINDS):
            self.pairs.append(self._make_pair(kind, i))
        # sending sockets: two bound to each device's address (the peer of the other), one
        # to the stranger address and one to 127.0.0.1; all with DF and so IP ID 0, which
        # is what the ICRC we compute assumes
        stranger = cfg.stranger or _next_ip(max(cfg.addrs, key=_ip_int))
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

    def _make_pair(self, kind: str, i: int) -> Pair:
        ends = []
        for k, s in enumerate(self.sides):
            ends.append(End(s, kind, i, self.srqs[k] if kind == "SRQ" else None))
        p = Pair(kind, ends[0], ends[1])
        self._reconnect(p)
        return p

    def _reconnect(self, p: Pair) -> None:
        for e in p.ends:
            self._drain(e)  # counts the error completions that broke the pair
            if e.qp.qp_state != IBV_QPS_RESET:
                e.qp.modify(QPAttr(qp_state=IBV_QPS_RESET), IBV_QP_STATE)
            self._drain(e)
            e.posted = 0
            e.sends_out = 0
        pa, pb = self.rng.randrange(1 << 24), self.rng.randrange(1 << 24)
        _connect(p.a, p.b, pa, pb)
        _connect(p.b, p.a, pb, pa)
        for e in p.ends:
            self._top_up(e)

    # -- legitimate traffic -----------------------------------------------------------------
    def _post_recv(self, e: End, n: int = 1) -> bool:
        extra = 40 if e.kind == "UD" else 0
        sge = e.side.sge("recv", e.slot * SLOT, SLOT if not extra else 1024 + extra)
        tgt = self.srqs[self.sides.index(e.side)] if e.srq is not None else e.qp
        try:
            for _ in range(n):
                self._wrid += 1
                tgt.post_recv(RecvWR(self._wrid, sg=[sge]))
        except PyverbsRDMAError:
            return False
        return True

    def _top_up(self, e: End) -> None:
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

    def _drain(self, e: End) -> list[Any]:
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
        self._wrid += 1
        if op == IBV_WR_SEND:
            n = r.randrange(1, 1024 if p.kind == "UD" else SLOT)
            wr = SendWR(self._wrid, opcode=op, sg=[e.side.sge("rw", 0, n)])
            if p.kind == "UD":
                wr.set_wr_ud(e.ah, peer.qpn, UD_QKEY)
        elif op in (IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ):
            n = r.randrange(1, 8192)
            off = r.randrange(0, prw.length - n)
            src = e.side.sge("rw" if op == IBV_WR_RDMA_WRITE else "sink",
                             r.randrange(0, 32 << 10), n)
            wr = SendWR(self._wrid, opcode=op, sg=[src])
            wr.set_wr_rdma(prw.rkey, prw.buf + off)
        else:
            off = r.randrange(0, prw.length // 8) * 8
            wr = SendWR(self._wrid, opcode=op, sg=[e.side.sge("sink", r.randrange(0, 4096) * 8, 8)])
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
                self._drain(e)
            broken = [e for e in p.ends if e.qp.qp_state != IBV_QPS_RTS]
            if broken:
                self.stats.recoveries[p.kind] = self.stats.recoveries.get(p.kind, 0) + 1
                self._reconnect(p)
            for e in p.ends:
                self._top_up(e)

    # -- frames ---------------------------------------------------------------------------
    def _pick_target(self, info: Any) -> tuple[int, End | None, Pair | None]:
        """Target device index and the live QP the frame is aimed at (None: no QP)."""
        r = self.rng
        t = r.randrange(2)
        kinds = _TRANSPORT_KIND.get(info.transport, KINDS)
        if r.random() < 0.85:
            cands = [p for p in self.pairs if p.kind in kinds]
        else:
            cands = self.pairs
        if not cands:
            return t, None, None
        p = r.choice(cands)
        return t, p.ends[t], p

    def _psn_for(self, e: End, is_request: bool) -> int:
        r = self.rng
        eng = getattr(e.qp, "engine", None)
        x = r.random()
        if eng is None or x > 0.9:
            self.stats.m("psn_random")
            return r.randrange(1 << 24)
        if is_request:
            base = eng.resp.psn
        else:
            base = eng.comp.psn if r.random() < 0.5 else eng.req.psn
        if x < 0.45:
            self.stats.m("psn_exact")
            return base
        if x < 0.8:
            self.stats.m("psn_near")
            return (base + r.randint(-8, 8)) & 0xFFFFFF
        self.stats.m("psn_far")
        return (base + r.choice((1 << 23, (1 << 23) - 1, -(1 << 23), 1 << 22, 4096))) & 0xFFFFFF

    def _mr_target(self, side: Side, length: int, atomic: bool) -> tuple[int, int, int]:
        """(va, rkey, dma_len) aimed at a real MR most of the time."""
        r = self.rng
        x = r.random()
        if x < 0.1:
            self.stats.m("reth_random")
            return r.getrandbits(64), r.getrandbits(32), r.choice(_INTERESTING32 + (length,))
        name = r.choices(("rw", "ro", "local", "none", "otherpd", "recv", "sink"),
                         (10, 3, 1, 1, 2, 1, 1))[0]
        mr = side.mrs[name]
        self.stats.real_key += 1
        key = mr.rkey
        if r.random() < 0.1:
            self.stats.m("rkey_wrong_byte")
            key = (key & ~0xFF) | ((key + r.randrange(1, 256)) & 0xFF)
        y = r.random()
        n = length
        if y < 0.55:
            off = r.randrange(0, max(1, mr.length - max(n, 8)))
        elif y < 0.75:  # at or across the edges
            self.stats.m("va_edge")
            off = r.choice((-1, -8, -4096, 0, mr.length - n, mr.length - n + 1, mr.length,
                            mr.length - 8, mr.length + 4096))
        else:
            self.stats.m("dma_len_odd")
            off = r.randrange(0, mr.length)
            n = r.choice((0, 1, mr.length, mr.length + 1, 1 << 31, 0xFFFFFFFF, n + 1, n - 1,
                          r.getrandbits(32)))
        if atomic and r.random() < 0.85:
            off &= ~7
        return (mr.buf + off) & 0xFFFFFFFFFFFFFFFF, key, n & 0xFFFFFFFF

    def make_frame(self, seeds_by_op: dict[int, list[bytes]], ops: list[int]) \
            -> tuple[bytes, int, End | None]:
        r = self.rng
        st = self.stats
        seed = r.choice(seeds_by_op[r.choice(ops)])
        pkt = parse(seed)
        f = pkt.fields()
        opcode = f.pop("opcode")
        payload = bytes(pkt.payload)
        # opcode swap: rebuilt with the new opcode's headers
        if r.random() < 0.12:
            st.m("opcode_swap")
            opcode = r.choice(_REQUEST_OPS if r.random() < 0.6 else _ALL_OPS)
        info = OPCODE_LIST[opcode]
        t, e, p = self._pick_target(info)
        side = self.sides[t]
        if e is not None and r.random() < 0.93:
            f["dest_qp"] = e.qpn
            st.to_live_qp += 1
            f["psn"] = self._psn_for(e, info.is_request)
        else:
            st.m("qpn_other")
            f["dest_qp"] = r.choice((0, 1, 0xFFFFFF, r.randrange(1 << 24),
                                     self.pairs[0].a.qpn + 100, r.randrange(16, 64)))
            f["psn"] = r.randrange(1 << 24)
        hdrs = {h for h, _ in info.headers}
        if Hdr.RETH in hdrs or Hdr.ATMETH in hdrs:
            n = len(payload) if Hdr.RETH in hdrs else 8
            if info.name.endswith("READ_REQUEST"):
                n = r.choice((1, 64, 1024, 4096, 16384))
            f["va"], f["rkey"], f["dma_len"] = self._mr_target(side, n, Hdr.ATMETH in hdrs)
            if Hdr.ATMETH in hdrs:
                if r.random() < 0.3:
                    st.m("atomic_operands")
                    f["swap_add"], f["compare"] = r.getrandbits(64), r.getrandbits(64)
        if Hdr.AETH in hdrs and r.random() < 0.5:
            st.m("aeth")
            f["syndrome"] = r.choice((0x1F, 0x00, 0x20, 0x3F, 0x60, 0x61, 0x62, 0x63, 0x64,
                                      0x40, 0x80, 0xFF, r.randrange(256)))
            f["msn"] = r.randrange(1 << 24) if r.random() < 0.3 else \
                (int(f.get("msn") or 0) + r.randint(-2, 2)) & 0xFFFFFF
        if Hdr.DETH in hdrs:
            f["qkey"] = UD_QKEY if r.random() < 0.8 else r.choice((0, 0x80000000, r.getrandbits(32)))
            f["src_qp"] = r.randrange(1 << 24)
        if Hdr.IETH in hdrs:
            f["ieth_rkey"] = r.choice([m.rkey for m in side.mrs.values()] + [r.getrandbits(32)])
        if Hdr.IMMDT in hdrs:
            f["imm"] = r.getrandbits(32)
        for k in ("va", "rkey", "dma_len", "syndrome", "msn", "swap_add", "compare", "orig",
                  "imm", "ieth_rkey", "qkey", "src_qp", "feth"):
            if f.get(k) is None:
                f.pop(k, None)
        # BTH bits
        y = r.random()
        if y < 0.05:
            st.m("pkey")
            f["pkey"] = r.choice((0, 0x7FFF, 0x8000, r.randrange(1 << 16)))
        elif y < 0.08:
            st.m("tver")
            f["tver"] = r.randrange(1, 16)
        elif y < 0.14:
            st.m("bth_bits")
            f["se"], f["migreq"], f["ackreq"] = (r.random() < 0.5 for _ in range(3))
            f["fecn"], f["becn"] = r.random() < 0.2, r.random() < 0.2
            f["resv6"], f["resv7"] = r.randrange(64), r.randrange(128)
        # payload size
        z = r.random()
        if z < 0.15:
            st.m("size")
            mtu = 1024
            n = r.choice((0, 1, 3, 7, 8, mtu - 1, mtu, mtu + 1, 4096, 4097, 2 * mtu,
                          r.randrange(0, 9000)))
            payload = (payload * (n // max(1, len(payload)) + 1))[:n] if payload else r.randbytes(n)
        pad = None
        if r.random() < 0.08:
            st.m("pad")
            pad = r.randrange(4)
        f.pop("pad", None)
        data = build(opcode, payload=payload, pad=pad, **f)
        # byte-level mutations, before the ICRC is (maybe) made right again
        if r.random() < 0.3:
            st.byte_mutated += 1
            data = self._mutate_bytes(data)
        sock_i = self._pick_sock(t)
        sock, src, from_peer, _ = self.socks[sock_i]
        dst = socket.inet_aton(self.cfg.addrs[t])
        sport = sock.getsockname()[1]
        w = r.random()
        if len(data) >= 16:
            if w < 0.75:
                c = icrc_ipv4(data, src, dst, sport)
                if w < 0.65:
                    st.good_icrc += 1
                else:  # right but for another source port / address
                    c = icrc_ipv4(data, src, dst, (sport + 1) & 0xFFFF)
                    st.m("icrc_wrong_port")
                data[-4:] = c.to_bytes(4, "little")
                if r.random() < 0.03:  # then corrupt a byte the ICRC covers
                    st.m("post_icrc_flip")
                    i = r.randrange(len(data))
                    data[i] ^= 1 << r.randrange(8)
            elif w < 0.9:
                st.m("icrc_flipped")
                data[-1 - r.randrange(4)] ^= 1 << r.randrange(8)
        return bytes(data), sock_i, e

    def _pick_sock(self, t: int) -> int:
        """A sending socket towards device ``t``: bound to its peer's address 75 % of the
        time (the source-address check passes), else to a stranger's."""
        peer = [i for i, s in enumerate(self.socks) if s[3] == t and s[2]]
        other = [i for i, s in enumerate(self.socks) if s[3] == t and not s[2]]
        return self.rng.choice(peer if self.rng.random() < 0.75 else other)

    def _mutate_bytes(self, data: bytearray) -> bytearray:
        r = self.rng
        st = self.stats
        for _ in range(r.choice((1, 1, 1, 2, 3, 4))):
            k = r.randrange(7)
            n = len(data)
            if k == 0 and n:
                st.m("bit_flip")
                i = r.randrange(n)
                data[i] ^= 1 << r.randrange(8)
            elif k == 1 and n:
                st.m("byte_set")
                data[r.randrange(n)] = r.choice(_INTERESTING8 + (r.randrange(256),))
            elif k == 2:
                st.m("truncate")
                del data[r.choice((0, 1, 11, 12, 15, 16, 27, 28, r.randrange(n + 1))):]
            elif k == 3:
                st.m("extend")
                data += r.randbytes(r.choice((1, 3, 4, 8, 64, r.randrange(2048))))
            elif k == 4 and n > 12:
                st.m("header_byte")  # within the headers, where the fields are
                data[r.randrange(min(n, 48))] = r.randrange(256)
            elif k == 5 and n:
                st.m("opcode_byte")
                data[0] = r.randrange(256)
            elif k == 6 and n > 8:
                st.m("delete_insert")
                i = r.randrange(n)
                if r.random() < 0.5:
                    del data[i:i + r.randrange(1, 9)]
                else:
                    data[i:i] = r.randbytes(r.randrange(1, 9))
        return data

    # -- running --------------------------------------------------------------------------
    def _received(self) -> int:
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
            data, sock_i, _ = self.make_frame(by_op, ops)
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
                    print(f"  {self.stats.sent} frames, {self._received()} received by the "
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
            fuzz_rcvd = self._received() - self._rcvd0 - sent_by_devs
            backlog = self.stats.sent - fuzz_rcvd - self._lost
            if backlog <= 2000:
                return
            if time.monotonic() > deadline:
                self._lost += backlog - 2000
                return
            time.sleep(0.002)

    # -- checks ---------------------------------------------------------------------------
    def measure(self) -> dict[str, int]:
        gc.collect()
        return {"threads": threading.active_count(), "fds": _fds(), "rss": _rss(),
                "blocks": sys.getallocatedblocks()}

    def settle(self, seconds: float = 0.5) -> None:
        """Let in-flight frames and retransmissions play out, then tidy the QPs."""
        end = time.monotonic() + seconds
        last = -1
        while time.monotonic() < end:
            n = self._received()
            if n == last:
                break
            last = n
            time.sleep(0.1)
        self.housekeeping()

    def check_flat(self, base: dict[str, int], now: dict[str, int]) -> None:
        c = self.checks
        alive = [_alive(d) for d in self.devs]
        c.append(Check("progress threads alive", all(alive), ", ".join(
            f"{d.name}: {'alive' if a else 'DEAD'}" for d, a in zip(self.devs, alive))))
        c.append(Check("no exception in any thread", not self.thread_errors,
                       self.thread_errors[0].splitlines()[-1] if self.thread_errors else ""))
        # Threads and descriptors: exact. Every socket (one per QP source port, the sending
        # sockets) and every thread exists before the baseline (the warm-up ran traffic on
        # every QP), and recovering a QP reuses its QPN and so its source port.
        c.append(Check("threads flat", now["threads"] == base["threads"],
                       f"{base['threads']} -> {now['threads']}"))
        c.append(Check("descriptors flat", now["fds"] == base["fds"],
                       f"{base['fds']} -> {now['fds']}"))
        # Allocated blocks (pymalloc objects): CPython's caches and freelists, the drop
        # counters' keys (one per reason) and the WQEs in flight at either moment (at most
        # QP_DEPTH per QP, a handful of objects each) move it by about a thousand (+600 to
        # +900 measured over 5 s runs); a leak of one object per frame grows it by the
        # number of frames, 3,000 to 4,500 a second.
        tol_blocks = 2000 + base["blocks"] // 100
        c.append(Check("allocated memory blocks flat",
                       now["blocks"] - base["blocks"] <= tol_blocks,
                       f"{base['blocks']} -> {now['blocks']} ({now['blocks'] - base['blocks']:+d},"
                       f" tolerance {tol_blocks})"))
        # RSS: coarser. pymalloc takes 1 MiB arenas and glibc keeps freed chunks (64 KiB
        # receive buffers, 8 KiB payloads) for reuse, so fragmentation alone moves RSS by a
        # few MiB; 16 MiB plus 10 % is far below what a per-frame leak costs over a run.
        tol_rss = (16 << 20) + base["rss"] // 10
        c.append(Check("RSS flat", now["rss"] - base["rss"] <= tol_rss,
                       f"{base['rss'] >> 20} -> {now['rss'] >> 20} MiB "
                       f"(tolerance +{tol_rss >> 20} MiB)"))

    def check_memory(self) -> None:
        bad = []
        total = 0
        for k, s in enumerate(self.sides):
            for msg in s.arena.compare():
                bad.append(f"{s.dev.name} {msg}")
            total += sum(b - a for _, a, b in s.arena.forbidden())
            for j, (buf, ref) in enumerate(zip(s.loose, s.loose_copy)):
                total += len(buf)
                if buf != ref:
                    bad.append(f"{s.dev.name} unregistered buffer {j} changed")
        self.checks.append(Check("memory outside permitted ranges unchanged", not bad,
                                 bad[0] if bad else f"{total} bytes in guards and sentinels"))

    def _wait(self, cond: Callable[[], bool], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True

    def _exercise(self, p: Pair) -> str | None:
        """WRITE, SEND and READ both ways (UC: WRITE, SEND; UD: SEND); None or what failed."""
        ops = {"UD": ("SEND",), "UC": ("WRITE", "SEND")}.get(p.kind, ("WRITE", "SEND", "READ"))
        for e, peer in ((p.a, p.b), (p.b, p.a)):
            for name in ops:
                for x in (e, peer):
                    self._drain(x)
                    self._top_up(x)
                n = 512 if p.kind == "UD" else 3000
                data = self.rng.randbytes(n)
                e.side.arena.region("rw")[:n] = data
                prw = peer.side.mrs["rw"]
                off = 8192 * (1 + KINDS.index(p.kind)) + (0 if e is p.a else 4096)
                self._wrid += 1
                if name == "SEND":
                    wr = SendWR(self._wrid, opcode=IBV_WR_SEND, sg=[e.side.sge("rw", 0, n)])
                    if p.kind == "UD":
                        wr.set_wr_ud(e.ah, peer.qpn, UD_QKEY)
                elif name == "WRITE":
                    wr = SendWR(self._wrid, opcode=IBV_WR_RDMA_WRITE, sg=[e.side.sge("rw", 0, n)])
                    wr.set_wr_rdma(prw.rkey, prw.buf + off)
                else:
                    peer.side.arena.region("rw")[off:off + n] = data
                    wr = SendWR(self._wrid, opcode=IBV_WR_RDMA_READ,
                                sg=[e.side.sge("sink", 0, n)])
                    wr.set_wr_rdma(prw.rkey, prw.buf + off)
                try:
                    e.qp.post_send(wr)
                except PyverbsRDMAError as ex:
                    return f"{name} post_send: {ex}"
                got: list[Any] = []
                if not self._wait(lambda: bool(len(e.scq)), 2.0):
                    return f"{name} {e.side.dev.ip}->{peer.side.dev.ip}: no completion"
                wcs = e.scq.poll_all()
                if any(w.status for w in wcs):
                    return f"{name}: completion status {wcs[-1].status}"
                if name == "SEND":
                    ok = self._wait(lambda: bool(len(peer.rcq)), 2.0)
                    got = peer.rcq.poll_all() if ok else []
                    if peer.srq is not None:
                        k = self.sides.index(peer.side)
                        self.srq_posted[k] = max(0, self.srq_posted[k] - len(got))
                    else:
                        peer.posted = max(0, peer.posted - len(got))
                    if not got or got[0].status:
                        return f"SEND {e.side.dev.ip}->{peer.side.dev.ip}: " + (
                            "nothing received" if not got else f"receive status {got[0].status}")
                    base = peer.slot * SLOT + (40 if p.kind == "UD" else 0)
                    if bytes(peer.side.arena.region("recv")[base:base + n]) != data:
                        return "SEND: received data differs"
                elif name == "WRITE":
                    # UC completes a WRITE when it is sent, not when it arrived: wait for it
                    rw = peer.side.arena.region("rw")
                    if not self._wait(lambda: bytes(rw[off:off + n]) == data, 2.0):
                        return "WRITE: data at the peer differs"
                else:
                    if bytes(e.side.arena.region("sink")[:n]) != data:
                        return "READ: data read back differs"
        return None

    def _exercise_safe(self, p: Pair) -> str | None:
        try:
            return self._exercise(p)
        except Exception as ex:  # the check reports it rather than dying with a traceback
            self.thread_errors.append("main thread (final check): " + traceback.format_exc().strip())
            return f"{type(ex).__name__}: {ex}"

    def check_pairs(self) -> None:
        for i, p in enumerate(self.pairs):
            states = [int(e.qp.qp_state) for e in p.ends]
            how = "intact"
            err = None
            if all(s == IBV_QPS_RTS for s in states):
                err = self._exercise_safe(p)
                if err is None:
                    self.checks.append(Check(f"{p.kind} pair works", True, how))
                    continue
                how = f"re-created after: {err}"
            else:
                how = f"re-created: QP states {states}"
            for e in p.ends:
                e.close()
            if p.kind == "SRQ":
                self.srq_posted = [min(x, RECV_TARGET) for x in self.srq_posted]
            p2 = self._make_pair(p.kind, i)
            self.pairs[i] = p2
            err = self._exercise_safe(p2)
            self.checks.append(Check(f"{p.kind} pair works", err is None,
                                     how if err is None else f"{how}; new pair: {err}"))

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


def _alive(dev: Any) -> bool:
    t = getattr(dev, "progress_thread", None)
    return t is not None and t.is_alive()


def _ip_int(ip: str) -> int:
    return struct.unpack("!I", socket.inet_aton(ip))[0]


def _next_ip(ip: str) -> str:
    return socket.inet_ntoa(struct.pack("!I", _ip_int(ip) + 1))


def run(a: argparse.Namespace) -> int:
    cfg = FuzzConfig(seed=a.seed, seconds=a.seconds, count=a.count, addrs=tuple(a.addrs),
                     stranger=a.stranger, pcaps=a.pcaps, icrc=a.icrc, warmup=a.warmup,
                     crash_pcap=a.crash_pcap, self_test=a.self_test, verbose=a.verbose)
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
    root = cfg.pcaps or _default_pcap_dir()
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
        err = fz._exercise(p)
        if err:
            raise ToolError(f"the devices do not work before any fuzzing: {p.kind}: {err}")
    fz._rcvd0 = fz._received()
    fz._sent0 = sum(d.counters.sent_pkts for d in devs)
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
    base = fz.measure()
    if cfg.count is not None:
        m_cnt = cfg.count - fz.stats.sent
    t_main = fz.fuzz(seeds, m_sec, m_cnt) if m_cnt is None or m_cnt > 0 else 0.0
    fz.settle()
    fz.apply_self_test()
    now = fz.measure()
    fz.check_flat(base, now)
    fz.check_memory()
    fz.check_pairs()
    st = fz.stats
    total_t = t_warm + t_main
    print(f"sent: {st.sent} frames in {total_t:.1f} s ({st.sent / max(total_t, 1e-9):.0f} "
          f"frames/s); {st.from_peer} from the peer's address, {st.to_live_qp} at a live QP, "
          f"{st.good_icrc} with a correct ICRC, {st.real_key} with a real rkey, "
          f"{st.byte_mutated} byte-mutated; {st.send_errors} send errors; "
          f"{st.legit_ops} legitimate operations alongside", file=out)
    print("mutations: " + ", ".join(f"{k} {v}" for k, v in sorted(st.mutations.items())), file=out)
    print("QP pairs reset and reconnected during the run: " + (", ".join(
        f"{k} {v}" for k, v in sorted(st.recoveries.items())) or "none"), file=out)
    print("error completions: " + (", ".join(f"{k} {v}" for k, v in sorted(
        st.wc_errors.items(), key=lambda kv: -kv[1])) or "none") + "; async events: " + (
        ", ".join(f"{k} {v}" for k, v in sorted(st.async_events.items(),
                                                key=lambda kv: -kv[1])) or "none"), file=out)
    for d in devs:
        c = d.counters
        drops = ", ".join(f"{k} {v}" for k, v in sorted(c.drops.items(), key=lambda kv: -kv[1]))
        extra = "".join(f", {k} {getattr(c, k)}" for k in ("icrc_unchecked", "sport_fallback")
                        if getattr(c, k, 0))
        print(f"{d.name}: received {c.rcvd_pkts}, sent {c.sent_pkts}, dropped "
              f"{c.dropped_pkts} ({c.dropped_pkts / max(total_t, 1e-9):.0f}/s){extra}; "
              f"drops by reason: {drops or 'none'}", file=out)
    print("checks:", file=out)
    for ch in fz.checks:
        print(f"  {'ok  ' if ch.ok else 'FAIL'} {ch.name}" + (f" ({ch.detail})" if ch.detail else ""),
              file=out)
    failed = [ch for ch in fz.checks if not ch.ok]
    if fz.thread_errors:
        print("first thread exception:\n" + fz.thread_errors[0], file=out)
    if failed:
        if any(ch.name.startswith(("progress", "no exception")) for ch in failed):
            print(f"last {len(fz.ring)} frames sent: {fz.write_crash_pcap()}", file=out)
        out.flush()
        print(f"softrdma fuzz: FAILED: {failed[0].name}: {failed[0].detail}", file=sys.stderr)
        return 1
    print(f"fuzz: all {len(fz.checks)} checks passed", file=out)
    return 0
