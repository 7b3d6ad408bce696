"""Helpers for tests and experiments: two connected endpoints on a simulated network.

    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    net = SimNetwork(seed=7, loss=0.05)
    a, b = connected_pair(net, "RC")
    b.post_recv(b.buf_sge(0, 4096), wr_id=1)
    a.post_send(IBV_WR_SEND, a.buf_sge(0, 100), wr_id=2)
    net.run_until(lambda: a.ncomp() and b.ncomp())

Each :class:`Endpoint` owns a context, PD, one CQ (send and receive), an MR with every
access right, and a QP brought to RTS with ibv_rc_pingpong's attributes (path MTU 1024,
timeout 14, retry_cnt 7, rnr_retry 7, min_rnr_timer 12) unless told otherwise.
"""

from __future__ import annotations

import itertools
from typing import Any

from .sim import SimNetwork
from ..verbs_api import (
    CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SendWR, AH,
)
from ..enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_MW_BIND, IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE, IBV_MTU_1024, IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD,
)

__all__ = ["Endpoint", "connect", "connected_pair", "ALL_ACCESS"]

ALL_ACCESS = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
              | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND)
_QPT = {"RC": IBV_QPT_RC, "UC": IBV_QPT_UC, "UD": IBV_QPT_UD}
_addr_counter = itertools.count(1)
UD_QKEY = 0x11111111


class Endpoint:
    def __init__(self, ctx: Context, qp_type: str, mr_size: int, cap: QPCap, cqe: int,
                 srq: Any = None) -> None:
        self.ctx = ctx
        self.device = ctx.device
        self.pd = PD(ctx)
        self.cq = CQ(ctx, cqe)
        self.mr = MR(self.pd, mr_size, ALL_ACCESS)
        self.qp_type = qp_type
        self.qp = QP(self.pd, QPInitAttr(qp_type=_QPT[qp_type], scq=self.cq, rcq=self.cq,
                                         srq=srq, cap=cap, sq_sig_all=0))
        self.ah: AH | None = None
        self.peer: "Endpoint | None" = None

    @property
    def gid(self):
        return self.ctx.query_gid(1, 1)

    def sge(self, offset: int, length: int) -> SGE:
        """An SGE over ``[offset, offset+length)`` of this endpoint's MR."""
        return SGE(self.mr.buf + offset, length, self.mr.lkey)

    buf_sge = sge

    def post_recv(self, sges: SGE | list[SGE], wr_id: int = 0) -> None:
        self.qp.post_recv(RecvWR(wr_id, sg=sges if isinstance(sges, list) else [sges]))

    def post_send(self, opcode: int, sges: SGE | list[SGE] | None = None, wr_id: int = 0,
                  *, remote_offset: int | None = None, imm: int = 0, compare_add: int = 0,
                  swap: int = 0, flags: int = 2, rkey: int | None = None) -> SendWR:
        sg = [] if sges is None else (sges if isinstance(sges, list) else [sges])
        wr = SendWR(wr_id, opcode=opcode, sg=sg, imm_data=imm, send_flags=flags)
        peer = self.peer
        if remote_offset is not None and peer is not None:
            wr.remote_addr = peer.mr.buf + remote_offset
            wr.rkey = peer.mr.rkey if rkey is None else rkey
            wr.compare_add = compare_add
            wr.swap = swap
        if self.qp_type == "UD" and peer is not None:
            wr.set_wr_ud(self.ah, peer.qp.qp_num, UD_QKEY)
        self.qp.post_send(wr)
        return wr

    def ncomp(self) -> int:
        return len(self.cq)

    def close(self) -> None:
        self.ctx.close()


def connect(e: Endpoint, peer: Endpoint, sq_psn: int, rq_psn: int, **overrides: Any) -> None:
    """Bring ``e``'s QP to RTS towards ``peer``'s (one direction: call it for both sides),
    with send PSN ``sq_psn`` and expected receive PSN ``rq_psn``; ``overrides`` are
    :class:`QPAttr` fields set last (``timeout=8``, ``path_mtu=...``)."""
    a = QPAttr(port_num=1)
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC
    a.path_mtu = IBV_MTU_1024
    a.max_dest_rd_atomic = a.max_rd_atomic = 4
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
    a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=peer.gid, sgid_index=1, hop_limit=64))
    a.dest_qp_num, a.rq_psn, a.sq_psn = peer.qp.qp_num, rq_psn, sq_psn
    a.qkey = UD_QKEY
    for k, v in overrides.items():
        setattr(a, k, v)
    e.qp.to_rts(a)
    if e.qp_type == "UD":
        e.ah = AH(e.pd, attr=AHAttr(is_global=1, gr=GlobalRoute(dgid=peer.gid, sgid_index=1,
                                                                 hop_limit=64)))
    e.peer = peer


def connected_pair(net: SimNetwork, qp_type: str = "RC", *, mr_size: int = 1 << 20,
                   cap: QPCap | None = None, cqe: int = 4096, psns: tuple[int, int] = (100, 0xFFFFF0),
                   mtu: int = 1500, a_attrs: dict | None = None,
                   b_attrs: dict | None = None) -> tuple[Endpoint, Endpoint]:
    """Two endpoints on two new devices of ``net`` (addresses 10.200.x.1 and 10.200.x.2),
    their QPs connected and in RTS. ``psns`` are the two send PSNs (the second one close to
    the 24-bit wrap on purpose)."""
    n = next(_addr_counter)
    da = net.add_device(f"10.{200 + n // 250}.{n % 250}.1", mtu=mtu)
    db = net.add_device(f"10.{200 + n // 250}.{n % 250}.2", mtu=mtu)
    cap = cap or QPCap(max_send_wr=256, max_recv_wr=256, max_send_sge=4, max_recv_sge=4,
                       max_inline_data=64)
    a = Endpoint(Context(name=da.name), qp_type, mr_size, cap, cqe)
    b = Endpoint(Context(name=db.name), qp_type, mr_size, cap, cqe)
    connect(a, b, psns[0], psns[1], **(a_attrs or {}))
    connect(b, a, psns[1], psns[0], **(b_attrs or {}))
    return a, b
