"""Reconstruct who talks to whom: RC/UC connections (both directions paired) and UD QPs.

The BTH names only the *destination* QP, so a connection appears in a capture as two
unrelated streams: A→B to QP y and B→A to QP x. A stream ("half") is the packets of one
(source address, destination address, destination QP). Two halves in opposite directions
belong together when the responses of one acknowledge PSNs the other sent (an ACK, READ
response or atomic ACK carries the PSN of the request it answers), and rxe makes it easier
still by sending both directions from the same UDP source port (a hash of both QPNs). Halves
are paired greedily, best evidence first. A half with no partner (a one-way UC stream, or
a capture that holds one side only) is a connection on its own.

Each connection then yields two *flows*, one per requester: A's requests with B's responses
to them, and B's requests with A's responses. The rule modules walk flows.

UD needs no pairing: the DETH names the source QP. UD packets are grouped by sender
(source address, source QP) and by receiver (destination address, destination QP).

The checker reads a capture twice (:mod:`softrdma.check`): this module's :class:`Survey`
is the first pass. It keeps, per half, counters and a bounded sample of PSNs rather than
the packets, so a capture of any length is surveyed in bounded memory; the second pass
routes each packet to its flow (:meth:`Conversations.route`).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

from ..wire.opcodes import Transport
from .decode import Packet

__all__ = ["Half", "Flow", "Connection", "Conversations", "Survey", "infer_mtu", "addr"]

#: PSNs kept per half as pairing evidence: enough to tell the QPs of one host pair apart
SAMPLE = 4096


def addr(raw: bytes) -> str:
    return str(ipaddress.ip_address(raw))


@dataclass
class Half:
    """What the survey learned of the RC/UC packets of one (source, destination,
    destination QP): counts, the commonest field values and a sample of PSNs."""

    src: bytes
    dst: bytes
    dest_qp: int
    transports: Counter = field(default_factory=Counter)
    sports: Counter = field(default_factory=Counter)
    sport_first: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # sport ->
    # (frame, IP version, flow label) of its first packet
    pkeys: Counter = field(default_factory=Counter)
    req_psns: set[int] = field(default_factory=set)
    resp_psns: list[int] = field(default_factory=list)
    requests: int = 0
    responses: int = 0
    sizes_req: Counter = field(default_factory=Counter)  # FIRST/MIDDLE request payloads
    sizes_resp: Counter = field(default_factory=Counter)  # FIRST/MIDDLE READ responses

    @property
    def key(self) -> tuple[bytes, bytes, int]:
        return (self.src, self.dst, self.dest_qp)

    @property
    def transport(self) -> Transport:
        return Transport(self.transports.most_common(1)[0][0])

    @property
    def sport(self) -> int:
        return self.sports.most_common(1)[0][0]

    def add(self, p: Packet) -> None:
        info = p.info
        self.transports[info.transport] += 1
        sport = p.ip.sport
        self.sports[sport] += 1
        if sport not in self.sport_first:
            self.sport_first[sport] = (p.frame, p.ip.ip_version, p.ip.flow_label)
        self.pkeys[p.bth.pkey] += 1
        sized = info.has_payload and not info.last and (info.first or info.middle)
        if info.is_request:
            self.requests += 1
            if len(self.req_psns) < SAMPLE:
                self.req_psns.add(p.psn)
            if sized:
                self.sizes_req[p.bth.payload_len] += 1
        elif info.is_response:
            self.responses += 1
            if len(self.resp_psns) < SAMPLE:
                self.resp_psns.append(p.psn)
            if sized and info.read:
                self.sizes_resp[p.bth.payload_len] += 1


@dataclass
class Flow:
    """One requester→responder direction of a connection: which half carries its requests
    and which its responses, how many the survey counted, and the path MTUs."""

    label: str
    transport: Transport
    req_key: tuple[bytes, bytes, int] | None
    resp_key: tuple[bytes, bytes, int] | None
    requests: int
    responses: int
    mtu_req: int | None = None  # path MTU of the requester's packets
    mtu_resp: int | None = None  # path MTU of the responder's READ responses


@dataclass
class Connection:
    a: Half
    b: Half | None

    @property
    def qpn_a(self) -> int | None:
        """The QPN at a's end (what b's packets are addressed to)."""
        return self.b.dest_qp if self.b else None

    def label(self, h: Half) -> str:
        other = self.b if h is self.a else self.a
        mine = f"0x{other.dest_qp:06x}" if other else "?"
        return f"{addr(h.src)} QP {mine} -> {addr(h.dst)} QP 0x{h.dest_qp:06x}"

    @property
    def pkeys(self) -> Counter:
        out = Counter(self.a.pkeys)
        if self.b is not None:
            out.update(self.b.pkeys)
        return out

    def flows(self, mtu: int | None = None) -> list[Flow]:
        out = []
        for req, resp in ((self.a, self.b), (self.b, self.a)):
            if req is None:
                continue
            n_resp = resp.responses if resp else 0
            if req.requests or n_resp:
                out.append(Flow(self.label(req), req.transport, req.key,
                                resp.key if resp else None, req.requests, n_resp,
                                mtu or infer_mtu(req.sizes_req),
                                mtu or infer_mtu(resp.sizes_resp) if resp else mtu))
        if self.b is None and self.a.responses:
            # responses to a requester this capture does not show
            out.append(Flow(f"{addr(self.a.dst)} QP 0x{self.a.dest_qp:06x} (requests not "
                            "captured)", self.a.transport, None, self.a.key, 0,
                            self.a.responses, mtu, mtu or infer_mtu(self.a.sizes_resp)))
        return out


@dataclass
class UdGroup:
    """The survey of a UD receiver (by destination) or sender (by source QP)."""

    packets: int = 0
    qkeys: Counter = field(default_factory=Counter)
    pkeys: Counter = field(default_factory=Counter)
    sports: Counter = field(default_factory=Counter)
    sport_first: dict[int, int] = field(default_factory=dict)  # sport -> its first frame


@dataclass
class Conversations:
    """The survey's result: connections and their flows, UD groups, and each destination
    QP's commonest transport; :meth:`route` tells the second pass where a packet goes."""

    connections: list[Connection]
    ud_senders: dict[tuple[bytes, int], UdGroup]  # (source address, source QP)
    ud_receivers: dict[tuple[bytes, int], UdGroup]  # (destination address, QP)
    dest_transports: dict[tuple[bytes, int], Counter]  # (destination, QP) -> transports
    roce_flows: set[tuple[bytes, bytes, int]]  # (src, dst, UDP source port) of RoCE
    flows: list[tuple[Connection, Flow]] = field(default_factory=list)
    _by_req: dict = field(default_factory=dict)
    _by_resp: dict = field(default_factory=dict)
    _conn: dict = field(default_factory=dict)

    def build(self, mtu: int | None) -> None:
        for c in self.connections:
            for h in (c.a, c.b):
                if h is not None:
                    self._conn[h.key] = (c, h)
            for f in c.flows(mtu):
                i = len(self.flows)
                self.flows.append((c, f))
                if f.req_key is not None:
                    self._by_req[f.req_key] = i
                if f.resp_key is not None:
                    self._by_resp[f.resp_key] = i

    def route(self, p: Packet) -> int | None:
        """Index in :attr:`flows` of the flow an RC/UC packet belongs to (None: none)."""
        key = (p.src, p.dst, p.bth.dest_qp)
        return (self._by_req if p.info.is_request else self._by_resp).get(key)

    def connection(self, p: Packet) -> tuple[Connection, Half] | None:
        return self._conn.get((p.src, p.dst, p.bth.dest_qp))


