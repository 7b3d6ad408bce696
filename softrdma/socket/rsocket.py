"""librdmacm's rsocket protocol (SOCK_STREAM), wire-compatible with rdma-core 44 on RoCE.

``softrdma.socket.socket(protocol="rsocket")`` returns an :class:`RSocket`: a byte
stream (``send`` returns the bytes accepted, ``recv(n)`` up to ``n`` bytes, ``b""`` at
the peer's orderly close) that ``rstream``/``riostream`` and any program linked with
librsocket can talk to. Only rdma_cm (:mod:`softrdma.rdmacm`) and the public verbs API
are used. docs/rsocket.md describes the protocol; in short (librdmacm/rsocket.c):

* Connect: the REQ private data is ``struct rs_conn_data`` (40 bytes, big-endian
  fields): version 1, flags (bit 0 NET: the sender is big-endian, bit 1 IOMAP),
  credits (receives posted, 384), target_iomap_size (a scaled u8), ``target_sgl``
  {addr, rkey, 2}: where the peer writes buffer grants, ``data_buf`` {addr, rkey,
  rbuf/2}: the first half of the receive ring. The REP carries the acceptor's.
  REQ: flow_control 1, retry 7, RNR retry 7; the acceptor echoes the REQ's values.
* Data: RDMA WRITE WITH IMM into the granted half of the peer's ring,
  ``imm = (op << 29) | len`` with op 0 (DATA); one receive (credit) each.
* Credits: the receiver writes a 16-byte ``rs_sge`` {addr, rkey, len} (in the
  *reader's* byte order, from the NET flag) into the sender's ``target_sgl`` slot and
  ``imm = (4 << 29) | (rseq_no + rq_size)`` (op SGL: the new sequence limit); with no
  half free it sends the same imm as a 0-byte write.
* iomap (riomap/riowrite): a 24-byte ``rs_iomap`` written after the two SGL slots,
  ``imm = (6 << 29) | index``; riowrite is a plain RDMA WRITE into the mapped buffer.
* Control: ``imm = (7 << 29) | {0 disconnect, 1 keepalive, 2 shutdown}`` as 0-byte
  writes (keepalive: a 0-byte RDMA WRITE without immediate). Close sends DISCONNECT,
  waits for its completion, then moves the QP to ERROR and destroys the id (DREQ).
"""

from __future__ import annotations

import errno
import struct
import time
from collections import deque
from typing import Any

from ..errors import PyverbsRDMAError
from ..rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam
from ..rdmacm import enums as ce
from ..verbs_api import MR, QPCap, QPInitAttr, RecvWR, SendWR, SGE
from ..verbs_api.enums import (
    ibv_access_flags as A, ibv_qp_attr_mask, ibv_qp_type, ibv_wc_flags as WCF,
    ibv_wc_status as WS, ibv_wr_opcode as O,
)
from .base import SocketBase, check_address, os_error
from .conn import Hub

__all__ = ["RSocket", "RSOptions", "CONN_DATA", "RS_OP_DATA", "RS_OP_SGL", "RS_OP_CTRL"]

E = ce.rdma_cm_event_type

# ---- constants of librdmacm/rsocket.c (rdma-core 44) ------------------------------------
RS_OLAP_START_SIZE = 2048
RS_MAX_TRANSFER = 65536
RS_SNDLOWAT = 2048
RS_QP_MIN_SIZE = 16
RS_QP_MAX_SIZE = 0xFFFE
RS_QP_CTRL_SIZE = 4
RS_SGL_SIZE = 2

RS_OP_DATA, RS_OP_WRITE, RS_OP_SGL, RS_OP_IOMAP_SGL, RS_OP_CTRL = 0, 2, 4, 6, 7
RS_CTRL_DISCONNECT, RS_CTRL_KEEPALIVE, RS_CTRL_SHUTDOWN = 0, 1, 2
RS_CONN_FLAG_NET, RS_CONN_FLAG_IOMAP = 1, 2
RS_WR_ID_FLAG_RECV = 1 << 63

CONN_DATA = struct.Struct(">BBH3xBQIIQII")  # struct rs_conn_data, 40 bytes
SGE_LE, SGE_BE = struct.Struct("<QII"), struct.Struct(">QII")  # struct rs_sge
IOMAP_LE, IOMAP_BE = struct.Struct("<QQII"), struct.Struct(">QQII")  # struct rs_iomap

