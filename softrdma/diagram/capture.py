"""Diagrams from a capture file: every RoCE frame an arrow, grouped by conversation.

    from softrdma.diagram.capture import from_capture
    d = from_capture("pcaps/linux-rxe/read_bw.pcap")          # every conversation
    d = from_capture(path, conversation=2)                    # the second one only
    d = from_capture(load(path, Stretch.parse_frames("100-140")))  # 41 frames of a long one

What a single capture point can and cannot show. A capture sees each packet once, at the
place it was taken, so the arrow's two ends carry the same time (it is drawn level) and a
packet is never seen to be lost: a loss shows only as its consequences, a retransmission
(the same request PSN again) or a NAK. Retransmissions and duplicates are marked by
:mod:`.marks`; a frame whose ICRC does not match its headers is marked ``bad-icrc``.

Lanes are the conversations' endpoints as :func:`softrdma.harness.conversations.conversations`
pairs them (one per pair of QPs, UDP source ports telling RC connections apart; a QP the
wire never names reads ``qpn ?``). Frames that are not RoCE are skipped; frames that claim
to be RoCE and do not decode are counted in the diagram's remarks.

A :class:`~.stretch.Stretch` reads only part of a long capture, as a stream: the frames
before it are skipped undecoded and reading stops at the first frame past its end. The
lanes are those of the conversations the stretch shows, and the title names the stretch.
What the stretch cannot know (a packet before it was a retransmission's original) is not
marked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO

from ..harness.conversations import Conversation, conversations
from ..harness.replay import CapturedPacket
from ..wire.dissect import frame_record
from ..wire.frames import FrameError, decode_frame
from ..wire.packet import DecodeError, parse
from ..wire.pcap import read_pcap
from .describe import PAYLOAD, arrow_of
from .marks import Marker
from .model import Diagram, Lane
from .stretch import Stretch

__all__ = ["CaptureFile", "load", "from_capture", "ConversationError", "Stretch"]


class ConversationError(ValueError):
    """A ``conversation`` or ``qpn`` filter that matches nothing in the capture."""


@dataclass
class CaptureFile:
    """A capture read once: its RoCE packets, each frame's dissector record, the
    conversations, and how many frames did not decode."""

    path: str
    packets: list[CapturedPacket]
    records: dict[int, dict]  # frame number -> softrdma dissect's record
    times: dict[int, float]  # frame number -> capture time, seconds
    conversations: list[Conversation]
    undecodable: int
    stretch: Stretch | None = None  # the part read, when not the whole capture


def load(path: str | os.PathLike[str] | BinaryIO, stretch: Stretch | None = None,
         ) -> CaptureFile:
    """Read ``path`` (pcap or pcapng; a path or a binary file object), all of it or only
    ``stretch`` (reading stops after its end). Raises
    :class:`softrdma.wire.pcap.PcapError` (and the OSErrors of ``open``) when it cannot be
    read."""
    packets: list[CapturedPacket] = []
    records: dict[int, dict] = {}
    times: dict[int, float] = {}
    bad = 0
    source = read_pcap(path)
    if stretch is not None:
        source = stretch.select(source)
    for r in source:
        try:
            f = decode_frame(r.data, r.linktype)
        except FrameError:
            continue  # not a whole IP/UDP datagram: nothing to draw
        if f is None or not f.is_roce:
            continue
        roce = bytes(f.payload)
        try:
            pkt = parse(roce)
        except DecodeError:
            bad += 1
            continue
        packets.append(CapturedPacket(r.index, f.ip_src, f.ip_dst, f.sport, f.ip_id, roce, pkt))
        records[r.index] = frame_record(r.index, r.timestamp, f, parse(roce), PAYLOAD)
        times[r.index] = r.timestamp
    name = getattr(path, "name", path)  # a file object's name, when it has one
    return CaptureFile(str(name), packets, records, times, conversations(packets), bad,
                       stretch)


def _ends(cv: Conversation, c: CapturedPacket, rec: dict) -> tuple[Lane, Lane]:
    """Which of the conversation's ends sent ``c``: the one whose address is the source,
    and when both ends share an address (two QPs on one host), the one the packet is not
    addressed to."""
    a, b = Lane(*cv.a), Lane(*cv.b)
    if a.ip != b.ip:
        return (a, b) if rec["src"] == a.ip else (b, a)
    return (b, a) if rec["qpn"] == a.qpn else (a, b)


def from_capture(source: str | os.PathLike[str] | CaptureFile, *,
                 conversation: int | None = None, qpn: int | None = None) -> Diagram:
    """The diagram of a capture: all conversations, or the ``conversation``-th (1-based,
    the order ``softrdma diagram --list`` prints), or those with an end whose QP number is
    ``qpn``. Raises :class:`ConversationError` when the filter matches nothing."""
    cap = source if isinstance(source, CaptureFile) else load(source)
    convs = list(enumerate(cap.conversations, 1))
    if conversation is not None:
        if not 1 <= conversation <= len(convs):
            raise ConversationError(f"no conversation {conversation}: the capture has "
                                    f"{len(convs)}")
        convs = [convs[conversation - 1]]
    if qpn is not None:
        convs = [(i, cv) for i, cv in convs if qpn in (cv.a[1], cv.b[1])]
        if not convs:
            raise ConversationError(f"no conversation has an end with qpn {qpn:#x}")
    name = os.path.basename(cap.path)
    if cap.stretch is not None:
        name = f"{name} ({cap.stretch.describe()})"
    title = name if len(convs) != 1 else f"{name}: conversation {convs[0][0]}, " \
        f"{convs[0][1].describe()}"
    d = Diagram(title)
    tagged = []
    for _, cv in convs:
        for end in (cv.a, cv.b):
            d.lane(*end)
        for c in cv.packets:
            rec = cap.records[c.index]
            tagged.append(arrow_of(rec, *_ends(cv, c, rec), rec["time"], rec["time"]))
    tagged.sort(key=lambda a: a.frame or 0)
    marker = Marker()
    for a in tagged:
        marker.mark(a)
    d.arrows = tagged
    if len(convs) > 1:
        d.remarks.append(f"{len(convs)} conversations side by side; "
                         f"--conversation N draws one (--list shows them)")
    if cap.stretch is not None:
        d.remarks.append(f"{cap.stretch.describe()} only: {len(tagged)} packets; a "
                         f"retransmission of a packet sent before the stretch is not marked")
    if cap.undecodable:
        d.remarks.append(f"{cap.undecodable} frames to UDP port 4791 did not decode as RoCE "
                         f"and are not drawn")
    return d
