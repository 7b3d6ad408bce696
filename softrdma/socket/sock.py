"""``softrdma.socket.socket``: messages over RDMA, with the manners of Python's sockets.

    from softrdma import socket as rsock
    with rsock.create_server(("127.0.0.1", 7471)) as srv:
        conn, peer = srv.accept()
        conn.send(conn.recv())                      # echo one message

    with rsock.create_connection(("127.0.0.1", 7471)) as s:
        s.send(b"hello")                            # one message, boundaries kept
        print(s.recv())

Errors are Python's: ``ConnectionRefusedError`` (nobody listens), ``TimeoutError`` (the
socket's timeout passed), ``BlockingIOError`` (non-blocking and nothing to do),
``EOFError`` from ``recv`` once the peer closed and every message it sent was taken,
``BrokenPipeError`` from ``send`` after a close, ``ConnectionResetError`` when the
connection broke (the peer vanished: noticed within ~3 s, see docs/socket.md).
"""

from __future__ import annotations

import asyncio
import errno
import time
from typing import Any

from ..errors import PyverbsRDMAError
from ..rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID
from ..rdmacm import enums as ce
from .base import SocketBase, check_address, os_error
from .conn import Connection, Hub, Message, Options

__all__ = ["socket", "create_connection", "create_server", "CLOSE_TIMEOUT"]

E = ce.rdma_cm_event_type
#: how long ``close()`` waits for a live peer to take what was sent (SO_LINGER's role);
#: a peer that vanished is noticed sooner (docs/socket.md, "Failures")
CLOSE_TIMEOUT = 60.0
_UNSET: Any = object()


