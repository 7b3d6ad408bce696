"""One connection of the socket layer, and the hub that drives many on one CQ.

A :class:`Connection` is one RC QP made by rdma_cm, with a pool of receive slots for
records, a pool of send slots, and the protocol state of docs/socket.md: credits both
ways, messages announced and not yet read, buffers lent to the peer until its ACK. It
does no waiting itself: its :class:`Hub` polls the CQ shared by all its connections (and
their CM event channel) and hands each completion and event to its connection; callers
wait on the hub. One hub is one progress path, whatever the number of connections (the
seed spent a thread per connection; its author wished for this).

Everything runs on the thread that calls in (the live device moves packets on its own);
the hub's lock makes a hub safe to share between threads.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import PyverbsRDMAError
from ..readiness import readable
from ..rdmacm import CMEvent, CMEventChannel, CMID, ConnParam
from ..rdmacm import enums as ce
from ..verbs_api import CQ, MR, PD, QPCap, QPInitAttr, SGE, CompChannel, RecvWR, SendWR
from ..verbs_api.enums import (
    ibv_access_flags as A, ibv_qp_type, ibv_send_flags as F, ibv_wc_status as WS, ibv_wr_opcode as O,
)
from .base import wait_slice
from .record import (
    CTRL_SLOTS, FEATURE_INLINE, FEATURE_LIMITS, MORE, RECORD_SIZE, AbortReason, Hello,
    ProtocolError, Record, RecordType as RT, describe_abort,
)

__all__ = ["Hub", "Connection", "Options", "Message", "Budget"]

E = ce.rdma_cm_event_type
#: a buffer the peer has read stays registered this long (device seconds) before it is
#: freed: a duplicated READ request the network delivers late then still finds its MR
#: (rxe would otherwise answer it with a remote access error and break the connection)
RETIRE_HOLD = 0.5
_RECV, _SEND, _READ, _PROBE = 1, 2, 3, 4
_KIND_SHIFT = 56


@dataclass
class Options:
    """Per-connection settings (each side tells the other its slots and inline limit)."""

    slots: int = 64  # receive slots posted for the peer's records: its credits
    inline_max: int = 4096  # messages up to this size travel inside the record's SEND
    mem_limit: int = 64 << 20  # bytes received and not yet read before credits stop
    max_message: int = 1 << 30  # the largest message this side takes (told in the hello)
    # the largest run of frames (more=True ... the frame closing it) this side takes; 0:
    # no limit (a socket hands frames out one by one; a Receiver holds a run whole)
    max_run: int = 0
    # a vanished peer is noticed after (retry + 1) ACK timeouts: 7 x 268 ms here. Not
    # 7 retries: rxe (and softrdma with it) treats a retry count of 7 as "for ever"
    ack_timeout: int = 16  # QP ACK timeout: 4.096 us x 2^16 = 268 ms
    retry: int = 6
    keepalive: float = 1.0  # seconds of silence before a probe (a dead peer shows up)


@dataclass
class Message:
    """A received message (the message queue adds who sent it)."""

    data: bytes | bytearray
    more: bool = False
    seq: int = 0
    # (no reference to its connection: a message the application keeps must not keep
    # the connection's buffers alive)


class _Rx:
    """A received record on its way to the application, in arrival order; ``run`` is
    the ticket of the run of frames it belongs to (:meth:`Budget.ticket`)."""

    __slots__ = ("rec", "data", "mr", "reading", "run")

    def __init__(self, rec: Record, data: bytes | bytearray | None, run: int) -> None:
        self.rec = rec
        self.data = data
        self.mr: Any = None
        self.reading = False
        self.run = run


class Budget:
    """The memory the connections sharing it hold for the application -- messages
    received inline, READ buffers allocated, and (for a message queue) what was taken
    and not yet handed out -- against ``limit``. Connections ask it before they allocate
    a READ buffer (:meth:`may_read`) and before they return credits (:meth:`may_credit`),
    so over the limit their peers stop. This one is a socket's: one connection, which
    reads the message at the head of its queue whatever the limit, when the application
    has taken everything before it (else the application could never get it), so it
    holds at most ``limit + max_message`` and what the peer sent inline on the credits
    it had. The message queue's (softrdma.socket.mq) is shared by all its senders."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # bytes counted, from every connection sharing it
        self._tickets = 0

    def ticket(self) -> int:
        """A number for a run of frames that begins: later runs get larger numbers."""
        self._tickets += 1
        return self._tickets

    def may_read(self, conn: "Connection", run: int, n: int, first: bool) -> bool:
        """May ``conn`` allocate ``n`` bytes to READ a message of run ``run`` (``first``:
        the message is at the head of the connection's queue, nothing before it)?"""
        return first or self.held + n <= self.limit

    def may_credit(self, conn: "Connection") -> bool:
        """May ``conn`` give its peer credits (let it send more)?"""
        return self.held <= self.limit


