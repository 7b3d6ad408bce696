"""One QP as the protocol core owns it (rxe's ``struct rxe_qp``): its state, attributes,
queues and address, and its requester, completer and responder, plus the QP's timers.

Sans-IO: it never touches a socket or a clock. Everything it needs from above comes
through the Protocols of :mod:`softrdma.qp.interfaces`, handed in at creation: the device
(:class:`~softrdma.qp.interfaces.DeviceServices`: time, counters, key table, transmit,
timers, async events), the send and receive CQs
(:class:`~softrdma.qp.interfaces.CompletionSink`) and an optional SRQ
(:class:`~softrdma.qp.interfaces.RecvSource`). The device hands it packets
(:meth:`on_packet`), asks it when it next needs waking (:attr:`deadline`) and wakes it
(:meth:`on_timer`); a responder with more of a READ's response to send than one pass
may asks the device for another pass, which the device gives with :meth:`run_responder`
(rxe reschedules the QP's responder task). The verbs ``QP`` is a thin translation layer over it, as
``rxe_verbs.c`` is over ``rxe_qp``; ``owner`` is that object, used only as the element of
the async events the engine raises.

Fault containment: the entry points from outside (:meth:`on_packet` from the receive path,
:meth:`on_timer` from the device's timers, :meth:`run_responder` from its progress passes,
:meth:`kick` from post_send and modify) catch
any exception the protocol code did not expect and hand it to :meth:`fault`, which moves
this QP alone to ERR, as a hardware QP that hit an internal error: outstanding WRs
complete with IBV_WC_WR_FLUSH_ERR, IBV_EVENT_QP_FATAL is raised, the device's
``qp_fatal`` counter counts it and the ``softrdma`` logger reports it once with its
traceback. The device, and every other QP on it, go on. Errors the protocol defines (a
NAK, a bad key, a retry limit) are not faults: the engines complete them as rxe does.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from ..completion import WC, WC_RECV, AsyncEvent, wc_opcode_of
from ..enums import (
    ibv_event_type, ibv_qp_state as S, ibv_qp_type as T, ibv_wc_status as WCS, mtu_to_bytes,
)
from .completer import Completer
from .interfaces import AttrView, CompletionSink, DeviceServices, RecvSource
from .params import qp_timeout_seconds, udp_sport_for_path, udp_sport_for_qpn
from .psn import psn_diff
from .requester import Requester
from .responder import Responder
from .wqe import RecvWqe, SendWqe, WqeState

__all__ = ["QpEngine"]

log = logging.getLogger("softrdma")
_FLUSH = int(WCS.IBV_WC_WR_FLUSH_ERR)


class QpEngine:
    __slots__ = ("device", "owner", "qp_num", "qp_type", "pd", "send_cq", "recv_cq", "srq",
                 "state", "attr", "av", "sq", "rq", "comm_est_sent", "last_wqe_sent",
                 "closed", "req", "comp", "resp", "src_port", "dst_ip", "tos", "retrans_at", "rnr_at")

    def __init__(self, device: DeviceServices, qp_num: int, qp_type: int, pd: Any,
                 send_cq: CompletionSink, recv_cq: CompletionSink, srq: RecvSource | None,
                 attr: AttrView, owner: Any = None) -> None:
        self.device = device
        self.owner = owner if owner is not None else self
        self.qp_num = qp_num
        self.qp_type = qp_type
        self.pd = pd  # compared by identity with the PD of every key the QP uses
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.srq = srq
        self.state = S.IBV_QPS_RESET
        self.attr = attr
        self.av: Any = None  # the path (AddressVector) once IBV_QP_AV is set
        self.sq: deque[SendWqe] = deque()
        self.rq: deque[RecvWqe] = deque()
        self.comm_est_sent = False
        self.last_wqe_sent = False
        self.closed = False
        self.req = Requester(self)
        self.comp = Completer(self)
        self.resp = Responder(self)
        self.src_port = udp_sport_for_qpn(qp_num)
        self.dst_ip: bytes | None = None
        #: the primary path's traffic class: the IP TOS of what this QP sends (rxe's av)
        self.tos = 0
        self.retrans_at: float | None = None
        self.rnr_at: float | None = None

    # -- control path (called under the device lock) ---------------------------------------
    def set_sq_psn(self, psn: int) -> None:
        self.req.psn = psn
        self.comp.psn = psn

    def set_rq_psn(self, psn: int) -> None:
        self.resp.psn = psn
        self.resp.ack_psn = psn

    def set_av(self, av: Any) -> None:
        self.av = av
        self.dst_ip = av.dst_ip
        self.tos = av.traffic_class & 0xFF
        if self.qp_type in (T.IBV_QPT_RC, T.IBV_QPT_UC):
            self.src_port = udp_sport_for_path(av.flow_label, self.qp_num,
                                               self.attr.dest_qp_num)

    def set_resp_resources(self, n: int) -> None:
        self.resp.set_resources(n)

    def set_state(self, new: int, fresh_attr: AttrView | None = None) -> None:
        """Enter state ``new`` (the transition was checked by the caller). RESET forgets
        everything (``fresh_attr`` replaces the attributes); ERR flushes both queues;
        RTR fixes the source port; RTS and SQD let the requester run."""
        old = self.state
        self.state = new
        if self.device.trace is not None and old != new:
            self.trace("qp", f"state {S(old).name[8:]} -> {S(new).name[8:]}",
                       old=S(old).name, new=S(new).name)
        if new == S.IBV_QPS_RESET:
            if fresh_attr is not None:
                self.attr = fresh_attr
            self.sq.clear()
            if self.srq is None:
                self.rq.clear()
            self.av = None
            self.comm_est_sent = False
            self.last_wqe_sent = False  # a reused QP reports LAST_WQE_REACHED again
            self.req.reset()
            self.comp.reset()
            self.resp.reset()
            self.src_port = udp_sport_for_qpn(self.qp_num)
            self.dst_ip = None
            self.tos = 0
            self._cancel_timers()
        self.attr.qp_state = self.attr.cur_qp_state = new
        if new == S.IBV_QPS_ERR:
            if old != S.IBV_QPS_ERR:
                self._cancel_timers()
            self.resp.drop_pending()
            self.flush()
        elif new == S.IBV_QPS_RTR and self.qp_type in (T.IBV_QPT_RC, T.IBV_QPT_UC) and self.av:
            # the source port hashes both QP numbers, known now
            self.src_port = udp_sport_for_path(self.av.flow_label, self.qp_num,
                                               self.attr.dest_qp_num)
        elif new == S.IBV_QPS_RTS:
            if old == S.IBV_QPS_RTR:
                self.req.rd_atomic = self.attr.max_rd_atomic
                self.comp.reset_retry_counters()
            self.req.drained_sent = False
            self.kick()
        elif new == S.IBV_QPS_SQD:
            self.req.drained_sent = False
            self.kick()

    def to_error(self) -> None:
        """Move to ERR from inside the data path (a fatal completion, a protocol error)."""
        if self.state not in (S.IBV_QPS_ERR, S.IBV_QPS_RESET):
            self.set_state(S.IBV_QPS_ERR)

    def flush(self) -> None:
        """Complete every outstanding WR with IBV_WC_WR_FLUSH_ERR (the QP is in ERR). With
        an SRQ the receives are not the QP's: tell the owner once (LAST_WQE_REACHED)."""
        sq = self.sq
        while sq:
            w = sq.popleft()
            self.send_cq.push(WC(wr_id=w.wr_id, status=_FLUSH, opcode=wc_opcode_of(w.opcode),
                                 qp_num=self.qp_num))
        if self.srq is None:
            rq = self.rq
            while rq:
                r = rq.popleft()
                self.recv_cq.push(WC(wr_id=r.wr_id, status=_FLUSH, opcode=WC_RECV,
                                     qp_num=self.qp_num))
        elif not self.last_wqe_sent:
            self.last_wqe_sent = True
            self.device.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_QP_LAST_WQE_REACHED,
                                              self.owner))

    @property
    def psn_state(self) -> tuple[int, int, int]:
        """(the PSN the responder expects next, the oldest PSN the completer waits an ACK
        for, the PSN the requester sends next): rxe's resp.psn, comp.psn and req.psn, for
        tools that aim packets at a QP (``softrdma fuzz``)."""
        return self.resp.psn, self.comp.psn, self.req.psn

    @property
    def sq_draining(self) -> bool:
        return self.state == S.IBV_QPS_SQD and self.in_flight()

    def destroy(self) -> None:
        self.closed = True
        self._cancel_timers()

    # -- data path -------------------------------------------------------------------------
    def mtu(self) -> int:
        qp = self
        if qp.qp_type == T.IBV_QPT_UD:
            return mtu_to_bytes(self.device.active_mtu)
        return mtu_to_bytes(qp.attr.path_mtu)

    def kick(self) -> None:
        """Work was posted (or the state allows more): let the requester send what it can."""
        try:
            self.req.run()
        except Exception as e:  # contained: see fault()
            self.fault(e, "send")

    def req_wake(self) -> None:
        """The completer freed something the requester may be waiting on."""
        req = self.req
        if req.need_retry or req.wait_psn or req.wait_fence or req.need_rd_atomic or \
                req.wqe_index < len(self.sq):
            req.wait_psn = False
            req.run()
        self._rearm_retrans()

    def in_flight(self) -> bool:
        """Some WQE was (partly) sent and is not complete yet."""
        for w in self.sq:
            if w.state in (WqeState.PROCESSING, WqeState.PENDING):
                return True
            if w.state == WqeState.POSTED:
                return False
        return False

    def on_packet(self, pkt: Any, ip_header: bytes) -> None:
        # A try block costs nothing until something raises (Python 3.11+): no per-packet work.
        try:
            if pkt.info.is_request:
                self.resp.on_request(pkt, ip_header)
            else:
                self.comp.on_response(pkt)
                self._rearm_retrans()
        except Exception as e:  # contained: see fault()
            self.fault(e, "receive")

    def run_responder(self) -> None:
        """The device's pass for this QP's responder, which asked for it
        (``DeviceServices.schedule_responder``): the next batch of the READ response
        under way, then the requests that waited for it (:meth:`Responder.resume`)."""
        if self.closed:
            return
        try:
            self.resp.resume()
        except Exception as e:  # contained: see fault()
            self.fault(e, "send")

    def fault(self, exc: BaseException, where: str) -> None:
        """An unexpected exception escaped this QP's protocol code (``where``: "receive",
        "send" or "timer"). Contain it to this QP: move it to ERR (outstanding WRs complete
        with IBV_WC_WR_FLUSH_ERR), raise IBV_EVENT_QP_FATAL, count it in the device's
        ``qp_fatal`` counter and log it once. Never raises: the caller is the receive
        path, the timer loop or post_send, none of which may die because one QP did."""
        qp = self
        dev = self.device
        dev.counters.qp_fatal += 1
        log.error("%s: QP 0x%x hit an unexpected %s in its %s path; the QP is moved to ERR "
                  "(IBV_EVENT_QP_FATAL), the device goes on", dev.name, qp.qp_num,
                  type(exc).__name__, where, exc_info=exc)
        was = qp.state
        try:
            qp.to_error()
        except Exception:
            # The state is too damaged even to flush (a CQ that cannot take a completion):
            # drop the work without completions rather than leave a half-alive QP.
            log.debug("flushing QP 0x%x after its fault failed too", qp.qp_num, exc_info=True)
            qp.state = qp.attr.qp_state = qp.attr.cur_qp_state = S.IBV_QPS_ERR
            qp.sq.clear()
            if qp.srq is None:
                qp.rq.clear()
        # Never leave a timer armed on a faulted QP: it would fire (and fault) forever.
        self.retrans_at = self.rnr_at = None
        dev.timer_changed(self)
        if was not in (S.IBV_QPS_ERR, S.IBV_QPS_RESET):
            dev.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_QP_FATAL, self.owner))

    # -- timers -------------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        a, b = self.retrans_at, self.rnr_at
        if a is None:
            return b
        if b is None:
            return a
        return min(a, b)

    def trace(self, kind: str, msg: str, **fields: Any) -> None:
        """One trace event of this QP (callers test ``device.trace`` first: no cost off)."""
        tr = self.device.trace
        if tr is not None:
            tr.emit(self.device, kind, self.qp_num, msg, **fields)

    def _set_timer(self, which: str, at: float | None, fired: bool = False) -> None:
        if self.device.trace is not None and not fired and \
                (at is None) != (getattr(self, which) is None):
            name = "retransmit" if which == "retrans_at" else "RNR"
            if at is None:
                self.trace("timer", f"{name} timer stopped", timer=name, action="stop")
            else:
                self.trace("timer", f"{name} timer armed: fires in "
                                    f"{at - self.device.now:.6f} s", timer=name,
                           action="arm", at=at)
        setattr(self, which, at)
        self.device.timer_changed(self)

    def arm_retrans_if_idle(self) -> None:
        """update_state: arm the retransmit timer unless it is already running."""
        if self.retrans_at is None:
            t = qp_timeout_seconds(self.attr.timeout)
            if t is not None:
                self._set_timer("retrans_at", self.device.now + t)

    def _rearm_retrans(self) -> None:
        """COMPST_EXIT: push the timer out while there are unacknowledged packets."""
        qp = self
        if qp.qp_type != T.IBV_QPT_RC or qp.state not in (S.IBV_QPS_RTS, S.IBV_QPS_SQD):
            return
        if psn_diff(self.req.psn, self.comp.psn) > 0:
            t = qp_timeout_seconds(qp.attr.timeout)
            if t is not None:
                self._set_timer("retrans_at", self.device.now + t)
        elif self.retrans_at is not None:
            self._set_timer("retrans_at", None)

    def arm_rnr(self, seconds: float) -> None:
        self._set_timer("rnr_at", self.device.now + seconds)

    def _cancel_timers(self) -> None:
        if self.retrans_at is not None or self.rnr_at is not None:
            self.retrans_at = self.rnr_at = None
            self.device.timer_changed(self)

    def on_timer(self, now: float) -> None:
        try:
            if self.rnr_at is not None and now >= self.rnr_at:
                if self.device.trace is not None:
                    self.trace("timer", "RNR timer fired: the requester retries",
                               timer="RNR", action="fire")
                self._set_timer("rnr_at", None, fired=True)
                self.req.need_retry = True
                self.req.wait_for_rnr_timer = False
                self.req.run()
            if self.retrans_at is not None and now >= self.retrans_at:
                if self.device.trace is not None:
                    self.trace("timer", "retransmit timer fired: no ACK in time",
                               timer="retransmit", action="fire")
                self._set_timer("retrans_at", None, fired=True)
                self.comp.on_timeout()
                self._rearm_retrans()
        except Exception as e:  # contained: see fault()
            self.fault(e, "timer")
