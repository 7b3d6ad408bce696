"""The IB CM connection state machine (sans-IO): one :class:`CmAgent` per port.

Linux's ``ib_cm`` (drivers/infiniband/core/cm.c) restated for a userspace stack: the
agent owns the cm_ids of one port, is fed received MADs (:meth:`CmAgent.on_mad`), the
passage of time (:meth:`CmAgent.on_timer`, woken at :attr:`CmAgent.deadline`) and the
consumer's calls (``send_req``, ``send_rep``, ``send_rtu``, ``send_rej``, ``send_mra``,
``send_dreq``, ``send_drep``, ``send_sidr_req``, ``send_sidr_rep``, ``listen``,
``establish``, ``destroy``), and hands MADs to a
:class:`CmTransmit` and events to a :class:`CmEventSink`. It has no sockets, threads or
clock of its own: it is handed one (``clock``, seconds; a virtual clock in tests) as the QP
engines are handed their device's ``now``, reads it once per entry point, and is woken
with the time the timer fired (``on_timer(now)``, as ``QpEngine.on_timer``).

What it does as Linux does (docs/cm.md, "The connection state machine"):

* **states** are ``enum ib_cm_state`` (:class:`CmState`), **events** ``enum
  ib_cm_event_type`` (:class:`CmEventType`); which user call and which received message
  is accepted in which state, and the state it leads to, are the tables
  :data:`USER_CALLS`, :data:`ON_RECEIVE` and :data:`ON_SEND_ERROR`;
* **timers**: a REQ is retransmitted every ``2*conv(packet_life_time) +
  conv(remote_cm_response_timeout)`` ms, a REP every ``conv(REQ local CM response
  timeout)`` (capped, see below), a DREQ with its id's REQ/REP timeout, each up to
  ``max_cm_retries`` times (15 from rdma_cm), where ``conv(t) = 1 << max(t - 8, 0)`` ms
  is Linux's approximation of 4.096 us x 2^t (``cm_convert_to_ms``). After the last
  retransmission's timeout the id gets REQ_ERROR, REP_ERROR or DREQ_ERROR. An MRA moves
  the pending timer to ``conv(service_timeout) + conv(av timeout)`` (``ib_modify_mad``).
  TIMEWAIT lasts ``conv(av timeout)`` (2048 ms for the ACK timeout 19 rxe paths give),
  then TIMEWAIT_EXIT and IDLE;
* **matching**: REQ duplicates by (remote comm ID, remote CA GUID), stale connections by
  (remote QPN, remote CA GUID) among live connections, a REP by the comm ID it names with
  no remote ID bound yet (otherwise it is a duplicate: the RTU is resent if ESTABLISHED,
  the MRA if MRA_REP_SENT), RTU/DREP/DREQ by both comm IDs (a DREQ also by our QPN), a REJ
  as ``cm_acquire_rejected_id``. A REQ with no listener gets REJ 8, a DREQ for no id a
  DREP. Linux never resends a REP on a duplicate REQ (it waits for its own timer), and
  neither does this;
* **SIDR** (service ID resolution, what rdma_cm uses for UD ids: udaddy): ``send_sidr_req``
  moves IDLE -> SIDR_REQ_SENT and sends a SIDR_REQ whose request ID is the id's local comm
  ID, retransmitted with the same TID every ``timeout_ms`` (rdma_cm: ``1 << (20 - 8)`` =
  4096 ms) up to ``max_cm_retries`` (15) times, then SIDR_REQ_ERROR and IDLE. A received
  SIDR_REQ is a duplicate, and dropped, while an id still holds its (request ID, source)
  (``cm_insert_remote_sidr``: from the SIDR_REQ until the SIDR_REP is sent); with no
  listener for its service ID it is answered with SIDR_REP status 1 (UNSUPPORTED) and no
  id, otherwise a new id in SIDR_REQ_RCVD gets SIDR_REQ_RECEIVED. ``send_sidr_rep``
  answers (SIDR_REQ_RCVD -> IDLE; the request ID, service ID and TID echoed); destroying
  an id in SIDR_REQ_RCVD answers with status 2 (REJECT). A SIDR_REP is matched by its
  request ID to an id in SIDR_REQ_SENT with no remote ID (``cm_acquire_id(id, 0)``),
  cancels the retransmission and gives SIDR_REP_RECEIVED; any other SIDR_REP is dropped
  (``counters['dropped']['unmatched_sidr_rep']``). SIDR is not retransmitted from the
  passive side and never enters TIMEWAIT.

**Timers a peer chooses are capped** (a softrdma bound; Linux takes them as sent). A REQ
names the REP's retransmit timeout (``local_cm_response_timeout``, 5 bits: 31 is 2^23 ms,
2.3 h) and the path's ACK timeout (TIMEWAIT, MRA waits), a REP its target ACK delay:
each exponent is cut to :data:`MAX_PEER_CM_TIMEOUT` (20, what rdma_cm itself asks of
peers) before it becomes a timer, so one forged REQ holds a half-open id at most
16 x 4.096 s, not 16 x 2.3 h; an MRA's service timeout is cut to
:data:`MAX_PEER_MRA_TIMEOUT` (24, rdma_cm's own MRA). The retry count (4 bits) is at most
15 by its width.

**A consumer with no room** (``destroy(cm_id, err=-ENOMEM)`` in REQ_RCVD: rdma_cm's
listener backlog is full) makes the CM forget the REQ without a REJ
(``cm_destroy_id``: "Do not reject to allow future retries"): the id and its remote keys
go, so the peer's retransmission of the REQ is a new request. A SIDR_REQ in the same case
is answered REJECT, as Linux does. Both are counted in ``counters['listen_overflow']``.

LAP/APR are not supported (Linux drops them on RoCE).
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol

from .mad import AttrId, MadError, new_tid
from .messages import (
    DREP, DREQ, MRA, REJ, REP, REQ, RTU, SIDR_REP, SIDR_REQ, CMMessage, MessageType,
    MsgResponse, RejectReason, SidrStatus, build_cm, parse_cm,
)

__all__ = [
    "CmState", "CmEventType", "CmEvent", "IbCmId", "CmAgent", "CmTransmit", "CmEventSink",
    "CmStateError", "USER_CALLS", "ON_RECEIVE", "ON_SEND_ERROR", "cm_convert_to_ms",
    "cm_ack_timeout", "MRA_FLAG_DELAY", "reply_without_consumer", "DEFAULT_SIDR_TIMEOUT_MS",
    "MAX_PEER_CM_TIMEOUT", "MAX_PEER_MRA_TIMEOUT", "peer_timeout_ms",
]

#: rdma_cm's defaults (drivers/infiniband/core/cma.c): CMA_CM_RESPONSE_TIMEOUT,
#: CMA_MAX_CM_RETRIES, CMA_IBOE_PACKET_LIFETIME; rxe's CA ACK delay.
DEFAULT_CM_RESPONSE_TIMEOUT = 20
DEFAULT_MAX_CM_RETRIES = 15
DEFAULT_PACKET_LIFETIME = 18
DEFAULT_ACK_DELAY = 15
#: rdma_cm's SIDR_REQ timeout (cma.c ``cma_resolve_ib_udp``: ``timeout_ms = 1 <<
#: (CMA_CM_RESPONSE_TIMEOUT - 8)``), with CMA_MAX_CM_RETRIES retries.
DEFAULT_SIDR_TIMEOUT_MS = 1 << (DEFAULT_CM_RESPONSE_TIMEOUT - 8)
#: ``IB_CM_MRA_FLAG_DELAY``: change state only; send the MRA if a duplicate arrives.
MRA_FLAG_DELAY = 0x80
#: The largest time exponent (4.096 us x 2^t) a peer may choose for one of our timers:
#: the REP's retransmit interval (the REQ's local CM response timeout) and the path's
#: ACK timeout from a REQ or a REP's target ACK delay (TIMEWAIT; MRA waits). 20 is
#: rdma_cm's CMA_CM_RESPONSE_TIMEOUT, the value rdma_cm puts in its own REQs and so asks of
#: every peer (conv(20) = 4096 ms); rxe paths need 19 (ACK timeout). The 5-bit fields go to
#: 31 (2^23 ms, 2.3 h per resend), which would let one forged REQ hold an id for 16 x 2.3 h.
MAX_PEER_CM_TIMEOUT = DEFAULT_CM_RESPONSE_TIMEOUT
#: The largest MRA service timeout a peer may make us wait (on top of the ACK timeout):
#: 24 (conv = 65.5 s) is rdma_cm's CMA_CM_MRA_SETTING, the MRA every Linux rdma_cm sends
#: while its application decides, so honouring it keeps Linux peers working; 31 would be
#: 2.3 h per retry. Only a peer that got our REQ or REP (it must name our comm ID) can
#: send one, and an id takes one MRA (a second is a duplicate).
MAX_PEER_MRA_TIMEOUT = 24


class CmState(enum.IntEnum):
    """``enum ib_cm_state`` (include/rdma/ib_cm.h), same order and values."""

    IDLE = 0
    LISTEN = 1
    REQ_SENT = 2
    REQ_RCVD = 3
    MRA_REQ_SENT = 4
    MRA_REQ_RCVD = 5
    REP_SENT = 6
    REP_RCVD = 7
    MRA_REP_SENT = 8
    MRA_REP_RCVD = 9
    ESTABLISHED = 10
    DREQ_SENT = 11
    DREQ_RCVD = 12
    TIMEWAIT = 13
    SIDR_REQ_SENT = 14
    SIDR_REQ_RCVD = 15


class CmEventType(enum.IntEnum):
    """``enum ib_cm_event_type`` (include/rdma/ib_cm.h), same values."""

    REQ_ERROR = 0
    REQ_RECEIVED = 1
    REP_ERROR = 2
    REP_RECEIVED = 3
    RTU_RECEIVED = 4
    USER_ESTABLISHED = 5
    DREQ_ERROR = 6
    DREQ_RECEIVED = 7
    DREP_RECEIVED = 8
    TIMEWAIT_EXIT = 9
    MRA_RECEIVED = 10
    REJ_RECEIVED = 11
    LAP_ERROR = 12
    LAP_RECEIVED = 13
    APR_RECEIVED = 14
    SIDR_REQ_ERROR = 15
    SIDR_REQ_RECEIVED = 16
    SIDR_REP_RECEIVED = 17


S = CmState

#: User calls: the states each is legal in, and the state it leads to (cm.c
#: ``ib_send_cm_*``, ``cm_send_*_locked``, ``cm_establish``). A target of TIMEWAIT means
#: "enter timewait" (its timer starts), IDLE "reset to idle" (the remote keys go).
USER_CALLS: dict[str, dict[CmState, CmState]] = {
    "send_req": {S.IDLE: S.REQ_SENT},
    "send_rep": {S.REQ_RCVD: S.REP_SENT, S.MRA_REQ_SENT: S.REP_SENT},
    "send_rtu": {S.REP_RCVD: S.ESTABLISHED, S.MRA_REP_SENT: S.ESTABLISHED},
    "send_mra": {S.REQ_RCVD: S.MRA_REQ_SENT, S.REP_RCVD: S.MRA_REP_SENT},
    "send_rej": {S.REQ_SENT: S.IDLE, S.MRA_REQ_RCVD: S.IDLE, S.REQ_RCVD: S.IDLE,
                 S.MRA_REQ_SENT: S.IDLE, S.REP_RCVD: S.IDLE, S.MRA_REP_SENT: S.IDLE,
                 S.REP_SENT: S.TIMEWAIT, S.MRA_REP_RCVD: S.TIMEWAIT},
    "send_dreq": {S.ESTABLISHED: S.DREQ_SENT},
    "send_drep": {S.DREQ_RCVD: S.TIMEWAIT},
    "establish": {S.REP_SENT: S.ESTABLISHED, S.MRA_REP_RCVD: S.ESTABLISHED},
    "listen": {S.IDLE: S.LISTEN},
    "send_sidr_req": {S.IDLE: S.SIDR_REQ_SENT},
    "send_sidr_rep": {S.SIDR_REQ_RCVD: S.IDLE},
}

#: Received messages that match an id: the states they are accepted in and the state
#: that follows (cm.c ``cm_*_handler``). In any other state the message is dropped (or
#: answered as a duplicate, see the handlers). A REJ with reason STALE_CONN in the REQ
#: states leads to TIMEWAIT instead of IDLE.
ON_RECEIVE: dict[str, dict[CmState, CmState]] = {
    "REP": {S.REQ_SENT: S.REP_RCVD, S.MRA_REQ_RCVD: S.REP_RCVD},
    "RTU": {S.REP_SENT: S.ESTABLISHED, S.MRA_REP_RCVD: S.ESTABLISHED},
    "MRA_REQ": {S.REQ_SENT: S.MRA_REQ_RCVD},
    "MRA_REP": {S.REP_SENT: S.MRA_REP_RCVD},
    "DREQ": {S.REP_SENT: S.DREQ_RCVD, S.DREQ_SENT: S.DREQ_RCVD, S.ESTABLISHED: S.DREQ_RCVD,
             S.MRA_REP_RCVD: S.DREQ_RCVD},
    "DREP": {S.DREQ_SENT: S.TIMEWAIT, S.DREQ_RCVD: S.TIMEWAIT},
    "REJ": {S.REQ_SENT: S.IDLE, S.MRA_REQ_RCVD: S.IDLE, S.REP_SENT: S.IDLE,
            S.MRA_REP_RCVD: S.IDLE, S.REQ_RCVD: S.IDLE, S.MRA_REQ_SENT: S.IDLE,
            S.DREQ_SENT: S.TIMEWAIT, S.REP_RCVD: S.TIMEWAIT, S.MRA_REP_SENT: S.TIMEWAIT,
            S.ESTABLISHED: S.TIMEWAIT},
    "SIDR_REP": {S.SIDR_REQ_SENT: S.IDLE},
}

#: A retransmitted message whose retries ran out, by the state it was sent in (or moved
#: to by an MRA): the state that follows and the event (``cm_process_send_error``).
ON_SEND_ERROR: dict[CmState, tuple[CmState, CmEventType]] = {
    S.REQ_SENT: (S.IDLE, CmEventType.REQ_ERROR),
    S.MRA_REQ_RCVD: (S.IDLE, CmEventType.REQ_ERROR),
    S.REP_SENT: (S.IDLE, CmEventType.REP_ERROR),
    S.MRA_REP_RCVD: (S.IDLE, CmEventType.REP_ERROR),
    S.DREQ_SENT: (S.TIMEWAIT, CmEventType.DREQ_ERROR),
    S.SIDR_REQ_SENT: (S.IDLE, CmEventType.SIDR_REQ_ERROR),
}


def cm_convert_to_ms(iba_time: int) -> int:
    """Linux's approximation of 4.096 us x 2^t in ms: ``1 << max(t - 8, 0)``."""
    return 1 << max(iba_time - 8, 0)