class socket(SocketBase):
    """An RDMA message socket (RC, rdma_cm's TCP port space). Unconnected, it can
    ``bind``/``listen``/``accept`` or ``connect``; connected, ``send`` and ``recv`` move
    whole messages. ``options`` tunes the protocol (:class:`Options`).
    ``protocol="rsocket"`` makes instead a byte stream speaking librdmacm's rsocket
    protocol (:class:`softrdma.socket.rsocket.RSocket`, docs/rsocket.md)."""

    def __new__(cls, *args: Any, protocol: str = "softrdma", **kw: Any) -> Any:
        if protocol == "rsocket":
            from .rsocket import RSocket
            return RSocket(*args, **kw)
        if protocol != "softrdma":
            raise ValueError(f"protocol must be 'softrdma' or 'rsocket', not {protocol!r}")
        return super().__new__(cls)

    def __init__(self, *, options: Options | None = None, protocol: str = "softrdma",
                 _conn: Connection | None = None,
                 _hub: Hub | None = None, _peer: tuple[str, int] | None = None) -> None:
        super().__init__(_conn, _hub, _peer)
        self.options = options or Options()

    # ---- server -------------------------------------------------------------------------

    def listen(self, backlog: int = 128) -> None:
        self._check_open()
        ch, cid = self._cm()
        try:
            cid.listen(backlog)
        except PyverbsRDMAError as e:
            raise os_error(e, "listen") from None
        self._listening = True
        self._backlog = backlog

    def _listener_progress(self) -> None:
        """Take connection requests off the channel; turn away what exceeds the backlog."""
        ch = self._channel.channel
        while ch.pending():
            ev = CMEvent(self._channel, 0)
            if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                if len(self._pending) >= max(self._backlog, 1):
                    CMID(ev, listen_id=self._id).reject(b"backlog")
                else:
                    self._pending.append(ev)
        if self._hub is not None:
            self._hub.progress()

    def accept(self) -> tuple["socket", tuple[str, int]]:
        """Wait for a connection; return a connected socket and the peer's (ip, port)."""
        self._check_open()
        if not self._listening:
            raise OSError(errno.EINVAL, "accept: the socket is not listening")
        deadline = self._deadline()
        while True:
            self._listener_progress()
            while self._pending:
                ev = self._pending.popleft()
                sock = self._accept_one(ev, deadline)
                if sock is not None:
                    return sock, sock._peer
            self._expired(deadline, "accept")
            self._channel.channel.wait(0.25 if deadline is None
                                       else min(0.25, deadline - time.monotonic()))

    def _hub_for(self, cmid: CMID, channel: CMEventChannel) -> Hub:
        return Hub(cmid.context, channel)

    def _accept_one(self, ev: CMEvent, deadline: float | None) -> "socket | None":
        child = CMID(ev, listen_id=self._id)
        channel = CMEventChannel()  # the new connection's events come to its own hub
        channel.channel.adopt(child.id)
        hub = self._hub_for(child, channel)
        try:
            # the passive QP's ACK timeout is the REQ's (19: 2 s) unless set, as on Linux
            child.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT,
                             self.options.ack_timeout)
            conn = Connection(hub, child, self.options)
            conn.set_peer(ev.private_data)
            child.accept(conn.conn_param())
        except Exception:
            try:
                child.reject(b"")
            except Exception:
                pass
            hub.close()
            channel.close()
            return None
        peer = (str(child.id.dst_ip), child.id.dst_port)
        sock = socket(options=self.options, _conn=conn, _hub=hub, _peer=peer)
        sock._channel = channel
        sock._timeout = self._timeout
        while not conn.established and conn.error is None:
            hub.progress()
            if conn.established or conn.error is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            hub.wait(deadline)
        if conn.error is not None:
            sock.close()
            return None
        return sock

    # ---- client -------------------------------------------------------------------------

    def connect(self, address: tuple[str, int]) -> None:
        """Resolve, connect, and return once the connection is ESTABLISHED."""
        self._check_open()
        host, port = check_address(address, "connect")
        ch, cid = self._cm()
        deadline = self._deadline()
        try:
            cid.resolve_addr(AddrInfo(dst=host, dst_service=str(port)))
            self._expect(E.RDMA_CM_EVENT_ADDR_RESOLVED, deadline, "connect")
            cid.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT,
                           self.options.ack_timeout)
            cid.resolve_route()
            self._expect(E.RDMA_CM_EVENT_ROUTE_RESOLVED, deadline, "connect")
        except PyverbsRDMAError as e:
            raise os_error(e, "connect") from None
        hub = Hub(cid.context, ch)
        conn = Connection(hub, cid, self.options)
        self._hub, self._conn = hub, conn
        try:
            cid.connect(conn.conn_param())
        except PyverbsRDMAError as e:
            raise os_error(e, "connect") from None
        while True:
            ch_ = ch.channel
            if ch_.pending():
                ev = CMEvent(ch, 0)
                if ev.event_type == E.RDMA_CM_EVENT_ESTABLISHED:
                    try:
                        conn.set_peer(ev.private_data)
                    except ConnectionError as e:
                        self.close()
                        raise ConnectionRefusedError(errno.ECONNREFUSED, str(e)) from None
                    conn.established = True
                    conn.pump()
                    self._peer = (host, port)
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
            ch_.wait(0.25 if deadline is None else min(0.25, deadline - time.monotonic()))

    def _expect(self, want: int, deadline: float | None, what: str) -> None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            ev = CMEvent(self._channel, left)
        except PyverbsRDMAError:
            raise TimeoutError(errno.ETIMEDOUT, f"{what}: timed out") from None
        if ev.event_type != want:
            raise ConnectionError(errno.EHOSTUNREACH,
                                  f"{what}: {ev.event_str()} (status {ev.status})")

    # ---- data -----------------------------------------------------------------------------

    def _connected(self) -> Connection:
        self._check_open()
        if self._conn is None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return self._conn

    def send(self, data: bytes | bytearray | memoryview, more: bool = False) -> int:
        """Send ``data`` as one message (``more``: a frame, another follows); returns its
        length. Blocks while the peer has no room (its credits), up to the timeout."""
        conn = self._connected()
        data = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
        deadline = self._deadline()
        while True:
            conn.check_usable(sending=True)
            self._hub.progress()
            conn.check_usable(sending=True)
            # a bounded backlog: queue while the records waiting for credit are few
            if conn.tx_backlog() < max(conn.opts.slots, 1):
                conn.queue_message(data, more)
                self._hub.progress()
                return len(data)
            self._expired(deadline, "send")
            self._hub.wait(deadline)

    sendall = send

    def recv(self, bufsize: int | None = None) -> bytes:
        """The next whole message (``bufsize`` is accepted for familiarity and ignored:
        a message is never split). ``EOFError`` once the peer has closed and every
        message it sent has been received."""
        msg = self._recv_message()
        return bytes(msg.data)

    def recv_message(self) -> Message:
        """The next message with its frame flag (``more``) and sequence number."""
        return self._recv_message()

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """Receive one message into ``buffer``; ValueError if it does not fit (the message
        stays queued for a larger buffer)."""
        self._connected()
        view = memoryview(buffer).cast("B")
        room = nbytes or len(view)
        msg = self._recv_message(peek_limit=room)
        n = len(msg.data)
        view[:n] = msg.data
        return n

    def _recv_message(self, peek_limit: int | None = None) -> Message:
        conn = self._connected()
        deadline = self._deadline()
        while True:
            self._hub.progress()
            if conn.has_message():
                if peek_limit is not None and len(conn.rxq[0].data) > peek_limit:
                    raise ValueError(f"the next message is {len(conn.rxq[0].data)} bytes; "
                                     f"the buffer holds {peek_limit}")
                msg = conn.take()
                return msg
            conn.check_usable(sending=False)
            if conn.at_eof():
                raise EOFError("the peer closed the connection")
            conn.tick()
            self._expired(deadline, "recv")
            self._hub.wait(deadline)

    # ---- select and asyncio ---------------------------------------------------------------

    def fileno(self) -> int:
        """A descriptor that becomes readable when there may be work: a completion (for a
        connected socket) or a connection request (for a listening one). After it
        fires, ``recv``/``accept`` may still find a message incomplete and, when
        non-blocking, raise BlockingIOError."""
        if self._hub is not None:
            return self._hub.fileno()
        if self._channel is not None:
            return self._channel.fd
        return -1

    def _fds(self) -> list[int]:
        fds = []
        if self._hub is not None:
            fds += [self._hub.comp.fd, self._hub.channel.fd]
        if self._channel is not None and self._channel.fd not in fds:
            fds.append(self._channel.fd)
        return fds

    async def _await_io(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        saved = self._timeout
        while True:
            self._timeout = 0.0
            try:
                return fn(*args)
            except BlockingIOError:
                pass
            finally:
                self._timeout = saved
            if self._hub is not None:
                with self._hub.lock:
                    self._hub.cq.req_notify()
            fut = loop.create_future()
            fds = self._fds()
            for fd in fds:
                loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
            try:
                await asyncio.wait_for(fut, 0.25)
            except asyncio.TimeoutError:
                pass
            finally:
                for fd in fds:
                    loop.remove_reader(fd)
                if self._hub is not None and self._hub.comp.fd in fds:
                    with self._hub.lock:
                        try:
                            self._hub.comp.get_cq_event(self._hub.cq, timeout=0)
                            self._hub.cq.ack_events(1)
                        except PyverbsRDMAError:
                            pass

    async def arecv(self) -> bytes:
        """``recv`` for asyncio: awaits the next message without blocking the loop."""
        return await self._await_io(self.recv)

    async def asend(self, data: bytes | bytearray | memoryview, more: bool = False) -> int:
        return await self._await_io(self.send, data, more)

    async def aaccept(self) -> tuple["socket", tuple[str, int]]:
        return await self._await_io(self.accept)

    # ---- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Send CLOSE, wait (up to CLOSE_TIMEOUT) until the peer acknowledged every message
        lent to it, disconnect, free the QP, CQ, MRs and ids. Idempotent."""
        if self._closed:
            return
        self._closed = True
        conn, hub = self._conn, self._hub
        if conn is not None and hub is not None:
            try:
                self._goodbye(conn, hub)
            finally:
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

    def _goodbye(self, conn: Connection, hub: Hub) -> None:
        if conn.error is not None or conn.disconnected or not conn.established:
            return
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while time.monotonic() < deadline and conn.error is None and not conn.disconnected:
            hub.progress()
            if not conn.txq and not conn.local_closed:
                from .record import Record, RecordType
                if conn.send_control(Record(RecordType.CLOSE)):
                    conn.local_closed = True
            if conn.local_closed and conn.idle_tx():
                return
            hub.wait(deadline)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "listening" if self._listening else \
            "connected" if self._conn is not None else "unconnected"
        return f"<softrdma.socket {state} {self.getsockname()}>"


def create_connection(address: tuple[str, int], timeout: float | None = _UNSET, *,
                      options: Any = None, protocol: str = "softrdma") -> Any:
    """Connect to ``address`` and return the connected socket (socket.create_connection).
    ``protocol="rsocket"``: librdmacm's rsocket stream (options: RSOptions)."""
    s = socket(options=options, protocol=protocol)
    if timeout is not _UNSET:
        s.settimeout(timeout)
    try:
        s.connect(address)
    except BaseException:
        s.close()
        raise
    return s


def create_server(address: tuple[str, int], *, backlog: int = 128,
                  options: Any = None, protocol: str = "softrdma") -> Any:
    """A socket bound to ``address`` and listening (socket.create_server).
    ``protocol="rsocket"``: librdmacm's rsocket stream (options: RSOptions)."""
    s = socket(options=options, protocol=protocol)
    try:
        s.bind(address)
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s
