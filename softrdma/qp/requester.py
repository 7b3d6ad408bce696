"""The requester: turns send WQEs into request packets (rxe_req.c).

It walks the send queue from ``wqe_index``, cuts each message into FIRST/MIDDLE/LAST (or
ONLY) packets of the path MTU, numbers them with consecutive PSNs (a read takes one PSN per
expected response packet), sets AckReq on the last packet of each message and on every
~65th packet of a long one, and stops when a gate closes:

- the unacknowledged window: ``req.psn`` may run at most 128 PSNs past ``comp.psn`` (RC);
- the initiator depth: at most ``max_rd_atomic`` reads and atomics outstanding;
- a fence (IBV_SEND_FENCE waits for outstanding reads/atomics; LOCAL_INV for everything);
- SQD: no new message starts.

A retry (go-back-N after a timeout or a PSN NAK, or after an RNR wait) rewinds to the
first unacknowledged packet.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..completion import AsyncEvent
from ..enums import (
    ibv_event_type, ibv_qp_state as S, ibv_qp_type as T, ibv_send_flags as F,
    ibv_wc_status as WCS, ibv_wr_opcode as W,
)
from ..wire.opcodes import OPCODE_LIST, Opcode as O, Transport
from ..wire.headers import BTH_PSN_MASK, feth_value
from ..wire.iov import ZERO_COPY_MIN
from ..wire.packet import REQUEST_BUILDERS, REQUEST_IOV_BUILDERS, build
from .dma import gather, gather_view
from .memory import AccessError
from .mw import bind_mw, invalidate_rkey
from .params import RXE_MAX_PKT_PER_ACK, RXE_MAX_UNACKED_PSNS
from .psn import psn_add, psn_diff
from .wqe import SendWqe, WqeState

if TYPE_CHECKING:  # pragma: no cover
    from .engine import QpEngine

__all__ = ["Requester"]

_FENCE = int(F.IBV_SEND_FENCE)  # plain ints: IntFlag '&' is a Python call per packet
_SOLICITED = int(F.IBV_SEND_SOLICITED)
_READ_OR_ATOMIC = {W.IBV_WR_RDMA_READ, W.IBV_WR_ATOMIC_CMP_AND_SWP, W.IBV_WR_ATOMIC_FETCH_AND_ADD}
_LOCAL = {W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW}
_SENDS = {W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_SEND_WITH_INV}
_WRITES = {W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM}

# (first-or-only opcode choice, continuation choice) per WR opcode, RC numbering; a UC
# opcode is the RC one with the UC transport bits (_UC) added.
#   fits -> (ONLY, LAST); not fits -> (FIRST, MIDDLE)
_SEQ = {
    W.IBV_WR_SEND: ((O.RC_SEND_ONLY, O.RC_SEND_FIRST), (O.RC_SEND_LAST, O.RC_SEND_MIDDLE)),
    W.IBV_WR_SEND_WITH_IMM: ((O.RC_SEND_ONLY_WITH_IMMEDIATE, O.RC_SEND_FIRST),
                             (O.RC_SEND_LAST_WITH_IMMEDIATE, O.RC_SEND_MIDDLE)),
    W.IBV_WR_SEND_WITH_INV: ((O.RC_SEND_ONLY_WITH_INVALIDATE, O.RC_SEND_FIRST),
                             (O.RC_SEND_LAST_WITH_INVALIDATE, O.RC_SEND_MIDDLE)),
    W.IBV_WR_RDMA_WRITE: ((O.RC_RDMA_WRITE_ONLY, O.RC_RDMA_WRITE_FIRST),
                          (O.RC_RDMA_WRITE_LAST, O.RC_RDMA_WRITE_MIDDLE)),
    W.IBV_WR_RDMA_WRITE_WITH_IMM: ((O.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, O.RC_RDMA_WRITE_FIRST),
                                   (O.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE, O.RC_RDMA_WRITE_MIDDLE)),
}
_UC = int(Transport.UC)
# plain names for the members tested per packet (an Enum member lookup costs each time)
_RTS, _SQD = S.IBV_QPS_RTS, S.IBV_QPS_SQD
_RC_QP, _UC_QP, _UD_QP = T.IBV_QPT_RC, T.IBV_QPT_UC, T.IBV_QPT_UD
_POSTED, _PROCESSING, _PENDING, _DONE, _ERROR = (
    WqeState.POSTED, WqeState.PROCESSING, WqeState.PENDING, WqeState.DONE, WqeState.ERROR)
_CONTINUES = {O.RC_SEND_FIRST, O.RC_SEND_MIDDLE, O.RC_RDMA_WRITE_FIRST, O.RC_RDMA_WRITE_MIDDLE,
              O.UC_SEND_FIRST, O.UC_SEND_MIDDLE, O.UC_RDMA_WRITE_FIRST, O.UC_RDMA_WRITE_MIDDLE}


#: the one-packet fast path (:meth:`Requester._send_only`); SOFTRDMA_SMALL_MSG=0 turns it off
#: (read at import; tests set it to compare both paths)
SMALL_MSG = os.environ.get("SOFTRDMA_SMALL_MSG", "1").strip().lower() not in (
    "0", "no", "off", "false")
# WR opcode -> (RC ONLY opcode, solicited allowed): the messages the fast path sends
_ONLY = {int(W.IBV_WR_SEND): (int(O.RC_SEND_ONLY), True),
         int(W.IBV_WR_SEND_WITH_IMM): (int(O.RC_SEND_ONLY_WITH_IMMEDIATE), True),
         int(W.IBV_WR_RDMA_WRITE): (int(O.RC_RDMA_WRITE_ONLY), False),
         int(W.IBV_WR_RDMA_WRITE_WITH_IMM): (int(O.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE), True)}


class Requester:
    __slots__ = ("qp", "psn", "opcode", "wqe_index", "noack_pkts", "rd_atomic",
                 "need_retry", "wait_for_rnr_timer", "wait_fence", "wait_psn", "need_rd_atomic",
                 "drained_sent")

    def __init__(self, qp: "QpEngine") -> None:
        self.qp = qp  # the QP engine (rxe: struct rxe_qp)
        self.reset()

    def reset(self) -> None:
        self.psn = 0
        self.opcode = -1  # last opcode sent, -1 at a message boundary
        self.wqe_index = 0  # index into qp.sq of the next WQE to work on
        self.noack_pkts = 0
        self.rd_atomic = 0  # free initiator-depth credits
        self.need_retry = False
        self.wait_for_rnr_timer = False
        self.wait_fence = False
        self.wait_psn = False
        self.need_rd_atomic = False
        self.drained_sent = False

    # ------------------------------------------------------------------------------
    def _next_opcode(self, wqe: SendWqe, fits: bool) -> int:
        qpt = self.qp.qp_type
        op = wqe.opcode
        if qpt == _UD_QP:
            if op == W.IBV_WR_SEND:
                return O.UD_SEND_ONLY
            if op == W.IBV_WR_SEND_WITH_IMM:
                return O.UD_SEND_ONLY_WITH_IMMEDIATE
            return -1
        if op == W.IBV_WR_RDMA_READ:
            return O.RC_RDMA_READ_REQUEST if qpt == _RC_QP else -1
        if op == W.IBV_WR_ATOMIC_CMP_AND_SWP:
            return O.RC_COMPARE_SWAP if qpt == _RC_QP else -1
        if op == W.IBV_WR_ATOMIC_FETCH_AND_ADD:
            return O.RC_FETCH_ADD if qpt == _RC_QP else -1
        if op == W.IBV_WR_ATOMIC_WRITE:  # IBTA 1.5 A19: RC only, like every atomic
            return O.RC_ATOMIC_WRITE if qpt == _RC_QP else -1
        if op == W.IBV_WR_FLUSH:
            return O.RC_FLUSH if qpt == _RC_QP else -1
        seq = _SEQ.get(op)
        if seq is None:
            return -1
        if qpt == _UC_QP and op == W.IBV_WR_SEND_WITH_INV:
            return -1  # rxe's next_opcode_uc has no SEND_WITH_INV: LOC_QP_OP_ERR
        cont = self.opcode in _CONTINUES
        code = seq[1][0 if fits else 1] if cont else seq[0][0 if fits else 1]
        return code + (_UC if qpt == _UC_QP else 0)

    def _fenced(self, wqe: SendWqe) -> bool:
        if wqe.opcode == W.IBV_WR_LOCAL_INV:
            return self.wqe_index != 0  # everything before it must have completed
        return bool(wqe.send_flags & _FENCE) and \
            self.rd_atomic != self.qp.attr.max_rd_atomic

    def _window_room(self) -> int:
        """How many more PSNs an RC requester may send before the unacknowledged window
        closes: ``self.psn`` may run RXE_MAX_UNACKED_PSNS past the completer's PSN."""
        return 1 - psn_diff(self.psn, psn_add(self.qp.comp.psn, RXE_MAX_UNACKED_PSNS))

    def _ackreq(self, last: bool, rc: bool) -> bool:
        """Whether the next packet asks for an ACK (rxe's need-ack rule), counting the
        packets sent without: an RC message's last packet does, and one packet in every
        RXE_MAX_PKT_PER_ACK + 2 of a long message; UC never does."""
        if last or not rc:
            self.noack_pkts = 0
            return rc
        self.noack_pkts += 1
        if self.noack_pkts > RXE_MAX_PKT_PER_ACK + 1:
            self.noack_pkts = 0
            return True
        return False

    def _check_init_depth(self, wqe: SendWqe) -> bool:
        if wqe.has_rd_atomic:
            return True
        if self.rd_atomic > 0:
            self.rd_atomic -= 1
            wqe.has_rd_atomic = True
            self.need_rd_atomic = False
            return True
        self.need_rd_atomic = True
        return False

    # ------------------------------------------------------------------------------
    def run(self) -> None:
        """Send as many packets as the gates allow (rxe_requester)."""
        qp = self.qp
        sq = qp.sq
        rc = qp.qp_type == _RC_QP
        fast = SMALL_MSG and qp.qp_type != _UD_QP
        while True:
            st = qp.state
            if st != _RTS and st != _SQD:
                return
            if self.need_retry and not self.wait_for_rnr_timer:
                self.retry()
                self.need_retry = False
                if qp.device.trace is not None:
                    qp.trace("retry", f"retransmitting from PSN {self.psn}",
                             psn=self.psn, action="retransmit")
            if self.wqe_index >= len(sq):
                if st == _SQD:  # the call only matters in SQD (every kick ends here)
                    self._check_drained()
                return
            wqe = sq[self.wqe_index]
            if fast and wqe.state == _POSTED and st == _RTS:
                r = self._send_only(wqe, rc)
                if r > 0:
                    continue
                if r < 0:
                    return
            if st == _SQD and wqe.state == _POSTED:
                # SQD: messages already under way finish; nothing new starts (rxe DRAIN)
                self._check_drained()
                return
            if self._fenced(wqe):
                self.wait_fence = True
                return
            if wqe.opcode in _LOCAL:
                self._do_local_op(wqe)
                continue
            if rc and self._window_room() <= 0:
                self.wait_psn = True
                return
            mtu = qp.mtu()
            resid = wqe.length - wqe.offset
            opcode = self._next_opcode(wqe, resid <= mtu)
            if opcode < 0:
                self._error(wqe, WCS.IBV_WC_LOC_QP_OP_ERR)
                return
            info = OPCODE_LIST[opcode]
            if info.read or info.atomic or info.atomic_write:
                # rxe counts an ATOMIC WRITE against max_rd_atomic (the responder keeps a
                # resource to replay it); a FLUSH takes no credit
                if not self._check_init_depth(wqe):
                    return
            if info.middle and resid > mtu and wqe.inline is None and len(wqe.sges) == 1:
                # the body of a long SEND or WRITE: as a train (same packets, one pass)
                try:
                    self._send_middles(wqe, opcode, mtu, rc)
                except AccessError:
                    self._error(wqe, WCS.IBV_WC_LOC_PROT_ERR)
                    return
                continue
            # a FLUSH carries none (oA19-2): its length travels in the RETH only
            payload = resid if (info.send or info.write or info.atomic_write) else 0
            if payload > mtu:
                if qp.qp_type == _UD_QP:
                    # C10-93.1.1: a UD message over the MTU is not sent, and not an error.
                    wqe.first_psn = wqe.last_psn = self.psn
                    self.psn = psn_add(self.psn, 1)
                    self.opcode = O.UD_SEND_ONLY
                    self.wqe_index += 1
                    wqe.state = _DONE
                    qp.comp.retire()
                    continue
                payload = mtu
            try:
                pkt = self._make_packet(wqe, opcode, info, payload, rc)
            except AccessError:
                self._error(wqe, WCS.IBV_WC_LOC_PROT_ERR)
                return
            # update_wqe_state / update_wqe_psn / update_state
            if info.last:
                wqe.state = _PENDING if rc else _DONE
            else:
                wqe.state = _PROCESSING
            if info.first:
                if info.flush or info.atomic_write:
                    npkts = 1  # one packet and one PSN, whatever the length a FLUSH names
                else:
                    npkts = max(1, -(-(wqe.length - (wqe.read_bytes if info.read
                                                     else wqe.offset)) // mtu))
                wqe.first_psn = self.psn
                wqe.last_psn = psn_add(self.psn, npkts - 1)
                wqe.npkts = npkts
            if info.read:
                self.psn = psn_add(wqe.first_psn, wqe.npkts)
            else:
                self.psn = psn_add(self.psn, 1)
            wqe.offset += payload
            self.opcode = opcode
            if info.last:
                self.wqe_index += 1
            av = wqe.av  # a UD WR's AH, else the QP's primary path
            if av is not None:
                qp.device.send_packet(qp, pkt, av.dst_ip, av.traffic_class & 0xFF)
            else:
                qp.device.send_packet(qp, pkt, qp.dst_ip, qp.tos)
            if rc:
                qp.arm_retrans_if_idle()
            elif info.last:
                qp.comp.retire()

    def _send_only(self, wqe: SendWqe, rc: bool) -> int:
        """The fast path of :meth:`run` for a posted RC/UC SEND or WRITE (with or without
        immediate) that fits one packet and carries no fence: the same gates, PSN, AckReq,
        state updates and packet (the same builder, fields in the same order) as the loop
        below, without its general dispatch. Returns 1 when the packet left, 0 when the
        WQE is not one of these (the general path takes it), -1 when a gate closed or it
        failed (as ``run`` returns there)."""
        only = _ONLY.get(wqe.opcode)
        if only is None or wqe.send_flags & _FENCE:
            return 0
        qp = self.qp
        length = wqe.length
        if length > qp.mtu() or \
                (length >= ZERO_COPY_MIN and getattr(qp.device, "zero_copy", False)):
            return 0
        psn = self.psn
        if rc:  # _window_room() <= 0, inline: psn_diff(psn, comp.psn + window) >= 1
            d = (psn - qp.comp.psn - RXE_MAX_UNACKED_PSNS) & BTH_PSN_MASK
            if 0 < d < 0x800000:
                self.wait_psn = True
                return -1
        opcode, may_solicit = only
        if not rc:
            opcode += _UC
        if not length:
            data = b""
        elif wqe.inline is not None:
            data = wqe.inline[:length]
        else:
            sges = wqe.sges
            try:
                if len(sges) == 1:  # gather's one-slice case, without the call
                    addr, slen, lkey = sges[0]
                    if length > slen:
                        raise AccessError("range", "read past the end of the SGE list")
                    data = bytes(qp.device.keys.resolve(lkey, qp.pd, addr, length, 0,
                                                        remote=False))
                else:
                    data = gather(qp.device.keys, qp.pd, sges, 0, length)
            except AccessError:
                self._error(wqe, WCS.IBV_WC_LOC_PROT_ERR)
                return -1
        self.noack_pkts = 0  # _ackreq(last=True, rc)
        solicited = may_solicit and bool(wqe.send_flags & _SOLICITED)
        compare_add = wqe.compare_add
        imm = wqe.imm
        pkt = REQUEST_BUILDERS[opcode](opcode, psn, qp.attr.dest_qp_num, rc, solicited,
                                       wqe.remote_addr, wqe.rkey, length, compare_add, 0,
                                       imm, imm, wqe.remote_qkey, qp.qp_num, data)
        wqe.state = _PENDING if rc else _DONE
        wqe.first_psn = wqe.last_psn = psn
        wqe.npkts = 1
        self.psn = (psn + 1) & BTH_PSN_MASK
        wqe.offset = length
        self.opcode = opcode
        self.wqe_index += 1
        qp.device.send_packet(qp, pkt, qp.dst_ip, qp.tos)
        if rc:
            qp.arm_retrans_if_idle()
        else:
            qp.comp.retire()
        return 1

    def _send_middles(self, wqe: SendWqe, opcode: int, mtu: int, rc: bool) -> None:
        """Send the MIDDLE packets of ``wqe`` that the window allows, up to (not including)
        its last packet: what :meth:`run` would send one loop at a time, byte for byte
        (the same window, AckReq rule and packet builder), but with the gates checked, the
        source range resolved and the header fields computed once. Nothing can change them
        between two of these packets: the device lock is held and the engines are not
        re-entered while sending."""
        qp = self.qp
        dev = qp.device
        count = (wqe.length - wqe.offset - 1) // mtu  # packets before the last
        if rc:
            count = min(count, self._window_room())
        if count <= 0:
            return
        addr, length, lkey = wqe.sges[0]
        offset = wqe.offset
        if offset + count * mtu > length:
            raise AccessError("range", "read past the end of the SGE list")
        # one lookup for the whole run, with rxe copy_data's checks (LOCAL access)
        src = dev.keys.resolve(lkey, qp.pd, addr + offset, count * mtu, 0, remote=False)
        dest_qp = qp.attr.dest_qp_num
        dst = wqe.av.dst_ip if wqe.av is not None else qp.dst_ip
        tos = wqe.av.traffic_class & 0xFF if wqe.av is not None else qp.tos
        psn = self.psn
        send = dev.send_packet
        # _make_packet's builder: the same bytes; with zero copy as a list of buffers whose
        # payload is a view of the MR (softrdma.wire.iov), read at sendmsg, not copied here
        zc = mtu >= ZERO_COPY_MIN and getattr(dev, "zero_copy", False)
        build = REQUEST_IOV_BUILDERS[opcode] if zc else REQUEST_BUILDERS[opcode]
        ackreq = self._ackreq
        wqe.state = _PROCESSING
        self.opcode = opcode
        for k in range(count):
            # a MIDDLE is never solicited and carries no RETH, ImmDt, IETH or DETH
            pkt = build(opcode, psn, dest_qp, ackreq(False, rc), False, 0, 0, 0, 0, 0, 0, 0,
                        0, 0, src[k * mtu:(k + 1) * mtu])
            psn = (psn + 1) & BTH_PSN_MASK
            self.psn = psn
            wqe.offset += mtu
            send(qp, pkt, dst, tos)
        if rc:
            qp.arm_retrans_if_idle()

    def _make_packet(self, wqe: SendWqe, opcode: int, info, payload: int,
                     rc: bool) -> bytearray | list:
        """The next packet of ``wqe``: one ``bytearray``, or with zero copy (a payload of
        at least ZERO_COPY_MIN bytes from one SGE) a list of buffers whose payload is a view
        of the MR (softrdma.wire.iov)."""
        qp = self.qp
        ackreq = self._ackreq(info.last, rc)
        solicited = bool(wqe.send_flags & _SOLICITED) and info.last and \
            (info.send or (info.write and info.with_imm))
        data = b""
        builders = REQUEST_BUILDERS
        if payload:
            if wqe.inline is not None:
                data = wqe.inline[wqe.offset:wqe.offset + payload]
            elif payload >= ZERO_COPY_MIN and len(wqe.sges) == 1 and \
                    getattr(qp.device, "zero_copy", False):
                data = gather_view(qp.device.keys, qp.pd, wqe.sges, wqe.offset, payload)
                builders = REQUEST_IOV_BUILDERS
            else:
                data = gather(self.qp.device.keys, qp.pd, wqe.sges, wqe.offset, payload)
        if info.read:
            va = wqe.remote_addr + wqe.read_bytes
            dma_len = wqe.length - wqe.read_bytes
        else:
            va = wqe.remote_addr + wqe.offset
            dma_len = wqe.length - wqe.offset
        if opcode == O.RC_COMPARE_SWAP:
            swap_add, compare = wqe.swap, wqe.compare_add
        else:
            swap_add, compare = wqe.compare_add, 0
        if qp.qp_type == _UD_QP:
            dest_qp = wqe.remote_qpn
        else:
            dest_qp = qp.attr.dest_qp_num
        if info.flush:  # the one request with a FETH: rare, so the keyword builder
            return build(opcode, psn=self.psn, dest_qp=dest_qp, ackreq=ackreq, va=va,
                         rkey=wqe.rkey, dma_len=dma_len,
                         feth=feth_value(wqe.flush_type, wqe.flush_level))
        # wire.packet.build_request(opcode, ...) without its dispatch: build(opcode, psn=..,
        # dest_qp=.., ...) with these fields, passed positionally
        return builders[opcode](opcode, self.psn, dest_qp, ackreq, solicited, va, wqe.rkey,
                                dma_len, swap_add, compare, wqe.imm, wqe.imm,
                                wqe.remote_qkey, qp.qp_num, data)

    def _error(self, wqe: SendWqe, status: int) -> None:
        """A local error: the WQE completes in error and the QP goes to ERR (rxe 'err:')."""
        wqe.status = status
        wqe.state = _ERROR
        self.wqe_index += 1
        self.qp.comp.retire()

    def _do_local_op(self, wqe: SendWqe) -> None:
        keys = self.qp.device.keys
        qp = self.qp
        status = WCS.IBV_WC_SUCCESS
        if wqe.opcode == W.IBV_WR_LOCAL_INV:
            if not invalidate_rkey(keys, qp.pd, wqe.imm):
                status = WCS.IBV_WC_LOC_QP_OP_ERR
        else:
            status = bind_mw(keys, qp.pd, qp, wqe.mw, wqe.bind_info, wqe.bind_rkey)
        self.wqe_index += 1
        if status != WCS.IBV_WC_SUCCESS:
            wqe.status = status
            wqe.state = _ERROR
        else:
            wqe.state = _DONE
        self.qp.comp.retire()

    def _check_drained(self) -> None:
        """In SQD with nothing in flight, tell the user once (IBV_EVENT_SQ_DRAINED)."""
        qp = self.qp
        if qp.state == _SQD and not self.drained_sent and not self.qp.in_flight():
            self.drained_sent = True
            if qp.attr.en_sqd_async_notify:
                self.qp.device.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_SQ_DRAINED,
                                                     qp.owner))

    # ------------------------------------------------------------------------------
    def retry(self) -> None:
        """Go back to the first unacknowledged packet (rxe req_retry)."""
        qp = self.qp
        mtu = qp.mtu()
        self.wqe_index = 0
        self.psn = qp.comp.psn
        self.opcode = -1
        first = True
        for wqe in self.qp.sq:
            if wqe.state == _POSTED:
                break
            if wqe.state == _DONE or wqe.state == _ERROR:
                continue
            if wqe.has_rd_atomic:
                # Give the initiator-depth credit back: the WQE takes one again, in SQ
                # order, when it is resent. Kept (as rxe does), a read/atomic behind a
                # fenced WQE would hold it while the fence waits for all credits: deadlock.
                wqe.has_rd_atomic = False
                self.rd_atomic += 1
            is_read = wqe.opcode == W.IBV_WR_RDMA_READ
            if not first or not is_read:
                wqe.offset = 0
            if first:
                first = False
                if wqe.opcode in _SENDS or wqe.opcode in _WRITES:
                    npsn = psn_add(qp.comp.psn, -wqe.first_psn)
                    self._skip_acked(wqe, npsn, mtu)
                if is_read:
                    wqe.read_bytes = (wqe.read_bytes // mtu) * mtu
            else:
                if is_read:
                    wqe.read_bytes = 0
            wqe.state = _POSTED

    def _skip_acked(self, wqe: SendWqe, npsn: int, mtu: int) -> None:
        """retry_first_write_send: the first ``npsn`` packets of this WQE were acknowledged."""
        if npsn <= 0 or npsn >= wqe.npkts:
            return
        wqe.offset = npsn * mtu
        # the next packet continues the message: pretend a FIRST was sent last
        cont = {W.IBV_WR_RDMA_WRITE: O.RC_RDMA_WRITE_FIRST,
                W.IBV_WR_RDMA_WRITE_WITH_IMM: O.RC_RDMA_WRITE_FIRST}.get(wqe.opcode, O.RC_SEND_FIRST)
        self.opcode = cont + (_UC if self.qp.qp_type == _UC_QP else 0)
        wqe.state = _PROCESSING
        # keep first_psn: the message's PSN range does not change on retry