def peer_timeout_ms(iba_time: int) -> int:
    """A timer in ms from a time exponent a peer sent: :func:`cm_convert_to_ms` of it,
    capped at :data:`MAX_PEER_CM_TIMEOUT` (4096 ms)."""
    return cm_convert_to_ms(min(iba_time, MAX_PEER_CM_TIMEOUT))


def cm_ack_timeout(ca_ack_delay: int, packet_life_time: int) -> int:
    """The local ACK timeout a REQ carries (cm.c ``cm_ack_timeout``): 4.096 us x 2^t
    covering the CA's ACK delay plus twice the packet lifetime, rounded as Linux does."""
    ack_timeout = packet_life_time + 1
    if ack_timeout >= ca_ack_delay:
        ack_timeout += ca_ack_delay >= ack_timeout - 1
    else:
        ack_timeout = ca_ack_delay + (ack_timeout >= ca_ack_delay - 1)
    return min(31, ack_timeout)


class CmStateError(Exception):
    """A user call made in a state that does not allow it (Linux returns -EINVAL)."""


class CmTransmit(Protocol):
    """Where the agent's MADs go: the QP1 of the port, as the device sees it."""

    def __call__(self, mad: bytes, dest: Hashable) -> None:
        """Send the 256-byte ``mad`` to ``dest`` (an address the caller chose: what
        :meth:`CmAgent.send_req` was given, or the source of a received MAD)."""
        ...


@dataclass(frozen=True)
class CmEvent:
    """What the agent tells its consumer (``struct ib_cm_event``)."""

    type: CmEventType
    cm_id: "IbCmId"
    message: CMMessage | None = None  # the MAD that caused it, if any
    private_data: bytes | None = None
    reason: int | None = None  # REJ_RECEIVED
    ari: bytes | None = None  # REJ_RECEIVED
    listen_id: "IbCmId | None" = None  # REQ_RECEIVED, SIDR_REQ_RECEIVED
    service_timeout: int | None = None  # MRA_RECEIVED
    send_status: str | None = None  # *_ERROR: "timeout"
    source: Hashable = None  # SIDR_REQ_RECEIVED: where the SIDR_REQ came from
    status: int | None = None  # SIDR_REP_RECEIVED: the SidrStatus


class CmEventSink(Protocol):
    """The consumer (rdma_cm): called once per event, after the agent's state changed.
    It may call back into the agent (accept, reply) from inside the call."""

    def __call__(self, event: CmEvent) -> None:
        ...


@dataclass
class _Pending:
    """A MAD waiting for its answer (the MAD layer's send with retries)."""

    mad: bytes
    dest: Hashable
    state: CmState  # the state it was sent in (msg->context[1])
    timeout_ms: int
    retries_left: int
    deadline: float


@dataclass(eq=False)
class IbCmId:
    """One connection's CM state (``struct cm_id_private``)."""

    local_id: int
    context: Any = None
    state: CmState = CmState.IDLE
    remote_id: int = 0
    service_id: int = 0
    dest: Hashable = None
    tid: int = 0
    local_qpn: int = 0
    remote_qpn: int = 0
    remote_ca_guid: int = 0
    timeout_ms: int = 0
    max_cm_retries: int = 0
    av_timeout: int = 0  # the path's ACK timeout: TIMEWAIT and MRA waits derive from it
    service_timeout: int = 0  # of the MRA we sent (resent on duplicates)
    private_data: bytes = b""  # of the last RTU/MRA/DREP we sent (resent on duplicates)
    req: CMMessage | None = None  # the REQ sent or received
    rep: CMMessage | None = None  # the REP sent or received
    pending: _Pending | None = None
    timewait_deadline: float | None = None
    timewait_remote_qpn: int = 0
    _remote_keys: list[tuple[str, tuple[int, Any]]] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"IbCmId(local={self.local_id:#010x}, remote={self.remote_id:#010x}, "
                f"{self.state.name})")


class CmAgent:
    """The CM of one port: cm_ids, listeners, timers.

    ``node_guid`` is the CA GUID put in REQ/REP; ``id_operand`` is XORed into comm IDs
    (Linux's ``random_id_operand``; pass a random 32-bit value in production) and
    ``hi_tid`` is the MAD agent's half of new TIDs. ``clock`` gives the time in seconds
    (the device's ``now``: a virtual clock under simulation). ``peer_key`` maps the source of a
    received MAD to what identifies the sender for SIDR_REQ duplicate detection (the
    source as given by default; a device passes its (IP, QPN), not per-packet fields)."""

    def __init__(self, node_guid: int, transmit: CmTransmit, on_event: CmEventSink, *,
                 clock: Callable[[], float], id_operand: int = 0, hi_tid: int = 0, ack_delay: int = DEFAULT_ACK_DELAY,
                 peer_key: Callable[[Hashable], Hashable] | None = None) -> None:
        self.node_guid = node_guid
        self.clock = clock
        self.transmit = transmit
        self.on_event = on_event
        self.id_operand = id_operand & 0xFFFFFFFF
        self.hi_tid = hi_tid
        self.ack_delay = ack_delay
        self.peer_key: Callable[[Hashable], Hashable] = peer_key or (lambda src: src)
        self.ids: dict[int, IbCmId] = {}
        self.listeners: dict[int, IbCmId] = {}
        self._remote_ids: dict[tuple[int, int], IbCmId] = {}
        self._remote_qpns: dict[tuple[int, int], IbCmId] = {}
        self._remote_sidr: dict[tuple[int, Hashable], IbCmId] = {}
        self._next = 0
        self._events: list[CmEvent] = []
        self._dispatching = False
        #: Linux's per-port counters (cm_tx_msgs, cm_tx_retries, cm_rx_msgs,
        #: cm_rx_duplicates), by message name; plus ``dropped`` (unparsable MADs) and
        #: ``listen_overflow`` (REQs forgotten and SIDR_REQs refused because the consumer
        #: had no room: :meth:`destroy` with ``err=-ENOMEM``).
        self.counters: dict[str, dict[str, int]] = {
            g: {} for g in ("tx", "tx_retries", "rx", "rx_duplicates", "dropped",
                            "listen_overflow")}

    # ---- ids and time ---------------------------------------------------------------

    def create_id(self, context: Any = None) -> IbCmId:
        """A new cm_id in IDLE with a fresh local comm ID (``ib_create_cm_id``)."""
        while True:
            self._next = (self._next + 1) & 0xFFFFFFFF
            local_id = self._next ^ self.id_operand
            if local_id and local_id not in self.ids:
                break
        cm_id = IbCmId(local_id, context)
        self.ids[local_id] = cm_id
        return cm_id

    @property
    def deadline(self) -> float | None:
        """When :meth:`on_timer` must next be called (None: no timer running)."""
        times = [t for c in self.ids.values()
                 for t in ((c.pending.deadline if c.pending else None), c.timewait_deadline)
                 if t is not None]
        return min(times, default=None)

    def on_timer(self, now: float) -> None:
        """Run every timer due at ``now``: retransmissions, send errors, TIMEWAIT exits."""
        while True:
            due = sorted(((t, kind, c.local_id) for c in list(self.ids.values())
                          for t, kind in ((c.pending.deadline if c.pending else None, 0),
                                          (c.timewait_deadline, 1))
                          if t is not None and t <= now))
            if not due:
                break
            _t, kind, local_id = due[0]
            cm_id = self.ids[local_id]
            if kind == 0:
                self._send_timeout(cm_id, now)
            else:
                self._timewait_exit(cm_id)
        self._dispatch()

    def _send_timeout(self, cm_id: IbCmId, now: float) -> None:
        p = cm_id.pending
        assert p is not None
        if p.retries_left > 0:  # the MAD layer's retry_send
            p.retries_left -= 1
            p.deadline = now + p.timeout_ms / 1000
            self._count("tx_retries", p.mad)
            self._tx(p.mad, p.dest)
            return
        cm_id.pending = None
        if p.state != cm_id.state or cm_id.state not in ON_SEND_ERROR:
            return  # an old send (cm_process_send_error discards it)
        nxt, event = ON_SEND_ERROR[cm_id.state]
        self._move(cm_id, nxt, now)
        self._emit(CmEvent(event, cm_id, send_status="timeout"))

    def _timewait_exit(self, cm_id: IbCmId) -> None:
        cm_id.timewait_deadline = None
        if cm_id.state != CmState.TIMEWAIT or cm_id.remote_qpn != cm_id.timewait_remote_qpn:
            return
        cm_id.state = CmState.IDLE
        self._emit(CmEvent(CmEventType.TIMEWAIT_EXIT, cm_id))

    # ---- state plumbing -------------------------------------------------------------

    def _move(self, cm_id: IbCmId, state: CmState, now: float) -> None:
        """Set the state; TIMEWAIT starts the timewait timer, IDLE and TIMEWAIT drop
        the remote keys (``cm_enter_timewait``, ``cm_reset_to_idle``)."""
        if state in (CmState.IDLE, CmState.TIMEWAIT):
            self._remove_remote(cm_id)
        if state == CmState.TIMEWAIT:
            cm_id.timewait_deadline = now + peer_timeout_ms(cm_id.av_timeout) / 1000
            cm_id.timewait_remote_qpn = cm_id.remote_qpn
        cm_id.state = state

    def _cancel(self, cm_id: IbCmId) -> None:
        cm_id.pending = None  # ib_cancel_mad

    def _remove_remote(self, cm_id: IbCmId) -> None:
        for table, key in cm_id._remote_keys:
            tbl = self._table(table)
            if tbl.get(key) is cm_id:
                del tbl[key]
        cm_id._remote_keys.clear()

    def _table(self, table: str) -> dict[Any, IbCmId]:
        """The remote-key table by name: "id" (remote comm ID, CA GUID), "qpn" (remote
        QPN, CA GUID) or "sidr" (SIDR request ID, peer)."""
        return {"id": self._remote_ids, "qpn": self._remote_qpns,
                "sidr": self._remote_sidr}[table]  # type: ignore[return-value]

    def _insert_remote(self, table: str, key: tuple[int, Any], cm_id: IbCmId) -> IbCmId | None:
        """Insert; the id already holding ``key`` if there is one (then nothing changes)."""
        tbl = self._table(table)
        cur = tbl.get(key)
        if cur is not None:
            return cur
        tbl[key] = cm_id
        cm_id._remote_keys.append((table, key))
        return None

    def _acquire(self, local_id: int, remote_id: int) -> IbCmId | None:
        """``cm_acquire_id``: the id with this local comm ID whose remote ID matches."""
        cm_id = self.ids.get(local_id)
        if cm_id is None or cm_id.remote_id != remote_id:
            return None
        return cm_id

    def _emit(self, event: CmEvent) -> None:
        self._events.append(event)

    def _dispatch(self) -> None:
        """Deliver queued events in order; a consumer calling back in from an event
        queues its own events behind the current ones."""
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self._events:
                self.on_event(self._events.pop(0))
        finally:
            self._dispatching = False

    def _count(self, group: str, mad_or_name: bytes | str) -> None:
        name = mad_or_name if isinstance(mad_or_name, str) else _name_of(mad_or_name)
        self.counters[group][name] = self.counters[group].get(name, 0) + 1

    def _tx(self, mad: bytes, dest: Hashable) -> None:
        self._count("tx", mad)
        self.transmit(mad, dest)

    def _send(self, cm_id: IbCmId, mad: bytes, now: float, *, expect_answer: bool) -> None:
        """Send a MAD for ``cm_id``; one that expects an answer is retransmitted every
        ``cm_id.timeout_ms`` up to ``cm_id.max_cm_retries`` times."""
        if expect_answer:
            cm_id.pending = _Pending(mad, cm_id.dest, cm_id.state, cm_id.timeout_ms,
                                     cm_id.max_cm_retries, now + cm_id.timeout_ms / 1000)
        self._tx(mad, cm_id.dest)

    def _check(self, call: str, cm_id: IbCmId) -> CmState:
        nxt = USER_CALLS[call].get(cm_id.state)
        if nxt is None or cm_id.local_id not in self.ids:
            raise CmStateError(f"{call} is not allowed in {cm_id.state.name}")
        return nxt

    # ---- user calls -----------------------------------------------------------------

    def listen(self, service_id: int, context: Any = None) -> IbCmId:
        """A listening id for ``service_id`` (exact match; ``ib_cm_listen``). A second
        listener on the same service ID is refused (Linux: -EBUSY)."""
        if service_id in self.listeners:
            raise CmStateError(f"service ID {service_id:#x} already has a listener")
        cm_id = self.create_id(context)
        cm_id.state = self._check("listen", cm_id)
        cm_id.service_id = service_id
        self.listeners[service_id] = cm_id
        return cm_id

    def send_req(self, cm_id: IbCmId, *, dest: Hashable, service_id: int,
                 local_qpn: int, starting_psn: int, private_data: bytes = b"",
                 packet_life_time: int = DEFAULT_PACKET_LIFETIME,
                 remote_cm_response_timeout: int = DEFAULT_CM_RESPONSE_TIMEOUT,
                 local_cm_response_timeout: int = DEFAULT_CM_RESPONSE_TIMEOUT,
                 max_cm_retries: int = DEFAULT_MAX_CM_RETRIES, **req_fields: Any) -> None:
        """Send a REQ (``ib_send_cm_req``): IDLE -> REQ_SENT, retransmitted every
        ``2*conv(packet_life_time) + conv(remote_cm_response_timeout)`` ms.
        ``req_fields`` are further REQ fields by name (GIDs, resources, MTU, ...)."""
        now = self.clock()
        nxt = self._check("send_req", cm_id)
        cm_id.dest = dest
        cm_id.service_id = service_id
        cm_id.local_qpn = local_qpn
        cm_id.timeout_ms = (2 * cm_convert_to_ms(packet_life_time)
                            + cm_convert_to_ms(remote_cm_response_timeout))
        cm_id.max_cm_retries = max_cm_retries
        cm_id.av_timeout = packet_life_time + 1  # cm_init_av_by_path
        cm_id.tid = new_tid(cm_id.local_id, self.hi_tid)
        fields = dict(pkey=0xFFFF, primary_local_lid=0xFFFF, primary_remote_lid=0xFFFF,
                      primary_hop_limit=64)
        fields.update(req_fields)
        fields.update(local_comm_id=cm_id.local_id, service_id=service_id,
                      local_ca_guid=self.node_guid, local_qpn=local_qpn,
                      starting_psn=starting_psn,
                      remote_cm_response_timeout=remote_cm_response_timeout,
                      local_cm_response_timeout=local_cm_response_timeout,
                      max_cm_retries=max_cm_retries,
                      primary_local_ack_timeout=cm_ack_timeout(self.ack_delay,
                                                               packet_life_time))
        mad = build_cm(REQ, tid=cm_id.tid, private_data=private_data, **fields)
        cm_id.req = parse_cm(mad)
        cm_id.state = nxt
        self._send(cm_id, mad, now, expect_answer=True)
        self._dispatch()

    def send_rep(self, cm_id: IbCmId, *, local_qpn: int, starting_psn: int,
                 private_data: bytes = b"", **rep_fields: Any) -> None:
        """Accept a REQ (``ib_send_cm_rep``): REQ_RCVD/MRA_REQ_SENT -> REP_SENT,
        retransmitted every conv(REQ local CM response timeout) ms, at most
        conv(:data:`MAX_PEER_CM_TIMEOUT`) = 4096 ms."""
        now = self.clock()
        nxt = self._check("send_rep", cm_id)
        fields = dict(target_ack_delay=self.ack_delay)
        fields.update(rep_fields)
        fields.update(local_comm_id=cm_id.local_id, remote_comm_id=cm_id.remote_id,
                      local_qpn=local_qpn, starting_psn=starting_psn,
                      local_ca_guid=self.node_guid)
        mad = build_cm(REP, tid=cm_id.tid, private_data=private_data, **fields)
        cm_id.local_qpn = local_qpn
        cm_id.rep = parse_cm(mad)
        cm_id.state = nxt
        self._send(cm_id, mad, now, expect_answer=True)
        self._dispatch()

    def send_rtu(self, cm_id: IbCmId, private_data: bytes = b"") -> None:
        """``ib_send_cm_rtu``: REP_RCVD/MRA_REP_SENT -> ESTABLISHED. Not retransmitted;
        resent when a duplicate REP arrives."""
        now = self.clock()
        nxt = self._check("send_rtu", cm_id)
        mad = build_cm(RTU, tid=cm_id.tid, private_data=private_data,
                       local_comm_id=cm_id.local_id, remote_comm_id=cm_id.remote_id)
        cm_id.state = nxt
        cm_id.private_data = bytes(private_data)
        self._send(cm_id, mad, now, expect_answer=False)
        self._dispatch()

    def send_mra(self, cm_id: IbCmId, service_timeout: int,
                 private_data: bytes = b"") -> None:
        """``ib_send_cm_mra``: REQ_RCVD -> MRA_REQ_SENT or REP_RCVD -> MRA_REP_SENT. With
        :data:`MRA_FLAG_DELAY` in ``service_timeout`` no MRA is sent now, only when a
        duplicate arrives (what rdma_cm does with 24 on every REQ)."""
        now = self.clock()
        nxt = self._check("send_mra", cm_id)
        mraed = MsgResponse.REQ if cm_id.state == CmState.REQ_RCVD else MsgResponse.REP
        timeout = service_timeout & ~MRA_FLAG_DELAY & 0x1F
        if not service_timeout & MRA_FLAG_DELAY:
            self._send(cm_id, self._mra(cm_id, mraed, timeout, private_data), now,
                       expect_answer=False)
        cm_id.state = nxt
        cm_id.service_timeout = timeout
        cm_id.private_data = bytes(private_data)
        self._dispatch()

    def _mra(self, cm_id: IbCmId, mraed: MsgResponse, service_timeout: int,
             private_data: bytes) -> bytes:
        return build_cm(MRA, tid=cm_id.tid, private_data=private_data,
                        local_comm_id=cm_id.local_id, remote_comm_id=cm_id.remote_id,
                        message_mraed=mraed, service_timeout=service_timeout)

    def send_rej(self, cm_id: IbCmId, reason: int = RejectReason.CONSUMER_DEFINED,
                 private_data: bytes = b"", ari: bytes = b"") -> None:
        """``ib_send_cm_rej``: reject during connection setup. In the REQ and REP_RCVD
        states the id goes back to IDLE, in REP_SENT/MRA_REP_RCVD to TIMEWAIT."""
        now = self.clock()
        nxt = self._check("send_rej", cm_id)
        mad = self._rej(cm_id, reason, private_data, ari, cm_id.state)
        self._cancel(cm_id)
        self._move(cm_id, nxt, now)
        self._send(cm_id, mad, now, expect_answer=False)
        self._dispatch()

    def _rej(self, cm_id: IbCmId, reason: int, private_data: bytes, ari: bytes,
             state: CmState) -> bytes:
        """``cm_format_rej``: a REJ for ``cm_id`` as the state it was in formats it."""
        if state in (CmState.REQ_RCVD, CmState.MRA_REQ_SENT):
            rejected = MsgResponse.REQ
        elif state in (CmState.REP_RCVD, CmState.MRA_REP_SENT):
            rejected = MsgResponse.REP
        else:
            rejected = MsgResponse.OTHER
        local = 0 if state == CmState.REQ_RCVD else cm_id.local_id
        return build_cm(REJ, tid=cm_id.tid, private_data=private_data,
                        local_comm_id=local, remote_comm_id=cm_id.remote_id,
                        message_rejected=rejected, reason=int(reason),
                        reject_info_length=len(ari), ari=bytes(ari).ljust(72, b"\0"))

    def send_dreq(self, cm_id: IbCmId, private_data: bytes = b"") -> None:
        """``ib_send_cm_dreq``: ESTABLISHED -> DREQ_SENT, retransmitted with the id's
        timeout; DREQ_ERROR and TIMEWAIT when the retries run out."""
        now = self.clock()
        nxt = self._check("send_dreq", cm_id)
        mad = build_cm(DREQ, tid=new_tid(cm_id.local_id, self.hi_tid),
                       private_data=private_data, local_comm_id=cm_id.local_id,
                       remote_comm_id=cm_id.remote_id, remote_qpn=cm_id.remote_qpn)
        cm_id.state = nxt
        self._send(cm_id, mad, now, expect_answer=True)
        self._dispatch()

    def dreq_mad(self, cm_id: IbCmId) -> bytes:
        """The DREQ :meth:`send_dreq` would send for ``cm_id`` now, built and not sent
        (no state changes): what a process's guardian sends for it when the process dies
        without disconnecting (the kernel's part in ``ucma_close``)."""
        return build_cm(DREQ, tid=new_tid(cm_id.local_id, self.hi_tid),
                        local_comm_id=cm_id.local_id, remote_comm_id=cm_id.remote_id,
                        remote_qpn=cm_id.remote_qpn)

    def send_drep(self, cm_id: IbCmId, private_data: bytes = b"") -> None:
        """``ib_send_cm_drep``: DREQ_RCVD -> TIMEWAIT; the DREP is resent when the
        DREQ is."""
        now = self.clock()
        nxt = self._check("send_drep", cm_id)
        cm_id.private_data = bytes(private_data)
        self._move(cm_id, nxt, now)
        self._send(cm_id, self._drep(cm_id), now, expect_answer=False)
        self._dispatch()

    def _drep(self, cm_id: IbCmId) -> bytes:
        return build_cm(DREP, tid=cm_id.tid, private_data=cm_id.private_data,
                        local_comm_id=cm_id.local_id, remote_comm_id=cm_id.remote_id)

    def establish(self, cm_id: IbCmId) -> None:
        """``ib_cm_notify(IB_EVENT_COMM_EST)``: data arrived before the RTU;
        REP_SENT/MRA_REP_RCVD -> ESTABLISHED and USER_ESTABLISHED."""
        nxt = self._check("establish", cm_id)
        self._cancel(cm_id)
        cm_id.state = nxt
        self._emit(CmEvent(CmEventType.USER_ESTABLISHED, cm_id))
        self._dispatch()

    def send_sidr_req(self, cm_id: IbCmId, *, dest: Hashable, service_id: int,
                      private_data: bytes = b"", pkey: int = 0xFFFF,
                      timeout_ms: int = DEFAULT_SIDR_TIMEOUT_MS,
                      max_cm_retries: int = DEFAULT_MAX_CM_RETRIES) -> None:
        """``ib_send_cm_sidr_req``: IDLE -> SIDR_REQ_SENT. The SIDR_REQ's request ID is
        the id's local comm ID; it is retransmitted with the same TID every
        ``timeout_ms`` up to ``max_cm_retries`` times, then SIDR_REQ_ERROR and IDLE."""
        now = self.clock()
        nxt = self._check("send_sidr_req", cm_id)
        cm_id.tid = new_tid(cm_id.local_id, self.hi_tid)
        mad = build_cm(SIDR_REQ, tid=cm_id.tid, private_data=private_data,
                       request_id=cm_id.local_id, pkey=pkey, service_id=service_id)
        cm_id.dest = dest
        cm_id.service_id = service_id
        cm_id.timeout_ms = timeout_ms
        cm_id.max_cm_retries = max_cm_retries
        cm_id.req = parse_cm(mad)
        cm_id.state = nxt
        self._send(cm_id, mad, now, expect_answer=True)
        self._dispatch()

    def send_sidr_rep(self, cm_id: IbCmId, *, status: int = SidrStatus.SUCCESS,
                      qpn: int = 0, qkey: int = 0, private_data: bytes = b"",
                      info: bytes = b"") -> None:
        """``ib_send_cm_sidr_rep``: answer a SIDR_REQ (SIDR_REQ_RCVD -> IDLE) with its
        request ID, service ID and TID echoed; ``qpn``/``qkey`` are the service's UD QP
        (rdma_cm: Q_Key 0x01234567), ``info`` the additional information (72 bytes at
        most). The id no longer claims the request: a later SIDR_REQ with the same
        request ID is a new one."""
        now = self.clock()
        nxt = self._check("send_sidr_rep", cm_id)
        if len(info) > 72:
            raise ValueError(f"SIDR_REP carries at most 72 bytes of additional "
                             f"information, got {len(info)}")
        mad = build_cm(SIDR_REP, tid=cm_id.tid, private_data=private_data,
                       request_id=cm_id.remote_id, status=int(status), qpn=qpn,
                       service_id=cm_id.service_id, qkey=qkey,
                       additional_info_length=len(info),
                       additional_info=bytes(info).ljust(72, b"\0"))
        self._move(cm_id, nxt, now)  # drops the (request ID, peer) key
        self._send(cm_id, mad, now, expect_answer=False)
        self._dispatch()

    def destroy(self, cm_id: IbCmId, err: int = 0) -> None:
        """``ib_destroy_cm_id``: say goodbye as Linux does for the state (REJ TIMEOUT
        with our GUID as ARI while a REQ is out, REJ 28 during setup, DREQ or DREP once
        connected, SIDR_REP REJECT (2) to a SIDR_REQ not answered yet; a SIDR_REQ out is
        just cancelled), then forget the id. No events follow.

        ``err`` is what the consumer's event handler returned (``cm_destroy_id``):
        ``-ENOMEM`` on a REQ not answered yet (REQ_RCVD) means no room for it, and the
        REQ is forgotten without a REJ so that the peer's retransmission may find room;
        it is counted in ``counters['listen_overflow']``, as is a SIDR_REQ refused so."""
        st = cm_id.state
        if err == -errno.ENOMEM and st in (CmState.REQ_RCVD, CmState.SIDR_REQ_RCVD):
            self._count("listen_overflow", "REQ" if st == CmState.REQ_RCVD else "SIDR_REQ")
        if st == CmState.REQ_RCVD and err == -errno.ENOMEM:
            pass  # cm_reset_to_idle below: "Do not reject to allow future retries"
        elif st == CmState.LISTEN:
            self.listeners.pop(cm_id.service_id, None)
        elif st == CmState.SIDR_REQ_SENT:
            self._cancel(cm_id)
        elif st == CmState.SIDR_REQ_RCVD:
            self.send_sidr_rep(cm_id, status=SidrStatus.REJECT)
        elif st in (CmState.REQ_SENT, CmState.MRA_REQ_RCVD):
            self._cancel(cm_id)
            self.send_rej(cm_id, RejectReason.TIMEOUT,
                          ari=self.node_guid.to_bytes(8, "big"))
        elif st in (CmState.REQ_RCVD, CmState.REP_SENT, CmState.MRA_REP_RCVD,
                    CmState.MRA_REQ_SENT, CmState.REP_RCVD, CmState.MRA_REP_SENT):
            self._cancel(cm_id)
            self.send_rej(cm_id, RejectReason.CONSUMER_DEFINED)
        elif st == CmState.ESTABLISHED:
            self.send_dreq(cm_id)
        elif st == CmState.DREQ_RCVD:
            self.send_drep(cm_id)
        self._cancel(cm_id)
        self._remove_remote(cm_id)
        cm_id.timewait_deadline = None
        cm_id.state = CmState.IDLE
        self.ids.pop(cm_id.local_id, None)
        self._dispatch()

    # ---- received MADs --------------------------------------------------------------

    def on_mad(self, mad: bytes | bytearray | memoryview, src: Hashable) -> None:
        """Process one received CM MAD from ``src`` (an address answers go back to).
        MADs the CM does not take (not 256 bytes, wrong class, LAP/APR, ...) are counted
        in ``counters['dropped']`` and ignored."""
        now = self.clock()
        try:
            msg = parse_cm(mad)
        except MadError as e:
            self._count("dropped", e.reason)
            return
        self._count("rx", msg.name)
        handler = getattr(self, f"_on_{msg.name.lower()}", None)
        if handler is not None:
            handler(msg, src, now)
        self._dispatch()

    def _answer(self, mtype: MessageType, msg: CMMessage, src: Hashable, **fields: Any
                ) -> None:
        """A reply not tied to an id (``cm_issue_rej``, ``cm_issue_drep``): the received
        TID echoed and its comm IDs swapped."""
        raw = msg.pack()
        their_local = int.from_bytes(raw[24:28], "big")
        their_remote = int.from_bytes(raw[28:32], "big")  # whatever the bytes hold
        self._tx(build_cm(mtype, tid=msg.tid, local_comm_id=their_remote,
                          remote_comm_id=their_local, **fields), src)

    def _on_req(self, msg: CMMessage, src: Hashable, now: float) -> None:
        guid = msg.local_ca_guid
        dup = self._remote_ids.get((msg.local_comm_id, guid))
        if dup is not None:  # cm_dup_req_handler
            self._count("rx_duplicates", "REQ")
            if dup.state == CmState.MRA_REQ_SENT:
                self._tx(self._mra(dup, MsgResponse.REQ, dup.service_timeout,
                                   dup.private_data), src)
            elif dup.state == CmState.TIMEWAIT:
                self._tx(self._rej(dup, RejectReason.STALE_CONN, b"", b"", CmState.TIMEWAIT),
                         src)
            return
        stale = self._remote_qpns.get((msg.local_qpn, guid))
        if stale is not None:
            self._answer(REJ, msg, src, message_rejected=MsgResponse.REQ,
                         reason=RejectReason.STALE_CONN)
            if stale.state == CmState.ESTABLISHED:
                self.send_dreq(stale)
            return
        listener = self.listeners.get(msg.service_id)
        if listener is None:
            self._answer(REJ, msg, src, message_rejected=MsgResponse.REQ,
                         reason=RejectReason.INVALID_SERVICE_ID)
            return
        cm_id = self.create_id(listener.context)
        cm_id.remote_id = msg.local_comm_id
        cm_id.service_id = msg.service_id
        cm_id.tid = msg.tid
        cm_id.dest = src
        cm_id.timeout_ms = peer_timeout_ms(msg.local_cm_response_timeout)  # capped
        cm_id.max_cm_retries = msg.max_cm_retries  # 4 bits: at most 15
        cm_id.remote_qpn = msg.local_qpn
        cm_id.remote_ca_guid = guid
        t = msg.primary_local_ack_timeout  # packet lifetime = t - 1; av timeout = lifetime + 1
        cm_id.av_timeout = (t - (t > 0)) + 1
        cm_id.req = msg
        cm_id.state = CmState.REQ_RCVD
        self._insert_remote("id", (cm_id.remote_id, guid), cm_id)
        self._insert_remote("qpn", (cm_id.remote_qpn, guid), cm_id)
        self._emit(CmEvent(CmEventType.REQ_RECEIVED, cm_id, msg, msg.private_data,
                           listen_id=listener))

    def _on_rep(self, msg: CMMessage, src: Hashable, now: float) -> None:
        cm_id = self._acquire(msg.remote_comm_id, 0)
        if cm_id is None:  # cm_dup_rep_handler
            cm_id = self._acquire(msg.remote_comm_id, msg.local_comm_id)
            if cm_id is None:
                return
            self._count("rx_duplicates", "REP")
            if cm_id.state == CmState.ESTABLISHED:
                self._tx(build_cm(RTU, tid=cm_id.tid, private_data=cm_id.private_data,
                                  local_comm_id=cm_id.local_id,
                                  remote_comm_id=cm_id.remote_id), src)
            elif cm_id.state == CmState.MRA_REP_SENT:
                self._tx(self._mra(cm_id, MsgResponse.REP, cm_id.service_timeout,
                                   cm_id.private_data), src)
            return
        nxt = ON_RECEIVE["REP"].get(cm_id.state)
        if nxt is None:
            return
        guid = msg.local_ca_guid
        if self._insert_remote("id", (msg.local_comm_id, guid), cm_id) is not None:
            return  # another id already talks to this remote comm ID
        stale = self._insert_remote("qpn", (msg.local_qpn, guid), cm_id)
        if stale is not None:
            self._remove_remote(cm_id)
            self._answer(REJ, msg, src, message_rejected=MsgResponse.REP,
                         reason=RejectReason.STALE_CONN)
            if stale.state == CmState.ESTABLISHED:
                self.send_dreq(stale)
            return
        cm_id.remote_id = msg.local_comm_id
        cm_id.remote_qpn = msg.local_qpn
        cm_id.remote_ca_guid = guid
        cm_id.av_timeout = cm_ack_timeout(msg.target_ack_delay, cm_id.av_timeout - 1)
        cm_id.rep = msg
        cm_id.state = nxt
        self._cancel(cm_id)
        self._emit(CmEvent(CmEventType.REP_RECEIVED, cm_id, msg, msg.private_data))

    def _on_rtu(self, msg: CMMessage, src: Hashable, now: float) -> None:
        cm_id = self._acquire(msg.remote_comm_id, msg.local_comm_id)
        if cm_id is None:
            return
        nxt = ON_RECEIVE["RTU"].get(cm_id.state)
        if nxt is None:
            self._count("rx_duplicates", "RTU")
            return
        cm_id.state = nxt
        self._cancel(cm_id)
        self._emit(CmEvent(CmEventType.RTU_RECEIVED, cm_id, msg, msg.private_data))

    def _on_mra(self, msg: CMMessage, src: Hashable, now: float) -> None:
        mraed = msg.message_mraed
        if mraed == MsgResponse.REQ:
            cm_id = self._acquire(msg.remote_comm_id, 0)
        elif mraed in (MsgResponse.REP, MsgResponse.OTHER):
            cm_id = self._acquire(msg.remote_comm_id, msg.local_comm_id)
        else:
            return
        if cm_id is None:
            return
        key = {MsgResponse.REQ: "MRA_REQ", MsgResponse.REP: "MRA_REP"}.get(mraed)
        nxt = ON_RECEIVE[key].get(cm_id.state) if key else None
        if nxt is None or cm_id.pending is None:
            if cm_id.state in (CmState.MRA_REQ_RCVD, CmState.MRA_REP_RCVD):
                self._count("rx_duplicates", "MRA")
            return
        timeout = (cm_convert_to_ms(min(msg.service_timeout, MAX_PEER_MRA_TIMEOUT))
                   + peer_timeout_ms(cm_id.av_timeout))
        p = cm_id.pending  # ib_modify_mad: restart the wait, and retries use it too
        p.timeout_ms = timeout
        p.deadline = now + timeout / 1000
        p.state = nxt
        cm_id.state = nxt
        self._emit(CmEvent(CmEventType.MRA_RECEIVED, cm_id, msg, msg.private_data,
                           service_timeout=msg.service_timeout))

    def _on_rej(self, msg: CMMessage, src: Hashable, now: float) -> None:
        if msg.reason == RejectReason.TIMEOUT:  # ARI holds the sender's GUID
            guid = int.from_bytes(msg.ari[:8], "big")
            cm_id = self._remote_ids.get((msg.local_comm_id, guid))
        elif msg.message_rejected == MsgResponse.REQ:
            cm_id = self._acquire(msg.remote_comm_id, 0)
        else:
            cm_id = self._acquire(msg.remote_comm_id, msg.local_comm_id)
        if cm_id is None:
            return
        nxt = ON_RECEIVE["REJ"].get(cm_id.state)
        if nxt is None:
            return
        if nxt == CmState.IDLE and msg.reason == RejectReason.STALE_CONN:
            nxt = CmState.TIMEWAIT
        self._cancel(cm_id)
        self._move(cm_id, nxt, now)
        self._emit(CmEvent(CmEventType.REJ_RECEIVED, cm_id, msg, msg.private_data,
                           reason=msg.reason, ari=msg.ari[:msg.reject_info_length]))

    def _on_dreq(self, msg: CMMessage, src: Hashable, now: float) -> None:
        cm_id = self._acquire(msg.remote_comm_id, msg.local_comm_id)
        if cm_id is None:  # cm_issue_drep
            self._count("rx_duplicates", "DREQ")
            self._answer(DREP, msg, src)
            return
        if cm_id.local_qpn != msg.remote_qpn:
            return
        if cm_id.state == CmState.TIMEWAIT:  # our DREP was lost: send it again
            self._count("rx_duplicates", "DREQ")
            self._tx(self._drep(cm_id), src)
            return
        if cm_id.state == CmState.DREQ_RCVD:
            self._count("rx_duplicates", "DREQ")
            return
        nxt = ON_RECEIVE["DREQ"].get(cm_id.state)
        if nxt is None:
            return
        self._cancel(cm_id)
        cm_id.state = nxt
        cm_id.tid = msg.tid
        self._emit(CmEvent(CmEventType.DREQ_RECEIVED, cm_id, msg, msg.private_data))

    def _on_drep(self, msg: CMMessage, src: Hashable, now: float) -> None:
        cm_id = self._acquire(msg.remote_comm_id, msg.local_comm_id)
        if cm_id is None:
            return
        nxt = ON_RECEIVE["DREP"].get(cm_id.state)
        if nxt is None:
            return
        self._cancel(cm_id)
        self._move(cm_id, nxt, now)
        self._emit(CmEvent(CmEventType.DREP_RECEIVED, cm_id, msg, msg.private_data))

    def _on_sidr_req(self, msg: CMMessage, src: Hashable, now: float) -> None:
        """``cm_sidr_req_handler``: a duplicate of a SIDR_REQ still being processed is
        dropped; with no listener the answer is SIDR_REP UNSUPPORTED (and no id stays);
        otherwise a new id in SIDR_REQ_RCVD and SIDR_REQ_RECEIVED."""
        key = (msg.request_id, self.peer_key(src))
        if key in self._remote_sidr:
            self._count("rx_duplicates", "SIDR_REQ")
            return
        listener = self.listeners.get(msg.service_id)
        if listener is None:  # cm_reject_sidr_req(IB_SIDR_UNSUPPORTED)
            self._tx(build_cm(SIDR_REP, tid=msg.tid, request_id=msg.request_id,
                              status=SidrStatus.UNSUPPORTED, service_id=msg.service_id),
                     src)
            return
        cm_id = self.create_id(listener.context)
        cm_id.remote_id = msg.request_id
        cm_id.service_id = msg.service_id
        cm_id.tid = msg.tid
        cm_id.dest = src
        cm_id.req = msg
        cm_id.state = CmState.SIDR_REQ_RCVD
        self._insert_remote("sidr", key, cm_id)
        self._emit(CmEvent(CmEventType.SIDR_REQ_RECEIVED, cm_id, msg, msg.private_data,
                           listen_id=listener, source=src))

    def _on_sidr_rep(self, msg: CMMessage, src: Hashable, now: float) -> None:
        """``cm_sidr_rep_handler``: the id whose local comm ID is the request ID (and
        has no remote ID), in SIDR_REQ_SENT; anything else is dropped."""
        cm_id = self._acquire(msg.request_id, 0)
        nxt = ON_RECEIVE["SIDR_REP"].get(cm_id.state) if cm_id is not None else None
        if cm_id is None or nxt is None:
            self._count("dropped", "unmatched_sidr_rep")
            return
        self._cancel(cm_id)
        self._move(cm_id, nxt, now)
        self._emit(CmEvent(CmEventType.SIDR_REP_RECEIVED, cm_id, msg, msg.private_data,
                           status=msg.status))


def reply_without_consumer(mad: bytes | bytearray | memoryview) -> bytes | None:
    """What Linux's CM answers when a MAD finds no consumer on the port (the CM runs on
    every port, whether or not anyone listens): a REQ gets REJ 8 (invalid service ID,
    ``cm_issue_rej``), a SIDR_REQ a SIDR_REP with status 1 (unsupported), a DREQ a DREP
    (``cm_issue_drep``), each echoing the TID; anything else no answer (None)."""
    try:
        msg = parse_cm(mad)
    except MadError:
        return None
    raw = msg.pack()
    their_local = int.from_bytes(raw[24:28], "big")
    their_remote = int.from_bytes(raw[28:32], "big")
    if msg.name == "REQ":
        return build_cm(REJ, tid=msg.tid, local_comm_id=their_remote,
                        remote_comm_id=their_local, message_rejected=MsgResponse.REQ,
                        reason=RejectReason.INVALID_SERVICE_ID)
    if msg.name == "SIDR_REQ":
        return build_cm(SIDR_REP, tid=msg.tid, request_id=msg.request_id,
                        status=SidrStatus.UNSUPPORTED, service_id=msg.service_id)
    if msg.name == "DREQ":
        return build_cm(DREP, tid=msg.tid, local_comm_id=their_remote,
                        remote_comm_id=their_local)
    return None


def _name_of(mad: bytes) -> str:
    attr = int.from_bytes(mad[16:18], "big")
    try:
        return AttrId(attr).name
    except ValueError:
        return str(attr)
