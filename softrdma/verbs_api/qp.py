"""Queue pairs: create, modify (the state machine), query, post, destroy.

``QP(pd, QPInitAttr(...), qp_attr=None)`` creates a QP in RESET; with ``qp_attr`` it moves
an RC/UC QP to INIT and a UD QP to RTS, as pyverbs does. ``modify(attr, mask)`` applies
the kernel's transition table (see :mod:`softrdma.qp.transitions`) and rxe's attribute
checks; a failed modify changes nothing. ``to_init``/``to_rtr``/``to_rts`` use the masks
pyverbs uses.

What each state allows (IBTA, as rxe enforces it): ``post_recv`` from INIT on (EINVAL in
RESET); ``post_send`` in RTS, SQD, SQE and ERR (EINVAL before RTS). Entering ERR completes
every outstanding work request of both queues with IBV_WC_WR_FLUSH_ERR, and anything
posted afterwards is flushed the same way. RESET empties both queues without completions.

One API, two backends: :class:`QP` is what programs (and pyverbs_compat's subclass) see on
either backend. It checks the arguments both backends check, keeps the creation
attributes and the lifetime rules (:class:`~.base.Resource`), and holds an implementation
chosen by the PD's context: ``context.backend.QP``, :class:`~.soft_qp.SoftQP` on a soft
device, :class:`softrdma.ibverbs.queues.HwQP` on a libibverbs one. Each verb is one
attribute lookup and one call into it.
"""

from __future__ import annotations

import errno
from typing import Any

from ..errors import PyverbsRDMAError
from ..qp.transitions import TRANSITIONS, required_mask
from ._check import U32, as_flag, as_int, require
from .attr import GID, QPAttr, QPCap, QPInitAttr
from .base import Sibling
from .cq import CQ
from .enums import ibv_qp_state as S, ibv_qp_type as T
from .mr import MW, MWBind
from .pd import PD
from .srq import SRQ
from .wr import RecvWR, SendWR

__all__ = ["QP", "check_cap"]


def _mgid(gid: Any, what: str) -> bytes:
    """The 16 bytes of a multicast GID (a GID, 16 bytes or an address as text, as
    :meth:`GID.parse` takes them); EINVAL if it is not multicast (rdma_is_multicast_addr)."""
    from ..soft.mcast import is_multicast_gid
    raw = GID.parse(gid, what).raw
    if not is_multicast_gid(raw):
        raise PyverbsRDMAError(f"{what}: {GID(raw).gid} is not a multicast GID", errno.EINVAL)
    return raw


def check_cap(cap: Any, what: str, field: str) -> QPCap:
    """``cap`` (a QPCap or None for the defaults) with every field a C ``uint32_t``."""
    cap = require(cap, QPCap, what, field, optional=True) or QPCap()
    for name in ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge",
                 "max_inline_data"):
        as_int(getattr(cap, name), what, f"{field}.{name}", U32)
    return cap


