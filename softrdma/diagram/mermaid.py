"""A diagram as Mermaid ``sequenceDiagram`` text, for documentation that renders Mermaid
(GitHub, GitLab, mkdocs-material).

    sequenceDiagram
        participant A as 10.0.0.1 qpn 0x11
        participant B as 10.0.0.2 qpn 0x12
        Note over A: RTS
        A->>B: WRITE_ONLY psn 100 A
        A-xB: WRITE_ONLY psn 101 A (lost)
        B->>A: ACK psn 100 msn 1

One line per packet, in the order they left: ``->>`` for a packet that arrived, ``-x``
for one that was lost; retransmissions, duplicates and bad ICRCs say so in brackets. An
arrow's marks (:mod:`.annotate`) follow it as a note over its two lanes, and the summary
block is ``%%`` comment lines after the remarks.
Mermaid has no slope, so arrival times are not shown; the SVG and HTML renderers show
them.
"""

from __future__ import annotations

from .model import Diagram, Kind

__all__ = ["render"]

_TAG = {Kind.RETRANSMISSION: "retransmit", Kind.DUPLICATE: "duplicate", Kind.LOST: "lost",
        Kind.BAD_ICRC: "bad ICRC"}


def _text(s: str) -> str:
    # ';' ends a statement and '#' starts an entity in Mermaid messages
    return s.replace(";", ",").replace("#", "no. ")


def render(d: Diagram) -> str:
    names = {ln: f"P{i + 1}" for i, ln in enumerate(d.lanes)}
    out = ["sequenceDiagram"]
    for ln, name in names.items():
        out.append(f"    participant {name} as {_text(ln.label)}")
    for r in d.remarks + d.summary:
        out.append(f"    %% {r}")
    # notes and departures in time order; at one instant notes first (layout's order)
    items: list[tuple[float, int, int, str]] = []
    for i, n in enumerate(d.notes):
        items.append((n.time, 1, i, f"    Note over {names[n.lane]}: {_text(n.text)}"))
    for i, a in enumerate(d.arrows):
        head = "-x" if a.kind == Kind.LOST else "->>"
        tags = ([_TAG[a.kind]] if a.kind in _TAG else [])
        if a.retransmit and a.kind != Kind.RETRANSMISSION:
            tags.insert(0, "retransmit")
        tag = f" ({', '.join(tags)})" if tags else ""
        line = f"    {names[a.src]}{head}{names[a.dst]}: {_text(a.label)}{tag}"
        if a.marks:  # one note under the arrow; Mermaid breaks lines at <br/>
            marks = "<br/>".join(_text(f"\u2691 {k}: {t}") for k, t in a.marks)
            line += f"\n    Note over {names[a.src]},{names[a.dst]}: {marks}"
        items.append((a.send_time, 2, i, line))
    items.sort(key=lambda x: x[:3])
    out += [line for *_, line in items]
    return "\n".join(out) + "\n"
