"""Step mode: two QPs on a simulated network, one event at a time, saying what happened
and why. For the REPL and notebooks.

    >>> from softrdma.harness.stepper import Stepper
    >>> s = Stepper("RC", seed=1)          # QP a on one device, QP b on another, both RTS
    >>> s.drop(opcode="RC_RDMA_WRITE_MIDDLE", nth=2)    # "what if this packet is lost?"
    >>> s.write(4096)                      # a posts a 4 KiB RDMA WRITE: 4 packets leave
    >>> s.step()                           # b receives the FIRST ...
    >>> s.run()                            # ... and so on until nothing is pending

Each step delivers one packet or fires one timer (whichever the virtual clock reaches
first) and prints the trace records it produced (docs/trace.md): the packets with their
PSNs, the responder's ACK/NAK decision and its reason, the requester going back and why,
timers, completions. Faults are injected at chosen packets with :meth:`drop`,
:meth:`duplicate` and :meth:`delay`; the network is otherwise loss-free unless
``loss=``, ``reorder=`` ... (SimNetwork's profile) say otherwise.
"""

from __future__ import annotations

import heapq
import logging
import sys
from dataclasses import dataclass, field
from typing import IO, Any

from .. import trace as _trace
from ..enums import (
    IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
)
from ..verbs_api import SendWR
from ..wire.packet import parse
from .sim import SimEvent, SimNetwork
from .testing import Endpoint, connected_pair

__all__ = ["Stepper", "Injection"]

DEFAULT_KINDS = "wqe,packet,ack,timer,retry,qp,cq,event,drop"


@dataclass
class Injection:
    """One fault at a chosen packet: ``action`` ("drop", "duplicate" or "delay") the
    ``nth`` packet (from 1) sent by ``sender`` ("a", "b" or None for either) whose
    opcode name contains ``opcode`` and whose PSN is ``psn`` (None: any)."""

    action: str
    nth: int = 1
    opcode: str | None = None
    psn: int | None = None
    sender: str | None = None
    seconds: float = 0.0  # for "delay"
    seen: int = 0
    hit: list[tuple[str, int]] = field(default_factory=list)  # (opcode, psn) it acted on

    def matches(self, sender: str, name: str, psn: int) -> bool:
        if self.hit or (self.sender is not None and self.sender != sender):
            return False
        if (self.opcode is not None and self.opcode not in name) or \
                (self.psn is not None and self.psn != psn):
            return False
        self.seen += 1
        return self.seen == self.nth


class _Keep(logging.Handler):
    def __init__(self, devices: set[str]) -> None:
        super().__init__()
        self.devices = devices
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        r = getattr(record, "softrdma", None)
        if r is not None and r.get("dev") in self.devices:
            self.records.append(dict(r, msg=record.getMessage()))