class QP(Sibling):
    """``ibv_qp``: the verbs of a queue pair, on the backend of the PD's context."""

    _kind = "QP"
    _pool = "qp"

    def __init__(self, pd_or_ctx: Any, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
        what = "Failed to create QP"
        pd = require(pd_or_ctx, PD, what, "pd")
        pd._check()
        require(init_attr, QPInitAttr, what, "init_attr")
        require(qp_attr, QPAttr, what, "qp_attr", optional=True)
        dev = pd.device
        qpt = as_int(init_attr.qp_type, what, "init_attr.qp_type", U32)
        scq, rcq, srq = init_attr.scq, init_attr.rcq, init_attr.srq
        if scq is None or rcq is None:
            raise PyverbsRDMAError(f"{what}: both a send CQ (init_attr.scq) and a receive CQ "
                                   f"(init_attr.rcq) are required", errno.EINVAL)
        # A PD (or anything else) where a CQ belongs would only fail at the first completion,
        # inside the data path: refuse it here, by name.
        require(scq, CQ, what, "init_attr.scq")
        require(rcq, CQ, what, "init_attr.rcq")
        require(srq, SRQ, what, "init_attr.srq", optional=True)
        for name, o in (("init_attr.scq", scq), ("init_attr.rcq", rcq), ("init_attr.srq", srq)):
            if o is not None:
                o._check()
                if o.device is not dev:
                    raise PyverbsRDMAError(f"{what}: {name} is from another device", errno.EINVAL)
        # (an SRQ may be in another PD of the same context: the verbs allow it)
        cap = check_cap(init_attr.cap, what, "init_attr.cap")
        sq_sig_all = as_flag(init_attr.sq_sig_all, what, "init_attr.sq_sig_all")
        impl_cls = pd.context.backend.QP
        impl_cls.check_create(pd, qpt, cap, srq, what)
        impl = self._create(pd.context, "QP", pd, qpt, cap, scq, rcq, srq, sq_sig_all)
        self.qp_num: int = impl.qp_num
        self.pd = pd
        self.qp_type = impl.qp_type
        self.qp_context = init_attr.qp_context
        self.send_cq = scq
        self.recv_cq = rcq
        self.srq = srq
        self.sq_sig_all = sq_sig_all
        self.cap: QPCap = impl.cap  # what the device granted
        init_attr.cap = QPCap(**impl.cap.__dict__)
        self._use(pd, scq, rcq, srq)
        if qp_attr is not None:
            if self.qp_type == T.IBV_QPT_UD:
                self.to_rts(qp_attr)
            else:
                self.to_init(qp_attr)

    # -- state ------------------------------------------------------------------------
    @property
    def state(self) -> int:
        """The QP's state (on a device: as ``ibv_query_qp`` reports it)."""
        return self.impl.state

    @property
    def qp_state(self) -> int:
        return self.impl.state

    @property
    def attr(self) -> QPAttr:
        """The current attributes (the soft engine's own record; a device's query)."""
        return self.impl.attr

    @property
    def sq_draining(self) -> bool:
        return self.impl.sq_draining

    @property
    def duplicate_requests(self) -> int | None:
        """How many duplicate requests this QP's responder answered (soft backend: the
        responder's count; None on a device, which does not say)."""
        return self.impl.duplicate_requests

    # -- modify ----------------------------------------------------------------------
    def modify(self, attr: QPAttr, attr_mask: int) -> None:
        """ibv_modify_qp: apply the attributes of ``attr`` that ``attr_mask`` names; the
        other attributes of ``attr`` are not read. All or nothing: a failure changes nothing."""
        self._check()
        self.impl.modify(attr, attr_mask)

    def to_error(self) -> None:
        """Move to ERR, completing everything outstanding with IBV_WC_WR_FLUSH_ERR."""
        self.impl.to_error()

    def flush(self) -> None:
        """Complete what is queued with IBV_WC_WR_FLUSH_ERR (a QP in ERR; a device does
        this by itself)."""
        self.impl.flush()

    def to_init(self, attr: QPAttr) -> None:
        """RESET -> INIT with the attributes that move needs (pyverbs ``to_init``)."""
        self._to(attr, S.IBV_QPS_INIT)

    def to_rtr(self, attr: QPAttr) -> None:
        """... -> RTR, through INIT if the QP is in RESET."""
        if self.state == S.IBV_QPS_RESET:
            self.to_init(attr)
        self._to(attr, S.IBV_QPS_RTR)

    def to_rts(self, attr: QPAttr) -> None:
        """... -> RTS, through INIT and RTR as needed."""
        if self.state in (S.IBV_QPS_RESET, S.IBV_QPS_INIT):
            self.to_rtr(attr)
        self._to(attr, S.IBV_QPS_RTS)

    def _to(self, attr: QPAttr, new: int) -> None:
        """Modify to ``new`` with exactly the mask the transition table requires."""
        cur = self.state
        if (S(cur), S(new)) not in TRANSITIONS:
            raise PyverbsRDMAError(f"Failed to modify QP: {S(cur).name}->{S(new).name} is not "
                                   f"a legal transition", errno.EINVAL)
        attr.qp_state = new
        self.modify(attr, required_mask(cur, new, self.qp_type))

    def query(self, attr_mask: int = 0) -> tuple[QPAttr, QPInitAttr]:
        """ibv_query_qp: the current attributes and the creation attributes."""
        self._check()
        a, cap, sq_sig_all = self.impl.query(attr_mask)
        ia = QPInitAttr(qp_type=self.qp_type, qp_context=self.qp_context, scq=self.send_cq,
                        rcq=self.recv_cq, srq=self.srq, cap=cap, sq_sig_all=sq_sig_all)
        return a, ia

    # -- posting ---------------------------------------------------------------------
    def post_recv(self, wr: RecvWR | list[RecvWR], bad_wr: RecvWR | None = None) -> None:
        """Post receive WRs (a chain or a list). On failure raises PyverbsRDMAError with
        ``bad_wr`` (and ``bad_wr_index``) naming the first WR not posted; earlier WRs stay
        posted, as with ibv_post_recv. Every field is checked before the WR is queued."""
        self._check()
        self.impl.post_recv(wr, bad_wr)

    def post_send(self, wr: SendWR | list[SendWR], bad_wr: SendWR | None = None) -> None:
        """Post send WRs (a chain or a list); errors as for :meth:`post_recv`.

        Every field of every WR is checked before it is queued (types, C widths, known
        flag bits, object classes; see :mod:`softrdma.verbs_api._check`): a WR the
        engines accept can no longer fail in a way that escapes its QP."""
        self._check()
        self.impl.post_send(wr, bad_wr)

    def bind_mw(self, mw: Any, mw_bind: Any) -> None:
        """ibv_bind_mw for a type 1 window: posts a bind WR; on success ``mw.rkey`` is the
        new rkey once the bind completes (IBV_WC_BIND_MW)."""
        self._check()
        what = "Failed to bind MW"
        require(mw, MW, what, "mw")
        mw._check()
        require(mw_bind, MWBind, what, "mw_bind")
        if mw.mw_type != 1:
            raise PyverbsRDMAError(f"{what}: use an IBV_WR_BIND_MW work request for type 2 "
                                   f"windows", errno.EINVAL)
        self.impl.bind_mw(mw, mw_bind)

    # -- multicast --------------------------------------------------------------------
    def attach_mcast(self, gid: Any, lid: int = 0) -> None:
        """ibv_attach_mcast: this UD QP receives what is sent to the multicast group
        ``gid`` (16 bytes, a GID object or a GID string: ``::ffff:239.1.2.3`` for an IPv4
        group, ``ff15::1`` for IPv6); ``lid`` is ignored on RoCE. EINVAL for a QP that is
        not UD or a GID that is not multicast (ib_attach_mcast); attaching twice is one
        attach (rxe). See softrdma.soft.mcast."""
        self._check()
        mgid = _mgid(gid, "Failed to attach QP to multicast group")
        if self.qp_type != T.IBV_QPT_UD:
            raise PyverbsRDMAError("Failed to attach QP to multicast group: only UD QPs join "
                                   "multicast groups", errno.EINVAL)
        self.impl.attach_mcast(mgid, int(lid))

    def detach_mcast(self, gid: Any, lid: int = 0) -> None:
        """ibv_detach_mcast: EINVAL if the QP is not attached to ``gid``."""
        self._check()
        mgid = _mgid(gid, "Failed to detach QP from multicast group")
        if self.qp_type != T.IBV_QPT_UD:
            raise PyverbsRDMAError("Failed to detach QP from multicast group: not a UD QP",
                                   errno.EINVAL)
        self.impl.detach_mcast(mgid, int(lid))

    # -- destroy ----------------------------------------------------------------------
    def _parents(self) -> tuple[Any, ...]:
        return self.pd, self.send_cq, self.recv_cq, self.srq

    def __repr__(self) -> str:
        return self.impl.describe(self.closed)
