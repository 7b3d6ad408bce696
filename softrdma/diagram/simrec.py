"""Diagrams of a run on the simulated network, with the truth about every packet.

    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.diagram.simrec import SimRecorder

    net = SimNetwork(seed=3, loss=0.2)
    with SimRecorder(net, "WRITE over a lossy link") as rec:
        a, b = connected_pair(net, "RC")
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 4096), wr_id=1, remote_offset=0)
        net.run_until(lambda: len(a.cq) > 0)
        rec.poll(a)                       # poll the CQ, and note the completions
    rec.diagram                           # -> render with softrdma.diagram.html.render

A capture sees a packet only where it was taken; :class:`~softrdma.harness.sim.SimNetwork`
*decides* each packet's fate, and tells its observers (``net.observers``). So this
recorder knows what no capture can: which packets were lost (an arrow that ends in an X),
which were delivered twice (a second arrow, ``duplicate``), delayed past later ones, or
corrupted (``bad-icrc``: the receiver's ICRC check drops it). Times are the network's
virtual clock, so an arrow's slope is the delay it really had.

Notes on the lanes:

* QP state changes, e.g. ``RTS`` when the run starts and ``ERR`` after retries run out.
  The recorder compares each QP's state at every network event, so a change is noted at
  the first event after it (virtual time stands still between events, so that is the
  time it happened unless a verbs call changed it between two ``run`` calls);
* timers: ``retransmit timer`` or ``RNR timer`` when a QP's timer fires;
* completions, when the caller passes the polled work completions (:meth:`poll`,
  :meth:`completions`): a CQ is the application's, and polling it is not the network's
  business.
"""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from typing import Any, Iterable

from ..harness.sim import SimEvent, SimNetwork
from ..wire.opcodes import Transport
from ..wire.packet import DecodeError, parse
from .describe import arrow_of, completion_text, record_of_roce, state_text
from .marks import Marker
from .model import Arrow, Diagram, Kind, Lane, Note

__all__ = ["SimRecorder"]


def _ip(b: bytes) -> str:
    return str(ipaddress.ip_address(b))


