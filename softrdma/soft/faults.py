"""Fault injection on a soft device: loss, duplication, reordering, corruption and delay,
per direction, at random (seeded) or targeted at chosen packets.

Every :class:`~softrdma.soft.device.SoftDevice` has ``dev.faults``, with one
:class:`Direction` for what it sends (``tx``: after the ICRC is computed, before the
wire) and one for what it receives (``rx``: after the wire, before rxe's receive checks)::

    dev.faults.seed(7)
    dev.faults.tx.random.loss = 0.05                  # random, 5 % of what dev sends
    rule = dev.faults.rx.drop("RC_RDMA_READ_RESPONSE_FIRST")   # the first one it receives
    ...
    rule.hits   # [Hit(frame=3, opcode='RC_RDMA_READ_RESPONSE_FIRST', qpn=..., psn=...)]

The random impairments have :class:`~softrdma.harness.sim.LinkProfile`'s names and draw in
the same order from one ``random.Random`` per device, so the simulated network and a real
UDP device say the same thing the same way (the simulator's link *is* an
:class:`Impairments`). Delays go through the device's own timers (a :class:`DelayLine`
the progress thread, ``poll`` or the simulator's virtual clock fires), never a sleep.

Every fault is counted in ``dev.counters.faults`` (``tx_loss``, ``rx_drop``,
``tx_duplicate``, ``rx_corrupt``, ``tx_delay``, ``rx_reorder``, ``rx_injected``...; shown as
``fault_<key>`` by ``softrdma devinfo -v`` and ``--counters``), and every packet dropped
on purpose also under the drop reason ``injected_loss``. With nothing configured the
device pays one attribute test per packet: a direction is attached to the device
(``dev.fault_tx`` / ``dev.fault_rx``) only while it has something to do.

The text form (``SOFTRDMA_FAULTS``, ``--fault``) is softrdma.soft.faultspec's; see
docs/faults.md.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from ..counters import Drop
from ..wire.icrc import icrc_ipv4, icrc_ipv6
from ..wire.opcodes import OPCODES
from .faultrules import FaultError, Hit, Rule
from .faultspec import FaultSpec, parse_spec

__all__ = ["Impairments", "Direction", "Faults", "DelayLine", "FaultError", "Rule", "Hit",
           "ENV_FAULTS"]

ENV_FAULTS = "SOFTRDMA_FAULTS"
RESPONSES = frozenset(op for op, i in OPCODES.items() if i.is_response)
Note = Callable[[str], None]


@dataclass
class Impairments:
    """Random impairments of one direction of a link; every choice from the caller's rng.

    ``loss_kind="requests"`` spares responses (ACKs, read responses, atomic ACKs) from the
    random loss, so only requests are retransmitted (rxe's requester timer, not the
    responder's duplicate handling, is exercised)."""

    loss: float = 0.0  # probability a packet is dropped
    duplicate: float = 0.0  # probability it is delivered twice
    reorder: float = 0.0  # probability it is held back by ``reorder_delay``
    corrupt: float = 0.0  # probability one bit is flipped (the ICRC must catch it)
    delay: float = 0.0  # one-way delay, seconds
    jitter: float = 0.0  # extra uniform random delay
    reorder_delay: float = 200e-6
    loss_kind: str = "all"  # "requests": responses are never lost at random

    def random_active(self) -> bool:
        return bool(self.loss or self.duplicate or self.reorder or self.corrupt or self.delay
                    or self.jitter)

    def impair(self, rng: random.Random, data: bytes, now: float,
               note: Note) -> list[tuple[float, bytes]]:
        """The copies of ``data`` to deliver, each with its due time (``now`` or later);
        empty if lost. ``note(kind)`` hears each impairment ("loss", "duplicate",
        "corrupt", "reorder"). The order of the draws is the simulator's, kept stable:
        the same seed gives the same run."""
        if self.loss and rng.random() < self.loss and not (
                self.loss_kind == "requests" and data[0] in RESPONSES):
            note("loss")
            return []
        copies = 2 if self.duplicate and rng.random() < self.duplicate else 1
        if copies == 2:
            note("duplicate")
        out = []
        for _ in range(copies):
            pkt = data
            if self.corrupt and rng.random() < self.corrupt:
                b = bytearray(data)
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
                pkt = bytes(b)
                note("corrupt")
            t = now + self.delay + (rng.random() * self.jitter if self.jitter else 0.0)
            if self.reorder and rng.random() < self.reorder:
                t += self.reorder_delay
                note("reorder")
            out.append((t, pkt))
        return out


_IMPAIRMENTS = frozenset(f.name for f in fields(Impairments))


class DelayLine:
    """Packets held back until a due time, fired by the device's timers: it stands in the
    device's timer set like a QP (``deadline``, ``closed``, ``on_timer``), so the progress
    thread wakes for it, ``poll`` waits for it and the simulator's virtual clock reaches it."""

    closed = False

    def __init__(self, device: Any) -> None:
        self.device = device
        self.deadline: float | None = None
        self.held = 0  # packets it has held, ever
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), fn, args))
        self.held += 1
        if self.deadline is None or due < self.deadline:
            self.deadline = due
            self.device.timer_changed(self)

    def on_timer(self, now: float) -> None:
        h = self._heap
        while h and h[0][0] <= now:
            _, _, fn, args = heapq.heappop(h)
            fn(*args)
        self.deadline = h[0][0] if h else None
        self.device.timer_changed(self)


