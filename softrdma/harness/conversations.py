"""Split a RoCE capture into conversations, one per pair of QPs, and replay each.

:func:`softrdma.harness.replay.replay_side` stands softrdma in for one endpoint of a
conversation between two QPs. A real capture often holds several: ``srq_pingpong`` runs
four RC connections over one SRQ, ``ucmatose`` two connections, ``udaddy`` a UD QP per
side, and every rdma_cm capture carries the CM's MADs on QP1. This module finds the
conversations and replays each one on its own device.

How the QPs are paired. The BTH names only the destination QP, so a packet from A to B
says which QP of B it is for, not which QP of A sent it.

* UD: the DETH carries the source QP, so each datagram names both ends.
* RC and UC: rxe derives a connected QP's UDP source port from the product of the two QP
  numbers (``calc_flow_label``), so both directions of a connection use one port and the
  port pairs the flows. A capture from an implementation that picks ports otherwise is
  paired when one flow runs in each direction between the two addresses; flows that
  cannot be paired are reported, not guessed.

QP1, the CM's MADs, is replayed by :mod:`softrdma.harness.replaycm`: softrdma's rdma_cm
answers the captured REQ as the passive side, compared field by field except the random
IDs and PSNs. The active side is refused (its random IDs are what every later message
names).

What is refused, and why (each :class:`Conversation` carries the reason):

* a flow with no partner (only one direction captured, or RC/UC flows that could not be
  paired): softrdma could not know what the missing side said.

The SRQ of ``srq_pingpong`` is not modelled: each QP is replayed with its own receive
queue. The wire does not show which queue a receive came from, and the packets an RC
responder sends do not depend on it.
"""

from __future__ import annotations

import ipaddress
import os
from collections import defaultdict
from dataclasses import dataclass, field
from array import array
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ..wire.opcodes import Transport
from .replay import CapturedPacket, ReplayError, ReplayResult, iter_capture, replay_side

if TYPE_CHECKING:
    from .replaydiff import ReplayDiff

__all__ = ["Conversation", "SideReplay", "conversations", "replay_conversations", "replay_file",
           "replay_one"]

QP1 = 1


def _ip(b: bytes) -> str:
    return str(ipaddress.ip_address(b))


@dataclass
class Conversation:
    """The packets two QPs exchanged (``a`` and ``b`` are ``(ip, qpn)``; a qpn of None
    means it could not be known)."""

    transport: str  # "RC", "UC" or "UD"
    a: tuple[str, int | None]
    b: tuple[str, int | None]
    packets: list[CapturedPacket] = field(default_factory=list)
    refused: str | None = None  # why it is not replayed, or None
    cm: bool = False  # the CM's MADs on QP1 (replayed by softrdma.harness.replaycm)
    #: the frame numbers of its packets when they are not held (:func:`replay_file`)
    frame_numbers: Any = field(default_factory=lambda: array("L"))

    @property
    def frames(self) -> tuple[int, int]:
        """First and last frame numbers (1-based, as tshark and ``softrdma dissect``)."""
        if self.frame_numbers:
            return self.frame_numbers[0], self.frame_numbers[-1]
        return self.packets[0].index, self.packets[-1].index

    @property
    def count(self) -> int:
        """How many packets it has (held or not)."""
        return len(self.frame_numbers) or len(self.packets)

    def endpoint(self, ip: str | None = None, qpn: int | None = None) -> tuple[str, int | None] | None:
        """The end matching ``ip`` and/or ``qpn``, or None."""
        for end in (self.a, self.b):
            if (ip is None or end[0] == ip) and (qpn is None or end[1] == qpn):
                return end
        return None

    def describe(self) -> str:
        def end(e: tuple[str, int | None]) -> str:
            return f"{e[0]} qpn {'?' if e[1] is None else hex(e[1])}"
        first, last = self.frames
        return (f"{self.transport} {end(self.a)} <-> {end(self.b)}: {self.count} "
                f"packets, frames {first}-{last}")


