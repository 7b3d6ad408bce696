"""What the protocol core needs from the layers above it, declared as Protocols.

The core (:mod:`softrdma.qp`) never imports the soft device or the verbs API: a
:class:`~softrdma.qp.engine.QpEngine` is handed objects that satisfy these Protocols when
it is created, exactly as rxe's QP code calls into its device (``rxe_xmit_packet``,
``rxe_counter_inc``) and into the CQ and SRQ it was created with. The soft device and
the verbs objects implement them; a test can implement them in a few lines
(``tests/test_engine_seam.py`` drives two engines with no verbs object at all).
"""

from __future__ import annotations

from typing import Any, Protocol

from ..completion import WC
from .memory import KeyTable
from .wqe import RecvWqe

__all__ = ["CompletionSink", "RecvSource", "DeviceServices", "AttrView", "PathView"]


class CompletionSink(Protocol):
    """A completion queue, as the engines see it (rxe_cq_post)."""

    def push(self, wc: WC, solicited: bool = False) -> bool:
        """Queue ``wc``; False if it could not be queued (the CQ overflowed or is gone)."""
        ...


class RecvSource(Protocol):
    """A shared receive queue, as the responder sees it."""

    closed: bool

    def take(self) -> RecvWqe | None:
        """The next posted receive, or None (the responder then answers RNR)."""
        ...


class PathView(Protocol):
    """A resolved address vector (``QpEngine.set_av``, a UD WQE's ``av``), as rxe's
    ``rxe_av``: where packets go and the IP header fields rxe takes from it."""

    dst_ip: bytes  # 4 or 16 bytes
    flow_label: int  # the UDP source port of an RC/UC QP is derived from it
    traffic_class: int  # the IPv4 TOS / IPv6 traffic class of every packet


class DeviceServices(Protocol):
    """The handful of device services a QP's engine uses."""

    name: str
    counters: Any  # softrdma.counters.Counters
    keys: KeyTable  # every memory access goes through it
    active_mtu: int  # the port's MTU (UD QPs use it)
    limits: Any  # rxe's device limits
    trace: Any  # a softrdma.trace.Tracer while tracing, else None (test it before emitting)
    # Optional: True if send_packet takes a packet as a list of buffers (softrdma.wire.iov);
    # the engines read it with getattr(device, "zero_copy", False)
    zero_copy: bool

    @property
    def now(self) -> float:
        """The time, in seconds (a virtual clock in simulation)."""
        ...

    def send_packet(self, qp: Any, pkt: bytearray | list, dst_ip: bytes | None,
                    tos: int = 0) -> None:
        """Fill the ICRC of ``pkt`` (BTH..ICRC: one bytearray, or a list of buffers when
        ``zero_copy``) for ``qp``'s path and transmit it with the path's traffic class
        ``tos`` (the IP TOS)."""
        ...

    def timer_changed(self, qp: Any) -> None:
        """``qp.deadline`` changed: wake the engine at the new time."""
        ...

    def schedule_responder(self, qp: Any) -> None:
        """``qp``'s responder has more to send than one pass may (a long READ's response):
        call ``qp.run_responder()`` on the device's next pass, once what is queued has
        left (rxe reschedules the QP's responder task). Asking twice before that pass
        counts once."""
        ...

    def emit_async(self, event: Any) -> None:
        """Deliver an asynchronous event (about ``event.element``) to its context."""
        ...


class AttrView(Protocol):
    """The QP attributes the engines read (a verbs ``QPAttr`` satisfies it)."""

    qp_state: int
    cur_qp_state: int
    qp_access_flags: int
    qkey: int
    path_mtu: int
    dest_qp_num: int
    timeout: int
    retry_cnt: int
    rnr_retry: int
    min_rnr_timer: int
    max_rd_atomic: int
    max_dest_rd_atomic: int
    en_sqd_async_notify: int
