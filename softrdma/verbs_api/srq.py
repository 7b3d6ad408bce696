"""Shared receive queues.

``SRQ(pd, SrqInitAttr(SrqAttr(max_wr=..., max_sge=...)))``. Arm the limit with
``srq.modify(SrqAttr(srq_limit=n), IBV_SRQ_LIMIT)``: when the number of posted receives
falls below ``n`` the SRQ raises IBV_EVENT_SRQ_LIMIT_REACHED once and disarms.

:class:`SRQ` is the API on both backends; it holds a :class:`SoftSRQ` (here: the queue of
receive WQEs the soft QPs' responders take from) or a ``softrdma.ibverbs.queues.HwSRQ``.
"""

from __future__ import annotations

import errno
from collections import deque
from typing import Any

from ..errors import PyverbsRDMAError
from ._check import U32, as_bits, as_int, require
from ..qp.wqe import RecvWqe
from .attr import SrqAttr, SrqInitAttr
from .base import Sibling
from ..completion import AsyncEvent
from .cq import ring_size
from .posting import check_wr_arg, recv_wqe, wr_chain
from .enums import ibv_event_type, ibv_srq_attr_mask
from .wr import RecvWR
from .pd import PD

__all__ = ["SRQ", "SoftSRQ"]


class SRQ(Sibling):
    """``ibv_srq``: receives shared by the QPs created with it."""

    _kind = "SRQ"
    _pool = "srq"

    def __init__(self, pd: Any, init_attr: SrqInitAttr) -> None:
        what = "Failed to create SRQ"
        require(pd, PD, what, "pd")
        pd._check()
        require(init_attr, SrqInitAttr, what, "init_attr")
        a = require(init_attr.attr, SrqAttr, what, "init_attr.attr")
        for name in ("max_wr", "max_sge", "srq_limit"):
            as_int(getattr(a, name), what, f"init_attr.attr.{name}", U32)
        pd.context.backend.SRQ.check_create(pd, a, what)
        self._create(pd.context, "SRQ", pd, a)
        self.pd = pd
        self.srq_context = init_attr.srq_context
        self._use(pd)

    @property
    def max_wr(self) -> int:
        return self.impl.max_wr

    @property
    def max_sge(self) -> int:
        return self.impl.max_sge

    @property
    def srq_limit(self) -> int:
        return self.impl.srq_limit

    def post_recv(self, wr: RecvWR | list[RecvWR], bad_wr: RecvWR | None = None) -> None:
        """Post receive WRs (a chain or a list) for the QPs of this SRQ; errors as for
        ``QP.post_recv``."""
        self._check()
        self.impl.post_recv(wr, bad_wr)

    def modify(self, attr: SrqAttr, attr_mask: int) -> None:
        """``ibv_modify_srq``: IBV_SRQ_MAX_WR and/or IBV_SRQ_LIMIT (arms the limit event)."""
        self._check()
        require(attr, SrqAttr, "Failed to modify SRQ", "attr")
        self.impl.modify(attr, attr_mask)

    def query(self) -> SrqAttr:
        self._check()
        return self.impl.query()

    def _parents(self) -> tuple[Any, ...]:
        return (self.pd,)


