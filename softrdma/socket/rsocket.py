"""librdmacm's rsocket protocol (SOCK_STREAM), wire-compatible with rdma-core 44 on RoCE.

``softrdma.socket.socket(protocol="rsocket")`` returns an :class:`RSocket`: a byte
stream (``send`` returns the bytes accepted, ``recv(n)`` up to ``n`` bytes, ``b""`` at
the peer's orderly close) that ``rstream``/``riostream`` and any program linked with
librsocket can talk to. Only rdma_cm (:mod:`softrdma.rdmacm`) and the public verbs API
are used. docs/rsocket.md describes the protocol. Three modules, as librdmacm/rsocket.c
has three parts:

* :mod:`~softrdma.socket.rswire`: the wire (constants, ``struct rs_conn_data``,
  ``rs_sge``, ``rs_iomap``, the immediate data of each message);
* :mod:`~softrdma.socket.rsconn`: one connection's state (rings, credits, sequence
  numbers, control messages, TIME_WAIT), driven by a hub;
* this module: the socket (rsend, rrecv, rshutdown, rclose, riomap, riowrite), its
  handshake being :class:`~softrdma.socket.base.SocketBase`'s. Close sends DISCONNECT,
  waits for its completion, then moves the QP to ERROR and destroys the id (DREQ).
"""

from __future__ import annotations

import errno
import select
import time
from socket import MSG_PEEK
from typing import Any

from ..errors import PyverbsRDMAError
from ..rdmacm import CMEventChannel, CMID
from ..verbs_api import MR
from ..verbs_api.enums import ibv_access_flags as A
from .base import SocketBase
from .conn import Hub
from .rsconn import (
    CLOSE_TIMEOUT, RS_CONNECTED, RS_DISCONNECTED, RS_ERROR, RS_READABLE, RS_WRITABLE,
    TIME_WAIT_PERIODS, IoMap, RSConn, RSOptions,
)
from .rswire import (
    CONN_DATA, RS_CTRL_DISCONNECT, RS_CTRL_SHUTDOWN, RS_MAX_TRANSFER, RS_OLAP_START_SIZE,
    RS_OP_CTRL, RS_OP_DATA, RS_OP_SGL, msg_set, scale_to_value, value_to_scale,
)

