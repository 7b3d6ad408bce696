"""The passive side's half-open connections: answered with a REP, their RTU not yet in.

A listener (``socket.listen`` / ``accept``, and ``Receiver``) answers a connection
request at once, as ``rdma_accept`` does, and keeps the connection in a
:class:`HalfOpenTable` until rdma_cm says ESTABLISHED. Nothing waits for one particular
connection: every call drives the whole table, hands over those that completed, and
turns away those that failed or ran out of time. That is what makes ``accept()`` return
only completed connections, as a TCP ``accept()`` does, and never be held by a request
that will not complete (one forged REQ, whose REP goes to an address nobody listens on).

A half-open connection costs what the protocol makes before the REP: the QP and its
registered receive slots, 274 KiB with the default ``Options`` (about 318 KiB in all;
the send slots wait for the first record it sends). An off-path
sender pays one 256-byte packet for that, so the table is bounded twice:

* in number, ``limit`` (a socket's backlog, at most :data:`HALF_OPEN_MAX`; a
  ``Receiver``'s, RECEIVER_BACKLOG by default): a new request evicts the **oldest**
  half-open connection when the table is full (:data:`REJ_EVICTED`). Dropping the new
  request instead, as Linux TCP drops SYNs when its SYN queue is full, would let a
  flood of ``limit`` forged REQs per :data:`HANDSHAKE_TIMEOUT` (a few packets a
  second) lock every legitimate client out for as long as it lasts; TCP gets away with
  it because syncookies answer without keeping state, which a REP cannot (it carries
  the QPN of a QP that must exist). Evicting the oldest, a legitimate client is turned
  away only if ``limit`` requests arrive within its round trip (REP out, RTU in), which
  is what a flood must sustain to keep it out, and a flood costs at most ``limit``
  connections' memory whatever its length;
* in time, :data:`HANDSHAKE_TIMEOUT` each (:data:`REJ_TIMEOUT`), however long the
  requester asked the CM to keep resending the REP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar

from ..rdmacm import CMEvent, CMID
from ..rdmacm.cm_id import CMA_CM_RESPONSE_TIMEOUT

__all__ = ["HalfOpen", "HalfOpenTable", "HANDSHAKE_TIMEOUT", "REP_TIMEOUT", "HALF_OPEN_MAX",
           "HANDSHAKE_REP_SENDS", "REJ_TIMEOUT", "REJ_EVICTED", "REJ_BACKLOG", "REJ_FAILED",
           "turn_away", "reject_id", "rej_reason", "reject_and_release"]

#: rdma_cm's REP retransmission period, in seconds: the REQ's local CM response timeout
#: sets it, and a REQ from rdma_cm says CMA_CM_RESPONSE_TIMEOUT (20), which the CM turns
#: into 2^(20-8) ms = 4.096 s (Linux's cm_convert_to_ms). A forged REQ may ask for
#: hours (31); the deadline below does not depend on what it asks.
REP_TIMEOUT = (1 << (CMA_CM_RESPONSE_TIMEOUT - 8)) / 1000
#: how many REPs a half-open connection is given before the socket layer gives up on it:
#: the first and two retransmissions, so a handshake survives two lost REPs (or RTUs:
#: the requester answers a repeated REP with a repeated RTU)
HANDSHAKE_REP_SENDS = 3
#: the longest a half-open connection waits for its RTU: 3 x 4.096 s = 12.3 s. rdma_cm
#: itself would resend the REP 15 times (65 s) and a forged REQ may ask for hours; a
#: legitimate client answers a REP within one round trip, and the CM's own retries only
#: matter when packets are lost (Linux TCP, for comparison, resends a SYN-ACK 5 times)
HANDSHAKE_TIMEOUT = HANDSHAKE_REP_SENDS * REP_TIMEOUT

#: the most half-open connections a listening socket keeps, whatever its backlog (as
#: Linux's tcp_max_syn_backlog caps the SYN queue): each costs ~330 KiB (the receive
#: slots of 274 KiB, the QP, a CQ, a PD) and 4 descriptors (its completion and CM
#: channels), so create_server's default backlog of 128 would let a flood take 41 MiB
#: and 512 descriptors, half a default 1024-descriptor limit; 32 is 10 MiB and 128,
#: and still 32 handshakes in flight at once, each needing one round trip
HALF_OPEN_MAX = 32

#: the REJ private data (reason 28, consumer defined) for each way a request is turned away
REJ_TIMEOUT = b"softrdma.socket: handshake timed out (no RTU)"
REJ_EVICTED = b"softrdma.socket: evicted, too many half-open connections"
REJ_BACKLOG = b"softrdma.socket: backlog full (too many connections not accepted)"
REJ_FAILED = b"softrdma.socket: the connection failed during the handshake"

C = TypeVar("C")
_REJ_PREFIX = b"softrdma.socket: "


def rej_reason(private_data: bytes) -> str:
    """``": <reason>"`` for a REJ a socket-layer listener sent (its private data is one
    of the REJ_* texts, zero-padded to 148 bytes), else ``""``: the requester's error
    then says why it was turned away."""
    data = bytes(private_data).rstrip(b"\0")
    if not data.startswith(_REJ_PREFIX) or not data.isascii():
        return ""
    return ": " + data.decode("ascii")


def turn_away(ev: CMEvent, listen_id: CMID, reason: bytes) -> None:
    """Reject a connection request without making anything for it (a REJ with
    ``reason``), and free the id rdma_cm made for it."""
    reject_id(CMID(ev, listen_id=listen_id), reason)


def reject_id(child: CMID, reason: bytes) -> None:
    """Reject the request ``child`` (the id of a CONNECT_REQUEST) and free the id."""
    try:
        child.reject(reason)
    except Exception:
        pass  # (the REQ may be gone already: the requester gave up)
    child.close()


def reject_and_release(conn: Any, reason: bytes) -> None:
    """Turn away a half-open connection: a REJ with ``reason``, then its QP, MRs and id
    go (``conn.release()``)."""
    try:
        conn.cmid.reject(reason)
    except Exception:
        pass  # (past REP_SENT: the id's close says goodbye as Linux does)
    conn.release()


@dataclass(eq=False)
class HalfOpen(Generic[C]):
    """One half-open connection: the protocol's connection (``conn``, with
    ``established`` and ``error``), the peer's address, when it must be done by
    (time.monotonic), and whatever its listener keeps with it (``extra``: a socket's own
    hub and channel)."""

    conn: C
    peer: tuple[str, int]
    deadline: float
    extra: Any = field(default=None)


class HalfOpenTable(Generic[C]):
    """At most ``limit`` half-open connections, oldest first.

    ``ready(conn)`` says a connection completed (rdma_cm's ESTABLISHED); ``release(entry,
    reason)`` turns one away (a REJ with ``reason``) and frees its QP, MRs and id. The
    owner drives the connections (its hubs' ``progress``) and calls :meth:`completed`.
    Entries hold no reference back to the table or the owner, so a released one is freed
    at once, without the cycle collector."""

    def __init__(self, limit: int, *, ready: Callable[[C], bool],
                 release: Callable[[HalfOpen[C], bytes], None],
                 timeout: float = HANDSHAKE_TIMEOUT) -> None:
        if limit < 1:
            raise ValueError(f"HalfOpenTable: limit must be at least 1, not {limit}")
        self.limit = limit
        self.timeout = timeout
        self._ready = ready
        self._release = release
        self._entries: dict[int, HalfOpen[C]] = {}  # by id(conn), in arrival order
        self._done: list[HalfOpen[C]] = []  # completed, not yet handed over
        self.evicted = 0  # counters, for tests and statistics
        self.timed_out = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[HalfOpen[C]]:
        return iter(list(self._entries.values()))

    def admit(self, conn: C, peer: tuple[str, int], extra: Any = None) -> HalfOpen[C]:
        """Add a connection just answered with a REP; the oldest half-open one goes if
        the table is full."""
        self._settle()
        while len(self._entries) >= self.limit:
            oldest = next(iter(self._entries.values()))
            self.evicted += 1
            self._drop(oldest, REJ_EVICTED)
        entry = HalfOpen(conn, peer, time.monotonic() + self.timeout, extra)
        self._entries[id(conn)] = entry
        return entry

    def triage(self, requests: list[CMEvent], listen_id: CMID) -> list[CMEvent]:
        """Of a batch of connection requests (oldest first), those worth answering: the
        newest ``limit``. The older ones would be evicted by newer ones of the same batch
        before their RTU could be seen, so they are rejected now (REJ_EVICTED), before a
        QP is made for them: a flood read in one batch costs a REJ per request."""
        cut = max(0, len(requests) - self.limit)
        for ev in requests[:cut]:
            self.evicted += 1
            turn_away(ev, listen_id, REJ_EVICTED)
        return requests[cut:]

    def completed(self) -> list[HalfOpen[C]]:
        """The connections that completed since the last call, oldest first (they leave
        the table); failed and expired ones are released on the way."""
        self._settle()
        done, self._done = self._done, []
        return done

    def _settle(self) -> None:
        if not self._entries:
            return
        now = time.monotonic()
        for key, e in list(self._entries.items()):
            if getattr(e.conn, "error", None) is not None:
                self.failed += 1
                self._drop(e, REJ_FAILED)
            elif self._ready(e.conn):
                del self._entries[key]
                self._done.append(e)
            elif now >= e.deadline:
                self.timed_out += 1
                self._drop(e, REJ_TIMEOUT)

    def _drop(self, e: HalfOpen[C], reason: bytes) -> None:
        del self._entries[id(e.conn)]
        self._release(e, reason)

    def close(self) -> None:
        """Turn away every connection still here, completed but not handed over too."""
        for e in list(self._entries.values()):
            self._drop(e, REJ_FAILED)
        for e in self._done:
            self._release(e, REJ_FAILED)
        self._done.clear()
