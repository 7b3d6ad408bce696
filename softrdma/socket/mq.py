"""``Receiver``: one receiver, any number of senders (the seed's message queue).

    rx = Receiver(("127.0.0.1", 7500))             # bound and listening
    while True:
        msg = rx.recv()                             # ReceivedMessage(data, sender, more)
        print(msg.sender, msg.data)

    # in any number of other processes:
    with create_connection(("127.0.0.1", 7500)) as s:
        s.send(b"part 1", more=True)                # frames of one message ...
        s.send(b"part 2")                           # ... delivered together

What it promises (docs/socket.md, "The message queue"):

* **per-sender order**: messages from one sender come out in the order it sent them;
* **contiguity**: a run of frames sent with ``more=True`` and closed by a frame without
  it comes out as one run, never interleaved with another sender's frames;
* **bounded memory**: everything held for the application (complete runs, runs in
  progress, messages received inline, READ buffers) stays under ``mem_limit``, except
  that, once the application took every complete run, the oldest run not yet wholly in
  memory may grow to its end, so the queue never deadlocks with every sender in the
  middle of a run: at most ``2 * mem_limit``,
  plus what each sender may already have in flight inline (``slots * inline_max``).
  Above the limit the receiver allocates no READ buffer and returns no credits, so
  senders block -- back-pressure, never drops. A run (or message) larger than
  ``mem_limit`` could never be held: the hello tells senders the limit, their ``send``
  refuses it (OSError EMSGSIZE), and a sender that announces one anyway is dropped with
  a ProtocolError, told why in an ABORT record (:attr:`Receiver.errors`);
* **no thread per connection**: every connection's QP completes into one CQ per
  device; ``recv`` (on the caller's thread) drives them all, accepts new senders and
  notices departed ones.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import PyverbsRDMAError
from ..readiness import readable
from ..rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID, RAI_PASSIVE
from ..rdmacm import enums as ce
from .base import accept_request, wait_slice
from .conn import Budget, Connection, Hub, Options
from .handshake import HalfOpen, HalfOpenTable, reject_and_release

__all__ = ["Receiver", "ReceivedMessage", "RECEIVER_BACKLOG"]

E = ce.rdma_cm_event_type
#: how many senders may be half-open at once (REP sent, RTU awaited), by default. Each
#: holds its QP and registered receive slots before it says a word: with the default
#: Options, 64 + 4 slots of 32 + 4,096 bytes, 274 KiB (318 KiB measured with the QP and
#: the rdma_cm id; the send slots wait for its first record), all paid for by one
#: 256-byte forged REQ. 32 of them are about 10 MiB, a sixth of the default mem_limit,
#: and still 32 handshakes in flight at once: a handshake takes
#: one round trip, while setting up a connection costs the receiver milliseconds of its
#: own. (It was 1024 and not enforced: 2,000 forged REQs held 1.2 GiB.)
RECEIVER_BACKLOG = 32
#: how many of the latest dropped senders' errors :attr:`Receiver.errors` keeps
ERRORS_KEPT = 64


@dataclass
class ReceivedMessage:
    data: bytes
    sender: tuple[str, int]  # the sender's (ip, port)
    more: bool = False  # another frame of the same message follows


class _QueueBudget(Budget):
    """The message queue's memory: one budget for every sender. Over the limit, no
    connection allocates READ buffers or returns credits -- except, when the application
    has nothing left to take (``ready`` is 0: all the memory is in runs in progress),
    the connection holding the oldest run not yet wholly in memory (``favoured``, chosen
    by the Receiver on every pass): that run may grow to its end, at most ``max_run``
    (the limit), so the queue completes it, hands it out and moves on instead of
    deadlocking. Only one run is ever past the limit (the next is favoured only once the
    application took this one), hence the worst case: twice the limit, plus what
    senders may have in flight inline on the credits they hold."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.ready = 0  # bytes of complete runs waiting for the application
        self.favoured = 0  # the ticket of the run that may exceed the limit (0: none)
        self.favoured_conn = 0  # id() of its connection (no reference: no cycle)

    def may_read(self, conn: Connection, run: int, n: int, first: bool) -> bool:
        return self.held + n <= self.limit or (run == self.favoured and not self.ready)

    def may_credit(self, conn: Connection) -> bool:
        return self.held < self.limit or (id(conn) == self.favoured_conn and
                                          not self.ready)