class SimRecorder:
    """Watch ``net`` (from now until :meth:`close`) and build :attr:`diagram`."""

    def __init__(self, net: SimNetwork, title: str = "simulated run") -> None:
        self.net = net
        self.diagram = Diagram(title)
        self._marker = Marker()
        self._copies: dict[int, Arrow] = {}  # SimCopy.seq -> its arrow, until delivered
        self._states: dict[tuple[str, int], int] = {}
        self._count = 0
        net.observers.append(self._on_event)

    # -- the observer --------------------------------------------------------------------
    def _on_event(self, ev: SimEvent) -> None:
        self.check(ev.time)
        if ev.kind == "send":
            self._on_send(ev)
        elif ev.kind == "deliver":
            a = self._copies.pop(ev.seq, None)
            if a is not None:
                a.recv_time = ev.time
        elif ev.kind == "timer":
            self._on_timer(ev.time)

    def _lanes(self, ev: SimEvent, roce: bytes) -> tuple[Lane, Lane]:
        """The sender's and receiver's lanes. The BTH names the destination QP only; the
        sender is the QP of the sending device connected to it (RC/UC: its destination
        QP number and address), or the DETH's source QP (UD)."""
        p = parse(roce)
        src_ip, dst_ip = _ip(ev.src), _ip(ev.dst)
        dst = Lane(dst_ip, p.dest_qp)
        src_qpn = p.src_qp if p.info.transport == Transport.UD else self._sender(ev, p.dest_qp)
        return Lane(src_ip, src_qpn), dst

    def _sender(self, ev: SimEvent, dest_qp: int) -> int | None:
        dev = self.net.devices.get(ev.src)
        if dev is None:
            return None
        for qpn, eng in dev.qps.items():
            if eng.attr.dest_qp_num == dest_qp and eng.dst_ip == ev.dst:
                return qpn
        return None

    def _arrow(self, data: bytes, ev: SimEvent, src: Lane, dst: Lane) -> Arrow:
        a = arrow_of(record_of_roce(data, ev.src, ev.dst, ev.sport, self._count, ev.time),
                     src, dst, ev.time, None)
        a.frame = None  # a simulated packet has no frame number
        return a

    def _on_send(self, ev: SimEvent) -> None:
        src, dst = self._lanes(ev, ev.data)
        self.diagram.lane(src.ip, src.qpn)
        self.diagram.lane(dst.ip, dst.qpn)
        self._count += 1
        first = self._arrow(ev.data, ev, src, dst)
        self._marker.mark(first)
        if not ev.copies:
            first.kind = Kind.LOST
            if ev.unroutable:
                first.detail += " (unroutable: no device has that address)"
            self.diagram.arrows.append(first)
            return
        for i, c in enumerate(ev.copies):
            a = first if i == 0 else replace(first, kind=Kind.DUPLICATE)
            if c.corrupted:  # the receiver's ICRC check will drop it
                try:  # drawn as it arrived: the flipped bit may be in a label field
                    a = replace(self._arrow(c.data, ev, src, dst), retransmit=first.retransmit)
                except DecodeError as e:  # a flip that leaves no RoCE packet at all
                    a = replace(first, kind=Kind.BAD_ICRC,
                                detail=f"{first.detail} (corrupted: {e})")
            if c.reordered:
                a.detail += " (held back: reordered)"
            a.recv_time = c.arrival  # the deliver event confirms it
            self._copies[c.seq] = a
            self.diagram.arrows.append(a)

    def _on_timer(self, t: float) -> None:
        for ip, qpn, eng in self._qps():
            for attr, what in (("retrans_at", "retransmit timer"), ("rnr_at", "RNR timer")):
                at = getattr(eng, attr)
                if at is not None and at <= t:
                    self.note((ip, qpn), t, what + " fired", "timer")

    def _qps(self) -> Iterable[tuple[str, int, Any]]:
        for dev in self.net.devices.values():
            for qpn, eng in list(dev.qps.items()):
                yield dev.ip, qpn, eng

    # -- what the caller may add ---------------------------------------------------------
    def check(self, t: float | None = None) -> None:
        """Note every QP whose state changed since the last look (at ``t``, default now)."""
        t = self.net.now if t is None else t
        for ip, qpn, eng in self._qps():
            st = int(eng.state)
            if self._states.get((ip, qpn)) != st:
                self._states[(ip, qpn)] = st
                self.note((ip, qpn), t, state_text(st), "state")

    def note(self, where: Any, t: float | None, text: str, kind: str = "info") -> None:
        """A note on a lane: ``where`` is a :class:`Lane`, an ``(ip, qpn)`` pair, or an
        endpoint of :mod:`softrdma.harness.testing`."""
        lane = self._lane_of(where)
        self.diagram.lane(lane.ip, lane.qpn)
        self.diagram.notes.append(Note(lane, self.net.now if t is None else t, text, kind))

    def completions(self, where: Any, wcs: Iterable[Any]) -> None:
        """Note polled work completions on ``where``'s lane: ``WC RDMA_WRITE SUCCESS``."""
        for wc in wcs:
            self.note(where, None, completion_text(wc), "completion")

    def poll(self, endpoint: Any) -> list[Any]:
        """Poll every completion of ``endpoint``'s CQ, note them, return them."""
        self.check()
        wcs = endpoint.cq.poll_all() if len(endpoint.cq) else []
        self.completions(endpoint, wcs)
        return wcs

    def _lane_of(self, where: Any) -> Lane:
        if isinstance(where, Lane):
            return where
        if isinstance(where, tuple):
            return Lane(where[0], where[1])
        return Lane(where.device.ip, where.qp.qp_num)  # a harness.testing Endpoint

    def close(self) -> None:
        """Stop watching (a last look at the QP states first)."""
        if self._on_event in self.net.observers:
            self.check()
            self.net.observers.remove(self._on_event)

    def __enter__(self) -> "SimRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
