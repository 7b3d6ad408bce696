"""What both socket kinds share (``socket`` with softrdma's message protocol, ``RSocket``
with rsocket's stream protocol): addresses, timeouts and the errors that go with them,
the rdma_cm id of an unconnected socket, the object's lifetime."""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import Any

from ..errors import PyverbsRDMAError
from ..rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID, RAI_PASSIVE

__all__ = ["SocketBase", "check_address", "os_error"]


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


class SocketBase:
    """Timeouts, bind, names and lifetime; subclasses add the protocol (``_conn`` has
    a ``cmid``)."""

    def __init__(self, conn: Any, hub: Any, peer: tuple[str, int] | None) -> None:
        self._timeout: float | None = None
        self._conn, self._hub, self._peer = conn, hub, peer
        self._channel: CMEventChannel | None = None
        self._id: CMID | None = None
        self._pending: deque[CMEvent] = deque()  # connection requests not accepted yet
        self._listening = False
        self._closed = False
        self._backlog = 0

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

    # ---- addresses ----------------------------------------------------------------------

    def _cm(self) -> tuple[CMEventChannel, CMID]:
        if self._id is None:
            self._channel = CMEventChannel()
            self._id = CMID(self._channel)
        return self._channel, self._id

    def bind(self, address: tuple[str, int]) -> None:
        self._check_open()
        host, port = check_address(address, "bind")
        _, cid = self._cm()
        try:
            cid.bind_addr(AddrInfo(src=host, src_service=str(port), flags=RAI_PASSIVE))
        except PyverbsRDMAError as e:
            raise os_error(e, "bind") from None

    def getsockname(self) -> tuple[str, int]:
        i = self._conn.cmid.id if self._conn is not None else \
            self._id.id if self._id is not None else None
        if i is None:
            return ("0.0.0.0", 0)
        ip = i.local_ip
        return (str(ip) if ip is not None else "0.0.0.0", i.src_port)

    def getpeername(self) -> tuple[str, int]:
        if self._peer is None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return self._peer

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        raise NotImplementedError

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