def conversations(capture: Iterable[CapturedPacket], *, keep: bool = True,
                  labels: dict[tuple[str, int], int] | None = None) -> list[Conversation]:
    """The capture's conversations, in order of their first packet. ``keep`` False keeps
    only each conversation's frame numbers (``frame_numbers``), not its packets: the index
    :func:`replay_file` makes in one pass over a long capture. ``labels``, if given, is
    filled with :func:`cm_flow_labels` of the same pass."""
    convs: dict[tuple, Conversation] = {}
    order: list[tuple] = []

    def conv(key: tuple, make) -> Conversation:
        if key not in convs:
            convs[key] = make()
            order.append(key)
        return convs[key]

    # connected flows: (src, dst, sport) -> packets, and the QP each is destined to
    flows: dict[tuple[bytes, bytes, int], list[Any]] = defaultdict(list)
    flow_qpn: dict[tuple[bytes, bytes, int], int] = {}
    flow_kind: dict[tuple[bytes, bytes, int], str] = {}
    for c in capture:
        p = c.pkt
        t = p.info.transport
        if t == Transport.UD:
            src, dst = (c.src, p.src_qp), (c.dst, p.dest_qp)
            key = ("UD",) + tuple(sorted([src, dst]))
            cv = conv(key, lambda: Conversation("UD", (_ip(src[0]), src[1]),
                                                (_ip(dst[0]), dst[1])))
            if keep:
                cv.packets.append(c)
            else:
                cv.frame_numbers.append(c.index)
            if QP1 in (p.src_qp, p.dest_qp):
                cv.cm = True
                if labels is not None:
                    labels.update(cm_flow_labels([c]))
            continue
        fk = (c.src, c.dst, c.sport)
        flows[fk].append(c if keep else c.index)
        flow_qpn[fk] = p.dest_qp
        flow_kind[fk] = t.name
    # pair each flow with the reverse flow on the same port (rxe), else the only one
    paired: dict[tuple, tuple] = {}
    for fk in flows:
        if fk in paired:
            continue
        src, dst, sport = fk
        rev = (dst, src, sport)
        if rev not in flows or rev in paired:
            back = [k for k in flows if k[0] == dst and k[1] == src and k not in paired
                    and flow_kind[k] == flow_kind[fk]]
            there = [k for k in flows if k[0] == src and k[1] == dst
                     and flow_kind[k] == flow_kind[fk]]
            rev = back[0] if len(back) == 1 and len(there) == 1 else None
        if rev is not None and rev != fk:
            paired[fk], paired[rev] = rev, fk
    for fk, pkts in flows.items():
        rev = paired.get(fk)
        src, dst, _ = fk
        if rev is None:
            key = ("lone", fk)
            cv = conv(key, lambda: Conversation(flow_kind[fk], (_ip(src), None),
                                                (_ip(dst), flow_qpn[fk])))
            cv.refused = ("only one direction of this flow is in the capture (or its "
                          "partner could not be told apart): nothing to answer")
        else:
            key = ("conn",) + tuple(sorted([fk, rev]))
            cv = conv(key, lambda: Conversation(flow_kind[fk], (_ip(src), flow_qpn[rev]),
                                                (_ip(dst), flow_qpn[fk])))
        if keep:
            cv.packets.extend(pkts)
        else:
            cv.frame_numbers.extend(pkts)
    out = [convs[k] for k in order]
    for cv in out:
        cv.packets.sort(key=lambda c: c.index)
        cv.frame_numbers = array("L", sorted(cv.frame_numbers))
    out.sort(key=lambda cv: cv.frames[0])
    return out


def cm_flow_labels(capture: list[CapturedPacket]) -> dict[tuple[str, int], int]:
    """``(ip, qpn) -> flow label`` from the capture's CM REQs: rdma_cm connects a QP with
    the REQ's primary path, whose flow label picks both ends' UDP source port."""
    from ..cm.messages import parse_cm  # (only when a capture has QP1 traffic)
    out: dict[tuple[str, int], int] = {}
    for c in capture:
        p = c.pkt
        if p.info.transport != Transport.UD or p.dest_qp != QP1:
            continue
        try:
            m = parse_cm(bytes(p.payload))
            if m.name != "REQ":
                continue
            out[(_ip(c.src), int(m.local_qpn))] = int(m.primary_flow_label)
        except Exception:  # not a CM MAD, or a malformed one: it decides nothing here
            continue
    return out


@dataclass
class SideReplay:
    """softrdma standing in for ``side`` of ``conversation``: the replay's result (None
    when the conversation is refused, with ``conversation.refused`` saying why)."""

    conversation: Conversation
    side: tuple[str, int | None]
    result: ReplayResult | None
    #: why the replay of this side stopped (a capture it cannot make sense of), or None
    error: str | None = None
    #: why this side (not the whole conversation) is not replayed, or None
    side_refused: str | None = None

    @property
    def refused(self) -> str | None:
        """Why this side is not replayed (None: it was, or it failed: see ``error``)."""
        return self.side_refused or (self.conversation.refused if self.result is None
                                     and self.error is None else None)

    @property
    def ok(self) -> bool:
        return self.result is not None and not self.result.mismatches

    def diff(self) -> "ReplayDiff | None":
        """The differences field by field (:mod:`softrdma.harness.replaydiff`)."""
        if self.result is None:
            return None
        from .replaydiff import diff_replay
        return diff_replay(self.result, self.side[0])


