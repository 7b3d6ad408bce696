"""The state of one rsocket connection (``struct rsocket``, its SOCK_STREAM half, in
librdmacm/rsocket.c): the send and receive rings, credits and 16-bit sequence numbers,
control messages (DISCONNECT, SHUTDOWN, keepalive), iomaps, and the close's TIME_WAIT.
It does no waiting of its own but in :meth:`RSConn.time_wait`: a
:class:`~softrdma.socket.conn.Hub` drives it (``on_wc``, ``on_cm``, ``pump``). The wire
layout is :mod:`softrdma.socket.rswire`'s.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import Any

from ..errors import PyverbsRDMAError
from ..rdmacm import CMEvent, CMID, ConnParam
from ..rdmacm import enums as ce
from ..verbs_api import MR, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR, SGE
from ..verbs_api.enums import (
    ibv_access_flags as A, ibv_qp_attr_mask, ibv_qp_state, ibv_qp_type,
    ibv_wc_flags as WCF, ibv_wc_status as WS, ibv_wr_opcode as O,
)
from .conn import Hub
from .rswire import (
    IOMAP_BE, IOMAP_LE, RS_CONN_FLAG_IOMAP, RS_CONN_FLAG_NET, RS_CTRL_DISCONNECT,
    RS_CTRL_KEEPALIVE, RS_CTRL_SHUTDOWN, RS_MAX_TRANSFER, RS_OP_CTRL, RS_OP_DATA,
    RS_OP_IOMAP_SGL, RS_OP_SGL, RS_OP_WRITE, RS_QP_CTRL_SIZE, RS_QP_MAX_SIZE,
    RS_QP_MIN_SIZE, RS_SGL_SIZE, RS_SNDLOWAT, RS_WR_ID_FLAG_RECV, SGE_BE, SGE_LE,
    ConnData, msg_set, scale_to_value, seq_diff, value_to_scale,
)

__all__ = ["RSConn", "RSOptions", "IoMap", "RS_CONNECTED", "RS_WRITABLE", "RS_READABLE",
           "RS_CONNECT_RDWR", "RS_DISCONNECTED", "RS_ERROR", "CLOSE_TIMEOUT",
           "TIME_WAIT_PERIODS"]

E = ce.rdma_cm_event_type

# rsocket states (bit values of enum rs_state)
RS_CONNECTED, RS_WRITABLE, RS_READABLE = 0x100, 0x200, 0x400
RS_CONNECT_RDWR = RS_CONNECTED | RS_WRITABLE | RS_READABLE
RS_DISCONNECTED, RS_ERROR = 0x1000, 0x2000

#: how long close() waits for outstanding sends to be acknowledged (rsocket waits for
#: ever; under loss against rxe's 2 s retransmission timer, tens of seconds may pass)
CLOSE_TIMEOUT = 60.0
#: TIME_WAIT after the peer's DISCONNECT, in the peer's retransmission periods: the QP
#: stays up answering until this long has passed without a duplicate (or the peer's DREQ).
#: 3.5: the peer's retransmissions can be lost too, and the next one comes a period later;
#: this outlasts two lost in a row (1.5 did not outlast one: a CI run lost our ACK and
#: rxe's first retransmission, and the second came 4.6 s after the DISCONNECT, after a
#: 3.2 s quiet spell had ended). It costs nothing when the peer's DREQ comes.
TIME_WAIT_PERIODS = 3.5
#: a keepalive unacknowledged after this many of our QP's retransmission periods means
#: the peer is gone: RC's own retry count would say so after retry_cnt + 1 of them, but
#: rsocket's REQ asks for retry_cnt 7, which rxe (and softrdma) take as "for ever"
KEEPALIVE_GIVE_UP = 8


class RSOptions:
    """rsocket's per-socket settings and their librdmacm defaults (rsocket.c: def_*;
    SO_SNDBUF/SO_RCVBUF, RDMA_SQSIZE/RQSIZE/INLINE/IOMAPSIZE in rsetsockopt)."""

    def __init__(self, sbuf_size: int = 1 << 17, rbuf_size: int = 1 << 17,
                 sq_size: int = 384, rq_size: int = 384, sq_inline: int = 64,
                 iomap_size: int = 0, keepalive: float | None = None,
                 ack_timeout: int | None = 16) -> None:
        self.sbuf_size = sbuf_size
        self.rbuf_size = rbuf_size
        self.sq_size = sq_size
        self.rq_size = rq_size
        self.sq_inline = sq_inline
        # rsetsockopt(RDMA_IOMAPSIZE) rounds through the 8-bit scale
        self.iomap_size = scale_to_value(value_to_scale(iomap_size))
        self.keepalive = keepalive  # seconds between keepalives (SO_KEEPALIVE), or None
        # the local QP's ACK timeout (4.096 us x 2^n; 16: 268 ms), a local setting only:
        # None keeps rdma_cm's (the path's on the active side, the REQ's on the passive
        # side: 19, 2 s, from Linux), which makes every lost tail packet cost 2 s
        self.ack_timeout = ack_timeout

    def copy(self) -> "RSOptions":
        o = RSOptions.__new__(RSOptions)
        o.__dict__.update(self.__dict__)
        return o


class IoMap:
    """A buffer riomapped for the peer (its MR, the offset it stands at, its slot)."""

    __slots__ = ("mr", "offset", "index")

    def __init__(self, mr: Any, offset: int, index: int) -> None:
        self.mr, self.offset, self.index = mr, offset, index


class RSConn:
    """The rsocket state of one connected stream (struct rsocket, SOCK_STREAM half),
    driven by a :class:`~softrdma.socket.conn.Hub` (on_wc, on_cm, pump)."""

    def __init__(self, hub: Hub, cmid: CMID, opts: RSOptions) -> None:
        self.hub, self.cmid, self.opts = hub, cmid, opts
        o = opts
        self.sq_size = min(max(o.sq_size, RS_QP_MIN_SIZE), RS_QP_MAX_SIZE)
        self.rq_size = min(max(o.rq_size, RS_QP_MIN_SIZE), RS_QP_MAX_SIZE)
        self.sbuf_size = o.sbuf_size
        self.rbuf_size = o.rbuf_size & ~1
        self.sq_inline = o.sq_inline
        self.target_iomap_size = o.iomap_size
        pd = hub.pd
        cap = QPCap(max_send_wr=self.sq_size, max_recv_wr=self.rq_size, max_send_sge=2,
                    max_recv_sge=1, max_inline_data=self.sq_inline)
        attr = QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, scq=hub.cq, rcq=hub.cq, cap=cap,
                          sq_sig_all=1)
        cmid.pd = pd
        cmid.create_qp(attr)
        self.qp = cmid.qp
        self.qpn = self.qp.qp_num
        # buffers (rs_init_bufs)
        self.smr = MR(pd, self.sbuf_size, A.IBV_ACCESS_LOCAL_WRITE)
        self.cmr = MR(pd, SGE_LE.size * RS_QP_CTRL_SIZE, A.IBV_ACCESS_LOCAL_WRITE)
        tlen = SGE_LE.size * RS_SGL_SIZE + IOMAP_LE.size * self.target_iomap_size
        self.target_mr = MR(pd, tlen, A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE)
        self.rmr = MR(pd, self.rbuf_size, A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE)
        self.tmem = self.target_mr.mem
        self.rmem = self.rmr.mem
        self.smem = self.smr.mem
        self.soff = 0  # ssgl[0].addr - sbuf: where the next copy goes
        self.sbuf_bytes_avail = self.sbuf_size
        self.rbuf_free_offset = self.rbuf_size >> 1
        self.rbuf_bytes_avail = self.rbuf_size >> 1
        self.rbuf_offset = 0
        self.ctrl_seqno = 0
        self.ctrl_max_seqno = RS_QP_CTRL_SIZE
        self.sqe_avail = self.sq_size - self.ctrl_max_seqno
        self.sseq_no = self.sseq_comp = 0
        self.rseq_no = 0
        self.rseq_comp = self.rq_size >> 1
        self.target_sge = 0
        self.remote_sge = 0
        self.remote_sgl = (0, 0, 0)  # addr, key, length
        self.remote_iomap = (0, 0, 0)
        self.swap = False  # RS_OPT_SWAP_SGL: write the peer's structures big-endian
        self.rmsg: deque[list[int]] = deque()  # [op, len] of data received, unread
        self.state = 0
        self.error: BaseException | None = None
        self.released = False
        self.established = False
        self.peer_closed = False  # the peer's DISCONNECT (or final SHUTDOWN) arrived
        self.peer_dreq = False  # rdma_cm's DISCONNECTED: the peer finished its close
        self.time_waited = False
        self.remote_iomappings: list[IoMap | None] = []
        self.iomap_queue: deque[IoMap] = deque()
        self.local_maps: list[IoMap] = []
        self.last_keepalive = time.monotonic()
        self.keepalive_out: float | None = None  # when the unacknowledged keepalive left
        for _ in range(self.rq_size):
            self._post_recv()
        hub.add(self)

    # ---- connection data ------------------------------------------------------------

    def conn_data(self) -> bytes:
        """rs_format_conn_data: this side's struct rs_conn_data."""
        return ConnData(1, RS_CONN_FLAG_IOMAP, self.rq_size,
                        value_to_scale(self.target_iomap_size),
                        self.target_mr.buf, self.target_mr.rkey, RS_SGL_SIZE,
                        self.rmr.buf, self.rmr.rkey, self.rbuf_size >> 1).pack()

    def conn_param(self, req: Any = None) -> ConnParam:
        """The REQ's parameters (rs_do_connect: flow control, retry and RNR retry 7), or
        the REP's: rs_accept echoes the REQ's (``req``); our conn data as private data."""
        data = self.conn_data()
        if req is None:
            cp = ConnParam(resources=0, depth=0, flow_control=1, retry=7, rnr_retry=7,
                           data_len=len(data))
        else:
            cp = ConnParam(resources=req.responder_resources, depth=req.initiator_depth,
                           flow_control=req.flow_control, retry=req.retry_count,
                           rnr_retry=req.rnr_retry_count, data_len=len(data))
        cp.set_private_data(data)
        return cp

    def save_conn_data(self, data: bytes) -> None:
        """rs_save_conn_data: the peer's struct rs_conn_data (ConnectionError if it is
        too short or not version 1)."""
        cd = ConnData.unpack(data)
        self.remote_sgl = (cd.target_sgl_addr, cd.target_sgl_key, cd.target_sgl_length)
        self.remote_sge = 1
        self.swap = bool(cd.flags & RS_CONN_FLAG_NET)  # we are little-endian
        if cd.flags & RS_CONN_FLAG_IOMAP:
            self.remote_iomap = (cd.target_sgl_addr + SGE_LE.size * cd.target_sgl_length,
                                 cd.target_sgl_key, scale_to_value(cd.target_iomap_size))
        self._set_target(0, cd.data_buf_addr, cd.data_buf_key, cd.data_buf_length)
        self.sseq_comp = cd.credits
        self.state = RS_CONNECT_RDWR

    # the target SGL: buffer grants from the peer, in our (little-endian) order
    def _target(self, i: int) -> tuple[int, int, int]:
        return SGE_LE.unpack_from(self.tmem, i * SGE_LE.size)

    def _set_target(self, i: int, addr: int, key: int, length: int) -> None:
        SGE_LE.pack_into(self.tmem, i * SGE_LE.size, addr, key, length)

    # ---- posting --------------------------------------------------------------------

    def _post_recv(self) -> None:
        self.qp.post_recv(RecvWR(RS_WR_ID_FLAG_RECV, 0, []))

    def _post(self, wr_data: int, opcode: int, sg: list, imm: int = 0, addr: int = 0,
              rkey: int = 0) -> None:
        wr = SendWR(wr_data, opcode, len(sg), imm_data=imm, sg=sg)
        wr.set_wr_rdma(rkey, addr)
        self.qp.post_send(wr)

    def _post_msg(self, msg: int) -> None:
        """rs_post_msg: a 0-byte RDMA WRITE WITH IMM."""
        self._post(msg, O.IBV_WR_RDMA_WRITE_WITH_IMM, [], imm=msg)

    def _copy_out(self, data: memoryview) -> list:
        """Copy into the send ring (ssgl[0]/ssgl[1]); the SGEs to post."""
        n = len(data)
        left = self.sbuf_size - self.soff
        base, lkey = self.smr.buf, self.smr.lkey
        if n <= left:
            self.smem[self.soff:self.soff + n] = data
            sg = [SGE(base + self.soff, n, lkey)]
            self.soff = self.soff + n if n < left else 0
        else:
            self.smem[self.soff:] = data[:left]
            self.smem[:n - left] = data[left:]
            sg = [SGE(base + self.soff, left, lkey), SGE(base, n - left, lkey)]
            self.soff = n - left
        return sg

    # ---- sending --------------------------------------------------------------------

    def can_send(self) -> bool:
        return (self.sqe_avail > 0 and self.sbuf_bytes_avail >= RS_SNDLOWAT and
                self.sseq_no != self.sseq_comp and self._target(self.target_sge)[2] != 0)

    def conn_can_send(self) -> bool:
        return self.can_send() or not (self.state & RS_WRITABLE)

    def write_data(self, data: memoryview) -> None:
        """rs_write_data: one DATA transfer into the current target SGE."""
        n = len(data)
        sg = self._copy_out(data)
        self.sseq_no = (self.sseq_no + 1) & 0xFFFF
        self.sqe_avail -= 1
        self.sbuf_bytes_avail -= n
        addr, key, length = self._target(self.target_sge)
        self._set_target(self.target_sge, addr + n, key, length - n)
        if length - n == 0:
            self.target_sge = (self.target_sge + 1) % RS_SGL_SIZE
        msg = msg_set(RS_OP_DATA, n)
        self._post(msg, O.IBV_WR_RDMA_WRITE_WITH_IMM, sg, imm=msg, addr=addr, rkey=key)

    def xfer_size(self, left: int, olen: int) -> tuple[int, int]:
        if olen < left:
            size = olen
            if olen < RS_MAX_TRANSFER:
                olen <<= 1
        else:
            size = left
        size = min(size, self.sbuf_bytes_avail, self._target(self.target_sge)[2])
        return size, olen

    # ---- credits (rs_update_credits) ------------------------------------------------

    def ctrl_avail(self) -> bool:
        return self.ctrl_seqno != self.ctrl_max_seqno

    def _give_credits(self) -> bool:
        return ((self.rbuf_bytes_avail >= (self.rbuf_size >> 1) or
                 seq_diff(self.rseq_no, self.rseq_comp) >= 0) and
                self.ctrl_avail() and bool(self.state & RS_CONNECTED))

    def _send_credits(self) -> None:
        slot = self.ctrl_seqno & (RS_QP_CTRL_SIZE - 1)
        self.ctrl_seqno += 1
        half = self.rbuf_size >> 1
        self.rseq_comp = (self.rseq_no + (self.rq_size >> 1)) & 0xFFFF
        msg = msg_set(RS_OP_SGL, self.rseq_no + self.rq_size)
        if self.rbuf_bytes_avail >= half:
            fmt = SGE_BE if self.swap else SGE_LE
            off = slot * SGE_LE.size
            fmt.pack_into(self.cmr.mem, off, self.rmr.buf + self.rbuf_free_offset,
                          self.rmr.rkey, half)
            r_addr, r_key, r_len = self.remote_sgl
            self._post(msg, O.IBV_WR_RDMA_WRITE_WITH_IMM,
                       [SGE(self.cmr.buf + off, SGE_LE.size, self.cmr.lkey)], imm=msg,
                       addr=r_addr + self.remote_sge * SGE_LE.size, rkey=r_key)
            self.rbuf_bytes_avail -= half
            self.rbuf_free_offset += half
            if self.rbuf_free_offset >= self.rbuf_size:
                self.rbuf_free_offset = 0
            self.remote_sge += 1
            if self.remote_sge == r_len:
                self.remote_sge = 0
        else:
            self._post_msg(msg)

    def update_credits(self) -> None:
        if self.released or self.error is not None:
            return
        try:
            if self._give_credits():
                self._send_credits()
        except PyverbsRDMAError as e:
            self.fail(e)

    # ---- completions (rs_poll_cq) ---------------------------------------------------

    def on_wc(self, wc: Any) -> None:
        if wc.wr_id & RS_WR_ID_FLAG_RECV:
            if wc.status != WS.IBV_WC_SUCCESS:
                return
            if not wc.wc_flags & WCF.IBV_WC_WITH_IMM:
                return  # (iWARP's SEND-based messages are not spoken here)
            msg = wc.imm_data & 0xFFFFFFFF
            op, data = msg >> 29, msg & 0x1FFFFFFF
            if op == RS_OP_SGL:
                self.sseq_comp = data & 0xFFFF
            elif op == RS_OP_IOMAP_SGL:
                pass  # the peer's iomap was updated
            elif op == RS_OP_CTRL:
                if data == RS_CTRL_DISCONNECT:
                    self.state = RS_DISCONNECTED
                    self.peer_closed = True
                elif data == RS_CTRL_SHUTDOWN:
                    if self.state & RS_WRITABLE:
                        self.state &= ~RS_READABLE
                    else:
                        self.state = RS_DISCONNECTED
                        self.peer_closed = True
            elif op == RS_OP_WRITE:
                pass
            else:
                self.rmsg.append([op, data])
            if self.state & RS_CONNECTED:
                try:
                    self._post_recv()
                except PyverbsRDMAError as e:
                    self.state = RS_ERROR
                    self.fail(e)
            return
        data = wc.wr_id & 0xFFFFFFFF
        op = data >> 29
        if op == RS_OP_SGL:
            self.ctrl_max_seqno += 1
        elif op == RS_OP_CTRL:
            self.ctrl_max_seqno += 1
            if (data & 0x1FFFFFFF) == RS_CTRL_DISCONNECT:
                self.state = RS_DISCONNECTED
            elif (data & 0x1FFFFFFF) == RS_CTRL_KEEPALIVE:
                self.keepalive_out = None
        elif op == RS_OP_IOMAP_SGL:
            self.sqe_avail += 1
            self.sbuf_bytes_avail += IOMAP_LE.size
        else:
            self.sqe_avail += 1
            self.sbuf_bytes_avail += data & 0x1FFFFFFF
        if wc.status != WS.IBV_WC_SUCCESS and self.state & RS_CONNECTED:
            self.state = RS_ERROR
            self.fail(ConnectionResetError(errno.ECONNRESET,
                                           f"work completion {WS(wc.status).name}"))

    def on_cm(self, ev: CMEvent) -> None:
        t = ev.event_type
        if t == E.RDMA_CM_EVENT_ESTABLISHED:
            self.established = True
        elif t == E.RDMA_CM_EVENT_DISCONNECTED:
            # rsocket learns of a close from the DISCONNECT message; a DREQ without one
            # means the peer went away: what was received stays readable
            self.peer_dreq = True
            if self.state & RS_CONNECTED:
                self.state = RS_DISCONNECTED
        elif t in (E.RDMA_CM_EVENT_REJECTED, E.RDMA_CM_EVENT_UNREACHABLE,
                   E.RDMA_CM_EVENT_CONNECT_ERROR):
            self.fail(ConnectionRefusedError(errno.ECONNREFUSED, ev.event_str()))

    def pump(self) -> None:
        self.update_credits()
        if not (self.opts.keepalive and self.state & RS_CONNECTED):
            return
        now = time.monotonic()
        if self.keepalive_out is not None:
            if now - self.keepalive_out > KEEPALIVE_GIVE_UP * self._own_ack_period():
                self.state = RS_ERROR
                self.fail(ConnectionResetError(
                    errno.ECONNRESET, f"the peer did not acknowledge a keepalive in "
                    f"{now - self.keepalive_out:.1f} s: it is gone"))
        elif now - self.last_keepalive > self.opts.keepalive:
            self.send_keepalive()

    def send_keepalive(self) -> None:
        """tcp_svc_send_keepalive: a 0-byte RDMA WRITE (no immediate). Its completion is
        awaited (pump): with rsocket's retry count, RC alone would retransmit it for
        ever to a peer that vanished, and a blocked send would never learn."""
        self.last_keepalive = time.monotonic()
        posted = self.ctrl_seqno
        self._send_ctrl(RS_CTRL_KEEPALIVE, O.IBV_WR_RDMA_WRITE)
        if self.ctrl_seqno != posted:
            self.keepalive_out = self.last_keepalive

    def _own_ack_period(self) -> float:
        """Our QP's retransmission period, 4.096 us x 2^timeout (2.1 s if unknown)."""
        try:
            own = self.qp.query(ibv_qp_attr_mask.IBV_QP_TIMEOUT)[0].timeout
        except Exception:
            own = 0
        return 4.096e-6 * (1 << own) if own else 2.2

    def send_ctrl(self, ctrl: int) -> None:
        """A DISCONNECT or SHUTDOWN message (rshutdown), if a control slot is free."""
        self._send_ctrl(ctrl, O.IBV_WR_RDMA_WRITE_WITH_IMM)

    def _send_ctrl(self, ctrl: int, opcode: int) -> None:
        if self.ctrl_avail() and self.state & RS_CONNECTED:
            self.ctrl_seqno += 1
            msg = msg_set(RS_OP_CTRL, ctrl)
            try:
                self._post(msg, opcode, [], imm=msg if opcode != O.IBV_WR_RDMA_WRITE else 0)
            except PyverbsRDMAError as e:
                self.fail(e)

    def qp_to_error(self) -> None:
        """ucma_shutdown: the QP to ERROR (what rdma_disconnect does first)."""
        try:
            self.qp.modify(QPAttr(qp_state=ibv_qp_state.IBV_QPS_ERR),
                           ibv_qp_attr_mask.IBV_QP_STATE)
        except Exception:
            pass

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            # without its traceback: its frames hold this connection, a cycle that kept
            # the connection's buffers until the next gc pass (as Connection.fail)
            self.error = exc.with_traceback(None)

    def ack_period(self) -> float:
        """The peer's retransmission period, as far as we can know it (4.096 us x
        2^timeout): the local ACK timeout the connection's CM REQ carried, which the
        passive side takes for its QP and the active side derives from the same path
        (rdma_cm on RoCE: 19, ~2.1 s), or our own QP's if that is longer. Our own alone
        would not do: softrdma's rsocket sets its QP's to 16 (RSOptions.ack_timeout)."""
        try:
            own = self.qp.query(ibv_qp_attr_mask.IBV_QP_TIMEOUT)[0].timeout
        except Exception:
            own = 0
        timeout = max(own, self.cmid.path_ack_timeout)
        return 4.096e-6 * (1 << timeout) if timeout else 2.2

    def duplicates_seen(self) -> int | None:
        """Duplicate requests this QP's responder has answered (None where the backend
        does not count them)."""
        return self.qp.duplicate_requests

    def time_wait(self) -> None:
        """TIME_WAIT, which rsocket lacks: the peer's DISCONNECT arrived, so the peer
        now waits for that message's ACK, and an RC requester whose last ACK is lost
        retransmits until it hears one (rxe, with rdma_cm's retry_cnt 7, for ever; a
        QP in ERROR drops the retransmissions). So the QP stays up and re-ACKs
        duplicates until the peer's DREQ says it is done, or until a quiet spell of
        TIME_WAIT_PERIODS retransmission periods without a duplicate. Once only."""
        if self.time_waited or self.released:
            return
        self.time_waited = True
        hub = self.hub
        quiet = TIME_WAIT_PERIODS * self.ack_period()
        seen = self.duplicates_seen()
        now = time.monotonic()
        hard, end = now + CLOSE_TIMEOUT, now + quiet
        while not self.peer_dreq and self.error is None and now < min(end, hard):
            hub.progress()
            if self.peer_dreq:
                break
            dups = self.duplicates_seen()
            if dups != seen:  # an ACK of ours was lost: start the quiet spell again
                seen, end = dups, time.monotonic() + quiet
            hub.wait(min(end, hard, time.monotonic() + 0.1))
            now = time.monotonic()

    def all_sends_done(self) -> bool:
        return ((self.ctrl_max_seqno - self.ctrl_seqno) + self.sqe_avail == self.sq_size
                or not self.state & RS_CONNECTED)

    # ---- receiving (rrecv's copy loop) ----------------------------------------------

    def have_rdata(self) -> bool:
        return bool(self.rmsg)

    def read(self, out: memoryview) -> int:
        left = len(out)
        pos = 0
        rsz, rmem = self.rbuf_size, self.rmem
        while left and self.rmsg:
            head = self.rmsg[0]
            if left < head[1]:
                rsize = left
                head[1] -= left
            else:
                self.rseq_no = (self.rseq_no + 1) & 0xFFFF
                rsize = head[1]
                self.rmsg.popleft()
            end_size = rsz - self.rbuf_offset
            if rsize > end_size:
                out[pos:pos + end_size] = rmem[self.rbuf_offset:rsz]
                self.rbuf_offset = 0
                pos += end_size
                rsize -= end_size
                left -= end_size
                self.rbuf_bytes_avail += end_size
            out[pos:pos + rsize] = rmem[self.rbuf_offset:self.rbuf_offset + rsize]
            self.rbuf_offset += rsize
            pos += rsize
            left -= rsize
            self.rbuf_bytes_avail += rsize
        return pos

    def peek(self, out: memoryview) -> int:
        """rs_peek: copy what :meth:`read` would take, taking nothing (MSG_PEEK)."""
        pos, off, rsz, rmem = 0, self.rbuf_offset, self.rbuf_size, self.rmem
        for _, size in self.rmsg:
            if pos == len(out):
                break
            size = min(size, len(out) - pos)
            while size:
                k = min(size, rsz - off)
                out[pos:pos + k] = rmem[off:off + k]
                pos, size, off = pos + k, size - k, (off + k) % rsz
        return pos

    # ---- iomap ----------------------------------------------------------------------

    def target_iomap(self, i: int) -> tuple[int, int, int, int]:
        """Entry ``i`` of the iomap table the peer fills: (offset, addr, key, length)."""
        return IOMAP_LE.unpack_from(self.tmem, SGE_LE.size * RS_SGL_SIZE + i * IOMAP_LE.size)

    def find_iomap(self, offset: int) -> tuple[int, int, int, int] | None:
        for i in range(self.target_iomap_size):
            off, addr, key, length = self.target_iomap(i)
            if off <= offset < off + length:
                return off, addr, key, length
        return None

    def write_iomap(self, m: IoMap) -> None:
        fmt = IOMAP_BE if self.swap else IOMAP_LE
        raw = fmt.pack(m.offset, m.mr.buf, m.mr.rkey, m.mr.length)
        sg = self._copy_out(memoryview(raw))
        self.sseq_no = (self.sseq_no + 1) & 0xFFFF
        self.sqe_avail -= 1
        self.sbuf_bytes_avail -= IOMAP_LE.size
        addr, key, _ = self.remote_iomap
        msg = msg_set(RS_OP_IOMAP_SGL, m.index)
        self._post(msg, O.IBV_WR_RDMA_WRITE_WITH_IMM, sg, imm=msg,
                   addr=addr + m.index * IOMAP_LE.size, rkey=key)

    def write_direct(self, iom: tuple[int, int, int, int], offset: int,
                     data: memoryview) -> None:
        n = len(data)
        sg = self._copy_out(data)
        self.sqe_avail -= 1
        self.sbuf_bytes_avail -= n
        off, addr, key, _ = iom
        self._post(msg_set(RS_OP_WRITE, n), O.IBV_WR_RDMA_WRITE, sg,
                   addr=addr + offset - off, rkey=key)

    # ---- the end --------------------------------------------------------------------

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.hub.remove(self)
        try:
            self.cmid.close()
        except Exception:
            pass
        for m in self.local_maps + [m for m in self.remote_iomappings if m]:
            try:
                m.mr.close()
            except Exception:
                pass
        for mr in (self.smr, self.cmr, self.target_mr, self.rmr):
            try:
                mr.close()
            except Exception:
                pass