class Survey:
    """The first pass: feed it every packet (:meth:`add`), then :meth:`finish`."""

    def __init__(self) -> None:
        self.halves: dict[tuple[bytes, bytes, int], Half] = {}
        self.ud_s: dict[tuple[bytes, int], UdGroup] = {}
        self.ud_r: dict[tuple[bytes, int], UdGroup] = {}
        self.dest: dict[tuple[bytes, int], Counter] = {}
        self.roce_flows: set[tuple[bytes, bytes, int]] = set()

    def add(self, p: Packet) -> None:
        t = p.info.transport
        self.roce_flows.add((p.src, p.dst, p.ip.sport))
        if t == Transport.CNP:
            return  # congestion notification: no QP conversation
        dk = (p.dst, p.bth.dest_qp)
        c = self.dest.get(dk)
        if c is None:
            c = self.dest[dk] = Counter()
        c[t] += 1
        if t == Transport.UD:
            s = self.ud_s.get((p.src, p.bth.src_qp or 0))
            if s is None:
                s = self.ud_s[(p.src, p.bth.src_qp or 0)] = UdGroup()
            s.packets += 1
            s.sports[p.ip.sport] += 1
            s.sport_first.setdefault(p.ip.sport, p.frame)
            r = self.ud_r.get(dk)
            if r is None:
                r = self.ud_r[dk] = UdGroup()
            r.packets += 1
            r.qkeys[p.bth.qkey] += 1
            r.pkeys[p.bth.pkey] += 1
            return
        key = (p.src, p.dst, p.bth.dest_qp)
        h = self.halves.get(key)
        if h is None:
            h = self.halves[key] = Half(*key)
        h.add(p)

    def finish(self, mtu: int | None = None) -> Conversations:
        conv = Conversations(_pair(list(self.halves.values())), self.ud_s, self.ud_r,
                             self.dest, self.roce_flows)
        conv.build(mtu)
        return conv


def _pair(halves: list[Half]) -> list[Connection]:
    req_psns = {id(h): h.req_psns for h in halves}
    resp_psns = {id(h): h.resp_psns for h in halves}
    sports = {id(h): set(h.sports) for h in halves}
    candidates = []
    for i, h1 in enumerate(halves):
        for j, h2 in enumerate(halves):
            if j <= i or (h2.src, h2.dst) != (h1.dst, h1.src) or h1.transport != h2.transport:
                continue
            score = (sum(psn in req_psns[id(h1)] for psn in resp_psns[id(h2)])
                     + sum(psn in req_psns[id(h2)] for psn in resp_psns[id(h1)]))
            if sports[id(h1)] & sports[id(h2)]:
                score += 3
            if score:
                candidates.append((score, i, j))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    partner: dict[int, int] = {}
    for _score, i, j in candidates:
        if i not in partner and j not in partner:
            partner[i] = j
            partner[j] = i
    out = []
    for i, h in enumerate(halves):
        j = partner.get(i)
        if j is None:
            out.append(Connection(h, None))
        elif i < j:
            out.append(Connection(h, halves[j]))
    return out


def infer_mtu(sizes: Counter) -> int | None:
    """The path MTU a sender used: the commonest payload of its FIRST and MIDDLE packets
    (they carry exactly one MTU), or None if it sent none. The commonest, not the largest,
    so one oversized packet is reported rather than believed."""
    if not sizes:
        return None
    best = max(sizes.values())
    return max(s for s, c in sizes.items() if c == best)
