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
connection broke (the peer vanished: noticed within ~3 s, see docs/socket.md; or it
refused what we sent, and said why), ``OSError(EMSGSIZE)`` from ``send`` for a message
or run over the limits the peer's hello announced.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..rdmacm import CMEventChannel, CMID
from .base import SocketBase
from .conn import Connection, Hub, Message, Options
from .record import Record, RecordType
from .rsocket import RSocket

__all__ = ["socket", "create_connection", "create_server", "CLOSE_TIMEOUT"]

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
            return RSocket(*args, **kw)
        if protocol != "softrdma":
            raise ValueError(f"protocol must be 'softrdma' or 'rsocket', not {protocol!r}")
        return super().__new__(cls)

    def __init__(self, *, options: Options | None = None, protocol: str = "softrdma",
                 _conn: Connection | None = None,
                 _hub: Hub | None = None, _peer: tuple[str, int] | None = None) -> None:
        super().__init__(_conn, _hub, _peer)
        self.options = options or Options()

    # ---- the handshake's hooks (SocketBase) -------------------------------------------

    def _make_hub(self, cmid: CMID, channel: CMEventChannel) -> Hub:
        return Hub(cmid.context, channel)

    def _make_conn(self, hub: Hub, cmid: CMID) -> Connection:
        return Connection(hub, cmid, self.options)

    def accept(self) -> tuple["socket", tuple[str, int]]:
        """Wait for a connection; return a connected socket and the peer's (ip, port)."""
        return super().accept()

    # ---- data -----------------------------------------------------------------------------

    def send(self, data: bytes | bytearray | memoryview, more: bool = False) -> int:
        """Send ``data`` as one message (``more``: a frame, another follows); returns its
        length. Blocks while the peer has no room (its credits), up to the timeout.
        OSError(EMSGSIZE) at once if the peer said (in its hello) it would refuse it: a
        message over its ``max_message``, or a frame making a run over its ``max_run``."""
        conn = self._connected()
        data = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
        conn.check_size(len(data))
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
            self._expired(deadline, "recv")
            self._hub.wait(deadline)

    # ---- select and asyncio ---------------------------------------------------------------

    def _fds(self) -> list[int]:
        fds = []
        if self._hub is not None:
            fds += [self._hub.fileno(), self._hub.channel.fd]
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
                self._hub.arm()
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
                if self._hub is not None and self._hub.fileno() in fds:
                    self._hub.take_cq_event()

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
        try:
            if self._conn is not None and self._hub is not None:
                self._goodbye(self._conn, self._hub)
        finally:
            self._free()

    def _goodbye(self, conn: Connection, hub: Hub) -> None:
        while conn.abort_pending:  # the ABORT telling the peer why must leave first
            hub.progress()
            hub.wait(conn.abort_until)
        if conn.error is not None or conn.disconnected or not conn.established:
            return
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while time.monotonic() < deadline and conn.error is None and not conn.disconnected:
            hub.progress()
            if not conn.txq and not conn.local_closed:
                if conn.send_control(Record(RecordType.CLOSE)):
                    conn.local_closed = True
            if conn.local_closed and conn.idle_tx():
                return
            hub.wait(deadline)

    def __repr__(self) -> str:
        return f"<softrdma.socket {self._state()} {self.getsockname()}>"


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