class SoftSRQ:
    """A soft SRQ: its receive queue, and :meth:`take` for the responders (the engine
    holds this object, not the API one)."""

    extras = frozenset({"rq", "take"})

    @staticmethod
    def check_create(pd: Any, a: SrqAttr, what: str) -> None:
        """rxe_srq_chk_init: the sizes within the device's limits."""
        lim = pd.device.limits
        if a.max_wr <= 0 or a.max_wr > lim.max_srq_wr:
            raise PyverbsRDMAError(f"{what}: max_wr {a.max_wr} is outside 1..{lim.max_srq_wr}",
                                   errno.EINVAL)
        if a.max_sge <= 0 or a.max_sge > lim.max_srq_sge:
            raise PyverbsRDMAError(f"{what}: max_sge {a.max_sge} is outside 1..{lim.max_srq_sge}",
                                   errno.EINVAL)
        if a.srq_limit > a.max_wr:
            raise PyverbsRDMAError(f"{what}: srq_limit {a.srq_limit} > max_wr {a.max_wr}",
                                   errno.EINVAL)

    def __init__(self, owner: SRQ, pd: Any, a: SrqAttr) -> None:
        self.owner = owner  # the SRQ that events name
        self.device = pd.device
        self.pd = pd
        self.max_wr = ring_size(a.max_wr)
        self.max_sge = a.max_sge
        self.srq_limit = a.srq_limit
        self.rq: deque[RecvWqe] = deque()

    @property
    def closed(self) -> bool:
        return self.owner.closed

    def post_recv(self, wr: RecvWR | list[RecvWR], bad_wr: RecvWR | None = None) -> None:
        check_wr_arg(wr, bad_wr, RecvWR, "Failed to post receive to SRQ")
        with self.device.lock:
            for i, w in enumerate(wr_chain(wr)):
                try:
                    if len(self.rq) >= self.max_wr:
                        raise PyverbsRDMAError("Failed to post receive to SRQ: the SRQ is full",
                                               errno.ENOMEM)
                    wqe = recv_wqe(self.device, self.pd, w, self.max_sge, "SRQ", i)
                except PyverbsRDMAError as e:
                    e.bad_wr = w
                    e.bad_wr_index = i
                    if bad_wr is not None and type(w) is type(bad_wr):
                        bad_wr.__dict__.update(w.__dict__)
                    raise
                self.rq.append(wqe)
                if self.device.trace is not None:
                    self.device.trace.emit(self.device, "wqe", None,
                                           f"post_srq_recv wr_id={wqe.wr_id} len={wqe.length}",
                                           queue="srq", wr_id=wqe.wr_id, len=wqe.length)

    def take(self) -> RecvWqe | None:
        """Pop the next receive for a QP's responder, raising the limit event if due."""
        if not self.rq:
            return None
        wqe = self.rq.popleft()
        if self.srq_limit and len(self.rq) < self.srq_limit:
            self.srq_limit = 0
            self.device.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_SRQ_LIMIT_REACHED,
                                              self.owner))
        return wqe

    def modify(self, attr: SrqAttr, attr_mask: int) -> None:
        what = "Failed to modify SRQ"
        lim = self.device.limits
        # plain ints: an IntFlag complement would miss bits above the defined ones
        attr_mask = as_bits(attr_mask, what, "attr_mask", int(ibv_srq_attr_mask.IBV_SRQ_MAX_WR)
                            | int(ibv_srq_attr_mask.IBV_SRQ_LIMIT), noun="mask bits")
        if attr_mask & ibv_srq_attr_mask.IBV_SRQ_MAX_WR:
            as_int(attr.max_wr, what, "attr.max_wr", U32)
        if attr_mask & ibv_srq_attr_mask.IBV_SRQ_LIMIT:
            as_int(attr.srq_limit, what, "attr.srq_limit", U32)
        with self.device.lock:
            new_max = self.max_wr
            if attr_mask & ibv_srq_attr_mask.IBV_SRQ_MAX_WR:
                if attr.max_wr <= 0 or attr.max_wr > lim.max_srq_wr:
                    raise PyverbsRDMAError(f"{what}: max_wr {attr.max_wr} is outside "
                                           f"1..{lim.max_srq_wr}", errno.EINVAL)
                if attr.max_wr < len(self.rq):
                    raise PyverbsRDMAError(f"{what}: max_wr {attr.max_wr} < the {len(self.rq)} "
                                           f"receives posted", errno.EINVAL)
                new_max = ring_size(attr.max_wr)
            if attr_mask & ibv_srq_attr_mask.IBV_SRQ_LIMIT:
                if attr.srq_limit > new_max:
                    raise PyverbsRDMAError(f"{what}: srq_limit {attr.srq_limit} > max_wr "
                                           f"{new_max}", errno.EINVAL)
                self.srq_limit = attr.srq_limit
            self.max_wr = new_max

    def query(self) -> SrqAttr:
        return SrqAttr(max_wr=self.max_wr, max_sge=self.max_sge, srq_limit=self.srq_limit)

    def destroy(self) -> None:
        pass
