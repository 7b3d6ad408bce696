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
* **bounded memory**: at most ``mem_limit`` bytes of complete runs waiting to be taken,
  plus, per sender, the run it is in the middle of and what it may already have in
  flight inline (``slots * inline_max``); above the limit the receiver stops reading
  announced messages and stops returning credits, so senders block -- back-pressure,
  never drops;
* **no thread per connection**: every connection's QP completes into one CQ per
  device; ``recv`` (on the caller's thread) drives them all, accepts new senders and
  notices departed ones.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import PyverbsRDMAError
from ..readiness import readable
from ..rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID, RAI_PASSIVE
from ..rdmacm import enums as ce
from .base import accept_request, wait_slice
from .conn import Connection, Hub, Options

__all__ = ["Receiver", "ReceivedMessage"]

E = ce.rdma_cm_event_type


@dataclass
class ReceivedMessage:
    data: bytes
    sender: tuple[str, int]  # the sender's (ip, port)
    more: bool = False  # another frame of the same message follows


class Receiver:
    """The receiving end of a many-senders message queue, bound to ``address``."""

    def __init__(self, address: tuple[str, int], *, mem_limit: int = 64 << 20,
                 options: Options | None = None, backlog: int = 1024) -> None:
        self.options = options or Options()
        self.mem_limit = mem_limit
        self.channel = CMEventChannel()
        self.listener = CMID(self.channel)
        try:
            self.listener.bind_addr(AddrInfo(src=address[0] or "0.0.0.0",
                                             src_service=str(address[1]), flags=RAI_PASSIVE))
            self.listener.listen(backlog)
        except PyverbsRDMAError as e:
            self.channel.close()
            raise OSError(e.error_code or errno.EIO, f"Receiver: {e}") from None
        self.hubs: dict[int, Hub] = {}  # by id(verbs context): one CQ per device
        self.conns: dict[int, tuple[Connection, tuple[str, int]]] = {}  # by id(conn)
        self.partial: dict[int, list[ReceivedMessage]] = {}  # frames of unfinished runs
        self.ready: deque[ReceivedMessage] = deque()  # complete runs, frame by frame
        self.held = 0  # bytes in self.ready and self.partial
        self._ready_bytes = 0  # bytes in self.ready
        self.closed = False
        self._timeout: float | None = None

    # ---- properties ---------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.local_addr

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
            hub = self.hubs[key] = Hub(cmid.context, None, cq_depth=32767)
        return hub

    def _accept(self, ev: CMEvent) -> None:
        child = CMID(ev, listen_id=self.listener)
        hub = self._hub(child)
        conn = accept_request(child, ev, self.options.ack_timeout,
                              lambda cmid: Connection(hub, cmid, self.options))
        if conn is not None:
            self.conns[id(conn)] = (conn, child.peer_addr)

    def progress(self) -> int:
        """Accept senders, move every connection, collect complete runs; returns how many
        things happened."""
        n = 0
        while self.channel.pending():
            ev = CMEvent(self.channel, 0)
            n += 1
            if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                self._accept(ev)
            else:
                for hub in self.hubs.values():
                    if hub.dispatch_cm(ev):
                        break
        for hub in self.hubs.values():
            n += hub.progress()
        # the limit is on complete runs waiting for the application: a run in progress
        # is never held back (its next frame may be what completes it)
        over = self._ready_bytes >= self.mem_limit
        for key, (conn, peer) in list(self.conns.items()):
            conn.paused = over and key not in self.partial
            while (not over or key in self.partial) and conn.has_message():
                msg = conn.take()
                frame = ReceivedMessage(bytes(msg.data), peer, msg.more)
                run = self.partial.setdefault(key, [])
                run.append(frame)
                self.held += len(frame.data)
                if not frame.more:  # the run is complete: out in one piece
                    self.ready.extend(run)
                    self._ready_bytes += sum(len(f.data) for f in run)
                    del self.partial[key]
                over = self._ready_bytes >= self.mem_limit
            if conn.error is not None or conn.at_eof():
                self._drop(key, conn)
        return n

    def _drop(self, key: int, conn: Connection) -> None:
        """A sender left: its unfinished run is discarded (it never completed), its
        resources freed."""
        if conn.has_message():
            return  # let its last messages out first
        run = self.partial.pop(key, [])
        self.held -= sum(len(f.data) for f in run)
        del self.conns[key]
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
                self._ready_bytes -= len(msg.data)
                if self._ready_bytes < self.mem_limit:
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
        for hub in self.hubs.values():
            hub.close()
        self.listener.close()
        self.channel.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