# rsocket states (bit values of enum rs_state)
_CONNECTED, _WRITABLE, _READABLE = 0x100, 0x200, 0x400
_CONNECT_RDWR = _CONNECTED | _WRITABLE | _READABLE
_DISCONNECTED, _ERROR = 0x1000, 0x2000

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


def msg_set(op: int, data: int) -> int:
    return ((op << 29) | (data & 0x1FFFFFFF)) & 0xFFFFFFFF


def value_to_scale(value: int, bits: int = 8) -> int:
    return value if value <= (1 << (bits - 1)) else (1 << (bits - 1)) | (value >> bits)


def scale_to_value(value: int, bits: int = 8) -> int:
    return value if value <= (1 << (bits - 1)) else (value & ~(1 << (bits - 1))) << bits


def _s16(v: int) -> int:
    v &= 0xFFFF
    return v - 0x10000 if v & 0x8000 else v


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


class _IoMap:
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
        self.err: BaseException | None = None
        self.released = False
        self.established = False
        self.peer_closed = False  # the peer's DISCONNECT (or final SHUTDOWN) arrived
        self.peer_dreq = False  # rdma_cm's DISCONNECTED: the peer finished its close
        self.time_waited = False
        self.remote_iomappings: list[_IoMap | None] = []
        self.iomap_queue: deque[_IoMap] = deque()
        self.local_maps: list[_IoMap] = []
        self.last_keepalive = time.monotonic()
        for _ in range(self.rq_size):
            self._post_recv()
        hub.add(self)

    # ---- connection data ------------------------------------------------------------

    def conn_data(self) -> bytes:
        """rs_format_conn_data: this side's struct rs_conn_data."""
        return CONN_DATA.pack(1, RS_CONN_FLAG_IOMAP, self.rq_size,
                              value_to_scale(self.target_iomap_size),
                              self.target_mr.buf, self.target_mr.rkey, RS_SGL_SIZE,
                              self.rmr.buf, self.rmr.rkey, self.rbuf_size >> 1)

    def save_conn_data(self, data: bytes) -> None:
        """rs_save_conn_data: the peer's struct rs_conn_data."""
        if len(data) < CONN_DATA.size:
            raise ConnectionError(errno.EPROTO, f"rsocket: {len(data)} bytes of "
                                  f"connection data, {CONN_DATA.size} needed")
        (ver, flags, credits, iomap_scale, t_addr, t_key, t_len, d_addr, d_key,
         d_len) = CONN_DATA.unpack_from(data)
        if ver != 1:
            raise ConnectionError(errno.ENOTSUP, f"rsocket: connection data version {ver}")
        self.remote_sgl = (t_addr, t_key, t_len)
        self.remote_sge = 1
        self.swap = bool(flags & RS_CONN_FLAG_NET)  # we are little-endian
        if flags & RS_CONN_FLAG_IOMAP:
            self.remote_iomap = (t_addr + SGE_LE.size * t_len, t_key,
                                 scale_to_value(iomap_scale))
        self._set_target(0, d_addr, d_key, d_len)
        self.sseq_comp = credits
        self.state = _CONNECT_RDWR

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
        return self.can_send() or not (self.state & _WRITABLE)

    def write_data(self, data: memoryview) -> None:
        """rs_write_data: one DATA transfer into the current target SGE."""
        n = len(data)
        sg = self._copy_out(data)
        self.sseq_no = (self.sseq_no + 1) & 0xFFFF
        self.sqe_avail -= 1
        self.sbuf_bytes_avail -= n
        addr, key, length = self._target(self.target_sge)
        self._set_target(self.target_sge, addr + n, key, length - n)
        i = self.target_sge
        if length - n == 0:
            self.target_sge = (self.target_sge + 1) % RS_SGL_SIZE
        msg = msg_set(RS_OP_DATA, n)
        self._post(msg, O.IBV_WR_RDMA_WRITE_WITH_IMM, sg, imm=msg, addr=addr, rkey=key)
        del i

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
                 _s16(self.rseq_no - self.rseq_comp) >= 0) and
                self.ctrl_avail() and bool(self.state & _CONNECTED))

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
        if self.released or self.err is not None:
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
                    self.state = _DISCONNECTED
                    self.peer_closed = True
                elif data == RS_CTRL_SHUTDOWN:
                    if self.state & _WRITABLE:
                        self.state &= ~_READABLE
                    else:
                        self.state = _DISCONNECTED
                        self.peer_closed = True
            elif op == RS_OP_WRITE:
                pass
            else:
                self.rmsg.append([op, data])
            if self.state & _CONNECTED:
                try:
                    self._post_recv()
                except PyverbsRDMAError as e:
                    self.state = _ERROR
                    self.fail(e)
            return
        data = wc.wr_id & 0xFFFFFFFF
        op = data >> 29
        if op == RS_OP_SGL:
            self.ctrl_max_seqno += 1
        elif op == RS_OP_CTRL:
            self.ctrl_max_seqno += 1
            if (data & 0x1FFFFFFF) == RS_CTRL_DISCONNECT:
                self.state = _DISCONNECTED
        elif op == RS_OP_IOMAP_SGL:
            self.sqe_avail += 1
            self.sbuf_bytes_avail += IOMAP_LE.size
        else:
            self.sqe_avail += 1
            self.sbuf_bytes_avail += data & 0x1FFFFFFF
        if wc.status != WS.IBV_WC_SUCCESS and self.state & _CONNECTED:
            self.state = _ERROR
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
            if self.state & _CONNECTED:
                self.state = _DISCONNECTED
        elif t in (E.RDMA_CM_EVENT_REJECTED, E.RDMA_CM_EVENT_UNREACHABLE,
                   E.RDMA_CM_EVENT_CONNECT_ERROR):
            self.fail(ConnectionRefusedError(errno.ECONNREFUSED, ev.event_str()))

    def pump(self) -> None:
        self.update_credits()
        if (self.opts.keepalive and self.state & _CONNECTED and
                time.monotonic() - self.last_keepalive > self.opts.keepalive):
            self.send_keepalive()

    def send_keepalive(self) -> None:
        """tcp_svc_send_keepalive: a 0-byte RDMA WRITE (no immediate)."""
        self.last_keepalive = time.monotonic()
        if self.ctrl_avail() and self.state & _CONNECTED:
            self.ctrl_seqno += 1
            try:
                self._post(msg_set(RS_OP_CTRL, RS_CTRL_KEEPALIVE), O.IBV_WR_RDMA_WRITE, [])
            except PyverbsRDMAError as e:
                self.fail(e)

    def fail(self, exc: BaseException) -> None:
        if self.err is None:
            self.err = exc

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
        peer = 0
        core = getattr(self.cmid, "id", None)
        req = getattr(core, "req", None)
        if req is not None:
            peer = int(req.primary_local_ack_timeout)
        else:
            route = getattr(core, "route", None)
            if route is not None:
                peer = route.packet_life_time + 1  # (cm.c: the active side's av.timeout)
        timeout = max(own, peer)
        return 4.096e-6 * (1 << timeout) if timeout else 2.2

    def duplicates_seen(self) -> int | None:
        """Duplicate requests this QP's responder has answered (soft backend only)."""
        resp = getattr(getattr(self.qp, "engine", None), "resp", None)
        return getattr(resp, "duplicates", None)

    def all_sends_done(self) -> bool:
        return ((self.ctrl_max_seqno - self.ctrl_seqno) + self.sqe_avail == self.sq_size
                or not self.state & _CONNECTED)

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

    def write_iomap(self, m: _IoMap) -> None:
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