class Receiver:
    """The receiving end of a many-senders message queue, bound to ``address``.

    A sender's request is answered at once and waits in :attr:`half_open` (at most
    ``backlog``, the oldest evicted for a newer one, each for at most HANDSHAKE_TIMEOUT)
    until it is ESTABLISHED; then it is one of the senders ``recv`` drives.

    ``mem_limit`` bounds what it holds (the module's docstring); it is also the largest
    run of frames -- and message -- it takes (``Options.max_run`` / ``max_message``,
    if smaller, lower them), which its hello tells every sender."""

    def __init__(self, address: tuple[str, int], *, mem_limit: int = 64 << 20,
                 options: Options | None = None, backlog: int = RECEIVER_BACKLOG) -> None:
        opts = options or Options()
        # a run is held whole before it is handed out: none may exceed what can be held
        run_cap = min(opts.max_run or mem_limit, mem_limit)
        self.options = dataclasses.replace(
            opts, max_message=min(opts.max_message, run_cap), max_run=run_cap)
        self.mem_limit = mem_limit
        self._budget = _QueueBudget(mem_limit)
        #: (sender, exception) for the latest senders dropped because their connection
        #: broke (a protocol error, a peer that vanished), newest last
        self.errors: deque[tuple[tuple[str, int], BaseException]] = deque(maxlen=ERRORS_KEPT)
        self.channel = CMEventChannel()
        self.listener = CMID(self.channel)
        try:
            self.listener.bind_addr(AddrInfo(src=address[0] or "0.0.0.0",
                                             src_service=str(address[1]), flags=RAI_PASSIVE))
            self.listener.listen(backlog)
        except PyverbsRDMAError as e:
            self.channel.close()
            raise OSError(e.error_code or errno.EIO, f"Receiver: {e}") from None
        # senders answered with a REP, their RTU not yet in: at most ``backlog``, the
        # oldest evicted for a newer one, each for at most HANDSHAKE_TIMEOUT
        self.half_open: HalfOpenTable[Connection] = HalfOpenTable(
            max(backlog, 1), ready=_established,
            release=functools.partial(_release_half_open, self.errors))
        self.hubs: dict[int, Hub] = {}  # by id(verbs context): one CQ per device
        self.conns: dict[int, tuple[Connection, tuple[str, int]]] = {}  # by id(conn)
        self.partial: dict[int, list[ReceivedMessage]] = {}  # frames of unfinished runs
        self.ready: deque[ReceivedMessage] = deque()  # complete runs, frame by frame
        self.held = 0  # bytes in self.ready and self.partial
        self.closed = False
        self._timeout: float | None = None

    # ---- properties ---------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.local_addr

    @property
    def in_memory(self) -> int:
        """Bytes held for the application in all: complete runs, runs in progress,
        messages received inline and READ buffers (what ``mem_limit`` bounds)."""
        return self._budget.held

    @property
    def senders(self) -> list[tuple[str, int]]:
        """The senders connected now."""
        return [peer for conn, peer in self.conns.values() if not conn.at_eof()]

    def settimeout(self, value: float | None) -> None:
        self._timeout = value

    # ---- progress -----------------------------------------------------------------------

    def _hub(self, cmid: CMID) -> Hub:
        key = id(cmid.context)
        hub = self.hubs.get(key)
        if hub is None:
            hub = self.hubs[key] = Hub(cmid.context, None, cq_depth=32767,
                                       budget=self._budget)
        return hub

    def _accept(self, ev: CMEvent) -> None:
        """Answer a sender's request (the REP goes out) and keep it half-open."""
        child = CMID(ev, listen_id=self.listener)
        hub = self._hub(child)
        conn = accept_request(child, ev, self.options.ack_timeout,
                              lambda cmid: Connection(hub, cmid, self.options))
        if conn is not None:
            self.half_open.admit(conn, child.peer_addr)
        else:
            child.close()

    def _cm_events(self) -> int:
        """Take every CM event waiting: the senders' own first (an ESTABLISHED must be
        seen before newer requests could evict its connection), then the requests, of
        which only the newest ``backlog`` are answered (HalfOpenTable.triage)."""
        requests: list[CMEvent] = []
        n = 0
        while self.channel.pending():
            ev = CMEvent(self.channel, 0)
            n += 1
            if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                requests.append(ev)
                continue
            for hub in self.hubs.values():
                if hub.dispatch_cm(ev):
                    break
        self._admit_completed()
        for ev in self.half_open.triage(requests, self.listener):
            self._accept(ev)
        return n

    def _admit_completed(self) -> None:
        for e in self.half_open.completed():
            self.conns[id(e.conn)] = (e.conn, e.peer)

    def progress(self) -> int:
        """Accept senders, move every connection, collect complete runs; returns how many
        things happened."""
        n = self._cm_events()
        for hub in self.hubs.values():
            n += hub.progress()
        self._admit_completed()
        # every complete message is taken: it is in memory already, and the budget
        # counts it the same in the connection or here (the limit acts on what is
        # allocated next: READ buffers, and credits for more records)
        for key, (conn, peer) in list(self.conns.items()):
            while conn.has_message():
                msg = conn.take(keep=True)
                frame = ReceivedMessage(bytes(msg.data), peer, msg.more)
                run = self.partial.setdefault(key, [])
                run.append(frame)
                self.held += len(frame.data)
                if not frame.more:  # the run is complete: out in one piece
                    self.ready.extend(run)
                    self._budget.ready += sum(len(f.data) for f in run)
                    del self.partial[key]
            if conn.error is not None or conn.at_eof():
                self._drop(key, conn, peer)
        self._favour()
        return n

    def _favour(self) -> None:
        """Let the oldest run not wholly in memory past the limit (_QueueBudget)."""
        best, owner = 0, None
        for conn, _ in self.conns.values():
            run = conn.oldest_open_run()
            if run is not None and (owner is None or run < best):
                best, owner = run, conn
        budget = self._budget
        if best != budget.favoured:
            budget.favoured, budget.favoured_conn = best, id(owner) if owner else 0
            if owner is not None:
                owner.pump()  # it may have waited for memory: its reads and credits go

    def _drop(self, key: int, conn: Connection, peer: tuple[str, int]) -> None:
        """A sender left: its unfinished run is discarded (it never completed), its
        resources freed; why, if its connection broke, goes to :attr:`errors`."""
        if conn.has_message():
            return  # let its last messages out first
        if conn.abort_pending:
            return  # the ABORT telling it why leaves first
        run = self.partial.pop(key, [])
        lost = sum(len(f.data) for f in run)
        self.held -= lost
        self._budget.held -= lost
        del self.conns[key]
        if conn.error is not None:
            self.errors.append((peer, conn.error))
        if self._budget.favoured_conn == id(conn):
            self._budget.favoured, self._budget.favoured_conn = 0, 0
        try:
            conn.cmid.disconnect()
        except Exception:
            pass
        conn.release()

    def _wait(self, deadline: float | None) -> None:
        fds = [self.channel.fd]
        for hub in self.hubs.values():
            hub.arm()
            fds.append(hub.fileno())
        r = readable(fds, wait_slice(deadline))
        for hub in self.hubs.values():
            if hub.fileno() in r:
                hub.take_cq_event()

    # ---- the application's side ---------------------------------------------------------

    def recv(self, timeout: float | None = None) -> ReceivedMessage:
        """The next frame, with its sender; frames of one run come out together.
        ``TimeoutError`` after ``timeout`` seconds (default: the receiver's timeout,
        None: wait for ever)."""
        if self.closed:
            raise OSError(errno.EBADF, "the receiver is closed")
        timeout = self._timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.ready:
                msg = self.ready.popleft()
                self.held -= len(msg.data)
                self._budget.held -= len(msg.data)
                self._budget.ready -= len(msg.data)
                if self._budget.held < self.mem_limit or not self.ready:
                    self.progress()  # below the limit again: let readers and credits go
                return msg
            self.progress()
            if self.ready:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(errno.ETIMEDOUT, "Receiver.recv: timed out")
            self._wait(deadline)

    def fileno(self) -> int:
        """The CM channel's descriptor (readable when a sender connects or leaves);
        completions wake ``recv`` through the CQs' channels."""
        return self.channel.fd

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for key, (conn, _) in list(self.conns.items()):
            try:
                conn.cmid.disconnect()
            except Exception:
                pass
            conn.release()
        self.conns.clear()
        self.half_open.close()
        for hub in self.hubs.values():
            hub.close()
        self.listener.close()
        self.channel.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _established(conn: Connection) -> bool:
    return conn.established


def _release_half_open(errors: deque, e: HalfOpen[Connection], reason: bytes) -> None:
    """Turn away a half-open sender; why, if its connection broke, goes to ``errors``
    (:attr:`Receiver.errors`) as for an established one: a sender can break the protocol
    before the receiver saw its ESTABLISHED (the RTU and the sender's first records read
    in one pass, the records first failing it)."""
    if e.conn.error is not None:
        errors.append((e.peer, e.conn.error))
    reject_and_release(e.conn, reason)
