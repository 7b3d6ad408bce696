"""The completer: turns ACKs, NAKs and read/atomic responses into send completions
(rxe_comp.c).

An ACK for PSN p completes every send/write WQE whose last PSN is at or before p (ACKs
coalesce). Read responses are written into the WQE's buffers as they arrive; an atomic ACK
writes the original value. A NAK "PSN sequence error" rewinds the requester to the PSN it
names; a missing ACK (the retransmit timer) rewinds it to the oldest unacknowledged PSN,
``retry_cnt`` times (7 = forever, as rxe has it); an RNR NAK waits the time it names and
retries, ``rnr_retry`` times (7 = forever). Other NAKs end the WQE in error and move the
QP to ERR, flushing the rest.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, Any

from .memory import AccessError
from ..enums import (
    ibv_qp_state as S, ibv_wc_flags as WCF, ibv_wc_status as WCS, ibv_wr_opcode as W,
)
from ..completion import WC, wc_opcode_of
from ..wire.headers import AETH_TYPE_MASK, AETH_VALUE_MASK, AethType, NakCode
from ..wire.opcodes import Opcode as O
from .dma import NoSpace, scatter
from .params import rnr_nak_seconds
from .psn import psn_add, psn_diff
from .wqe import SendWqe, WqeState

if TYPE_CHECKING:  # pragma: no cover
    from .engine import QpEngine

__all__ = ["Completer"]

# AETH syndrome: the type bits (AethType) and the value bits (credits, RNR timer, NAK code),
# as plain ints because they are tested per response packet
_AETH_TYPE, _AETH_VALUE = int(AETH_TYPE_MASK), int(AETH_VALUE_MASK)
_ACK, _RNR_NAK, _NAK = int(AethType.ACK), int(AethType.RNR_NAK), int(AethType.NAK)
_READ_OR_ATOMIC = {W.IBV_WR_RDMA_READ, W.IBV_WR_ATOMIC_CMP_AND_SWP, W.IBV_WR_ATOMIC_FETCH_AND_ADD}
# plain ints: tested for every WQE completed (an enum member lookup costs each time)
_SUCCESS = int(WCS.IBV_WC_SUCCESS)
_POSTED, _PENDING, _DONE, _ERROR = (WqeState.POSTED, WqeState.PENDING, WqeState.DONE,
                                    WqeState.ERROR)
_SENDS = frozenset({int(W.IBV_WR_SEND), int(W.IBV_WR_SEND_WITH_IMM), int(W.IBV_WR_SEND_WITH_INV)})
# the WQEs a coalesced ACK retires in _retire_implied (nothing but an ACK completes them)
_PLAIN = frozenset(int(o) for o in (W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_SEND_WITH_INV,
                                    W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM))
_PSN_MASK = 0xFFFFFF
#: retire the WQEs a coalesced ACK implies in one pass (SOFTRDMA_SMALL_MSG=0: one by one)
SMALL_MSG = os.environ.get("SOFTRDMA_SMALL_MSG", "1").strip().lower() not in (
    "0", "no", "off", "false")
_ANSWERED_BY_EMPTY_READ_RESPONSE = {W.IBV_WR_ATOMIC_WRITE, W.IBV_WR_FLUSH}
_NAK_STATUS = {NakCode.INVALID_REQUEST: WCS.IBV_WC_REM_INV_REQ_ERR,
               NakCode.REMOTE_ACCESS_ERROR: WCS.IBV_WC_REM_ACCESS_ERR,
               NakCode.REMOTE_OPERATIONAL_ERROR: WCS.IBV_WC_REM_OP_ERR}
_U64 = struct.Struct("<Q")  # atomics are host-order (little-endian) 64-bit words in memory


class Completer:
    __slots__ = ("qp", "psn", "opcode", "retry_cnt", "rnr_retry", "started_retry", "retry_psn")

    def __init__(self, qp: "QpEngine") -> None:
        self.qp = qp  # the QP engine (rxe: struct rxe_qp)
        self.reset()

    def reset(self) -> None:
        self.psn = 0  # next PSN we expect a response for
        self.opcode = -1  # last response opcode in a multi-packet read response
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.started_retry = False
        self.retry_psn = 0  # comp.psn when the retry under way (started_retry) began

    def reset_retry_counters(self) -> None:
        a = self.qp.attr
        self.retry_cnt = a.retry_cnt
        self.rnr_retry = a.rnr_retry
        self.started_retry = False

    # -- completing WQEs --------------------------------------------------------------
    def do_complete(self, wqe: SendWqe) -> None:
        qp = self.qp
        if wqe.signaled or wqe.status != _SUCCESS:
            flags = WCF.IBV_WC_WITH_IMM if wqe.opcode in (W.IBV_WR_SEND_WITH_IMM,
                                                          W.IBV_WR_RDMA_WRITE_WITH_IMM) else 0
            qp.send_cq.push(WC(wr_id=wqe.wr_id, status=wqe.status,
                                opcode=wc_opcode_of(wqe.opcode), byte_len=wqe.length,
                                qp_num=qp.qp_num, wc_flags=int(flags)))
        sq = qp.sq
        if sq and sq[0] is wqe:
            sq.popleft()
            req = self.qp.req
            if req.wqe_index > 0:
                req.wqe_index -= 1
        if wqe.status == _SUCCESS and wqe.opcode in _SENDS:
            self.qp.device.counters.rdma_sends += 1
        req = self.qp.req
        if wqe.has_rd_atomic:
            wqe.has_rd_atomic = False
            req.rd_atomic += 1
        if req.wait_fence:
            req.wait_fence = False

    def retire(self) -> None:
        """Complete the WQEs at the head of the SQ that need no response (UD/UC sends, local
        operations, local errors); an errored WQE moves the QP to ERR (COMPST_ERROR)."""
        qp = self.qp
        sq = qp.sq
        while sq:
            wqe = sq[0]
            if wqe.state == WqeState.DONE:
                self.do_complete(wqe)
            elif wqe.state == WqeState.ERROR:
                self.do_complete(wqe)
                qp.to_error()
                return
            else:
                return

    def _fail(self, wqe: SendWqe, status: int) -> None:
        wqe.status = status
        self.do_complete(wqe)
        self.qp.to_error()

    # -- responses ----------------------------------------------------------------------
    def on_response(self, pkt: Any) -> None:
        """Handle one ACK / NAK / read response / atomic ACK (rxe_completer for a packet)."""
        qp = self.qp
        # WQEs completed by a later PSN's ACK (coalesced ACKs)
        implied = SMALL_MSG and self._retire_implied(pkt.psn)
        while True:
            sq = qp.sq
            # get_wqe
            wqe = sq[0] if sq else None
            if wqe is None or wqe.state == _POSTED:
                break
            if wqe.state == _DONE:
                self.do_complete(wqe)
                continue
            if wqe.state == _ERROR:
                self.do_complete(wqe)
                qp.to_error()
                break
            # check_psn
            is_rd_atm = wqe.opcode in _READ_OR_ATOMIC
            if psn_diff(pkt.psn, wqe.last_psn) > 0:
                if wqe.state == _PENDING:
                    if is_rd_atm:
                        self.error_retry(wqe, timeout=False,
                                         why="a response past the READ/atomic awaited")
                        break
                    # a coalesced ACK: everything up to this WQE's last PSN arrived (comp_wqe)
                    if not implied:
                        self.reset_retry_counters()
                    if psn_diff(wqe.last_psn, self.psn) >= 0:
                        self.psn = psn_add(wqe.last_psn, 1)
                        self.opcode = -1
                    self.do_complete(wqe)
                    implied = True  # the requester is woken once, after the loop
                    continue
                break
            diff = psn_diff(pkt.psn, self.psn)
            if diff < 0:
                if pkt.psn == wqe.last_psn:
                    self._comp_ack(wqe, pkt)
                    break
                if not (pkt.opcode == O.RC_ACKNOWLEDGE and self.opcode in (
                        O.RC_RDMA_READ_RESPONSE_FIRST, O.RC_RDMA_READ_RESPONSE_MIDDLE)):
                    break  # an old duplicate
            elif diff > 0 and is_rd_atm:
                break
            self._check_ack(wqe, pkt)
            break
        if implied:
            qp.req_wake()

    def _retire_implied(self, psn: int) -> bool:
        """What :meth:`on_response`'s loop does for the SENDs and WRITEs at the head of the
        SQ that a response with a later ``psn`` implies (a coalesced ACK: 50 WQEs for one
        train), in one pass: the loop's PSN test and updates and :meth:`do_complete`'s
        bookkeeping inline, a CQE only for a signaled WQE. Stops at the first WQE it does
        not cover (the loop takes it). Returns whether it retired any."""
        qp = self.qp
        sq = qp.sq
        req = qp.req
        done = 0
        while sq:
            wqe = sq[0]
            if wqe.state != _PENDING or wqe.opcode not in _PLAIN:
                break
            last = wqe.last_psn
            d = (psn - last) & _PSN_MASK
            if not 0 < d < 0x800000:  # psn_diff(psn, last) > 0
                break
            if not done:
                self.reset_retry_counters()
            done += 1
            if not (last - self.psn) & 0x800000:  # psn_diff(last, self.psn) >= 0
                self.psn = (last + 1) & _PSN_MASK
                self.opcode = -1
            if wqe.signaled or wqe.status != _SUCCESS:
                self.do_complete(wqe)
                continue
            sq.popleft()  # do_complete of an unsignaled success
            if req.wqe_index > 0:
                req.wqe_index -= 1
            if wqe.opcode in _SENDS:
                qp.device.counters.rdma_sends += 1
            if req.wait_fence:
                req.wait_fence = False
        return done > 0

    def _check_ack(self, wqe: SendWqe, pkt: Any) -> None:
        qp = self.qp
        op = pkt.opcode
        info = pkt.info
        # sequence of read responses
        if self.opcode == -1:
            if not info.first:
                return  # a MIDDLE/LAST with no read in progress: a stray packet, dropped
        elif self.opcode in (O.RC_RDMA_READ_RESPONSE_FIRST, O.RC_RDMA_READ_RESPONSE_MIDDLE):
            if op != O.RC_ACKNOWLEDGE and op not in (O.RC_RDMA_READ_RESPONSE_MIDDLE,
                                                     O.RC_RDMA_READ_RESPONSE_LAST):
                if not ((pkt.psn == wqe.first_psn and op == O.RC_RDMA_READ_RESPONSE_FIRST) or
                        (wqe.first_psn == wqe.last_psn and op == O.RC_RDMA_READ_RESPONSE_ONLY)):
                    return
        if op in (O.RC_RDMA_READ_RESPONSE_FIRST, O.RC_RDMA_READ_RESPONSE_LAST,
                  O.RC_RDMA_READ_RESPONSE_ONLY, O.RC_RDMA_READ_RESPONSE_MIDDLE):
            if op != O.RC_RDMA_READ_RESPONSE_MIDDLE and pkt.syndrome & _AETH_TYPE != _ACK:
                return
            if wqe.opcode in _ANSWERED_BY_EMPTY_READ_RESPONSE and op in (
                    O.RC_RDMA_READ_RESPONSE_ONLY, O.RC_RDMA_READ_RESPONSE_MIDDLE):
                # ATOMIC WRITE and FLUSH are answered with a READ RESPONSE ONLY without
                # data (rxe check_ack: COMPST_WRITE_SEND for the one, COMPST_READ of no
                # bytes for the other): the WQE completes
                if op == O.RC_RDMA_READ_RESPONSE_ONLY or wqe.opcode == W.IBV_WR_FLUSH:
                    self.reset_retry_counters()
                    self._comp_ack(wqe, pkt)
                    return
            if wqe.opcode != W.IBV_WR_RDMA_READ:
                self._fail(wqe, WCS.IBV_WC_FATAL_ERR)
                return
            self.reset_retry_counters()
            self._do_read(wqe, pkt)
            return
        if op == O.RC_ATOMIC_ACKNOWLEDGE:
            if pkt.syndrome & _AETH_TYPE != _ACK or wqe.opcode not in (W.IBV_WR_ATOMIC_CMP_AND_SWP,
                                                             W.IBV_WR_ATOMIC_FETCH_AND_ADD):
                return
            self.reset_retry_counters()
            try:
                scatter(qp.device.keys, qp.pd, wqe.sges, 0, _U64.pack(pkt.orig))
            except (AccessError, NoSpace):
                self._fail(wqe, WCS.IBV_WC_LOC_PROT_ERR)
                return
            self._comp_ack(wqe, pkt)
            return
        if op == O.RC_ACKNOWLEDGE:
            syn = pkt.syndrome
            kind = syn & _AETH_TYPE
            if kind == _ACK:
                if wqe.opcode in _READ_OR_ATOMIC:
                    # Only a read response / atomic ACK can complete a read or an atomic.
                    # A plain ACK with its PSN is the re-ACK of a duplicate send/write
                    # (prev_psn = ack_psn - 1 after the atomic ran); rxe would complete the
                    # WQE here without its data (COMPST_WRITE_SEND). Ignore it instead.
                    return
                self.reset_retry_counters()
                if wqe.state == WqeState.PENDING and wqe.last_psn == pkt.psn:
                    self._comp_ack(wqe, pkt)
                else:
                    self._update_comp(pkt)
                return
            if kind == _RNR_NAK:
                qp.device.counters.rcvd_rnr_err += 1
                self.rnr_retry_step(wqe, syn & _AETH_VALUE)
                return
            if kind == _NAK:
                if syn == NakCode.PSN_SEQ_ERROR:
                    # a NAK implicitly acknowledges every PSN before the one it names
                    if psn_diff(pkt.psn, self.psn) > 0:
                        qp.device.counters.rcvd_seq_err += 1
                        self.psn = pkt.psn
                        qp.req_wake()
                    self.error_retry(wqe, timeout=False, nak=True)
                    return
                self._fail(wqe, _NAK_STATUS.get(syn, WCS.IBV_WC_REM_OP_ERR))
                return
        # anything else: ignore (rxe: COMPST_ERROR on garbage, but never from a valid peer)

    def _do_read(self, wqe: SendWqe, pkt: Any) -> None:
        data = pkt.payload
        try:
            scatter(self.qp.device.keys, self.qp.pd, wqe.sges, wqe.read_bytes, data)
        except (AccessError, NoSpace):
            self._fail(wqe, WCS.IBV_WC_LOC_PROT_ERR)
            return
        wqe.read_bytes += len(data)
        if wqe.read_bytes >= wqe.length and pkt.info.last:
            self._comp_ack(wqe, pkt)
        else:
            self._update_comp(pkt)

    def _comp_ack(self, wqe: SendWqe, pkt: Any) -> None:
        """complete_ack: the response that completes ``wqe`` arrived."""
        self.do_complete(wqe)
        if psn_diff(pkt.psn, self.psn) >= 0:
            self._update_comp(pkt)
        else:
            self.qp.req_wake()

    def _update_comp(self, pkt: Any) -> None:
        self.opcode = -1 if pkt.info.last else pkt.opcode
        if psn_diff(pkt.psn, self.psn) >= 0:
            self.psn = psn_add(pkt.psn, 1)
        self.qp.req_wake()

    # -- retries ---------------------------------------------------------------------------
    def on_timeout(self) -> None:
        """The retransmit timer fired (comp.timeout_retry)."""
        sq = self.qp.sq
        wqe = sq[0] if sq else None
        if wqe is None or wqe.state == WqeState.POSTED or self.qp.state == S.IBV_QPS_ERR:
            return
        if wqe.state in (WqeState.DONE, WqeState.ERROR):
            self.retire()
            return
        self.error_retry(wqe, timeout=True)

    def error_retry(self, wqe: SendWqe, timeout: bool, why: str = "PSN sequence NAK",
                    nak: bool = False) -> None:
        """Go back to ``self.psn`` (comp.psn) once more, if ``retry_cnt`` allows: the timer
        fired (``timeout``), a PSN-sequence NAK came (``nak``), or a READ/atomic response
        answered a later request than the one we wait for (``why`` says which, for the
        trace).

        rxe starts one retry sequence from packets and ignores every later one until an
        ACK arrives (comp.started_retry, "IB/rxe: avoid back-to-back retries"): then a loss
        among the resent packets, NAK'd by the responder at once, waits for the retransmit
        timer. That costs a whole timeout (67 ms at perftest's timeout 14) for most losses
        of a lossy link, because an ACK comes only once per message. Here a NAK always
        sends the requester back: a responder NAKs a gap once, and again only when it saw
        a go-back that still lacks the PSN (softrdma's responder; rxe's never does), so
        each NAK is news. A READ response past the one awaited is not: those still in
        flight behind a missing one would each start a retry (rxe's storm), so they are
        ignored while the retry under way has made no progress (comp.psn has not passed
        the PSN it went back to)."""
        qp = self.qp
        if timeout:
            why = "timeout"
        elif not nak and self.started_retry and psn_diff(self.psn, self.retry_psn) <= 0:
            if qp.device.trace is not None:
                qp.trace("retry", f"{why} for PSN {self.psn} ignored: the retry under way "
                                  f"went back to PSN {self.retry_psn} and has made no "
                                  "progress since", why=why, psn=self.psn, action="ignored")
            return  # nothing new since the retry began: it covers this PSN already
        if self.retry_cnt > 0:
            if self.retry_cnt != 7:  # rxe treats 7 as infinite, like rnr_retry
                self.retry_cnt -= 1
            if qp.device.trace is not None:
                left = "unlimited" if self.retry_cnt == 7 else str(self.retry_cnt)
                qp.trace("retry", f"go back to PSN {self.psn}: {why} (retries left: {left})",
                         why=why, psn=self.psn, retries_left=self.retry_cnt,
                         action="go-back-n")
            if psn_diff(qp.req.psn, self.psn) > 0:
                qp.device.counters.completer_retry_err += 1
                qp.req.need_retry = True
                self.started_retry = True
                self.retry_psn = self.psn
                qp.req_wake()
            return
        qp.device.counters.retry_exceeded_err += 1
        if qp.device.trace is not None:
            qp.trace("retry", f"{why}: retry_cnt exhausted, the WQE fails with "
                              "RETRY_EXC_ERR", why=why, psn=self.psn, action="exhausted")
        self._fail(wqe, WCS.IBV_WC_RETRY_EXC_ERR)

    def rnr_retry_step(self, wqe: SendWqe, timer_code: int) -> None:
        qp = self.qp
        if self.rnr_retry > 0:
            if self.rnr_retry != 7:
                self.rnr_retry -= 1
            if qp.device.trace is not None:
                qp.trace("retry", f"RNR NAK for PSN {self.psn}: wait "
                                  f"{rnr_nak_seconds(timer_code):.6f} s, then retry",
                         why="RNR NAK", psn=self.psn, retries_left=self.rnr_retry,
                         action="rnr-wait")
            qp.req.wait_for_rnr_timer = True
            qp.arm_rnr(rnr_nak_seconds(timer_code))
            return
        qp.device.counters.retry_rnr_exceeded_err += 1
        if qp.device.trace is not None:
            qp.trace("retry", "RNR NAK: rnr_retry exhausted, the WQE fails with "
                              "RNR_RETRY_EXC_ERR", why="RNR NAK", psn=self.psn,
                     action="exhausted")
        self._fail(wqe, WCS.IBV_WC_RNR_RETRY_EXC_ERR)