class RSocket(SocketBase):
    """A SOCK_STREAM socket speaking librdmacm's rsocket protocol (module docstring).

    Python-socket manners: ``bind``/``listen``/``accept``/``connect``, ``send`` (bytes
    accepted), ``sendall``, ``recv(bufsize)`` (``b""`` at EOF), ``recv_into``,
    ``shutdown``, ``close``, timeouts and non-blocking mode, ``fileno``; plus
    ``riomap``/``riowrite`` (rsocket's direct RDMA writes)."""

    protocol = "rsocket"

    def __init__(self, *, options: RSOptions | None = None, _conn: RSConn | None = None,
                 _hub: Hub | None = None, _peer: tuple[str, int] | None = None) -> None:
        super().__init__(_conn, _hub, _peer)
        self.options = options or RSOptions()

    # ---- server ---------------------------------------------------------------------

    def listen(self, backlog: int = 128) -> None:
        self._check_open()
        _, cid = self._cm()
        try:
            cid.listen(backlog)
        except PyverbsRDMAError as e:
            raise os_error(e, "listen") from None
        self._listening = True
        self._backlog = backlog

    def accept(self) -> tuple["RSocket", tuple[str, int]]:
        self._check_open()
        if not self._listening:
            raise OSError(errno.EINVAL, "accept: the socket is not listening")
        deadline = self._deadline()
        while True:
            ch = self._channel.channel
            while ch.pending():
                ev = CMEvent(self._channel, 0)
                if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                    self._pending.append(ev)
            while self._pending:
                sock = self._accept_one(self._pending.popleft(), deadline)
                if sock is not None:
                    return sock, sock._peer
            self._expired(deadline, "accept")
            ch.wait(0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic())))

    def _accept_one(self, ev: CMEvent, deadline: float | None) -> "RSocket | None":
        """rs_accept: check the version, make the endpoint, answer with our data."""
        child = CMID(ev, listen_id=self._id)
        channel = CMEventChannel()
        channel.channel.adopt(child.id)
        hub = Hub(child.context, channel, cq_depth=4 * (self.options.sq_size +
                                                        self.options.rq_size) + 64)
        try:
            if self.options.ack_timeout is not None:
                child.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT,
                                 self.options.ack_timeout)
            conn = RSConn(hub, child, self.options.copy())
            conn.save_conn_data(ev.private_data)
            p = ev.param
            data = conn.conn_data()
            cp = ConnParam(resources=p.responder_resources, depth=p.initiator_depth,
                           flow_control=p.flow_control, retry=p.retry_count,
                           rnr_retry=p.rnr_retry_count, data_len=len(data))
            cp.set_private_data(data)
            child.accept(cp)
        except Exception:
            try:
                child.reject(b"")
            except Exception:
                pass
            hub.close()
            channel.close()
            return None
        peer = (str(child.id.dst_ip), child.id.dst_port)
        sock = RSocket(options=self.options, _conn=conn, _hub=hub, _peer=peer)
        sock._channel = channel
        sock._timeout = self._timeout
        # data may come before ESTABLISHED (the first write is the RTU's proxy)
        while not conn.established and conn.err is None:
            hub.progress()
            if conn.established or conn.err is not None or conn.rmsg:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            hub.wait(deadline)
        if conn.err is not None:
            sock.close()
            return None
        return sock

    # ---- client ---------------------------------------------------------------------

    def connect(self, address: tuple[str, int]) -> None:
        """rs_do_connect: resolve, create the endpoint, REQ with our conn data."""
        self._check_open()
        host, port = check_address(address, "connect")
        ch, cid = self._cm()
        deadline = self._deadline()
        try:
            cid.resolve_addr(AddrInfo(dst=host, dst_service=str(port)))
            self._expect(E.RDMA_CM_EVENT_ADDR_RESOLVED, deadline, "connect")
            if self.options.ack_timeout is not None:
                cid.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT,
                               self.options.ack_timeout)
            cid.resolve_route()
            self._expect(E.RDMA_CM_EVENT_ROUTE_RESOLVED, deadline, "connect")
        except PyverbsRDMAError as e:
            raise os_error(e, "connect") from None
        o = self.options
        hub = Hub(cid.context, ch, cq_depth=4 * (o.sq_size + o.rq_size) + 64)
        conn = RSConn(hub, cid, o.copy())
        self._hub, self._conn = hub, conn
        data = conn.conn_data()
        cp = ConnParam(resources=0, depth=0, flow_control=1, retry=7, rnr_retry=7,
                       data_len=len(data))
        cp.set_private_data(data)
        try:
            cid.connect(cp)
        except PyverbsRDMAError as e:
            raise os_error(e, "connect") from None
        while True:
            if ch.channel.pending():
                ev = CMEvent(ch, 0)
                if ev.event_type == E.RDMA_CM_EVENT_ESTABLISHED:
                    try:
                        conn.save_conn_data(ev.private_data)
                    except ConnectionError as e:
                        self.close()
                        raise ConnectionRefusedError(errno.ECONNREFUSED, str(e)) from None
                    conn.established = True
                    self._peer = (host, port)
                    hub.progress()
                    return
                status = f"{ev.event_str()} (status {ev.status})"
                self.close()
                if ev.event_type == E.RDMA_CM_EVENT_REJECTED:
                    raise ConnectionRefusedError(errno.ECONNREFUSED,
                                                 f"connect to {host}:{port}: {status}")
                raise ConnectionError(errno.EHOSTUNREACH, f"connect to {host}:{port}: {status}")
            if deadline is not None and time.monotonic() >= deadline:
                self.close()
                raise TimeoutError(errno.ETIMEDOUT, f"connect to {host}:{port}: timed out")
            ch.channel.wait(0.25 if deadline is None else
                            max(0.0, min(0.25, deadline - time.monotonic())))

    def _expect(self, want: int, deadline: float | None, what: str) -> None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            ev = CMEvent(self._channel, left)
        except PyverbsRDMAError:
            raise TimeoutError(errno.ETIMEDOUT, f"{what}: timed out") from None
        if ev.event_type != want:
            raise ConnectionError(errno.EHOSTUNREACH,
                                  f"{what}: {ev.event_str()} (status {ev.status})")

    # ---- data -----------------------------------------------------------------------

    def _connected(self) -> RSConn:
        self._check_open()
        if self._conn is None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return self._conn

    def _raise_error(self, conn: RSConn) -> None:
        if conn.err is not None or conn.state & _ERROR:
            raise ConnectionResetError(errno.ECONNRESET, f"rsocket: connection broken: "
                                       f"{conn.err}")

    def _wait_for(self, conn: RSConn, test: Any, deadline: float | None, what: str) -> None:
        """rs_get_comp: progress until ``test()``; raise on timeout/non-blocking."""
        while True:
            self._hub.progress()
            if test():
                return
            self._raise_error(conn)
            self._expired(deadline, what)
            self._hub.wait(deadline)

    def send(self, data: Any) -> int:
        """rsend: stream ``data``; returns the bytes accepted (all of them when blocking;
        with a timeout or non-blocking, what went before it passed)."""
        conn = self._connected()
        view = memoryview(data).cast("B")
        deadline = self._deadline()
        if not conn.state & _WRITABLE:
            self._raise_error(conn)
            raise BrokenPipeError(errno.EPIPE, "send: the connection is closed")
        if conn.iomap_queue:
            self._send_iomaps(conn, deadline)
        left, pos, olen = len(view), 0, RS_OLAP_START_SIZE
        lock = self._hub.lock
        self._hub.progress()
        while left:
            with lock:  # a receiving thread may be polling the same CQ
                if conn.can_send():
                    size, olen = conn.xfer_size(left, olen)
                    try:
                        conn.write_data(view[pos:pos + size])
                    except PyverbsRDMAError as e:
                        conn.fail(e)
                        self._raise_error(conn)
                    pos += size
                    left -= size
                    continue
            try:
                self._wait_for(conn, conn.conn_can_send, deadline, "send")
            except (BlockingIOError, TimeoutError):
                if pos:
                    break
                raise
            if not conn.state & _WRITABLE:
                if pos:
                    break
                self._raise_error(conn)
                raise ConnectionResetError(errno.ECONNRESET, "send: the peer closed")
        self._hub.progress()
        return pos

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            pos += self.send(view[pos:])

    def recv(self, bufsize: int) -> bytes:
        buf = bytearray(bufsize)
        n = self.recv_into(buf)
        return bytes(buf[:n])

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """rrecv: up to ``nbytes`` (or len(buffer)) bytes; 0 at the peer's orderly close."""
        conn = self._connected()
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        if not len(view):
            return 0
        deadline = self._deadline()
        if not conn.have_rdata():
            self._wait_for(conn, lambda: conn.have_rdata() or not conn.state & _READABLE,
                           deadline, "recv")
        with self._hub.lock:
            n = conn.read(view)
            conn.update_credits()
        if n == 0:
            self._raise_error(conn)
        return n

    def shutdown(self, how: int) -> None:
        """rshutdown: SHUT_RD (0), SHUT_WR (1: a SHUTDOWN message, or DISCONNECT when not
        readable either) or SHUT_RDWR (2: DISCONNECT); waits for outstanding sends."""
        conn = self._connected()
        hub = self._hub
        if conn.state & _CONNECTED:
            if how == 2:
                ctrl = RS_CTRL_DISCONNECT
                conn.state &= ~(_READABLE | _WRITABLE)
            elif how == 1:
                conn.state &= ~_WRITABLE
                ctrl = RS_CTRL_SHUTDOWN if conn.state & _READABLE else RS_CTRL_DISCONNECT
            else:
                conn.state &= ~_READABLE
                if conn.state & _WRITABLE:
                    return
                ctrl = RS_CTRL_DISCONNECT
            deadline = time.monotonic() + CLOSE_TIMEOUT
            while not (conn.ctrl_avail() or not conn.state & _CONNECTED) and \
                    conn.err is None and time.monotonic() < deadline:
                hub.progress()
                hub.wait(deadline)
            with hub.lock:
                if conn.state & _CONNECTED and conn.ctrl_avail():
                    conn.ctrl_seqno += 1
                    try:
                        conn._post_msg(msg_set(RS_OP_CTRL, ctrl))
                    except PyverbsRDMAError as e:
                        conn.fail(e)
        if conn.state & _CONNECTED:
            deadline = time.monotonic() + CLOSE_TIMEOUT
            while conn.err is None and time.monotonic() < deadline:
                hub.progress()
                if conn.all_sends_done():
                    break
                hub.wait(deadline)
        if conn.state & _DISCONNECTED:
            if conn.peer_closed:
                self._time_wait(conn)
            try:  # ucma_shutdown: the QP to ERROR
                from ..verbs_api import QPAttr
                from ..verbs_api.enums import ibv_qp_state
                conn.qp.modify(QPAttr(qp_state=ibv_qp_state.IBV_QPS_ERR),
                               ibv_qp_attr_mask.IBV_QP_STATE)
            except Exception:
                pass

    def _time_wait(self, conn: RSConn) -> None:
        """TIME_WAIT, which rsocket lacks: the peer's DISCONNECT arrived, so the peer
        now waits for that message's ACK, and an RC requester whose last ACK is lost
        retransmits until it hears one (rxe, with rdma_cm's retry_cnt 7, for ever; a
        QP in ERROR drops the retransmissions). So the QP stays up and re-ACKs
        duplicates until the peer's DREQ says it is done, or until a quiet spell of
        TIME_WAIT_PERIODS retransmission periods without a duplicate."""
        if conn.time_waited or conn.released:
            return
        conn.time_waited = True
        hub = conn.hub
        quiet = TIME_WAIT_PERIODS * conn.ack_period()
        seen = conn.duplicates_seen()
        now = time.monotonic()
        hard, end = now + CLOSE_TIMEOUT, now + quiet
        while not conn.peer_dreq and conn.err is None and now < min(end, hard):
            hub.progress()
            if conn.peer_dreq:
                break
            dups = conn.duplicates_seen()
            if dups != seen:  # an ACK of ours was lost: start the quiet spell again
                seen, end = dups, time.monotonic() + quiet
            hub.wait(min(end, hard, time.monotonic() + 0.1))
            now = time.monotonic()

    # ---- riomap / riowrite ----------------------------------------------------------

    def riomap(self, buffer: Any, offset: int = 0) -> tuple[int, Any]:
        """riomap(PROT_WRITE): let the peer riowrite into ``buffer`` (an int: a new
        zeroed buffer of that size) at ``offset``; returns (offset, MR) — the MR's
        ``mem`` shows what arrives. The mapping reaches the peer with the next send."""
        conn = self._connected()
        free = [i for i in range(conn.remote_iomap[2])
                if i >= len(conn.remote_iomappings) or conn.remote_iomappings[i] is None]
        if not free:
            raise OSError(errno.ENOMEM, "riomap: the peer's iomap table is full "
                          f"({conn.remote_iomap[2]} entries)")
        access = A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE
        if isinstance(buffer, int):
            mr = MR(self._hub.pd, buffer, access)
        else:
            mr = MR(self._hub.pd, len(buffer), access, buffer=buffer)
        i = free[0]
        while len(conn.remote_iomappings) <= i:
            conn.remote_iomappings.append(None)
        m = _IoMap(mr, offset, i)
        conn.remote_iomappings[i] = m
        conn.iomap_queue.append(m)
        return offset, mr

    def riounmap(self, mr: Any) -> None:
        conn = self._connected()
        for i, m in enumerate(conn.remote_iomappings):
            if m is not None and m.mr is mr:
                conn.remote_iomappings[i] = None
                if m in conn.iomap_queue:
                    conn.iomap_queue.remove(m)
                mr.close()
                return
        raise OSError(errno.EINVAL, "riounmap: not mapped")

    def _send_iomaps(self, conn: RSConn, deadline: float | None) -> None:
        while conn.iomap_queue:
            if not conn.can_send():
                self._wait_for(conn, conn.conn_can_send, deadline, "riomap")
                if not conn.state & _WRITABLE:
                    raise ConnectionResetError(errno.ECONNRESET, "riomap: the peer closed")
            with self._hub.lock:
                conn.write_iomap(conn.iomap_queue.popleft())

    def riowrite(self, data: Any, offset: int) -> int:
        """riowrite: RDMA WRITE ``data`` at ``offset`` of what the peer riomapped; the
        bytes written (0 when nothing the peer mapped covers ``offset``)."""
        conn = self._connected()
        view = memoryview(data).cast("B")
        deadline = self._deadline()
        if conn.iomap_queue:
            self._send_iomaps(conn, deadline)
        left, pos, olen = len(view), 0, RS_OLAP_START_SIZE
        iom = None
        self._hub.progress()
        while left:
            if iom is None or offset > iom[0] + iom[3]:
                iom = conn.find_iomap(offset)
                if iom is None:
                    break
            if not conn.can_send():
                try:
                    self._wait_for(conn, conn.conn_can_send, deadline, "riowrite")
                except (BlockingIOError, TimeoutError):
                    if pos:
                        break
                    raise
                if not conn.state & _WRITABLE:
                    raise ConnectionResetError(errno.ECONNRESET, "riowrite: the peer closed")
            if olen < left:
                size = olen
                if olen < RS_MAX_TRANSFER:
                    olen <<= 1
            else:
                size = left
            with self._hub.lock:
                size = min(size, conn.sbuf_bytes_avail, iom[0] + iom[3] - offset)
                conn.write_direct(iom, offset, view[pos:pos + size])
            pos += size
            left -= size
            offset += size
        self._hub.progress()
        return pos

    # ---- select ---------------------------------------------------------------------

    def fileno(self) -> int:
        if self._hub is not None:
            return self._hub.fileno()
        if self._channel is not None:
            return self._channel.fd
        return -1

    def progress(self) -> None:
        """Handle what completed (for callers polling riomapped memory)."""
        if self._hub is not None:
            self._hub.progress()

    # ---- the end --------------------------------------------------------------------

    def close(self) -> None:
        """rclose: shutdown(SHUT_RDWR) when connected (DISCONNECT, wait for our sends),
        then disconnect and free the QP, MRs, CQ and ids. Idempotent."""
        if self._closed:
            return
        conn, hub = self._conn, self._hub
        if conn is not None and conn.state & _CONNECTED and not conn.released:
            try:
                self.shutdown(2)
            except Exception:
                pass
        if conn is not None and conn.peer_closed:
            self._time_wait(conn)  # (shutdown is skipped once the peer's close arrived)
        self._closed = True
        if conn is not None:
            try:
                conn.cmid.disconnect()
            except Exception:
                pass
            conn.release()
        for ev in self._pending:
            try:
                CMID(ev, listen_id=self._id).reject(b"")
            except Exception:
                pass
        self._pending.clear()
        if hub is not None:
            hub.close()
        if self._id is not None and (conn is None or conn.cmid is not self._id):
            self._id.close()
        if self._channel is not None:
            self._channel.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "listening" if self._listening else \
            "connected" if self._conn is not None else "unconnected"
        return f"<softrdma.socket rsocket {state} {self.getsockname()}>"