class WatchedImpairments(Impairments):
    """A direction's random impairments: checked when set, and the direction is told, so
    it attaches itself to the device's data path only while it has something to do."""

    def __init__(self, changed: Callable[[], None]) -> None:
        object.__setattr__(self, "_changed", None)
        super().__init__()
        object.__setattr__(self, "_changed", changed)

    def __setattr__(self, key: str, value: Any) -> None:
        if key in _IMPAIRMENTS:
            _check_setting(key, value)
        object.__setattr__(self, key, value)
        if self._changed is not None:
            self._changed()


class Direction:
    """The faults of one direction (``dev.faults.tx`` or ``dev.faults.rx``): the random
    impairments in :attr:`random` (``dev.faults.tx.random.loss = 0.05``, or
    ``dev.faults.tx.set(loss=0.05)``), and the targeted rules, made by :meth:`drop`,
    :meth:`duplicate`, :meth:`delay` and :meth:`corrupt`. Rules run in the order they were
    added, before the random impairments; a dropped packet goes no further."""

    def __init__(self, faults: "Faults", name: str) -> None:
        self.faults = faults
        self.name = name
        self.rules: list[Rule] = []
        self.frames = 0  # packets seen (Hit.frame counts from 1)
        self.random = WatchedImpairments(faults.refresh)

    def set(self, **impairments: Any) -> "Direction":
        """Set random impairments by name (``loss``, ``duplicate``, ``reorder``,
        ``corrupt``, ``delay``, ``jitter``, ``reorder_delay``, ``loss_kind``)."""
        for k, v in impairments.items():
            if k not in _IMPAIRMENTS:
                raise FaultError(f"unknown impairment {k!r} (one of "
                                 f"{', '.join(sorted(_IMPAIRMENTS))})")
            setattr(self.random, k, v)
        return self

    @property
    def active(self) -> bool:
        return bool(self.rules) or self.random.random_active()

    # -- targeted rules ------------------------------------------------------------------
    def add(self, rule: Rule) -> Rule:
        """Add a rule made elsewhere (a parsed spec's); return it."""
        self.rules.append(rule)
        self.faults.refresh()
        return rule

    def drop(self, opcode: str | int | None = None, *, nth: int = 1, count: int = 1,
             qpn: int | None = None, psn: int | None = None) -> Rule:
        """Drop matching packets ``nth`` .. ``nth+count-1`` (``count=0``: every one)."""
        return self.add(Rule("drop", opcode, nth, count, qpn, psn))

    def duplicate(self, opcode: str | int | None = None, *, nth: int = 1, count: int = 1,
                  qpn: int | None = None, psn: int | None = None, copies: int = 1) -> Rule:
        """Deliver matching packets ``1 + copies`` times, back to back."""
        return self.add(Rule("duplicate", opcode, nth, count, qpn, psn, copies=copies))

    def delay(self, opcode: str | int | None = None, *, seconds: float, nth: int = 1,
              count: int = 1, qpn: int | None = None, psn: int | None = None) -> Rule:
        """Hold matching packets back ``seconds`` (packets behind them overtake them)."""
        return self.add(Rule("delay", opcode, nth, count, qpn, psn, seconds=seconds))

    def corrupt(self, opcode: str | int | None = None, *, field: str = "icrc",
                value: int | None = None, fix_icrc: bool | None = None, nth: int = 1,
                count: int = 1, qpn: int | None = None, psn: int | None = None) -> Rule:
        """Change ``field`` of matching packets to ``value`` (None: flip its lowest bit).
        Fields: softrdma.soft.faultrules.FIELDS (``psn``, ``rkey``, ``syndrome``,
        ``icrc``, ``payload``...). The ICRC is recomputed (``fix_icrc``, the default for
        every field but ``icrc``: a well-formed packet with a wrong value, as a faulty peer
        sends it) or left stale (a line error the receiver's ICRC check must catch)."""
        return self.add(Rule("corrupt", opcode, nth, count, qpn, psn, field=field,
                             value=value, fix_icrc=fix_icrc))

    def clear(self) -> None:
        """Remove every rule and zero every impairment of this direction."""
        self.rules.clear()
        for f in fields(Impairments):
            setattr(self.random, f.name, f.default)
        self.faults.refresh()

    # -- the data path ---------------------------------------------------------------------
    def outcomes(self, data: bytes, fix: Callable[[bytes], bytes]) -> list[tuple[float, bytes]]:
        """What becomes of one packet: ``(due time, bytes)`` per copy, [] if dropped."""
        self.frames += 1
        now = self.faults.device.now
        extra, hold = 0, 0.0
        count = self.faults.count
        for rule in self.rules:
            if not rule.take(data, self.frames):
                continue
            act = rule.action
            if act == "drop":
                count(self.name, "drop")
                return []
            if act == "corrupt":
                data = rule.corrupt(data, fix)
                count(self.name, "corrupt")
            elif act == "duplicate":
                extra += rule.copies
                count(self.name, "duplicate")
            else:
                hold += rule.seconds
                count(self.name, "delay")
        rnd = self.random
        if not rnd.random_active():
            return [(now + hold, data)] * (1 + extra)
        note = self.faults.note_for(self.name)
        out: list[tuple[float, bytes]] = []
        for _ in range(1 + extra):
            out += [(t + hold, p) for t, p in rnd.impair(self.faults.rng, data, now, note)]
        if rnd.delay or rnd.jitter:
            count(self.name, "delay", len(out))
        return out

    def __repr__(self) -> str:
        return f"<faults {self.name}: {self.describe() or 'none'}>"

    def describe(self) -> str:
        """This direction as spec text (empty when it does nothing)."""
        base, rnd = Impairments(), self.random
        parts = [f"{f.name}={getattr(rnd, f.name):g}" if isinstance(getattr(rnd, f.name), float)
                 else f"{f.name}={getattr(rnd, f.name)}" for f in fields(Impairments)
                 if getattr(rnd, f.name) != getattr(base, f.name)]
        parts += [r.describe() for r in self.rules]
        return ", ".join(parts)


