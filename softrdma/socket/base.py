"""What both socket kinds share (``socket`` with softrdma's message protocol, ``RSocket``
with rsocket's stream protocol): addresses, timeouts and the errors that go with them,
the rdma_cm id of an unconnected socket, the connection handshake on both sides, the
object's lifetime.

The handshake is rdma_cm's, the same for both protocols; what differs comes from hooks:
the subclass makes the hub and the connection (:meth:`SocketBase._make_hub`,
:meth:`SocketBase._make_conn`), and the connection (:class:`Endpoint`) writes and reads
the private data of the REQ and REP and chooses the connection parameters.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import Any, Callable, Protocol, TypeVar

from ..errors import PyverbsRDMAError
from ..rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam, RAI_PASSIVE
from ..rdmacm import enums as ce

__all__ = ["SocketBase", "Endpoint", "accept_request", "check_address", "os_error",
           "wait_slice", "WAIT_SLICE"]

E = ce.rdma_cm_event_type
#: the longest one wait blocks, so keepalives, timers and timeouts still run
WAIT_SLICE = 0.25


def wait_slice(deadline: float | None) -> float:
    """How long the next wait may block: WAIT_SLICE, or what is left before ``deadline``
    (time.monotonic) if less; never negative, however late the caller is."""
    if deadline is None:
        return WAIT_SLICE
    return max(0.0, min(WAIT_SLICE, deadline - time.monotonic()))


def check_address(address: Any, what: str) -> tuple[str, int]:
    """``(host, port)`` as Python's sockets take it (TypeError / OverflowError otherwise)."""
    if not (isinstance(address, tuple) and len(address) >= 2 and isinstance(address[1], int)):
        raise TypeError(f"{what}: address must be a (host, port) tuple, not {address!r:.60}")
    host, port = address[0], address[1]
    if not 0 <= port <= 0xFFFF:
        raise OverflowError(f"{what}: port must be 0-65535, not {port}")
    return (host or "0.0.0.0"), port


def os_error(e: PyverbsRDMAError, what: str) -> OSError:
    """The Python exception for an rdma_cm error (ConnectionRefusedError, TimeoutError,
    else OSError), with its errno."""
    code = e.error_code or errno.EIO
    cls = {errno.ECONNREFUSED: ConnectionRefusedError,
           errno.ETIMEDOUT: TimeoutError}.get(code, OSError)
    return cls(code, f"{what}: {e}")


class Endpoint(Protocol):
    """What the handshake needs of a protocol's connection (``Connection``, ``RSConn``)."""

    cmid: CMID
    established: bool
    error: BaseException | None  # why the connection broke, or None

    def conn_param(self, req: Any = None) -> ConnParam:
        """This side's REQ (``req`` None) or REP (``req``: the REQ's parameters)."""

    def save_conn_data(self, private_data: bytes) -> None:
        """Take the peer's private data; ConnectionError if it is unacceptable."""

    def release(self) -> None:
        """Free the QP, MRs and the rdma_cm id."""


C = TypeVar("C", bound=Endpoint)


def accept_request(child: CMID, ev: CMEvent, ack_timeout: int | None,
                   make_conn: Callable[[CMID], C]) -> C | None:
    """The passive half of the handshake (rdma_accept): set the QP's ACK timeout (the
    REQ's, 19: 2 s, unless set, as on Linux), make the endpoint, take the peer's private
    data, answer with ours. On any failure the request is rejected: None."""
    try:
        if ack_timeout is not None:
            child.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT, ack_timeout)
        conn = make_conn(child)
        conn.save_conn_data(ev.private_data)
        child.accept(conn.conn_param(ev.param))
    except Exception:
        try:
            child.reject(b"")
        except Exception:
            pass
        return None
    return conn


