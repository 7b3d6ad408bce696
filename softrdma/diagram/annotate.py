"""Marks beside the arrows: what someone else has to say about a packet, drawn where it is.

The diagram knows packets; the checker knows what they mean for recovery (this gap was a
loss before the capture point, this ACK is a NAK the requester ignored, this burst is a
go-back after a timeout). :func:`annotate` puts such words on the picture: each mark
beside the arrow of its frame, and a summary block under the title that lists them all,
including those whose frame is not drawn (outside the stretch, past ``--max-packets``).

    from softrdma.diagram import annotate, from_capture
    d = annotate(from_capture("lossy.pcap"), {41: ["nak: PSN 124 lost after the capture"]})

:func:`recovery_marks` turns the checker's recovery report
(``softrdma.check.check_pcap(...).recovery``: per flow, ``events`` of ``RecoveryEvent(frame,
ts, kind, psn, count, text)``) into marks. A packet lost before the capture point has no
frame of its own; the event names the frame where the gap shows, and that is where its
mark goes ("2 packets lost before the capture point (PSN 100-101)").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .model import Diagram

__all__ = ["Mark", "annotate", "recovery_marks", "event_text"]

#: the summary lists at most this many marks one per line (the rest are counted)
SUMMARY_LINES = 40


@dataclass(frozen=True)
class Mark:
    """One annotation: the capture's ``frame`` (1-based), a short ``kind`` (``nak``,
    ``lost-before``... it picks the colour) and the ``text`` drawn."""

    frame: int
    kind: str
    text: str


MarksArg = Mapping[int, Iterable[str]] | Iterable[Mark | tuple[int, str, str]]


def _marks(marks: MarksArg) -> list[Mark]:
    if isinstance(marks, Mapping):
        return [Mark(int(f), "note", str(t)) for f, texts in marks.items() for t in texts]
    return [m if isinstance(m, Mark) else Mark(int(m[0]), str(m[1]), str(m[2])) for m in marks]


def annotate(d: Diagram, marks: MarksArg, *, heading: str = "marks") -> Diagram:
    """Put ``marks`` on ``d`` (in place; returned for chaining): ``{frame: [text, ...]}``
    or an iterable of :class:`Mark` / ``(frame, kind, text)``. Each goes beside the arrow
    of its frame; the summary block says how many of each kind, then lists them in frame
    order, saying which frames are not drawn."""
    ms = sorted(_marks(marks), key=lambda m: m.frame)
    if not ms:
        return d
    by_frame = {a.frame: a for a in d.arrows if a.frame is not None}
    drawn = 0
    for m in ms:
        a = by_frame.get(m.frame)
        if a is not None:
            a.marks.append((m.kind, m.text))
            drawn += 1
    kinds = Counter(m.kind for m in ms)
    head = f"{heading}: " + ", ".join(f"{k} \u00d7{n}" for k, n in kinds.items())
    if drawn < len(ms):
        head += f" ({len(ms) - drawn} at frames not drawn)"
    d.summary.append(head)
    for m in ms[:SUMMARY_LINES]:
        where = "" if m.frame in by_frame else " (not drawn)"
        d.summary.append(f"  frame {m.frame}{where}: {m.kind}: {m.text}")
    if len(ms) > SUMMARY_LINES:
        d.summary.append(f"  ... and {len(ms) - SUMMARY_LINES} more")
    return d


def event_text(ev: Any) -> str:
    """The words for one recovery event: its own ``text`` when it has one, else made
    from its kind, PSN and count."""
    text = getattr(ev, "text", "") or ""
    if text:
        return text
    kind, psn, count = getattr(ev, "kind", "?"), getattr(ev, "psn", None), \
        getattr(ev, "count", 1) or 1
    span = "" if psn is None else (f" (PSN {psn})" if count == 1 else
                                   f" (PSN {psn}-{(psn + count - 1) & 0xFFFFFF})")
    packets = f"{count} packet{'s' if count != 1 else ''}"
    if kind == "lost-before":
        return f"{packets} lost before the capture point{span}"
    if kind == "lost-after":
        return f"{packets} lost after the capture point{span}"
    return f"{kind}{span}"


def recovery_marks(result: Any) -> list[Mark]:
    """Marks from a check result's recovery report (``result.recovery``: a list of flows,
    each with ``label`` and ``events``). A result without one (a checker that has no
    recovery report) gives none."""
    out = []
    for flow in getattr(result, "recovery", None) or []:
        for ev in getattr(flow, "events", None) or []:
            frame = getattr(ev, "frame", None)
            if frame is None:
                continue
            out.append(Mark(int(frame), str(getattr(ev, "kind", "event")), event_text(ev)))
    return out
