"""The neutral event model every diagram is drawn from: lanes, arrows and notes.

A sequence diagram of RDMA traffic has three kinds of things, whatever produced them (a
capture, a run on the simulated network, a JSON-lines trace):

* a :class:`Lane` per endpoint, ``"10.0.0.1 qpn 0x11"``: one vertical line, time flowing
  down;
* an :class:`Arrow` per packet, from the sender's lane at the time it left to the
  receiver's lane at the time it arrived (``recv_time`` None: it never arrived), labelled
  with what the transport cares about: opcode, PSN, AckReq and the AETH;
* a :class:`Note` on a lane at a time: a QP state change, a completion, a timer that fired.

Renderers (:mod:`.svg`, :mod:`.html`, :mod:`.mermaid`) read only this model, and adapters
(:mod:`.capture`, :mod:`.simrec`, :mod:`.events`) only build it, so a new source or a new
output format is one module that knows nothing of the others.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Kind", "Lane", "Arrow", "Note", "Diagram"]


class Kind(str, enum.Enum):
    """What happened to a packet, as far as the source of the diagram can tell.

    From a single capture point nothing is ever seen to be lost (a packet is only on the
    wire the capture watched); a capture shows retransmissions and duplicates. A run on the
    simulated network knows every fate, because the network decided it."""

    NORMAL = "normal"
    RETRANSMISSION = "retransmission"  # a request PSN its sender had sent before
    DUPLICATE = "duplicate"  # a second copy: the network's, or a response repeated
    LOST = "lost"  # dropped on the way (recv_time is None)
    BAD_ICRC = "bad-icrc"  # arrived corrupted; the receiver's ICRC check drops it


@dataclass(frozen=True)
class Lane:
    """An endpoint: an address and a QP number (None when the wire did not say it)."""

    ip: str
    qpn: int | None = None

    @property
    def label(self) -> str:
        return f"{self.ip} qpn {'?' if self.qpn is None else hex(self.qpn)}"


@dataclass
class Arrow:
    """One packet. ``opcode`` is the opcode table's name (``RC_RDMA_WRITE_FIRST``);
    ``aeth`` the syndrome in words (``ACK credit=31``, ``NAK PSN_SEQ_ERR``) with ``msn``;
    ``frame`` the capture's 1-based frame number when it came from one; ``detail`` the
    one-line dissector format, shown as the arrow's tooltip. ``kind`` is the one thing a
    picture marks; a lost or corrupted retransmission keeps ``retransmit`` True as well."""

    src: Lane
    dst: Lane
    send_time: float
    recv_time: float | None
    opcode: str
    psn: int
    ackreq: bool = False
    aeth: str | None = None
    msn: int | None = None
    length: int = 0
    kind: Kind = Kind.NORMAL
    frame: int | None = None
    detail: str = ""
    retransmit: bool = False  # a request PSN sent before, whatever its fate (kind) was
    #: annotations drawn beside the arrow, ``(kind, text)``: what a caller (the checker's
    #: recovery report, say) has to say about this packet; see :mod:`.annotate`
    marks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def is_nak(self) -> bool:
        return self.aeth is not None and "NAK" in self.aeth

    @property
    def short_opcode(self) -> str:
        """``RC_RDMA_WRITE_FIRST`` -> ``WRITE_FIRST``, ``RC_ACKNOWLEDGE`` -> ``ACK``: the
        transport prefix and "RDMA" say nothing the lanes do not, and short labels fit
        beside an arrow."""
        name = self.opcode
        for prefix in ("RC_", "UC_", "UD_", "RD_", "XRC_"):
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        name = name.replace("RDMA_", "").replace("ACKNOWLEDGE", "ACK")
        return name.replace("_WITH_IMMEDIATE", "_IMM").replace("_WITH_INVALIDATE", "_INV")

    @property
    def label(self) -> str:
        """The text beside the arrow: ``WRITE_FIRST psn 100 A``, ``ACK psn 102 msn 3`` or
        ``ACK psn 102 NAK PSN_SEQ_ERROR msn 3`` (a plain ACK's syndrome is left out: the
        opcode says it)."""
        parts = [self.short_opcode, f"psn {self.psn}"]
        if self.ackreq:
            parts.append("A")
        if self.aeth is not None:
            syn = self.aeth
            if syn.startswith("ACK "):
                syn = ""
            parts.append(" ".join(x for x in (syn, f"msn {self.msn}") if x))
        return " ".join(parts)


@dataclass
class Note:
    """Something that happened on one endpoint at a time: ``kind`` is ``state``,
    ``completion``, ``timer``, ``nak`` or ``info``; ``text`` is what the box says."""

    lane: Lane
    time: float
    text: str
    kind: str = "info"


@dataclass
class Diagram:
    """What one picture shows. ``lanes`` are in column order, left to right; ``arrows``
    and ``notes`` in any order (renderers sort by time). ``remarks`` are lines shown under
    the title: what was left out (``--max-packets``), frames that did not decode, so a
    picture never hides that it is partial. ``summary`` is a block of lines drawn under
    them: what the arrows' marks add up to (:func:`.annotate.annotate`)."""

    title: str
    lanes: list[Lane] = field(default_factory=list)
    arrows: list[Arrow] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    remarks: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    def lane(self, ip: str, qpn: int | None) -> Lane:
        """The lane for ``(ip, qpn)``, added on the right when it is new."""
        ln = Lane(ip, qpn)
        if ln not in self.lanes:
            self.lanes.append(ln)
        return ln

    def counts(self) -> dict[str, int]:
        """Arrows per kind, for legends and summaries."""
        out = {k.value: 0 for k in Kind}
        for a in self.arrows:
            out[a.kind.value] += 1
        return out

    def truncate(self, max_packets: int | None) -> "Diagram":
        """Keep the first ``max_packets`` arrows (in time order) and the notes up to the
        last kept one; record what was cut."""
        if max_packets is None or len(self.arrows) <= max_packets:
            return self
        arrows = sorted(self.arrows, key=lambda a: a.send_time)
        kept, dropped = arrows[:max_packets], arrows[max_packets:]
        end = dropped[0].send_time
        notes = [n for n in self.notes if n.time < end]
        first = dropped[0].frame
        where = f" from frame {first} on" if first is not None else ""
        lost_notes = len(self.notes) - len(notes)
        also = f" and {lost_notes} notes" if lost_notes else ""
        cut = (f"showing the first {max_packets} of {len(arrows)} packets: "
               f"{len(dropped)} packets{where}{also} left out")
        return Diagram(self.title, list(self.lanes), kept, notes, self.remarks + [cut],
                       list(self.summary))
