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
from ..readiness import readable
from ..rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam, RAI_PASSIVE
from ..rdmacm import enums as ce
from .handshake import (
    HALF_OPEN_MAX, REJ_BACKLOG, REJ_FAILED, HalfOpen, HalfOpenTable, reject_and_release,
    reject_id, rej_reason, turn_away,
)

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
    data, answer with ours. On any failure the request is rejected and the endpoint, if
    made, released (its QP and MRs must not outlive a request with a bad hello): None."""
    conn = None
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
        if conn is not None:
            conn.release()
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
        self._accept_queue: deque[Any] = deque()  # completed connections not accepted yet
        self._half_open: HalfOpenTable[Any] | None = None  # requests answered, RTU awaited
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

    @staticmethod
    def _accepted(conn: Any) -> bool:
        """``accept`` may hand the connection over (rdma_cm's ESTABLISHED). Static: the
        half-open table keeps it, and must not keep the listener with it."""
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
    #
    # A request is answered at once (rdma_accept: the REP goes out) and its connection
    # waits, half-open, in a HalfOpenTable of at most ``backlog`` until ESTABLISHED; then
    # it waits, as a connected socket, in the accept queue (at most ``backlog`` too, as
    # TCP's) for accept() to take it. accept() drives all of them, so no one request
    # holds it; a request that finds the accept queue full is rejected (REJ_BACKLOG).

    def listen(self, backlog: int = 128) -> None:
        """Listen; ``backlog`` bounds both the half-open connections (REP sent, RTU
        awaited; the oldest is evicted for a newer request; never more than
        HALF_OPEN_MAX) and the completed ones not yet accepted (a request beyond it is
        rejected). At least 1, as on Linux."""
        self._check_open()
        _, cid = self._cm()
        try:
            cid.listen(backlog)
        except PyverbsRDMAError as e:
            raise os_error(e, "listen") from None
        self._listening = True
        self._backlog = max(backlog, 1)
        self._table().limit = self._half_open_limit()  # (listen() again: a new backlog)

    def _half_open_limit(self) -> int:
        return min(max(self._backlog, 1), HALF_OPEN_MAX)

    def _table(self) -> HalfOpenTable[Any]:
        if self._half_open is None:
            self._half_open = HalfOpenTable(self._half_open_limit(),
                                            ready=type(self)._accepted,
                                            release=self._release_half_open)
        return self._half_open

    def _listener_progress(self) -> None:
        """Answer the connection requests waiting on the channel, drive every half-open
        connection and every one in the accept queue, and move those that completed
        into the accept queue."""
        table = self._table()
        requests: list[CMEvent] = []
        while self._channel.pending():
            ev = CMEvent(self._channel, 0)
            if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                requests.append(ev)
            else:
                self._child_event(table, ev)
        # what completed first (an RTU must be seen before newer requests could evict
        # its connection), then the newest requests of the batch (HalfOpenTable.triage)
        self._collect_completed(table)
        for ev in table.triage(requests, self._id):
            if len(self._accept_queue) >= self._backlog:
                turn_away(ev, self._id, REJ_BACKLOG)
            else:
                self._accept_one(ev)
        self._collect_completed(table)
        for sock in list(self._accept_queue):  # completed: they keep moving (credits, CLOSE)
            sock._hub.progress()
            if sock._conn.error is not None:  # broke before it was accepted
                self._accept_queue.remove(sock)
                sock._abort()

    def _child_event(self, table: HalfOpenTable[Any], ev: CMEvent) -> None:
        """A half-open connection's CM event (its ESTABLISHED, REJECTED...), which comes
        to the listener's channel so that the listener's descriptor wakes a select()
        loop. Once ESTABLISHED, the id moves to the connection's own channel; what came
        here just before the move goes to its hub still."""
        for e in table:
            if e.extra.dispatch_cm(ev):
                if ev.event_type == E.RDMA_CM_EVENT_ESTABLISHED:
                    e.conn.cmid.migrate(e.extra.channel)
                return
        for sock in self._accept_queue:
            if sock._hub.dispatch_cm(ev):
                return

    def _collect_completed(self, table: HalfOpenTable[Any]) -> None:
        for e in table:
            e.extra.progress()
        for e in table.completed():
            sock = self._connected_socket(e)
            if len(self._accept_queue) >= self._backlog:  # (filled since the request came)
                sock._abort()
            else:
                self._accept_queue.append(sock)

    def listen_queue(self) -> tuple[int, int]:
        """A listening socket's queues: ``(half-open, completed)``, the connections
        answered and waiting for their RTU, and those ESTABLISHED and waiting for
        ``accept`` (Linux's reqsk_queue_len and sk_ack_backlog); each at most the
        backlog."""
        return (len(self._half_open) if self._half_open is not None else 0,
                len(self._accept_queue))

    def accept(self) -> tuple[Any, tuple[str, int]]:
        """Wait for a completed connection; return a connected socket and the peer's
        (ip, port). Connections complete in any order: a request that never does (its
        RTU never comes) is turned away after HANDSHAKE_TIMEOUT without holding others."""
        self._check_open()
        if not self._listening:
            raise OSError(errno.EINVAL, "accept: the socket is not listening")
        deadline = self._deadline()
        while True:
            self._listener_progress()
            if self._accept_queue:
                sock = self._accept_queue.popleft()
                return sock, sock._peer
            self._expired(deadline, "accept")
            self._listener_wait(deadline)

    def _listener_wait(self, deadline: float | None) -> None:
        """Block until a request, a CM event or a completion of a half-open or queued
        connection may be waiting (at most WAIT_SLICE, so handshake deadlines run)."""
        hubs = [e.extra for e in self._half_open or ()]
        if not hubs and not self._accept_queue:
            self._channel.wait(wait_slice(deadline))
            return
        hubs += [s._hub for s in self._accept_queue]
        fds = [self._channel.fd]
        for hub in hubs:
            hub.arm()
            fds += [hub.fileno(), hub.channel.fd]
        r = readable(fds, wait_slice(deadline))
        for hub in hubs:
            if hub.fileno() in r:
                hub.take_cq_event()

    def _accept_one(self, ev: CMEvent) -> None:
        """Answer one request (the REP goes out) with a hub and channel of its own, and
        add it to the half-open table; a request that cannot be answered is rejected.
        Its CM events come to the listener's channel until it completes."""
        child = CMID(ev, listen_id=self._id)
        try:
            channel = CMEventChannel()  # the connection's events, once it is ESTABLISHED
        except OSError:  # out of descriptors: turned away, accept() goes on
            reject_id(child, REJ_FAILED)
            return
        try:
            hub = self._make_hub(child, channel)
        except (OSError, PyverbsRDMAError):
            reject_id(child, REJ_FAILED)
            channel.close()
            return
        conn = accept_request(child, ev, self.options.ack_timeout,
                              lambda cmid: self._make_conn(hub, cmid))
        if conn is None:
            hub.close()
            child.close()
            channel.close()
            return
        self._table().admit(conn, child.peer_addr, hub)

    def _connected_socket(self, e: HalfOpen[Any]) -> Any:
        """The socket for a connection that completed its handshake."""
        hub = e.extra
        e.conn.cmid.migrate(hub.channel)  # (done already unless it completed by data)
        sock = type(self)(options=self.options, _conn=e.conn, _hub=hub, _peer=e.peer)
        sock._channel = hub.channel
        sock._timeout = self._timeout
        return sock

    @staticmethod
    def _release_half_open(e: HalfOpen[Any], reason: bytes) -> None:
        """Turn away a half-open connection: REJ with ``reason``, then free its QP, MRs,
        id, hub and channel (a static method: the table keeps no reference to the
        listener)."""
        hub = e.extra
        reject_and_release(e.conn, reason)
        hub.close()
        if hub.channel is not None:
            hub.channel.close()

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
            raise ConnectionRefusedError(errno.ECONNREFUSED,
                                         f"{what}: {status}{rej_reason(ev.private_data)}")
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
        connected socket), or a connection request or a connection completing or
        failing its handshake (for a listening one). After it
        fires, ``recv``/``accept`` may still find nothing complete and, when
        non-blocking, raise BlockingIOError."""
        if self._hub is not None:
            return self._hub.fileno()
        if self._channel is not None:
            return self._channel.fd
        return -1

    @property
    def listening(self) -> bool:
        """``listen`` was called and the socket is not closed."""
        return self._listening and not self._closed

    @property
    def connected(self) -> bool:
        """The socket has a connection (connected or accepted; perhaps closed by the
        peer since) and is not closed."""
        return self._conn is not None and not self._closed

    def accept_ready(self) -> bool:
        """A listening socket: answer the requests and drive the handshakes waiting
        (without blocking), and say whether ``accept`` would return a connection at once
        (poll's POLLIN on a listener). False for any other socket."""
        if self._closed or not self._listening:
            return False
        self._listener_progress()
        return bool(self._accept_queue)

    def wait_fds(self) -> list[int]:
        """Descriptors that become readable when the socket may have news (a completion,
        a CM event, a connection request), completions armed first: for a caller that
        waits on many sockets and descriptors in one poll(2). Hand the readable ones to
        :meth:`took` after the wait."""
        if self._closed:
            return []
        if self._listening:
            hubs = [e.extra for e in self._half_open or ()]
            hubs += [s._hub for s in self._accept_queue]
            fds = [self._channel.fd]
        elif self._hub is not None:
            hubs, fds = [self._hub], []
        else:
            return [self._channel.fd] if self._channel is not None else []
        for hub in hubs:
            hub.arm()
            fds.append(hub.fileno())
            if hub.channel is not None:
                fds.append(hub.channel.fd)
        return fds

    def took(self, ready: Any) -> None:
        """After a wait on :meth:`wait_fds`: acknowledge the completion events of the
        descriptors in ``ready`` (a container of descriptors), so the next wait blocks."""
        if self._closed:
            return
        hubs = [self._hub] if self._hub is not None else []
        if self._listening:
            hubs += [e.extra for e in self._half_open or ()]
            hubs += [s._hub for s in self._accept_queue]
        for hub in hubs:
            if hub.fileno() in ready:
                hub.take_cq_event()

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        raise NotImplementedError

    def _free(self) -> None:
        """Disconnect, free the connection, close the connections not accepted and turn
        away the half-open ones, free the hub, the listening or unconnected id and the channel."""
        conn, hub = self._conn, self._hub
        if conn is not None:
            try:
                conn.cmid.disconnect()
            except Exception:
                pass
            conn.release()
        while self._accept_queue:  # completed, never accepted: reset, as TCP's are
            self._accept_queue.popleft()._abort()
        if self._half_open is not None:
            self._half_open.close()
        if hub is not None:
            hub.close()
        if self._id is not None and (conn is None or conn.cmid is not self._id):
            self._id.close()
        if self._channel is not None:
            self._channel.close()

    def _abort(self) -> None:
        """Close without the protocol's goodbye (a connection never accepted, or broken):
        disconnect and free at once, as TCP resets one."""
        self._closed = True
        self._free()

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
