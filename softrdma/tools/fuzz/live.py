"""The live setup the fuzzer fires at: two devices' arenas, MRs and QP pairs.

Each device owns an *arena*: one bytearray out of which its MRs are carved, each MR
between guard areas, plus MRs that peers may not write (remote read only, local write
only, no access, full access but in another PD) and a stretch that is never registered.
Only three ranges of an arena may change: the MR the peer may write (remote
write/atomic), the receive buffers and the sink that RDMA READ and atomic results land
in. Everything else is filled with a seeded pattern and compared byte for byte at the end
(:mod:`.checks`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ...enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_MTU_1024,
    IBV_QPT_RC,
    IBV_QPT_UC,
    IBV_QPT_UD,
)
from ...verbs_api import (
    AH,
    CQ,
    MR,
    PD,
    QP,
    SGE,
    AHAttr,
    Context,
    GlobalRoute,
    QPAttr,
    QPCap,
    QPInitAttr,
)

__all__ = ["Region", "Arena", "ARENA_LAYOUT", "Side", "End", "Pair", "KINDS", "connect",
           "RW", "UD_QKEY", "GUARD", "SLOT", "QP_DEPTH", "RECV_TARGET"]

RW = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
    IBV_ACCESS_REMOTE_ATOMIC
UD_QKEY = 0x11111111
GUARD = 4096  # bytes of pattern before and after every region of an arena
SLOT = 8192  # receive slot per QP; a fuzzed SEND longer than this is a length error
QP_DEPTH = 64
RECV_TARGET = 16  # receives kept posted per QP (and on each SRQ)


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

    def psns(self) -> tuple[int, int, int] | None:
        """(expected, oldest unacknowledged, next) PSN of this QP's engine, read from the
        device the fuzzer drives (None if the device has no such QP)."""
        eng = self.side.dev.qps.get(self.qpn)
        return None if eng is None else eng.psn_state

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


def connect(e: End, peer: End, sq_psn: int, rq_psn: int) -> None:
    """Bring ``e``'s QP to RTS towards ``peer``'s (one direction)."""
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