class Stepper:
    """QP ``a`` and QP ``b`` (:class:`~softrdma.harness.testing.Endpoint`), connected,
    on a :class:`~softrdma.harness.sim.SimNetwork` of their own."""

    def __init__(self, qp_type: str = "RC", *, seed: int = 0, kinds: str = DEFAULT_KINDS,
                 out: IO[str] | None = sys.stdout, **link: Any) -> None:
        self.net = SimNetwork(seed=seed, **link)
        self.a, self.b = connected_pair(self.net, qp_type)
        self.names = {self.a.qp.device.name: "a", self.b.qp.device.name: "b"}
        self.out = out
        self.injections: list[Injection] = []
        self._keep = _Keep(set(self.names))
        logging.getLogger("softrdma").addHandler(self._keep)
        self._was = _trace.current()
        _trace.enable(kinds, handler=None)
        self._send = self.net._send
        self.net._send = self._inject  # type: ignore[method-assign]
        self.log: list[dict[str, Any]] = []  # every record so far

    # -- faults at chosen packets --------------------------------------------------------
    def drop(self, nth: int = 1, opcode: str | None = None, psn: int | None = None,
             sender: str | None = None) -> Injection:
        """Lose the ``nth`` matching packet on the wire."""
        return self._add(Injection("drop", nth, opcode, psn, sender))

    def duplicate(self, nth: int = 1, opcode: str | None = None, psn: int | None = None,
                  sender: str | None = None) -> Injection:
        """Deliver the ``nth`` matching packet twice."""
        return self._add(Injection("duplicate", nth, opcode, psn, sender))

    def delay(self, seconds: float, nth: int = 1, opcode: str | None = None,
              psn: int | None = None, sender: str | None = None) -> Injection:
        """Hold the ``nth`` matching packet back ``seconds`` (packets behind it overtake
        it: a reordering)."""
        return self._add(Injection("delay", nth, opcode, psn, sender, seconds))

    def _add(self, inj: Injection) -> Injection:
        self.injections.append(inj)
        return inj

    def _inject(self, src: Any, data: bytes, dst_ip: bytes, sport: int) -> None:
        who = self.names.get(src.name, "?")
        try:
            p = parse(data)
        except Exception:
            self._send(src, data, dst_ip, sport)
            return
        for inj in self.injections:
            if inj.matches(who, p.info.name, p.psn):
                inj.hit.append((p.info.name, p.psn))
                self._note(f"injected: {inj.action} {p.info.name} PSN {p.psn} from {who}"
                           + (f" by {inj.seconds} s" if inj.action == "delay" else ""))
                if inj.action == "drop":
                    self._lost(src, data, dst_ip, sport)
                    return
                if inj.action == "duplicate":
                    self._send(src, data, dst_ip, sport)
                    break
                if inj.action == "delay":
                    net = self.net
                    dst = net.devices.get(dst_ip)
                    if dst is not None:
                        t = net.now + net.profile.delay + inj.seconds
                        heapq.heappush(net._events, (t, next(net._seq), dst, data,
                                                     src.ip_packed, dst_ip, sport, 0))
                        net.stats["sent"] += 1
                    return
        self._send(src, data, dst_ip, sport)

    def _lost(self, src: Any, data: bytes, dst_ip: bytes, sport: int) -> None:
        """A packet dropped on purpose is lost on the network: counted, and shown to the
        network's observers (a diagram draws it with its X)."""
        net = self.net
        net.stats["sent"] += 1
        net.stats["lost"] += 1
        if net.observers:
            net._notify(SimEvent("send", net.now, src.ip_packed, dst_ip, sport, data))

    # -- work requests -----------------------------------------------------------------------
    def send(self, size: int, imm: int | None = None, *, sender: str = "a",
             post_recv: bool = True) -> None:
        """A SEND (with immediate data if ``imm``). The other side gets a receive posted
        for it first, unless ``post_recv=False`` (then watch the RNR NAK; :meth:`recv`
        later lets the retry through)."""
        src, dst = self._ends(sender)
        if post_recv:  # (UD: room for the 40-byte GRH in front)
            grh = 40 if src.qp_type == "UD" else 0
            dst.post_recv(dst.buf_sge(0, max(size, 1) + grh), wr_id=100)
        src.post_send(IBV_WR_SEND if imm is None else IBV_WR_SEND_WITH_IMM,
                      src.buf_sge(0, size), wr_id=1, imm=imm or 0)
        self._flush()

    def recv(self, size: int, *, on: str = "b", wr_id: int = 100) -> None:
        """Post a receive of ``size`` bytes on ``on``."""
        end = self.a if on == "a" else self.b
        end.post_recv(end.buf_sge(0, max(size, 1)), wr_id=wr_id)
        self._flush()

    def write(self, size: int, imm: int | None = None, *, sender: str = "a",
              post_recv: bool = True) -> None:
        """An RDMA WRITE to the other side's buffer (with immediate data if ``imm``: that
        consumes a receive, posted for it unless ``post_recv=False``)."""
        src, dst = self._ends(sender)
        if imm is not None and post_recv:
            dst.post_recv(dst.buf_sge(0, 1), wr_id=100)
        src.post_send(IBV_WR_RDMA_WRITE if imm is None else IBV_WR_RDMA_WRITE_WITH_IMM,
                      src.buf_sge(0, size), wr_id=2, remote_offset=0, imm=imm or 0)
        self._flush()

    def read(self, size: int, *, sender: str = "a") -> None:
        src, _ = self._ends(sender)
        src.post_send(IBV_WR_RDMA_READ, src.buf_sge(0, size), wr_id=3, remote_offset=0)
        self._flush()

    def fetch_add(self, add: int, *, sender: str = "a") -> None:
        src, _ = self._ends(sender)
        src.post_send(IBV_WR_ATOMIC_FETCH_AND_ADD, src.buf_sge(0, 8), wr_id=4,
                      remote_offset=0, compare_add=add)
        self._flush()

    def cmp_swap(self, compare: int, swap: int, *, sender: str = "a") -> None:
        src, _ = self._ends(sender)
        src.post_send(IBV_WR_ATOMIC_CMP_AND_SWP, src.buf_sge(0, 8), wr_id=5,
                      remote_offset=0, compare_add=compare, swap=swap)
        self._flush()

    def atomic_write(self, value: bytes, *, offset: int = 0, sender: str = "a") -> None:
        """An ATOMIC WRITE of the 8 bytes ``value`` at ``offset`` of the other side's MR."""
        src, dst = self._ends(sender)
        wr = SendWR(6)
        wr.set_wr_atomic_write(dst.mr.rkey, dst.mr.buf + offset, value)
        src.qp.post_send(wr)
        self._flush()

    def flush(self, length: int, ptype: int, level: int, *, offset: int = 0, mr: Any = None,
              sender: str = "a") -> None:
        """A FLUSH of placement type ``ptype`` and selectivity level ``level`` over
        ``length`` bytes at ``offset`` of ``mr`` (default: the other side's MR)."""
        src, dst = self._ends(sender)
        mr = dst.mr if mr is None else mr
        wr = SendWR(7)
        wr.set_wr_flush(mr.rkey, mr.buf + offset, length, ptype, level)
        src.qp.post_send(wr)
        self._flush()

    def _ends(self, sender: str) -> tuple[Endpoint, Endpoint]:
        if sender not in ("a", "b"):
            raise ValueError(f"sender must be 'a' or 'b', not {sender!r}")
        return (self.a, self.b) if sender == "a" else (self.b, self.a)

    # -- driving ---------------------------------------------------------------------------
    def step(self) -> list[str]:
        """Deliver the next packet or fire the next timer; print and return what it
        caused (an empty list: nothing was pending)."""
        if not self.net.step():
            return []
        return self._flush()

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is pending; return the number of steps."""
        n = 0
        while n < max_steps and self.net.step():
            self._flush()
            n += 1
        return n

    @property
    def pending(self) -> list[str]:
        """What is on the wire now, in delivery order."""
        out = []
        for t, _, dev, data, _src, _dst, _sport, _ip_id in sorted(self.net._events):
            p = parse(data)
            out.append(f"t={t:.6f} to {self.names.get(dev.name, '?')}: {p.info.name} "
                       f"PSN {p.psn}")
        return out

    def completions(self, on: str = "a") -> list[Any]:
        """Poll ``on``'s CQ (the completions so far, removed from the CQ)."""
        end = self.a if on == "a" else self.b
        return end.cq.poll_all() if hasattr(end.cq, "poll_all") else []

    def _note(self, text: str) -> None:
        self._keep.records.append({"t": self.net.now, "dev": "net", "kind": "inject",
                                   "msg": text})

    def _flush(self) -> list[str]:
        recs, self._keep.records = self._keep.records, []
        self.log.extend(recs)
        lines = []
        for r in recs:
            who = self.names.get(r.get("dev"), "net")
            lines.append(f"{r['t']:10.6f} {who} {r['kind']:<6} {r['msg']}")
        if self.out is not None:
            for line in lines:
                print(line, file=self.out)
        return lines

    def close(self) -> None:
        """Stop tracing (restoring what was on before) and free both endpoints."""
        logging.getLogger("softrdma").removeHandler(self._keep)
        if self._was is None:
            _trace.disable()
        else:
            _trace.enable(self._was.kinds, handler=None)
        self.net._send = self._send  # type: ignore[method-assign]
        for e in (self.a, self.b):
            e.close()
        self.net.close()

    def __enter__(self) -> "Stepper":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