class SocketBase:
    """Timeouts, bind, names, the handshake and lifetime; subclasses add the protocol
    (``_conn`` is an :class:`Endpoint`, ``options`` has an ``ack_timeout``)."""

    options: Any

    def __init__(self, conn: Any, hub: Any, peer: tuple[str, int] | None) -> None:
        self._timeout: float | None = None
        self._conn, self._hub, self._peer = conn, hub, peer
        self._channel: CMEventChannel | None = None
        self._id: CMID | None = None
        self._pending: deque[CMEvent] = deque()  # connection requests not accepted yet
        self._listening = False
        self._closed = False
        self._backlog = 0

    # ---- the protocol's hooks -----------------------------------------------------------

    def _make_hub(self, cmid: CMID, channel: CMEventChannel) -> Any:
        """The hub (CQ, PD, progress) a new connection on ``cmid``'s device runs on."""
        raise NotImplementedError

    def _make_conn(self, hub: Any, cmid: CMID) -> Endpoint:
        """The protocol's connection on ``cmid`` (its QP made), added to ``hub``."""
        raise NotImplementedError

    def _accepted(self, conn: Any) -> bool:
        """``accept`` may hand the connection over (rdma_cm's ESTABLISHED)."""
        return conn.established

    # ---- timeouts ---------------------------------------------------------------------

    def settimeout(self, value: float | None) -> None:
        if value is not None and value < 0:
            raise ValueError("Timeout value out of range")
        self._timeout = value

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool) -> None:
        self._timeout = None if flag else 0.0

    def _deadline(self) -> float | None:
        return None if self._timeout is None else time.monotonic() + self._timeout

    def _expired(self, deadline: float | None, what: str) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            if self._timeout == 0:
                raise BlockingIOError(errno.EAGAIN, f"{what}: would block")
            raise TimeoutError(errno.ETIMEDOUT, f"{what}: timed out")

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "Bad file descriptor: the socket is closed")

    def _connected(self) -> Any:
        self._check_open()
        if self._conn is None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return self._conn

    # ---- addresses ----------------------------------------------------------------------

    def _cm(self) -> tuple[CMEventChannel, CMID]:
        if self._id is None:
            self._channel = CMEventChannel()
            self._id = CMID(self._channel)
        return self._channel, self._id

    def _set_ack_timeout(self, cmid: CMID) -> None:
        if self.options.ack_timeout is not None:
            cmid.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT,
                            self.options.ack_timeout)

    def bind(self, address: tuple[str, int]) -> None:
        self._check_open()
        host, port = check_address(address, "bind")
        _, cid = self._cm()
        try:
            cid.bind_addr(AddrInfo(src=host, src_service=str(port), flags=RAI_PASSIVE))
        except PyverbsRDMAError as e:
            raise os_error(e, "bind") from None

    def getsockname(self) -> tuple[str, int]:
        cid = self._conn.cmid if self._conn is not None else self._id
        try:
            return cid.local_addr if cid is not None else ("0.0.0.0", 0)
        except PyverbsRDMAError:  # the id is gone (a closed socket's, on librdmacm)
            return ("0.0.0.0", 0)

    def getpeername(self) -> tuple[str, int]:
        if self._peer is None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return self._peer

    # ---- the passive side ---------------------------------------------------------------

    def listen(self, backlog: int = 128) -> None:
        self._check_open()
        _, cid = self._cm()
        try:
            cid.listen(backlog)
        except PyverbsRDMAError as e:
            raise os_error(e, "listen") from None
        self._listening = True
        self._backlog = backlog

    def _listener_progress(self) -> None:
        """Take connection requests off the channel; turn away what exceeds the backlog."""
        while self._channel.pending():
            ev = CMEvent(self._channel, 0)
            if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                if len(self._pending) >= max(self._backlog, 1):
                    CMID(ev, listen_id=self._id).reject(b"backlog")
                else:
                    self._pending.append(ev)

    def accept(self) -> tuple[Any, tuple[str, int]]:
        """Wait for a connection; return a connected socket and the peer's (ip, port)."""
        self._check_open()
        if not self._listening:
            raise OSError(errno.EINVAL, "accept: the socket is not listening")
        deadline = self._deadline()
        while True:
            self._listener_progress()
            while self._pending:
                sock = self._accept_one(self._pending.popleft(), deadline)
                if sock is not None:
                    return sock, sock._peer
            self._expired(deadline, "accept")
            self._channel.wait(wait_slice(deadline))

    def _accept_one(self, ev: CMEvent, deadline: float | None) -> Any:
        """Answer one request on a channel and hub of its own; the connected socket, or
        None if the request was turned away or the connection broke at once."""
        child = CMID(ev, listen_id=self._id)
        channel = CMEventChannel()  # the new connection's events come to its own hub
        child.migrate(channel)
        hub = self._make_hub(child, channel)
        conn = accept_request(child, ev, self.options.ack_timeout,
                              lambda cmid: self._make_conn(hub, cmid))
        if conn is None:
            hub.close()
            channel.close()
            return None
        sock = type(self)(options=self.options, _conn=conn, _hub=hub, _peer=child.peer_addr)
        sock._channel = channel
        sock._timeout = self._timeout
        while not self._accepted(conn) and conn.error is None:
            hub.progress()
            if self._accepted(conn) or conn.error is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            hub.wait(deadline)
        if conn.error is not None:
            sock.close()
            return None
        return sock

    # ---- the active side ----------------------------------------------------------------

    def connect(self, address: tuple[str, int]) -> None:
        """Resolve, connect, and return once the connection is ESTABLISHED."""
        self._check_open()
        host, port = check_address(address, "connect")
        ch, cid = self._cm()
        deadline = self._deadline()
        try:
            cid.resolve_addr(AddrInfo(dst=host, dst_service=str(port)))
            self._expect(E.RDMA_CM_EVENT_ADDR_RESOLVED, deadline, "connect")
            self._set_ack_timeout(cid)
            cid.resolve_route()
            self._expect(E.RDMA_CM_EVENT_ROUTE_RESOLVED, deadline, "connect")
        except PyverbsRDMAError as e:
            raise os_error(e, "connect") from None
        hub = self._make_hub(cid, ch)
        conn = self._make_conn(hub, cid)
        self._hub, self._conn = hub, conn
        try:
            cid.connect(conn.conn_param())
        except PyverbsRDMAError as e:
            raise os_error(e, "connect") from None
        what = f"connect to {host}:{port}"
        while not ch.pending():
            if deadline is not None and time.monotonic() >= deadline:
                self.close()
                raise TimeoutError(errno.ETIMEDOUT, f"{what}: timed out")
            ch.wait(wait_slice(deadline))
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
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{what}: {status}")
        raise ConnectionError(errno.EHOSTUNREACH, f"{what}: {status}")

    def _expect(self, want: int, deadline: float | None, what: str) -> None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            ev = CMEvent(self._channel, left)
        except PyverbsRDMAError:
            raise TimeoutError(errno.ETIMEDOUT, f"{what}: timed out") from None
        if ev.event_type != want:
            raise ConnectionError(errno.EHOSTUNREACH,
                                  f"{what}: {ev.event_str()} (status {ev.status})")

    # ---- select -------------------------------------------------------------------------

    def fileno(self) -> int:
        """A descriptor that becomes readable when there may be work: a completion (for a
        connected socket) or a connection request (for a listening one). After it
        fires, ``recv``/``accept`` may still find nothing complete and, when
        non-blocking, raise BlockingIOError."""
        if self._hub is not None:
            return self._hub.fileno()
        if self._channel is not None:
            return self._channel.fd
        return -1

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        raise NotImplementedError

    def _free(self) -> None:
        """Disconnect, free the connection, turn away requests not accepted, free the
        hub, the listening or unconnected id and the channel."""
        conn, hub = self._conn, self._hub
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

    def _state(self) -> str:
        return "closed" if self._closed else "listening" if self._listening else \
            "connected" if self._conn is not None else "unconnected"

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # best effort, as a Python socket's
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass
