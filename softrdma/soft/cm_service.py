"""The CM on a soft device: a :class:`~softrdma.cm.state.CmAgent` wired to QP1 and timers.

The agent (``softrdma.cm.state``) is sans-IO; :class:`CmService` gives it the three
things a device has (docs/cm.md, "The CM on a device"):

* **MADs in**: the service registers itself as the device's MAD handler
  (:meth:`SoftDevice.set_mad_handler`), so every CM MAD QP1 accepts reaches
  :meth:`CmAgent.on_mad`, with the :class:`~softrdma.soft.gsi.MadSource` as the address
  answers go back to;
* **MADs out**: the agent's :class:`~softrdma.cm.state.CmTransmit` is
  :meth:`SoftDevice.send_mad`. A destination is a ``MadSource`` (answers: its source IP
  and source QP), an ``(ip, qpn)`` pair, or an IP address (QP 1). MADs the agent sends
  while it runs are queued and sent when it returns, so a MAD a device sends to itself
  is never delivered into the middle of the agent;
* **time**: the service looks like a QP engine to the device's timers (``deadline``,
  ``on_timer(now)``, ``closed``; :meth:`SoftDevice.timer_changed` after every call into
  the agent), so the progress thread of a live device retransmits REQ/REP/DREQ/SIDR_REQ
  and ends TIMEWAIT on time, and :meth:`SoftDevice.progress` does it on a manual device.

Every call into the agent holds the device lock. Events (:class:`~softrdma.cm.state.CmEvent`)
go to ``on_event`` if one is given -- called with the device lock held, usually on the
progress thread, so it must not block (it may call back into the service) -- and
otherwise into a queue read with :meth:`CmService.get_event`.
"""

from __future__ import annotations

import queue
from typing import Any, Callable, Hashable

from ..cm.state import CmAgent, CmEvent, CmState, IbCmId
from .gsi import MadSource

__all__ = ["CmService"]


def mad_address(dest: Hashable) -> tuple[str, int]:
    """``(ip, qpn)`` of a CM destination: a MadSource, an (ip, qpn) pair or an IP."""
    if isinstance(dest, MadSource):
        return dest.src_ip, dest.src_qp
    if isinstance(dest, tuple):
        ip, qpn = dest
        return str(ip), int(qpn)
    return str(dest), 1


class CmService:
    """The IB CM of one soft device (one port): ``CmService(device)``.

    ``id_operand`` and ``hi_tid`` default to random 32-bit values from the device's
    secret random source (seeded devices give reproducible comm IDs and TIDs).

    :attr:`watchers` (process-wide) are called with the service after every call into
    its agent, device lock held: the states of its ids may have changed (``softrdma
    exec`` keeps its guardian's list of connections to disconnect current)."""

    watchers: list[Callable[["CmService"], None]] = []

    def __init__(self, device: Any, on_event: Callable[[CmEvent], Any] | None = None, *,
                 id_operand: int | None = None, hi_tid: int | None = None) -> None:
        self.device = device
        self.closed = False
        self.events: "queue.Queue[CmEvent]" = queue.Queue()
        self._user_event = on_event
        self._outbox: list[tuple[bytes, Hashable]] = []
        self._depth = 0
        rng = device.secret_rng
        self.agent = CmAgent(
            int.from_bytes(bytes(device.node_guid), "big"), self._transmit, self._on_event,
            clock=lambda: device.now,
            id_operand=rng.getrandbits(32) if id_operand is None else id_operand,
            hi_tid=rng.getrandbits(32) if hi_tid is None else hi_tid,
            ack_delay=device.limits.local_ca_ack_delay,
            peer_key=mad_address)  # SIDR_REQ duplicates: same (IP, QPN), whatever the PSN
        with device.lock:
            if device.gsi.handler is not None:
                raise RuntimeError(f"device {device.name} already has a MAD handler")
            device.set_mad_handler(self._on_mad)

    # ---- the device's side ----------------------------------------------------------

    @property
    def deadline(self) -> float | None:
        """The agent's next timer (the device's progress reads it)."""
        return None if self.closed else self.agent.deadline

    def on_timer(self, now: float) -> None:
        """Called by the device's ``fire_timers`` (device lock held)."""
        self._run(self.agent.on_timer, now)

    def _on_mad(self, mad: bytes, source: MadSource) -> None:
        if self.closed:
            return
        self._run(self.agent.on_mad, mad, source)

    def _transmit(self, mad: bytes, dest: Hashable) -> None:
        self._outbox.append((mad, dest))

    def _on_event(self, event: CmEvent) -> None:
        if self._user_event is not None:
            self._user_event(event)
        else:
            self.events.put(event)

    def _run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Call into the agent under the device lock; then send what it queued and tell
        the device's timers about the agent's deadline."""
        dev = self.device
        with dev.lock:
            self._depth += 1
            try:
                return fn(*args, **kw)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._flush()
                    dev.timer_changed(self)
                    for watch in CmService.watchers:
                        watch(self)

    def _flush(self) -> None:
        while self._outbox:
            mad, dest = self._outbox.pop(0)
            ip, qpn = mad_address(dest)
            self.device.send_mad(mad, ip, qpn)

    # ---- the consumer's side --------------------------------------------------------

    @property
    def now(self) -> float:
        return self.device.now

    @property
    def counters(self) -> dict[str, dict[str, int]]:
        """The CM's counters by group and message (:attr:`CmAgent.counters`: ``tx``,
        ``rx``, ``tx_retries``, ``rx_duplicates``, ``dropped``, ``listen_overflow``)."""
        return self.agent.counters

    @property
    def id_count(self) -> int:
        """How many CM ids the service holds (listeners included)."""
        return len(self.agent.ids)

    def get_event(self, timeout: float | None = None) -> CmEvent:
        """The next event (without an ``on_event`` callback); ``queue.Empty`` on timeout."""
        return self.events.get(timeout=timeout)

    def listen(self, service_id: int, context: Any = None) -> IbCmId:
        return self._run(self.agent.listen, service_id, context)

    def connect(self, dest: Hashable, *, service_id: int, local_qpn: int, starting_psn: int,
                private_data: bytes = b"", context: Any = None, **req: Any) -> IbCmId:
        """A new id and its REQ to ``dest`` (an IP, or (ip, qpn)); ``req`` are further
        :meth:`CmAgent.send_req` arguments (timeouts, retries, REQ fields)."""
        def go() -> IbCmId:
            cm_id = self.agent.create_id(context)
            self.agent.send_req(cm_id, dest=dest, service_id=service_id,
                                local_qpn=local_qpn, starting_psn=starting_psn,
                                private_data=private_data, **req)
            return cm_id
        return self._run(go)

    def accept(self, cm_id: IbCmId, *, local_qpn: int, starting_psn: int,
               private_data: bytes = b"", **rep: Any) -> None:
        """Answer a REQ with a REP."""
        self._run(lambda: self.agent.send_rep(cm_id, local_qpn=local_qpn,
                                              starting_psn=starting_psn,
                                              private_data=private_data, **rep))

    def ready_to_use(self, cm_id: IbCmId, private_data: bytes = b"") -> None:
        """Answer a REP with an RTU."""
        self._run(lambda: self.agent.send_rtu(cm_id, private_data))

    def reject(self, cm_id: IbCmId, reason: int | None = None, private_data: bytes = b"",
               ari: bytes = b"") -> None:
        kw: dict[str, Any] = {"private_data": private_data, "ari": ari}
        if reason is not None:
            kw["reason"] = reason
        self._run(lambda: self.agent.send_rej(cm_id, **kw))

    def send_mra(self, cm_id: IbCmId, service_timeout: int, private_data: bytes = b"") -> None:
        self._run(lambda: self.agent.send_mra(cm_id, service_timeout,
                                              private_data))

    def disconnect(self, cm_id: IbCmId, private_data: bytes = b"") -> None:
        """Send a DREQ."""
        self._run(lambda: self.agent.send_dreq(cm_id, private_data))

    def disconnect_reply(self, cm_id: IbCmId, private_data: bytes = b"") -> None:
        """Answer a DREQ with a DREP."""
        self._run(lambda: self.agent.send_drep(cm_id, private_data))

    def sidr_request(self, dest: Hashable, *, service_id: int, private_data: bytes = b"",
                     context: Any = None, **kw: Any) -> IbCmId:
        """A new id and its SIDR_REQ to ``dest`` (an IP, or (ip, qpn)); ``kw`` are further
        :meth:`CmAgent.send_sidr_req` arguments (``timeout_ms``, ``max_cm_retries``,
        ``pkey``). The answer is a SIDR_REP_RECEIVED (or SIDR_REQ_ERROR) event."""
        def go() -> IbCmId:
            cm_id = self.agent.create_id(context)
            self.agent.send_sidr_req(cm_id, dest=dest, service_id=service_id,
                                     private_data=private_data, **kw)
            return cm_id
        return self._run(go)

    def sidr_reply(self, cm_id: IbCmId, *, status: int = 0, qpn: int = 0, qkey: int = 0,
                   private_data: bytes = b"", info: bytes = b"") -> None:
        """Answer a SIDR_REQ_RECEIVED with a SIDR_REP (status 0: success, with the UD
        QP's number and Q_Key)."""
        self._run(lambda: self.agent.send_sidr_rep(cm_id, status=status, qpn=qpn,
                                                   qkey=qkey, private_data=private_data,
                                                   info=info))

    def establish(self, cm_id: IbCmId) -> None:
        self._run(lambda: self.agent.establish(cm_id))

    def destroy(self, cm_id: IbCmId, err: int = 0) -> None:
        """Forget ``cm_id`` saying goodbye as its state asks (:meth:`CmAgent.destroy`);
        ``err=-ENOMEM`` on a request not answered yet: no room, forgotten without a REJ."""
        self._run(lambda: self.agent.destroy(cm_id, err))

    def established(self) -> list[IbCmId]:
        """The ids whose connection is ESTABLISHED now (device lock held by the caller,
        or a snapshot that may be stale)."""
        return [c for c in list(self.agent.ids.values()) if c.state == CmState.ESTABLISHED]

    def holds(self, cm_id: IbCmId) -> bool:
        """Whether ``cm_id`` is still one of this service's ids (not destroyed, and not
        dropped by the agent when a connection ended)."""
        return self.agent.ids.get(cm_id.local_id) is cm_id

    def close(self) -> None:
        """Destroy every id (saying goodbye as :meth:`CmAgent.destroy` does), stop the
        timers and unregister the MAD handler. Idempotent."""
        dev = self.device
        with dev.lock:
            if self.closed:
                return
            for cm_id in list(self.agent.ids.values()):
                self.destroy(cm_id)
            self.closed = True
            dev.timer_changed(self)  # closed: the deadline is None, the timer goes
            if dev.gsi.handler == self._on_mad:
                dev.set_mad_handler(None)

    def __enter__(self) -> "CmService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
