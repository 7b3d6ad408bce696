"""A simulated network for soft devices: deterministic loss, duplication, reordering, delay
and corruption on a virtual clock, so protocol behaviour (retries, RNR waits, timeouts)
can be exercised exactly and instantly.

    from softrdma.harness.sim import SimNetwork
    net = SimNetwork(seed=1, loss=0.1, delay=50e-6)
    a = net.add_device("10.0.0.1"); b = net.add_device("10.0.0.2")
    ... create QPs on Context(name=a.name) and Context(name=b.name), connect them ...
    net.run_until(lambda: len(cq) >= 1, timeout=10.0)   # virtual seconds

Every random choice comes from one ``random.Random(seed)``: the same seed and the same
traffic give the same run, packet for packet. The link's impairments are
:class:`softrdma.soft.faults.Impairments`, the ones a live device applies per direction
(``dev.faults.tx``/``rx``); the devices' targeted faults (``dev.faults.rx.drop(...)``,
docs/faults.md) work here too, their delays on the virtual clock.

Trains. ``SimNetwork(trains=True)`` moves packets as a live device on UDP does with GSO
and GRO (softrdma.wire.trains, softrdma.soft.udp): what a device sends in one hold of its
lock is grouped into trains, the IPv4 segments after the first get their ICRC moved to
their IP ID (1, 2, ...), each packet then meets the link's impairments on its own, and
the packets that arrive together (same time, source, destination and port, in order) are
handed over as one train (``SoftDevice.receive_train``), the ICRC checked against each
packet's IP ID. The data-path tests run both ways.

Observers. ``net.observers`` is a list of callables, each called with a :class:`SimEvent`
for every packet sent (with its fate: the copies that will arrive, none when it was lost),
every packet delivered and every timer about to fire. It is empty unless someone watches
(:class:`softrdma.diagram.simrec.SimRecorder` draws the run), and then costs one list test
per event; observers must not send or step the network.
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import random
from dataclasses import dataclass
from typing import Any, Callable

from ..soft.device import SoftDevice
from ..soft.faults import Impairments
from ..wire.trains import coalesce, split, train_iov
from ..verbs_api.device import add_device, unregister_device

__all__ = ["SimNetwork", "LinkProfile", "SimEvent", "SimCopy"]

_STAT = {"loss": "lost", "duplicate": "duplicated", "corrupt": "corrupted",
         "reorder": "reordered"}  # Impairments' notes -> SimNetwork.stats keys


def _trace_net(src: SoftDevice, data: bytes, what: str, reason: str,
               dst_ip: bytes = b"") -> None:
    """The trace's line for what the network did to a packet ``src`` sent to ``dst_ip``."""
    from ..wire.packet import parse
    try:
        pkt = parse(data)
    except Exception:
        return
    src.trace.emit(src, "drop", None, f"{pkt.info.name} PSN {pkt.psn} to QP "
                                      f"0x{pkt.dest_qp:x}: {what}", reason=reason,
                   psn=pkt.psn, opcode=pkt.info.name, dest_qp=pkt.dest_qp,
                   peer=str(ipaddress.ip_address(dst_ip)) if dst_ip else None)


@dataclass
class LinkProfile(Impairments):
    """The link between every two devices (both ways): :class:`Impairments` with a 10 us
    one-way delay by default."""

    delay: float = 10e-6  # one-way delay, seconds


@dataclass(frozen=True)
class SimCopy:
    """One copy of a sent packet on its way: ``seq`` names it in the later ``deliver``
    event; ``data`` is what will arrive (a bit flipped when ``corrupted``)."""

    seq: int
    arrival: float
    data: bytes
    corrupted: bool = False
    reordered: bool = False


@dataclass(frozen=True)
class SimEvent:
    """What the network did, for observers. ``kind``:

    * ``"send"``: ``src`` sent ``data`` to ``dst`` at ``time``; ``copies`` are what will
      arrive (empty: lost, or ``unroutable``; two: duplicated);
    * ``"deliver"``: copy ``seq`` was handed to ``dst``'s device (after it handled it);
    * ``"timer"``: the devices' due timers fire at ``time`` (called before they do).
    """

    kind: str
    time: float
    src: bytes = b""
    dst: bytes = b""
    sport: int = 0
    data: bytes = b""
    copies: tuple[SimCopy, ...] = ()
    seq: int = -1
    unroutable: bool = False


