"""Losses in a long capture made by :mod:`.capgen`, repaired the way rxe repairs them.

:func:`with_losses` takes one RC flow of SENDs or RDMA WRITEs as captured at the
requester's NIC and loses every ``every``-th request packet *after* the capture point
(the capture shows it; the responder never gets it). What rxe then puts on the wire,
and so what the capture shows next (drivers/infiniband/sw/rxe):

- the requester keeps sending: the packets after the lost one go out as before;
- the responder gets the next PSN instead of the lost one, counts ``out_of_seq_request``
  and sends one NAK "PSN sequence error" carrying the PSN it expects and the MSN of the
  messages it completed (``check_psn`` in rxe_resp.c, once per gap: ``sent_psn_nak``);
  the packets after it are dropped without another NAK, and the ACKs of the messages
  they end are never sent;
- the requester, on the NAK, goes back to its PSN and sends again everything it had sent
  from there (``req_retry`` in rxe_req.c: the same opcodes, payloads and PSNs; a new
  IPv4 ID, hence a new ICRC), then carries on; the responder ACKs as before.

The NAK arrives ``rtt_ns`` after the packet that revealed the gap; the flow's later
packets are delayed by the time the repair took. The result has, per loss, one NAK and
one go-back whose counts a checker's recovery report should find.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..wire.frames import decode_frame, encode_frame
from ..wire.headers import NakCode
from ..wire.opcodes import Opcode, lookup
from ..wire.packet import build, parse

__all__ = ["LossStats", "with_losses", "RTT_NS", "RESEND_GAP_NS"]

#: the round trip between the hosts: a NAK follows the packet that revealed the gap by this
RTT_NS = 60_000
#: the spacing of the packets the requester sends again
RESEND_GAP_NS = 8_000

_MOD = 1 << 24


@dataclass
class LossStats:
    """What :func:`with_losses` did: packets lost, NAKs added, packets sent again."""

    lost: int = 0
    naks: int = 0
    resent: int = 0

    def text(self) -> str:
        return (f"{self.lost} packet(s) lost after the capture point, {self.naks} NAK(s), "
                f"{self.resent} packet(s) sent again")


def _after(a: int, b: int) -> bool:
    """PSN ``a`` is at or after ``b`` (24-bit serial arithmetic)."""
    return (a - b) % _MOD < _MOD // 2


def _resend(frame: bytes | bytearray) -> bytes:
    """The same packet sent again: a new IPv4 ID (so a new IP checksum and ICRC)."""
    f = decode_frame(frame)
    return encode_frame(bytes(f.payload), src=f.ip_src, dst=f.ip_dst, sport=f.sport,
                        dport=f.dport, ip_id=f.ip_id ^ 0x8000, ttl=f.ttl, tos=f.tos,
                        frag=f.ip_frag, eth_src=f.eth_src, eth_dst=f.eth_dst)


class _Pushback:
    """An iterator that can take back the item it last gave."""

    def __init__(self, items: Iterator[tuple[int, bytearray]]) -> None:
        self._it = iter(items)
        self._back: list[tuple[int, bytearray]] = []

    def __iter__(self) -> "_Pushback":
        return self

    def __next__(self) -> tuple[int, bytearray]:
        return self._back.pop() if self._back else next(self._it)

    def push(self, item: tuple[int, bytearray]) -> None:
        self._back.append(item)


def with_losses(items: Iterator[tuple[int, bytearray]], every: int,
                stats: LossStats | None = None) -> Iterator[tuple[int, bytes | bytearray]]:
    """The flow ``items`` (``(ts_ns, frame)`` of one RC connection of SENDs or RDMA
    WRITEs, requester's side, in order) with every ``every``-th request packet lost after
    the capture point and repaired as rxe does (module text)."""
    if every < 2:
        raise ValueError("every must be at least 2: the packet after a lost one reveals it")
    stats = stats if stats is not None else LossStats()
    src = _Pushback(items)
    shift = 0  # how much later than in the clean flow: the repairs' time
    completed = 0  # messages whose last packet the responder got
    requests = 0
    respond = None  # the responder's addresses, ports and the requester's QPN
    for ts0, frame in src:
        ts = ts0 + shift
        f = decode_frame(frame)
        pkt = parse(f.payload)
        info = lookup(pkt.opcode)
        if not info.is_request:
            respond = respond or (f.ip_src, f.ip_dst, f.sport, f.eth_src, f.eth_dst, pkt.dest_qp)
            yield ts, frame
            continue
        if not (info.opcode in _WRITES or info.opcode in _SENDS):
            raise ValueError(f"losses are modelled for SEND and RDMA WRITE flows, "
                             f"not {info.name}")
        requests += 1
        if requests % every or respond is None:
            completed += info.last
            yield ts, frame
            continue
        # lost after the capture point: the capture shows it, the responder never gets it
        lost_psn = pkt.psn
        stats.lost += 1
        yield ts, frame
        sent = [frame]  # what the requester sends again, from the lost PSN on
        msgs = int(info.last)
        nak_at = None
        held = []  # ACKs of PSNs from the lost one on: the responder sends them later
        for ts0, frame2 in src:
            ts2 = ts0 + shift
            if nak_at is not None and ts2 > nak_at:
                src.push((ts0, frame2))
                break
            p2 = parse(decode_frame(frame2).payload)
            i2 = lookup(p2.opcode)
            if i2.is_request:
                sent.append(frame2)
                msgs += i2.last
                if nak_at is None:  # the packet that shows the responder the gap
                    nak_at = ts2 + RTT_NS
                yield ts2, frame2
            elif _after(p2.psn, lost_psn):
                held.append(frame2)
            else:
                yield ts2, frame2
        else:
            return
        ip_src, ip_dst, sport, eth_src, eth_dst, qpn = respond
        nak = build(Opcode.RC_ACKNOWLEDGE, dest_qp=qpn, psn=lost_psn,
                    syndrome=NakCode.PSN_SEQ_ERROR, msn=completed % _MOD)
        yield nak_at, encode_frame(nak, src=ip_src, dst=ip_dst, sport=sport,
                                   eth_src=eth_src, eth_dst=eth_dst)
        stats.naks += 1
        t = nak_at + RTT_NS // 2
        for fr in sent:
            yield t, _resend(fr)
            t += RESEND_GAP_NS
        stats.resent += len(sent)
        t += RTT_NS - RESEND_GAP_NS
        for fr in held:
            yield t, fr
            t += RESEND_GAP_NS
        completed += msgs
        shift += max(0, t - (ts0 + shift))  # the next packet comes after the repair


_WRITES = {o for o in Opcode if o.name.startswith("RC_RDMA_WRITE")}
_SENDS = {o for o in Opcode if o.name.startswith("RC_SEND")}