def replay_conversations(capture: list[CapturedPacket], *, ip: str | None = None,
                         qpn: int | None = None, device_name: str = "replay0",
                         inline: bool = False) -> Iterator[SideReplay]:
    """Replay every conversation of ``capture``, softrdma standing in for each end in
    turn, or only for the end at ``ip`` and/or ``qpn`` (conversations without such an
    end are skipped). Refused conversations are yielded with ``result=None``."""
    labels = cm_flow_labels(capture)
    convs = conversations(capture)
    yield from _replay_all(convs, labels, None, ip=ip, qpn=qpn, device_name=device_name,
                           inline=inline)


def replay_file(path: str, *, ip: str | None = None, qpn: int | None = None,
                device_name: str = "replay0", inline: bool = False,
                warnings: list[str] | None = None,
                index: list[Conversation] | None = None) -> Iterator[SideReplay]:
    """:func:`replay_conversations` on the capture file ``path``, in bounded memory: a first
    pass keeps only each conversation's frame numbers (and the CM REQs' flow labels); then
    each conversation replayed is read again, alone, replayed, and let go before the next.
    What is held at once: the index (a few bytes per packet) and one conversation's packets
    with its replay. A file cut inside a record is read up to the cut (``warnings`` gets a
    line saying so); ``index``, if given, gets every conversation found."""
    labels: dict[tuple[str, int], int] = {}
    convs = conversations(iter_capture(path, warnings), keep=False, labels=labels)
    if index is not None:
        index.extend(convs)
    yield from _replay_all(convs, labels, path, ip=ip, qpn=qpn, device_name=device_name,
                           inline=inline)


def _replay_all(convs: list[Conversation], labels: dict[tuple[str, int], int],
                path: str | None, *, ip: str | None, qpn: int | None, device_name: str,
                inline: bool) -> Iterator[SideReplay]:
    # rdma_cm made the connections, but a REQ may be missing: the label is then the port's
    by_cm = any(cv.cm for cv in convs)
    for cv in convs:
        if ip is not None or qpn is not None:
            end = cv.endpoint(ip, qpn)
            if end is None:
                continue
            sides = [end]
        else:
            sides = [cv.a, cv.b]
        if path is not None and not cv.packets:
            wanted = set(cv.frame_numbers)
            cv.packets = [c for c in iter_capture(path, []) if c.index in wanted]
        yield from _replay_sides(cv, sides, labels, by_cm, device_name, inline)
        if path is not None:
            cv.packets = []  # let the conversation go: the next one is read on its own


def _replay_sides(cv: Conversation, sides: list[tuple[str, int | None]],
                  labels: dict[tuple[str, int], int], by_cm: bool, device_name: str,
                  inline: bool) -> Iterator[SideReplay]:
    for side in sides:
        if cv.refused:
            yield SideReplay(cv, side, None)
            continue
        # the REQ came from either end
        fl = labels.get(cv.a, labels.get(cv.b, None if by_cm else 0))
        yield replay_one(cv, side, device_name=device_name, inline=inline, flow_label=fl)


def replay_one(cv: Conversation, side: tuple[str, int | None], *, device_name: str,
               inline: bool = False, flow_label: int | None = 0) -> SideReplay:
    """softrdma in place of ``side`` of ``cv``. A capture the replay cannot make sense of
    (garbled beyond what it reconstructs) gives a :class:`SideReplay` with ``error`` set,
    never an exception: a replay tool must survive any capture."""
    try:
        if cv.cm:
            from .replaycm import is_passive, replay_cm
            passive = is_passive(cv.packets, side[0])
            if passive is None:
                return SideReplay(cv, side, None, side_refused=(
                    "QP1 (the CM): the capture shows no REQ or SIDR_REQ (lost, or sent "
                    "before the capture began): nothing for softrdma's CM to answer"))
            if not passive:
                return SideReplay(cv, side, None, side_refused=(
                    "QP1 (the CM): softrdma answers the captured REQ as the passive side; "
                    "this side sent it (its comm ID, PSN and port are random per run)"))
            return SideReplay(cv, side, replay_cm(cv.packets, side[0], device_name=device_name))
        return SideReplay(cv, side, replay_side(cv.packets, side[0], device_name=device_name,
                                                inline=inline, flow_label=flow_label))
    except ReplayError as e:
        return SideReplay(cv, side, None, error=str(e))
    except Exception as e:  # noqa: BLE001 - a softrdma bug or an unforeseen capture: say so
        if os.environ.get("SOFTRDMA_DEBUG"):
            raise
        return SideReplay(cv, side, None, error=f"the replay stopped: {type(e).__name__}: {e}")