def _check_setting(key: str, value: Any) -> None:
    if key == "loss_kind":
        if value not in ("all", "requests"):
            raise FaultError(f"loss_kind={value!r}: 'all' or 'requests'")
        return
    if not isinstance(value, (int, float)) or value != value or value < 0 or \
            (key in ("loss", "duplicate", "reorder", "corrupt") and value > 1):
        raise FaultError(f"{key}={value!r}: " + ("a probability 0..1" if key in
                         ("loss", "duplicate", "reorder", "corrupt") else "seconds >= 0"))


class Faults:
    """The faults of one device: ``tx``, ``rx``, one seeded ``rng`` for both, and the
    :class:`DelayLine` that holds delayed packets. ``dev.faults``; see the module doc."""

    def __init__(self, device: Any, seed: int | str | None = None) -> None:
        self.device = device
        self.rng = random.Random(f"softrdma-faults-{device.name}" if seed is None else seed)
        self.line = DelayLine(device)
        self.tx = Direction(self, "tx")
        self.rx = Direction(self, "rx")
        self.env_loaded = False
        self._notes = {d: self._make_note(d) for d in ("tx", "rx")}

    # -- configuration --------------------------------------------------------------------
    def seed(self, seed: int | str) -> None:
        """Restart the random draws from ``seed`` (same seed, same traffic: same faults)."""
        self.rng.seed(seed)

    def load(self, spec: str | FaultSpec) -> list[Rule]:
        """Apply a spec (text or parsed) on top of what is configured; return the rules it
        added, in order. FaultError names the token it could not read."""
        s = parse_spec(spec) if isinstance(spec, str) else spec
        if s.seed is not None:
            self.seed(s.seed)
        for d, name, value in s.settings:
            setattr(self.direction(d).random, name, value)
        return [self.direction(d).add(rule) for d, rule in s.rules]

    def load_env(self, env: Mapping[str, str]) -> None:
        """The environment's faults, once per device: SOFTRDMA_TX_LOSS (``tx:loss=``),
        SOFTRDMA_TX_LOSS_KIND=requests (``tx:loss_kind=requests``), then SOFTRDMA_FAULTS
        (parsed whole before any of it applies). FaultError names the variable and token."""
        if self.env_loaded:
            return
        loss = env.get("SOFTRDMA_TX_LOSS", "")
        if loss.strip():
            try:
                self.tx.random.loss = float(loss)
            except (ValueError, FaultError):
                raise FaultError(f"SOFTRDMA_TX_LOSS={loss!r}: not a probability 0..1") from None
        kind = env.get("SOFTRDMA_TX_LOSS_KIND", "").strip()
        if kind:
            if kind not in ("all", "requests"):
                raise FaultError(f"SOFTRDMA_TX_LOSS_KIND={kind!r}: 'requests' or 'all'")
            self.tx.random.loss_kind = kind
        text = env.get(ENV_FAULTS, "")
        if text.strip():
            try:
                self.load(text)
            except FaultError as e:
                raise FaultError(f"{ENV_FAULTS}: {e}") from None
        self.env_loaded = True  # only once it all applied: a failed attach fails again

    def direction(self, name: str) -> Direction:
        if name not in ("tx", "rx"):
            raise FaultError(f"unknown direction {name!r} (tx or rx)")
        return self.tx if name == "tx" else self.rx

    def clear(self) -> None:
        """No faults any more (packets already delayed are still delivered)."""
        self.tx.clear()
        self.rx.clear()

    @property
    def rules(self) -> list[Rule]:
        return self.tx.rules + self.rx.rules

    def describe(self) -> str:
        """The configuration as spec text (``tx:...; rx:...``), empty when none."""
        return "; ".join(f"{d.name}:{t}" for d in (self.tx, self.rx) if (t := d.describe()))

    def refresh(self) -> None:
        """Attach to the device the directions that have something to do (the data path
        tests ``dev.fault_tx is not None``: nothing else when no fault is configured)."""
        dev = self.device
        dev.fault_tx = self.tx if self.tx.active else None
        dev.fault_rx = self.rx if self.rx.active else None

    # -- counting ----------------------------------------------------------------------------
    def count(self, direction: str, kind: str, n: int = 1) -> None:
        c = self.device.counters.faults
        key = f"{direction}_{kind}"
        c[key] = c.get(key, 0) + n
        if kind in ("drop", "loss"):
            for _ in range(n):
                self.device.counters.drop(Drop.INJECTED_LOSS)  # (traced as a drop)
        elif self.device.trace is not None:  # duplicate, delay, corrupt...: the trace says so
            self.device.trace.emit(self.device, "drop", None,
                                   f"injected fault: {direction} {kind}",
                                   reason=f"fault_{key}")

    def _make_note(self, direction: str) -> Note:
        return lambda kind: self.count(direction, kind)

    def note_for(self, direction: str) -> Note:
        return self._notes[direction]

    # -- applying them (called by the device) -----------------------------------------------
    def send(self, data: bytes, dst_ip: bytes, sport: int, tos: int = 0) -> None:
        """The tx path: ``data`` (ICRC filled) leaves through ``device.wire_send`` now,
        later, several times or never (with the path's traffic class ``tos``)."""
        dev = self.device
        src = dev.ip_packed

        def fix(b: bytes) -> bytes:
            return with_icrc(b, src, dst_ip, sport)

        self._deliver(self.tx.outcomes(data, fix), dev.wire_send, dst_ip, sport, tos)

    def receive(self, data: bytes, src_ip: bytes, dst_ip: bytes, ip_id: int,
                ip_header: bytes | None, sport: int, verify: bool,
                deliver: Callable[..., None]) -> None:
        """The rx path: ``deliver(data, src, dst, ip_id, ip_header, sport, verify)`` (the
        device's receive checks) now, later, several times or never. A packet dropped here
        was received: it counts in ``rcvd_pkts`` as well as in the drop reason."""
        data = bytes(data)
        if len(data) < 12:  # not even a BTH: nothing to match; the receive checks judge it
            deliver(data, src_ip, dst_ip, ip_id, ip_header, sport, verify)
            return

        def fix(b: bytes) -> bytes:
            return with_icrc(b, src_ip, dst_ip, sport, ip_id)

        out = self.rx.outcomes(data, fix)
        if not out:
            self.device.counters.rcvd_pkts += 1
            return
        self._deliver(out, deliver, src_ip, dst_ip, ip_id, ip_header, sport, verify)

    def _deliver(self, out: list[tuple[float, bytes]], fn: Callable[..., None],
                 *rest: Any) -> None:
        now = self.device.now
        for due, pkt in out:
            if due <= now:
                fn(pkt, *rest)
            else:
                self.line.push(due, fn, pkt, *rest)

    def __repr__(self) -> str:
        return f"<Faults of {self.device.name}: {self.describe() or 'none'}>"


def with_icrc(data: bytes, src: bytes, dst: bytes, sport: int, ip_id: int = 0) -> bytes:
    """``data`` with the ICRC the receiver will compute for these addresses and port."""
    if len(data) < 16:
        return data
    b = bytearray(data)
    if len(src) == 4:
        c = icrc_ipv4(b, src, dst, sport, ip_id=ip_id)
    else:
        c = icrc_ipv6(b, src, dst, sport)
    b[-4:] = c.to_bytes(4, "little")
    return bytes(b)