# (CONN_DATA, the RS_OP_* names and the helpers stay importable from here, as before
# the split)
__all__ = ["RSocket", "RSOptions", "RSConn", "CONN_DATA", "RS_OP_DATA", "RS_OP_SGL",
           "RS_OP_CTRL", "CLOSE_TIMEOUT", "TIME_WAIT_PERIODS", "msg_set",
           "value_to_scale", "scale_to_value"]


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

    # ---- the handshake's hooks (SocketBase: rs_accept, rs_do_connect) ---------------

    def _make_hub(self, cmid: CMID, channel: CMEventChannel) -> Hub:
        o = self.options
        return Hub(cmid.context, channel, cq_depth=4 * (o.sq_size + o.rq_size) + 64)

    def _make_conn(self, hub: Hub, cmid: CMID) -> RSConn:
        return RSConn(hub, cmid, self.options.copy())

    @staticmethod
    def _accepted(conn: RSConn) -> bool:
        # data may come before ESTABLISHED (the first write is the RTU's proxy)
        return conn.established or bool(conn.rmsg)

    def accept(self) -> tuple["RSocket", tuple[str, int]]:
        """raccept: wait for a connection; a connected RSocket and the peer's (ip, port)."""
        return super().accept()

    # ---- data -----------------------------------------------------------------------

    def _raise_error(self, conn: RSConn) -> None:
        if conn.error is not None or conn.state & RS_ERROR:
            raise ConnectionResetError(errno.ECONNRESET, f"rsocket: connection broken: "
                                       f"{conn.error}")

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
        if not conn.state & RS_WRITABLE:
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
            if not conn.state & RS_WRITABLE:
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

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        """rrecv: up to ``nbytes`` (or len(buffer)) bytes; 0 at the peer's orderly close.
        ``flags`` MSG_PEEK: copy them and leave them queued."""
        conn = self._connected()
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        if not len(view):
            return 0
        deadline = self._deadline()
        if not conn.have_rdata():
            self._wait_for(conn, lambda: conn.have_rdata() or not conn.state & RS_READABLE,
                           deadline, "recv")
        with self._hub.lock:
            if flags & MSG_PEEK:
                return conn.peek(view)
            n = conn.read(view)
            conn.update_credits()
        if n == 0:
            self._raise_error(conn)
        return n

    def shutdown(self, how: int, linger: bool = True) -> None:
        """rshutdown: SHUT_RD (0), SHUT_WR (1: a SHUTDOWN message, or DISCONNECT when not
        readable either) or SHUT_RDWR (2: DISCONNECT); waits for outstanding sends.
        ``linger`` False: once disconnected, leave the TIME_WAIT (and the QP's move to
        ERROR) to :meth:`close`, for a caller that closes on a thread of its own."""
        conn = self._connected()
        hub = self._hub
        if conn.state & RS_CONNECTED:
            if how == 2:
                ctrl = RS_CTRL_DISCONNECT
                conn.state &= ~(RS_READABLE | RS_WRITABLE)
            elif how == 1:
                conn.state &= ~RS_WRITABLE
                ctrl = RS_CTRL_SHUTDOWN if conn.state & RS_READABLE else RS_CTRL_DISCONNECT
            else:
                conn.state &= ~RS_READABLE
                if conn.state & RS_WRITABLE:
                    return
                ctrl = RS_CTRL_DISCONNECT
            deadline = time.monotonic() + CLOSE_TIMEOUT
            while not (conn.ctrl_avail() or not conn.state & RS_CONNECTED) and \
                    conn.error is None and time.monotonic() < deadline:
                hub.progress()
                hub.wait(deadline)
            with hub.lock:
                conn.send_ctrl(ctrl)
        if conn.state & RS_CONNECTED:
            deadline = time.monotonic() + CLOSE_TIMEOUT
            while conn.error is None and time.monotonic() < deadline:
                hub.progress()
                if conn.all_sends_done():
                    break
                hub.wait(deadline)
        if conn.state & RS_DISCONNECTED and linger:
            if conn.peer_closed:
                conn.time_wait()
            conn.qp_to_error()

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
        m = IoMap(mr, offset, i)
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
                if not conn.state & RS_WRITABLE:
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
                if not conn.state & RS_WRITABLE:
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

    def progress(self) -> None:
        """Handle what completed (for callers polling riomapped memory)."""
        if self._hub is not None:
            self._hub.progress()

    def poll(self, events: int) -> int:
        """librdmacm's rs_poll_rs: handle what completed (without blocking), then the
        poll(2) events of ``events`` the socket has -- POLLIN for data or the peer's
        close (or, listening, a connection to accept), POLLOUT for room to send -- plus
        POLLHUP once disconnected and every byte read, POLLERR once broken, asked for
        or not."""
        if self._closed:
            return select.POLLNVAL
        if self._listening:
            return select.POLLIN & events if self.accept_ready() else 0
        conn = self._conn
        if conn is None:
            return 0
        self._hub.progress()
        revents = 0
        state = conn.state
        if events & select.POLLIN and (conn.have_rdata() or not state & RS_READABLE):
            revents |= select.POLLIN
        if events & select.POLLOUT and conn.can_send():
            revents |= select.POLLOUT
        if not state & RS_CONNECTED:
            # POLLHUP waits until what arrived was read (rsocket.c says it at once: a
            # poller that takes POLLHUP for the end, as rstream -T a does, would lose
            # the tail the peer sent just before its DISCONNECT)
            if not state & RS_DISCONNECTED:
                revents |= select.POLLERR
            elif not conn.have_rdata():
                revents |= select.POLLHUP
        return revents

    # ---- the end --------------------------------------------------------------------

    def close(self) -> None:
        """rclose: shutdown(SHUT_RDWR) when connected (DISCONNECT, wait for our sends),
        then disconnect and free the QP, MRs, CQ and ids. Idempotent."""
        if self._closed:
            return
        conn = self._conn
        if conn is not None and conn.state & RS_CONNECTED and not conn.released:
            try:
                self.shutdown(2)
            except Exception:
                pass
        if conn is not None and conn.peer_closed:
            conn.time_wait()  # (shutdown is skipped once the peer's close arrived)
        self._closed = True
        self._free()

    def __repr__(self) -> str:
        return f"<softrdma.socket rsocket {self._state()} {self.getsockname()}>"