class Hub:
    """One CQ (with its completion channel) and one CM event channel for any number of
    connections on one device. ``progress()`` handles what is there; ``wait()`` blocks
    until something may be."""

    def __init__(self, ctx: Any, channel: CMEventChannel | None,
                 cq_depth: int = 16384, budget: Budget | None = None) -> None:
        self.ctx = ctx
        # the memory budget its connections share (a message queue's), or None: each
        # connection has its own (a socket's)
        self.budget = budget
        self.channel = channel
        self.pd = PD(ctx)
        self.comp = CompChannel(ctx)
        self.cq = CQ(ctx, cq_depth, None, self.comp)
        self.cq.req_notify()
        self.conns: dict[int, Connection] = {}  # by QPN: completions
        self.by_id: dict[int, Connection] = {}  # by rdma_cm id: CM events
        self.lock = threading.RLock()
        self.on_cm_event: Callable[[CMEvent], None] | None = None  # listeners' hook
        self.closed = False

    def add(self, conn: "Connection") -> None:
        self.conns[conn.qpn] = conn
        self.by_id[id(conn.cmid.id)] = conn

    def remove(self, conn: "Connection") -> None:
        self.conns.pop(conn.qpn, None)
        self.by_id.pop(id(conn.cmid.id), None)

    def progress(self) -> int:
        """Handle every completion and CM event waiting; return how many."""
        n = 0
        with self.lock:
            if self.closed:
                return 0
            # CM events are taken before the CQ is drained and handled after it: what the
            # peer sent before it disconnected is in the CQ by the time DISCONNECTED is
            # read (a real device completes the receive before it ACKs), and counts first
            events = []
            while self.channel is not None and self.channel.pending():
                events.append(CMEvent(self.channel, 0))
            n += self._drain()
            for ev in events:
                n += 1
                self._on_cm(ev)
            # every connection's duties, keepalive included, on every pass: whoever waits
            # (send for credits, close for ACKs, recv, a Receiver) notices a dead peer
            for conn in list(self.conns.values()):
                conn.pump()
        return n

    def _drain(self) -> int:
        """Hand every completion in the CQ to its connection; return how many."""
        n = 0
        while True:
            got, wcs = self.cq.poll(32)
            if not got:
                return n
            n += got
            for wc in wcs:
                conn = self.conns.get(wc.qp_num)
                if conn is not None:
                    conn.on_wc(wc)

    def dispatch_cm(self, ev: CMEvent) -> bool:
        """Give a CM event, read from a channel the hub does not own (a listener's), to
        the connection of this hub it is about (False: none). The CQ is drained first,
        as :meth:`progress` does: the peer's records sent before it disconnected are in
        the CQ by the time its DISCONNECTED was read, and a CLOSE among them makes the
        disconnect a goodbye, not a reset (handled after the event, a sender that sent,
        closed and left before the listener looked lost its messages)."""
        with self.lock:
            owner = self.by_id.get(id(ev.id))
            if owner is None:
                return False
            if not self.closed:
                self._drain()
            owner.on_cm(ev)
            return True

    def _on_cm(self, ev: CMEvent) -> None:
        owner = self.by_id.get(id(ev.id))
        if ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST or owner is None:
            if self.on_cm_event is not None:
                self.on_cm_event(ev)
            return
        owner.on_cm(ev)

    def wait(self, deadline: float | None) -> None:
        """Block until a completion or CM event may be waiting, or ``deadline``
        (time.monotonic) passes; at most 0.25 s, so keepalives and timeouts run."""
        with self.lock:
            self.cq.req_notify()
            got, wcs = self.cq.poll(32)
            if got:  # raced: handle them now
                for wc in wcs:
                    conn = self.conns.get(wc.qp_num)
                    if conn is not None:
                        conn.on_wc(wc)
                return
        left = wait_slice(deadline)
        fds = [self.comp.fd] + ([self.channel.fd] if self.channel is not None else [])
        r = readable(fds, left)
        if self.comp.fd in r:
            self.take_cq_event()

    def arm(self) -> None:
        """Ask for the next completion's event (before waiting on :meth:`fileno`)."""
        with self.lock:
            self.cq.req_notify()

    def take_cq_event(self) -> None:
        """Take and acknowledge the completion event that made :meth:`fileno` readable
        (none there is fine: another waiter took it)."""
        with self.lock:
            try:
                self.comp.get_cq_event(self.cq, timeout=0)
                self.cq.ack_events(1)
            except PyverbsRDMAError:
                pass

    def fileno(self) -> int:
        return self.comp.fd

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for conn in list(self.conns.values()):
                conn.release()
            for obj in (self.cq, self.comp, self.pd):
                try:
                    obj.close()
                except Exception:
                    pass