class SimNetwork:
    def __init__(self, seed: int = 0, *, trains: bool = False, **profile: Any) -> None:
        self.rng = random.Random(seed)
        self.trains = trains
        self._queued: dict[SoftDevice, list[tuple[bytes, bytes, int]]] = {}
        self.profile = LinkProfile(**profile)
        self.now = 0.0
        self.devices: dict[bytes, SoftDevice] = {}
        # (arrival, seq, device, packet, src ip, dst ip, UDP source port, IPv4 ID)
        self._events: list[tuple[float, int, SoftDevice, bytes, bytes, bytes, int, int]] = []
        self._seq = itertools.count()
        self._made: dict[str, SoftDevice] = {}  # registered by add_device, for close()
        self.stats = {"sent": 0, "lost": 0, "duplicated": 0, "reordered": 0, "corrupted": 0,
                      "delivered": 0, "unroutable": 0}
        self.observers: list[Callable[[SimEvent], None]] = []  # see the module docstring

    def _notify(self, ev: SimEvent) -> None:
        for fn in self.observers:
            fn(ev)

    def add_device(self, ip: str, name: str | None = None, mtu: int | None = 1500) -> SoftDevice:
        """Create a soft device whose packets travel over this network. It is registered like
        any device (:func:`softrdma.verbs_api.add_device`), so ``Context(name=dev.name)``
        opens it; :meth:`close` unregisters the devices made here."""
        dev = add_device(ip, name=name, mtu=mtu, seed=self.rng.randrange(1 << 30), live=False)
        self._made[dev.name] = dev
        self.attach(dev)
        return dev

    def close(self) -> None:
        """Unregister the devices :meth:`add_device` made (close their contexts first)."""
        for dev in self.devices.values():
            if self._made.pop(dev.name, None) is dev:
                unregister_device(dev.name)

    def __enter__(self) -> "SimNetwork":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach(self, dev: SoftDevice) -> None:
        self.devices[dev.ip_packed] = dev
        dev.now = self.now
        if self.trains:
            dev.transmit = lambda data, dst, sport, tos=0, _src=dev: self._queue(_src, data, dst, sport)
            dev.lock.on_release = lambda _src=dev: self._flush(_src)
        else:
            dev.transmit = lambda data, dst, sport, tos=0, _src=dev: self._send(_src, data, dst, sport)

    def _queue(self, src: SoftDevice, data: bytes, dst_ip: bytes, sport: int) -> None:
        self._queued.setdefault(src, []).append((data, dst_ip, sport))
        if src.lock.depth == 0:  # not sent from inside a lock hold: no flush will come
            self._flush(src)

    def _flush(self, src: SoftDevice) -> None:
        """What ``src`` sent in one lock hold, as the UDP transport sends it: in trains."""
        queued = self._queued.pop(src, None)
        if not queued:
            return
        for dst_ip, sport, size, packets in coalesce(queued):
            if len(packets) == 1:
                self._send(src, packets[0], dst_ip, sport)
                continue
            # what the kernel does with the sendmsg: one datagram, cut every ``size`` bytes
            wire = b"".join(train_iov(packets, len(dst_ip) == 4))
            for k, seg in enumerate(split(memoryview(wire), len(wire), size)):
                self._send(src, bytes(seg), dst_ip, sport, ip_id=k)

    def _note(self, kind: str) -> None:
        self.stats[_STAT[kind]] += 1

    def _traced_note(self, kind: str, src: SoftDevice, data: bytes, dst_ip: bytes) -> None:
        self._note(kind)
        what = {"loss": "lost on the simulated network", "duplicate": "duplicated by the "
                "simulated network", "corrupt": "corrupted by the simulated network",
                "reorder": "held back (reordered) by the simulated network"}[kind]
        _trace_net(src, data, what, f"sim_{kind}", dst_ip)

    def _send(self, src: SoftDevice, data: bytes, dst_ip: bytes, sport: int,
              ip_id: int = 0) -> None:
        self.stats["sent"] += 1
        dst = self.devices.get(dst_ip)
        if dst is None:
            self.stats["unroutable"] += 1
            if self.observers:
                self._notify(SimEvent("send", self.now, src.ip_packed, dst_ip, sport, data,
                                      unroutable=True))
            return
        note = self._note if src.trace is None else \
            (lambda kind: self._traced_note(kind, src, data, dst_ip))
        sent: list[SimCopy] = []
        p = self.profile
        for t, pkt in p.impair(self.rng, data, self.now, note):
            seq = next(self._seq)
            heapq.heappush(self._events, (t, seq, dst, pkt, src.ip_packed, dst_ip, sport, ip_id))
            if self.observers:
                # held back beyond the delay and its jitter: reordered (impair's rule)
                late = bool(p.reorder) and t - self.now - p.delay > p.jitter
                sent.append(SimCopy(seq, t, pkt, pkt is not data, late))
        if self.observers:
            self._notify(SimEvent("send", self.now, src.ip_packed, dst_ip, sport, data,
                                  tuple(sent)))

    def _set_now(self, t: float) -> None:
        self.now = t
        for d in self.devices.values():
            d.now = t

    def step(self) -> bool:
        """Handle the next event (a delivery or a timer). False when nothing is pending."""
        t_pkt = self._events[0][0] if self._events else None
        t_tmr = None
        for d in self.devices.values():
            dl = d.next_deadline()
            if dl is not None and (t_tmr is None or dl < t_tmr):
                t_tmr = dl
        if t_pkt is None and t_tmr is None:
            return False
        if t_tmr is None or (t_pkt is not None and t_pkt <= t_tmr):
            t, seq, dev, pkt, src, dst, sport, ip_id = heapq.heappop(self._events)
            self._set_now(max(self.now, t))
            if self.trains:
                self._deliver_train(t, seq, dev, pkt, src, dst, sport, ip_id)
                return True
            self.stats["delivered"] += 1
            dev.receive(pkt, src, dst, sport=sport, verify_icrc=True, ip_id=ip_id)
            if self.observers:
                self._notify(SimEvent("deliver", self.now, src, dst, sport, pkt, seq=seq))
        else:
            self._set_now(max(self.now, t_tmr))
            if self.observers:
                self._notify(SimEvent("timer", self.now))
            for d in self.devices.values():
                d.fire_timers(self.now)
        return True

    def _deliver_train(self, t: float, seq: int, dev: SoftDevice, pkt: bytes, src: bytes,
                       dst: bytes, sport: int, ip_id: int) -> None:
        """Deliver ``pkt`` with the packets queued right behind it for the same arrival
        time, device and flow: one train, as UDP GRO hands it over."""
        ev = self._events
        seqs, parts, ids = [seq], [pkt], [ip_id]
        while ev and ev[0][0] == t and ev[0][2] is dev and ev[0][4] == src and \
                ev[0][5] == dst and ev[0][6] == sport:
            e = heapq.heappop(ev)
            seqs.append(e[1])
            parts.append(e[3])
            ids.append(e[7])
        self.stats["delivered"] += len(parts)
        if len(parts) == 1:
            dev.receive(pkt, src, dst, sport=sport, verify_icrc=True, ip_id=ip_id)
        else:
            dev.receive_train(parts, src, dst, sport=sport, verify_icrc=True, ip_ids=ids)
        if self.observers:
            for q, p in zip(seqs, parts):
                self._notify(SimEvent("deliver", self.now, src, dst, sport, p, seq=q))

    def run(self, until: float | None = None, max_events: int = 10_000_000) -> int:
        """Run until nothing is pending (or virtual time ``until``); return events handled."""
        n = 0
        while n < max_events:
            if until is not None and self._next_time() is not None and self._next_time() > until:
                self._set_now(until)
                break
            if not self.step():
                break
            n += 1
        return n

    def run_until(self, cond: Callable[[], bool], timeout: float = 60.0,
                  max_events: int = 10_000_000) -> bool:
        """Run until ``cond()`` is true or ``timeout`` virtual seconds pass."""
        end = self.now + timeout
        n = 0
        while not cond():
            nt = self._next_time()
            if nt is None or nt > end or n >= max_events:
                return cond()
            self.step()
            n += 1
        return True

    def _next_time(self) -> float | None:
        ts = [self._events[0][0]] if self._events else []
        for d in self.devices.values():
            dl = d.next_deadline()
            if dl is not None:
                ts.append(dl)
        return min(ts) if ts else None
