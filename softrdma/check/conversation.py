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
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

from ..wire.opcodes import Transport
from .decode import Packet

__all__ = ["Half", "Flow", "Connection", "Conversations", "reconstruct", "infer_mtu",
           "addr"]


def addr(raw: bytes) -> str:
    return str(ipaddress.ip_address(raw))


@dataclass
class Half:
    """The RC/UC packets of one (source, destination, destination QP)."""

    src: bytes
    dst: bytes
    dest_qp: int
    packets: list[Packet] = field(default_factory=list)

    @property
    def transport(self) -> Transport:
        return Counter(p.info.transport for p in self.packets).most_common(1)[0][0]

    def requests(self) -> list[Packet]:
        return [p for p in self.packets if p.info.is_request]

    def responses(self) -> list[Packet]:
        return [p for p in self.packets if p.info.is_response]


@dataclass
class Flow:
    """One requester→responder direction of a connection: the requester's request packets
    and the responder's responses to them, in frame order."""

    label: str
    transport: Transport
    requests: list[Packet]
    responses: list[Packet]
    mtu_req: int | None = None  # path MTU of the requester's packets
    mtu_resp: int | None = None  # path MTU of the responder's READ responses
    responder_requests: list[int] = field(default_factory=list)  # frames of the responder
    # end's own requests (on the same connection), in order

    def events(self) -> list[tuple[Packet, bool]]:
        """(packet, is_request) in frame order."""
        ev = [(p, True) for p in self.requests] + [(p, False) for p in self.responses]
        ev.sort(key=lambda e: e[0].frame)
        return ev


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

    def flows(self) -> list[Flow]:
        out = []
        for req, resp in ((self.a, self.b), (self.b, self.a)):
            if req is None:
                continue
            requests = req.requests()
            responses = resp.responses() if resp else []
            if requests or responses:
                out.append(Flow(self.label(req), req.transport, requests, responses,
                                responder_requests=[p.frame for p in resp.requests()]
                                if resp else []))
        if self.b is None and self.a.responses():
            # responses to a requester this capture does not show
            out.append(Flow(f"{addr(self.a.dst)} QP 0x{self.a.dest_qp:06x} (requests not "
                            "captured)", self.a.transport, [], self.a.responses()))
        return out


@dataclass
class Conversations:
    connections: list[Connection]
    ud_senders: dict[tuple[bytes, int], list[Packet]]  # (source address, source QP)
    ud_receivers: dict[tuple[bytes, int], list[Packet]]  # (destination address, QP)
    by_dest: dict[tuple[bytes, int], list[Packet]]  # every packet, by destination QP


def reconstruct(packets: list[Packet]) -> Conversations:
    halves: dict[tuple[bytes, bytes, int], Half] = {}
    ud_s: dict[tuple[bytes, int], list[Packet]] = {}
    ud_r: dict[tuple[bytes, int], list[Packet]] = {}
    by_dest: dict[tuple[bytes, int], list[Packet]] = {}
    for p in packets:
        t = p.info.transport
        if t == Transport.CNP:
            continue  # congestion notification: no QP conversation
        by_dest.setdefault((p.dst, p.bth.dest_qp), []).append(p)
        if t == Transport.UD:
            ud_s.setdefault((p.src, p.bth.src_qp or 0), []).append(p)
            ud_r.setdefault((p.dst, p.bth.dest_qp), []).append(p)
        else:
            key = (p.src, p.dst, p.bth.dest_qp)
            h = halves.get(key)
            if h is None:
                h = halves[key] = Half(*key)
            h.packets.append(p)
    return Conversations(_pair(list(halves.values())), ud_s, ud_r, by_dest)


def _pair(halves: list[Half]) -> list[Connection]:
    req_psns = {id(h): {p.psn for p in h.requests()} for h in halves}
    resp_psns = {id(h): [p.psn for p in h.responses()] for h in halves}
    sports = {id(h): {p.ip.sport for p in h.packets} for h in halves}
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


def infer_mtu(packets: list[Packet]) -> int | None:
    """The path MTU a sender used: the commonest payload of its FIRST and MIDDLE packets
    (they carry exactly one MTU), or None if it sent none. The commonest, not the largest,
    so one oversized packet is reported rather than believed."""
    sizes = Counter(p.bth.payload_len for p in packets
                    if p.info.has_payload and not p.info.last and (p.info.first or p.info.middle))
    if not sizes:
        return None
    best = max(sizes.values())
    return max(s for s, c in sizes.items() if c == best)
