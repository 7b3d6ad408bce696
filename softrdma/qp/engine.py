"""One QP's protocol engine: requester, completer and responder plus the QP's timers.

Sans-IO: it never touches a socket or a clock. The device hands it packets
(:meth:`on_packet`) and the time (``device.now``), asks it when it next needs waking
(:attr:`deadline`) and wakes it (:meth:`on_timer`); it hands packets to
``device.send_packet`` and completions to the CQs.

Fault containment: the entry points from outside (:meth:`on_packet` from the receive path,
:meth:`on_timer` from the device's timers, :meth:`kick` from post_send and modify) catch
any exception the protocol code did not expect and hand it to :meth:`fault`, which moves
this QP alone to ERR, as a hardware QP that hit an internal error: outstanding WRs
complete with IBV_WC_WR_FLUSH_ERR, IBV_EVENT_QP_FATAL is raised, the device's
``qp_fatal`` counter counts it and the ``softrdma`` logger reports it once with its
traceback. The device, and every other QP on it, go on. Errors the protocol defines (a
NAK, a bad key, a retry limit) are not faults: the engines complete them as rxe does.
"""

from __future__ import annotations

import logging
from typing import Any

from ..completion import AsyncEvent
from ..enums import ibv_event_type, ibv_qp_state as S, ibv_qp_type as T, mtu_to_bytes
from .completer import Completer
from .psn import psn_diff
from .params import qp_timeout_seconds, udp_sport_for_path, udp_sport_for_qpn
from .requester import Requester
from .responder import Responder
from .wqe import WqeState

__all__ = ["QpEngine"]

log = logging.getLogger("softrdma")


class QpEngine:
    __slots__ = ("qp", "device", "req", "comp", "resp", "src_port", "dst_ip", "retrans_at",
                 "rnr_at")

    def __init__(self, qp: Any) -> None:
        self.qp = qp
        self.device = qp.device
        self.req = Requester(self)
        self.comp = Completer(self)
        self.resp = Responder(self)
        self.src_port = udp_sport_for_qpn(qp.qp_num)
        self.dst_ip: bytes | None = None
        self.retrans_at: float | None = None
        self.rnr_at: float | None = None

    # -- control path hooks (called by the QP under the device lock) -----------------------
    def reset(self) -> None:
        self.req.reset()
        self.comp.reset()
        self.resp.reset()
        self.src_port = udp_sport_for_qpn(self.qp.qp_num)
        self.dst_ip = None
        self._cancel_timers()

    def set_sq_psn(self, psn: int) -> None:
        self.req.psn = psn
        self.comp.psn = psn

    def set_rq_psn(self, psn: int) -> None:
        self.resp.psn = psn
        self.resp.ack_psn = psn

    def on_av(self, av: Any) -> None:
        self.dst_ip = av.dst_ip
        if self.qp.qp_type in (T.IBV_QPT_RC, T.IBV_QPT_UC):
            self.src_port = udp_sport_for_path(av.flow_label, self.qp.qp_num,
                                               self.qp.attr.dest_qp_num)

    def on_resp_resources(self, n: int) -> None:
        self.resp.set_resources(n)

    def on_state(self, old: int, new: int) -> None:
        qp = self.qp
        if new == S.IBV_QPS_RTR and qp.qp_type in (T.IBV_QPT_RC, T.IBV_QPT_UC) and qp.av:
            # the source port hashes both QP numbers, known now
            self.src_port = udp_sport_for_path(qp.av.flow_label, qp.qp_num, qp.attr.dest_qp_num)
        if new == S.IBV_QPS_RTS:
            if old == S.IBV_QPS_RTR:
                self.req.rd_atomic = qp.attr.max_rd_atomic
                self.comp.reset_retry_counters()
            self.req.drained_sent = False
            self.kick()
        elif new == S.IBV_QPS_SQD:
            self.req.drained_sent = False
            self.kick()

    def on_error(self) -> None:
        self._cancel_timers()

    def on_recv_posted(self) -> None:
        pass

    def destroy(self) -> None:
        self._cancel_timers()

    # -- data path -------------------------------------------------------------------------
    def mtu(self) -> int:
        qp = self.qp
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
                req.wqe_index < len(self.qp.sq):
            req.wait_psn = False
            req.run()
        self._rearm_retrans()

    def in_flight(self) -> bool:
        """Some WQE was (partly) sent and is not complete yet."""
        for w in self.qp.sq:
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

    def fault(self, exc: BaseException, where: str) -> None:
        """An unexpected exception escaped this QP's protocol code (``where``: "receive",
        "send" or "timer"). Contain it to this QP: move it to ERR (outstanding WRs complete
        with IBV_WC_WR_FLUSH_ERR), raise IBV_EVENT_QP_FATAL, count it in the device's
        ``qp_fatal`` counter and log it once. Never raises: the caller is the receive
        path, the timer loop or post_send, none of which may die because one QP did."""
        qp = self.qp
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
        dev.timer_changed(qp)
        if was not in (S.IBV_QPS_ERR, S.IBV_QPS_RESET):
            dev.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_QP_FATAL, qp))

    def invalidate_rkey(self, rkey: int) -> bool:
        """rxe invalidate_rkey: only type 2 windows bound through this QP's PD can be
        invalidated (user MRs are not fast-register MRs)."""
        from ..soft.memory import MemKind
        e = self.device.keys.get(rkey)
        if e is None or e.kind is not MemKind.MW or e.mw_type != 2 or not e.valid:
            return False
        if e.pd is not self.qp.pd and (e.mr is None or e.mr.pd is not self.qp.pd):
            return False
        if e.mr is not None:
            e.mr.refs -= 1
        e.mr = None
        e.valid = False
        e.qp = None
        return True

    # -- timers -------------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        a, b = self.retrans_at, self.rnr_at
        if a is None:
            return b
        if b is None:
            return a
        return min(a, b)

    def _set_timer(self, which: str, at: float | None) -> None:
        setattr(self, which, at)
        self.device.timer_changed(self.qp)

    def arm_retrans_if_idle(self) -> None:
        """update_state: arm the retransmit timer unless it is already running."""
        if self.retrans_at is None:
            t = qp_timeout_seconds(self.qp.attr.timeout)
            if t is not None:
                self._set_timer("retrans_at", self.device.now + t)

    def _rearm_retrans(self) -> None:
        """COMPST_EXIT: push the timer out while there are unacknowledged packets."""
        qp = self.qp
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
            self.device.timer_changed(self.qp)

    def on_timer(self, now: float) -> None:
        try:
            if self.rnr_at is not None and now >= self.rnr_at:
                self._set_timer("rnr_at", None)
                self.req.need_retry = True
                self.req.wait_for_rnr_timer = False
                self.req.run()
            if self.retrans_at is not None and now >= self.retrans_at:
                self._set_timer("retrans_at", None)
                self.comp.on_timeout()
                self._rearm_retrans()
        except Exception as e:  # contained: see fault()
            self.fault(e, "timer")