class Connection:
    """The protocol state of one connected endpoint (docs/socket.md, "The protocol")."""

    def __init__(self, hub: Hub, cmid: CMID, opts: Options) -> None:
        self.hub = hub
        self.cmid = cmid
        self.opts = opts
        self.peer: Hello | None = None
        self.slot = RECORD_SIZE + opts.inline_max
        pd = hub.pd
        # receive slots for the peer's records; send slots for ours (credits bound how many
        # can be in flight, so as many as the peer may announce is enough)
        self.nrecv = opts.slots + CTRL_SLOTS
        self.recv_mr = MR(pd, self.nrecv * self.slot, A.IBV_ACCESS_LOCAL_WRITE)
        self.send_slots = max(opts.slots, 16) + 8
        # registered at the first record we send, not here: a passive side's connection
        # exists from the REQ on, and a forged REQ never completes (issue 26: it halves
        # what a half-open connection holds, 564 -> 274 KiB with the default Options)
        self.send_mr: Any = None
        self.free_send = deque(range(self.send_slots))
        attr = QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, scq=hub.cq, rcq=hub.cq,
                          cap=QPCap(max_send_wr=self.send_slots + opts.slots + 8,
                                    max_recv_wr=self.nrecv, max_send_sge=1,
                                    max_recv_sge=1),
                          sq_sig_all=1)
        cmid.pd = pd  # the QP and the hub's MRs must share a PD
        cmid.create_qp(attr)
        self.qp = cmid.qp
        self.qpn = self.qp.qp_num
        for i in range(self.nrecv):
            self._post_recv(i)
        hub.add(self)
        # protocol state
        self.credits = 0  # records other than CREDIT we may still send (peer's hello)
        self.ctrl_credits = CTRL_SLOTS  # CREDIT records we may still send
        self.unreturned = 0  # data slots reposted and not yet returned to the peer
        self.unreturned_ctrl = 0  # control slots likewise
        self.granted = opts.slots  # data credits the peer has had from us, in total
        self.received = 0  # records other than CREDIT received from the peer, in total
        self.tx_seq = 0
        self.rx_seq = 0
        # the largest message we take: a record's length field is 32 bits
        self.max_message = min(opts.max_message, 0xFFFFFFFF)
        self.tx_run = 0  # bytes of our run in progress (frames queued with more=True)
        self.rx_run = 0  # bytes of the peer's run in progress, as announced
        self.abort_until: float | None = None  # an ABORT is in flight until then
        self._abort_slot = -1
        self.txq: deque[tuple[Record, bytes | None, Any]] = deque()
        self.unacked: dict[int, Any] = {}  # seq -> MR lent to the peer for its READ
        self.retired: deque[tuple[float, Any]] = deque()  # (when, MR) read and ACKed
        self.rxq: deque[_Rx] = deque()
        self.held = 0  # bytes received (or being read) and not yet taken
        self.budget = hub.budget or Budget(opts.mem_limit)
        self._run = 0  # the ticket of the peer's run in progress (0: between runs)
        self.reads = 0
        self.established = False
        self.peer_closed = False  # CLOSE received
        self.local_closed = False  # CLOSE sent
        self.disconnected = False  # the CM said DISCONNECTED
        self.error: BaseException | None = None
        self._acks_due: deque[int] = deque()  # messages read whose ACK awaits a credit
        self.last_heard = time.monotonic()
        self.probing = False  # a zero-length WRITE probe is in flight
        self.released = False
        self.on_message: Callable[[Connection], None] | None = None

    # ---- setup ----------------------------------------------------------------------

    def hello(self) -> Hello:
        return Hello(self.opts.slots, self.opts.inline_max, FEATURE_INLINE | FEATURE_LIMITS,
                     max_message=self.max_message, max_run=self.opts.max_run or None)

    def conn_param(self, req: Any = None) -> ConnParam:
        """The REQ's parameters, or the REP's (``req``, the REQ's, are not echoed: each
        side asks for what it can take) with our hello as private data."""
        data = self.hello().pack()
        cp = ConnParam(resources=ce.RDMA_MAX_RESP_RES, depth=ce.RDMA_MAX_INIT_DEPTH,
                       retry=self.opts.retry, rnr_retry=7, data_len=len(data))
        cp.set_private_data(data)
        return cp

    def save_conn_data(self, private_data: bytes) -> None:
        """Take the peer's hello (ProtocolError, a ConnectionError, if malformed)."""
        self.peer = Hello.unpack(private_data)
        self.credits = self.peer.slots

    # ---- posting --------------------------------------------------------------------

    def _post_recv(self, i: int) -> None:
        self.qp.post_recv(RecvWR((_RECV << _KIND_SHIFT) | i, 1,
                                 [SGE(self.recv_mr.buf + i * self.slot, self.slot,
                                      self.recv_mr.lkey)]))

    def _send_record(self, rec: Record, payload: bytes | None = None) -> None:
        i = self.free_send.popleft()
        # over the memory limit, data credits stay here (back-pressure) whatever goes out
        withhold = not self.budget.may_credit(self)
        give = 0 if withhold else min(self.unreturned, 0xFFFF)
        rec.credit = give
        self.unreturned -= give
        self.granted += give
        rec.ctrl_credit = self.unreturned_ctrl
        self.unreturned_ctrl = 0
        off = i * self.slot
        buf = bytearray(rec.pack())
        if payload:
            buf += payload
        if self.send_mr is None:
            self.send_mr = MR(self.hub.pd, self.send_slots * self.slot,
                              A.IBV_ACCESS_LOCAL_WRITE)
        self.send_mr.write(bytes(buf), len(buf), off)
        self.qp.post_send(SendWR((_SEND << _KIND_SHIFT) | i, O.IBV_WR_SEND, 1,
                                 sg=[SGE(self.send_mr.buf + off, len(buf),
                                         self.send_mr.lkey)],
                                 send_flags=F.IBV_SEND_SIGNALED))
        if rec.type == RT.CREDIT:
            self.ctrl_credits -= 1
        else:
            self.credits -= 1

    def _can_send(self, credit_only: bool) -> bool:
        # CREDIT records have slots of their own (CTRL_SLOTS): returning credits never
        # waits for credits, and since the peer never answers a CREDIT with a CREDIT,
        # the control credits always come back with its next other record
        if not self.free_send:
            return False
        return self.ctrl_credits >= 1 if credit_only else self.credits >= 1

    # ---- the application's side -----------------------------------------------------

    def check_usable(self, sending: bool) -> None:
        if self.error is not None:
            raise ConnectionResetError(errno.ECONNRESET, f"connection broken: {self.error}")
        if sending and (self.peer_closed or self.local_closed or self.disconnected):
            raise BrokenPipeError(errno.EPIPE, "the connection is closed")

    def queue_message(self, data: bytes | bytearray | memoryview, more: bool) -> None:
        """Queue one message (a frame when ``more``); it leaves as credits allow.
        OSError(EMSGSIZE), nothing queued, if the peer's hello says it would refuse it."""
        n = len(data)
        self.check_size(n)
        if n <= (self.peer.inline_max if self.peer and self.peer.features & FEATURE_INLINE
                 else -1):
            rec = Record(RT.INLINE, MORE if more else 0, 0, 0, n)
            self.txq.append((rec, bytes(data), None))
        else:
            if n > 0xFFFFFFFF:
                raise ValueError("a message is at most 4 GiB - 1")
            mr = MR(self.hub.pd, n, A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_READ,
                    buffer=bytearray(data))
            rec = Record(RT.NORMAL, MORE if more else 0, 0, 0, n, mr.rkey, mr.buf)
            self.txq.append((rec, None, mr))
        self.tx_run = self.tx_run + n if more else 0
        self.pump()

    def check_size(self, n: int) -> None:
        """Refuse locally what the peer told us (its hello) it would refuse."""
        peer = self.peer
        if peer is None or peer.max_message is None:
            return  # a peer without FEATURE_LIMITS: it checks on its side
        if n > peer.max_message:
            raise OSError(errno.EMSGSIZE, f"send: a {n}-byte message exceeds the "
                          f"receiver's max_message of {peer.max_message} bytes")
        if peer.max_run is not None and self.tx_run + n > peer.max_run:
            raise OSError(errno.EMSGSIZE, f"send: this frame makes a run of "
                          f"{self.tx_run + n} bytes (frames sent with more=True and it), "
                          f"over the receiver's max_run of {peer.max_run} bytes")

    def tx_backlog(self) -> int:
        return len(self.txq)

    def take(self, keep: bool = False) -> Message | None:
        """The next message if it is complete, else None. ``keep``: its bytes stay
        counted in the budget (a message queue holds them on) and nothing is pumped."""
        if self.rxq and self.rxq[0].data is not None:
            rx = self.rxq.popleft()
            self.held -= len(rx.data)
            msg = Message(rx.data, bool(rx.rec.flags & MORE), rx.rec.seq)
            if not keep:
                self.budget.held -= len(rx.data)
                self.pump()  # memory freed: reads and credits may go on
            return msg
        return None

    def _hold(self, n: int) -> None:
        self.held += n
        self.budget.held += n

    def oldest_open_run(self) -> int | None:
        """The ticket of this connection's oldest run not wholly in memory yet (a frame
        announced and not read, or its last frame not arrived), or None."""
        for rx in self.rxq:
            if rx.data is None:
                return rx.run
        return self._run or None

    def has_message(self) -> bool:
        return bool(self.rxq) and self.rxq[0].data is not None

    def at_eof(self) -> bool:
        """The peer closed and everything it sent has been taken."""
        return (self.peer_closed or self.disconnected) and not self.rxq

    # ---- the engine -----------------------------------------------------------------

    def pump(self) -> None:
        """Move what can move: READs of announced messages (within the memory limit),
        queued sends (within credits), credit returns."""
        if self.error is not None or self.released or self.peer is None:
            return
        try:
            self._free_retired()
            self._flush_acks()
            self._start_reads()
            while self.txq and not self.local_closed and self._can_send(False):
                rec, payload, mr = self.txq.popleft()
                rec.seq = self.tx_seq
                self.tx_seq = (self.tx_seq + 1) & 0xFFFFFFFF
                if mr is not None:
                    self.unacked[rec.seq] = mr
                self._send_record(rec, payload)
            self._return_credits()
            self.tick()
        except PyverbsRDMAError as e:
            self.fail(e)

    def _now(self) -> float:
        # the device's clock where it has one (virtual time in the simulated network),
        # else the monotonic clock: nothing here depends on the soft backend
        dev = getattr(self.hub.ctx, "device", None)
        now = getattr(dev, "now", None)
        return now if isinstance(now, float) else time.monotonic()

    def _free_retired(self, everything: bool = False) -> None:
        if not self.retired:
            return
        limit = self._now() - RETIRE_HOLD
        while self.retired and (everything or self.retired[0][0] <= limit):
            self.retired.popleft()[1].close()

    def _start_reads(self) -> None:
        first = True  # nothing before it in the queue: the application took it all
        for rx in self.rxq:
            if rx.data is not None or rx.reading:
                first = False
                continue
            n = rx.rec.length
            # back-pressure: the buffer is allocated only when the budget allows (the
            # message, and everything behind it, waits; credits wait too)
            if not self.budget.may_read(self, rx.run, n, first):
                return
            first = False
            mr = MR(self.hub.pd, n, A.IBV_ACCESS_LOCAL_WRITE)
            rx.mr, rx.reading = mr, True
            self._hold(n)
            self.reads += 1
            wr = SendWR((_READ << _KIND_SHIFT) | (rx.rec.seq & 0xFFFFFFFF), O.IBV_WR_RDMA_READ,
                        1, sg=[SGE(mr.buf, n, mr.lkey)], send_flags=F.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(rx.rec.rkey, rx.rec.addr)
            self.qp.post_send(wr)

    def _return_credits(self) -> None:
        """A CREDIT record when the peer runs low on data credits we could return, or
        when half our control slots wait to be returned (the peer's keepalives): never in
        answer to a lone CREDIT, so CREDITs cannot bounce back and forth."""
        if self.local_closed and self.peer_closed or not self._can_send(True):
            return
        if self.unreturned > 0 and self.budget.may_credit(self):
            # (withheld while over the memory limit: the peer stops until we read)
            if self.granted - self.received <= self.opts.slots // 2:
                self._send_record(Record(RT.CREDIT))
                return
        if self.unreturned_ctrl >= CTRL_SLOTS // 2:
            self._send_record(Record(RT.CREDIT))

    def send_control(self, rec: Record) -> bool:
        """ACK, CLOSE or CREDIT now, if a credit of the right kind is there."""
        if self._can_send(rec.type == RT.CREDIT):
            self._send_record(rec)
            return True
        return False

    def on_wc(self, wc: Any) -> None:
        kind, idx = wc.wr_id >> _KIND_SHIFT, wc.wr_id & ((1 << _KIND_SHIFT) - 1)
        if wc.status != WS.IBV_WC_SUCCESS:
            if not (self.released or (self.disconnected and
                                      wc.status == WS.IBV_WC_WR_FLUSH_ERR)):
                self.fail(ConnectionResetError(
                    errno.ECONNRESET, f"work completion {WS(wc.status).name}"))
            if kind == _SEND:
                self._sent(idx)
            elif kind == _PROBE:
                self.probing = False
            return
        self.last_heard = time.monotonic()
        try:
            if kind == _RECV:
                self._on_record(idx, wc.byte_len)
            elif kind == _SEND:
                self._sent(idx)
            elif kind == _READ:
                self._on_read_done(idx)
            elif kind == _PROBE:
                self.probing = False
        except ProtocolError as e:
            self.fail(e)

    def _sent(self, i: int) -> None:
        self.free_send.append(i)
        if i == self._abort_slot:
            self.abort_until = None  # the ABORT arrived (or never will)

    def _on_record(self, i: int, nbytes: int) -> None:
        off = i * self.slot
        raw = self.recv_mr.read(nbytes, off)
        rec = Record.unpack(raw)
        if rec.type == RT.ABORT:
            self.fail(ConnectionResetError(errno.ECONNRESET, describe_abort(rec)))
            return
        self.credits += rec.credit
        self.ctrl_credits += rec.ctrl_credit
        if rec.type != RT.CREDIT:
            self.received += 1
        t = rec.type
        if t in (RT.NORMAL, RT.INLINE):
            if self.peer_closed:
                raise ProtocolError("a message after CLOSE")
            if rec.seq != self.rx_seq:
                raise ProtocolError(f"message {rec.seq} where {self.rx_seq} was due",
                                    seq=rec.seq)
            self._check_announced(rec)
            self.rx_seq = (self.rx_seq + 1) & 0xFFFFFFFF
            run = self._run or self.budget.ticket()
            self._run = run if rec.flags & MORE else 0
            if t == RT.INLINE:
                if rec.length > self.opts.inline_max or rec.length != nbytes - RECORD_SIZE:
                    raise ProtocolError(f"INLINE of {rec.length} bytes in a "
                                        f"{nbytes}-byte SEND")
                data = raw[RECORD_SIZE:]
                self.rxq.append(_Rx(rec, data, run))
                self._hold(len(data))
            else:
                self.rxq.append(_Rx(rec, None, run))
        elif t == RT.ACK:
            mr = self.unacked.pop(rec.seq, None)
            if mr is None:
                raise ProtocolError(f"ACK of message {rec.seq}, which is not out")
            self.retired.append((self._now(), mr))
        elif t == RT.CLOSE:
            self.peer_closed = True
        self._post_recv(i)
        if t == RT.CREDIT:
            self.unreturned_ctrl += 1
        else:
            self.unreturned += 1
        if self.on_message is not None and self.has_message():
            self.on_message(self)

    def _check_announced(self, rec: Record) -> None:
        """A message (INLINE or NORMAL) within the limits our hello told the peer; the
        check comes before anything is allocated for it."""
        n = rec.length
        if n > self.max_message:
            raise ProtocolError(
                f"message {rec.seq}: the record's length field announces {n} bytes, over "
                f"this side's max_message of {self.max_message} bytes",
                reason=AbortReason.MESSAGE_SIZE, seq=rec.seq, value=n,
                limit=self.max_message)
        run = self.rx_run + n
        if self.opts.max_run and run > self.opts.max_run:
            raise ProtocolError(
                f"message {rec.seq}: its run of frames (MORE flag) reaches {run} bytes, "
                f"over this side's max_run of {self.opts.max_run} bytes",
                reason=AbortReason.RUN_SIZE, seq=rec.seq, value=run,
                limit=self.opts.max_run)
        self.rx_run = run if rec.flags & MORE else 0

    def _on_read_done(self, seq: int) -> None:
        rx = next((r for r in self.rxq if r.reading and r.rec.seq == seq), None)
        if rx is None:
            return
        rx.data = rx.mr.read(rx.rec.length, 0)
        rx.mr.close()
        rx.mr, rx.reading = None, False
        self.reads -= 1
        # the buffer can go back to its owner: ACK (queued if no credit just now)
        self._acks_due.append(seq)
        self._flush_acks()
        if self.on_message is not None and self.has_message():
            self.on_message(self)

    def _flush_acks(self) -> None:
        due = self._acks_due
        while due and self.send_control(Record(RT.ACK, seq=due[0])):
            due.popleft()

    def on_cm(self, ev: CMEvent) -> None:
        t = ev.event_type
        if t == E.RDMA_CM_EVENT_ESTABLISHED:
            self.established = True
        elif t == E.RDMA_CM_EVENT_DISCONNECTED:
            self.disconnected = True
            if not self.peer_closed and not self.local_closed and self.error is None:
                self.fail(ConnectionResetError(errno.ECONNRESET,
                                               "the peer disconnected without closing"))
        elif t in (E.RDMA_CM_EVENT_REJECTED, E.RDMA_CM_EVENT_UNREACHABLE,
                   E.RDMA_CM_EVENT_CONNECT_ERROR):
            self.fail(ConnectionRefusedError(errno.ECONNREFUSED, f"{ev.event_str()} "
                                             f"(status {ev.status})"))

    def fail(self, exc: BaseException) -> None:
        """The connection is broken (the first reason is kept). A protocol error found
        here is told to a peer that understands ABORT, if a slot and a credit allow."""
        if self.error is not None:
            return
        # kept without its traceback: its frames hold this connection (a cycle that kept
        # a dropped sender's buffers until gc), and the reason is in the message
        self.error = exc.with_traceback(None)
        if isinstance(exc, ProtocolError) and self.peer is not None and \
                self.peer.features & FEATURE_LIMITS and not self.released and \
                self.free_send and (self.credits >= 1 or self.ctrl_credits >= 1):
            self._abort_slot = self.free_send[0]
            try:
                self._send_record(exc.abort_record())
            except PyverbsRDMAError:
                return
            # RC delivers it or gives up within (retry + 1) ACK timeouts: wait no longer
            self.abort_until = time.monotonic() + (self.opts.retry + 1) * \
                4.096e-6 * (1 << self.opts.ack_timeout)

    @property
    def abort_pending(self) -> bool:
        """An ABORT we sent may still be on its way: disconnecting now would flush it."""
        return self.abort_until is not None and time.monotonic() < self.abort_until

    def tick(self) -> None:
        """Periodic duties (run by every :meth:`pump`, so by every wait on the hub): ACKs
        waiting for credit, and a probe after ``keepalive`` seconds of silence, which
        RC's own retransmission turns into a failed completion if the peer vanished."""
        if self.error is not None or not self.established or self.released:
            return
        self._flush_acks()
        if self.probing or time.monotonic() - self.last_heard <= self.opts.keepalive:
            return
        self.last_heard = time.monotonic()
        if not self.local_closed and self.send_control(Record(RT.CREDIT)):
            return
        self._probe()

    def _probe(self) -> None:
        """A zero-length RDMA WRITE: the peer's responder ACKs it without a receive, a
        credit or a memory key (rsocket's keepalive), so a peer can be probed even when
        no control credit is left or after our CLOSE."""
        wr = SendWR(_PROBE << _KIND_SHIFT, O.IBV_WR_RDMA_WRITE, 0, sg=[],
                    send_flags=F.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(0, 0)
        self.qp.post_send(wr)
        self.probing = True

    def idle_tx(self) -> bool:
        """Nothing of ours is still owed: all sent, all lent buffers acknowledged."""
        return not self.txq and not self.unacked and \
            len(self.free_send) == self.send_slots

    # ---- the end --------------------------------------------------------------------

    def release(self) -> None:
        """Free the QP, MRs and the rdma_cm id (idempotent)."""
        if self.released:
            return
        self.released = True
        self.hub.remove(self)
        self._free_retired(everything=True)
        for mr in list(self.unacked.values()) + [r.mr for r in self.rxq if r.mr]:
            try:
                mr.close()
            except Exception:
                pass
        self.unacked.clear()
        self.rxq.clear()
        self.budget.held -= self.held  # what was received and never taken
        self.held = 0
        try:
            self.cmid.close()
        except Exception:
            pass
        for mr in (self.recv_mr, self.send_mr):
            if mr is None:
                continue
            try:
                mr.close()
            except Exception:
                pass
