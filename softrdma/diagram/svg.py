"""A diagram as a self-contained SVG: no fonts, scripts or styles from anywhere else.

What the picture shows (docs/diagrams.md has an example):

* a column per endpoint, its address and QP number in a box at the top, time flowing down
  (ordered time, see :mod:`.layout`), the time since the first moment on the left;
* a packet as an arrow labelled ``opcode psn N [A] [AETH msn M]`` beside its start: blue
  requests, green responses, the label in red for a NAK;
* a retransmission dashed orange, tagged ``retransmit``; a duplicate dotted purple, tagged
  ``duplicate``; a lost packet red, ending half-way in an X; a corrupted one brown, tagged
  ``bad ICRC`` (the receiver drops it);
* notes as boxes on a lane: QP states (blue), completions (green), timers (yellow);
* every arrow's tooltip is the ``softrdma dissect`` line of its packet;
* marks (:mod:`.annotate`: the checker's recovery report, say) under the arrow of their
  frame, one line each, ``⚑ kind: text``, and the summary block under the title.

Each arrow is a ``<g class="arrow KIND">`` with ``data-psn``, ``data-opcode`` and
``data-frame``, so a page script or a test can find them; its marks are
``<text class="mark" data-kind="KIND">`` inside that group.
"""

from __future__ import annotations

from dataclasses import replace
from xml.sax.saxutils import escape

from .layout import Geometry, Layout, layout
from .model import Arrow, Diagram, Kind, Note

__all__ = ["render", "style_key", "STYLE", "KIND_STYLE", "LEGEND"]

SVG_NS = "http://www.w3.org/2000/svg"
FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"

#: colour and dash of each kind of arrow (requests and responses differ when normal)
KIND_STYLE: dict[str, tuple[str, str]] = {
    "request": ("#1f4e9c", ""),
    "response": ("#2e7d32", ""),
    Kind.RETRANSMISSION.value: ("#d35400", "7 4"),
    Kind.DUPLICATE.value: ("#7b1fa2", "2 3"),
    Kind.LOST.value: ("#c62828", ""),
    Kind.BAD_ICRC.value: ("#8d6e63", "5 3"),
}
#: the legend's entries: (style key, text)
LEGEND = [
    ("request", "request"),
    ("response", "response (ACK, READ response)"),
    (Kind.RETRANSMISSION.value, "retransmission"),
    (Kind.DUPLICATE.value, "duplicate"),
    (Kind.LOST.value, "lost (X where it vanished)"),
    (Kind.BAD_ICRC.value, "bad ICRC (the receiver drops it)"),
]
#: how far across a lost packet's arrow goes before its X: past the labels of the arrows
#: that follow it (they start at the same lane), so the X is never hidden under one
LOSS_AT = 0.7
TAG = {Kind.RETRANSMISSION: "retransmit", Kind.DUPLICATE: "duplicate", Kind.LOST: "lost",
       Kind.BAD_ICRC: "bad ICRC"}
#: colours of marks by kind (the recovery report's kinds); others are grey
MARK_COLOUR = {"lost-before": "#c62828", "lost-after": "#c62828", "nak": "#c62828",
               "rnr-nak": "#b26a00", "go-back": "#d35400", "timeout": "#b26a00",
               "duplicate": "#7b1fa2", "unresolved": "#555555"}
NOTE_FILL = {"state": "#dbe8fb", "completion": "#dcf2dc", "timer": "#fff3c4", "nak": "#fbdada",
             "info": "#eeeeee"}
STYLE = f"""
text {{ font-family: {FONT}; font-size: 12px; fill: #222; }}
.title {{ font-size: 16px; font-weight: bold; }}
.lane-head {{ font-weight: bold; }}
.tick, .gap {{ fill: #666; font-size: 11px; }}
.nak {{ fill: #c62828; font-weight: bold; }}
/* a white halo, so a label stays readable where an earlier arrow crosses it */
text.label {{ paint-order: stroke; stroke: white; stroke-width: 4px;
  stroke-linejoin: round; }}
g.arrow:hover line, g.arrow:hover path.shaft {{ stroke-width: 3; }}
"""


def style_key(a: Arrow) -> str:
    if a.kind != Kind.NORMAL:
        return a.kind.value
    return "response" if ("ACK" in a.short_opcode or "RESPONSE" in a.short_opcode) \
        else "request"


def _marker_id(key: str) -> str:
    return f"head-{key}"


def _defs() -> list[str]:
    out = ["<defs>"]
    for key, (colour, _) in KIND_STYLE.items():
        out.append(f'<marker id="{_marker_id(key)}" viewBox="0 0 10 10" refX="10" refY="5" '
                   f'markerWidth="8" markerHeight="8" orient="auto-start-reverse">'
                   f'<path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>')
    out.append("</defs>")
    return out


def _arrow(a: Arrow, lay: Layout, lane_index: dict, g: Geometry) -> list[str]:
    x1 = lay.lane_x[lane_index[a.src]]
    x2 = lay.lane_x[lane_index[a.dst]]
    y1, y2 = lay.arrow_y[id(a)]
    key = style_key(a)
    colour, dash = KIND_STYLE[key]
    rightward = x2 >= x1
    attrs = (f'class="arrow {a.kind.value}" data-kind="{a.kind.value}" data-psn="{a.psn}" '
             f'data-opcode="{a.opcode}"' + (f' data-frame="{a.frame}"' if a.frame else ""))
    out = [f"<g {attrs}>", f"<title>{escape(a.detail or a.label)}</title>"]
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    if y2 is None:  # lost: the arrow stops on the way, where the packet vanished, in an X
        xm = x1 + LOSS_AT * (x2 - x1)
        ym = y1 + g.send_row / 2
        out.append(f'<line class="shaft" x1="{x1:.1f}" y1="{y1:.1f}" x2="{xm:.1f}" '
                   f'y2="{ym:.1f}" stroke="{colour}" stroke-width="1.6"{dash_attr}/>')
        r = 6
        out.append(f'<path class="loss-mark" d="M{xm - r:.1f},{ym - r:.1f} L{xm + r:.1f},'
                   f'{ym + r:.1f} M{xm - r:.1f},{ym + r:.1f} L{xm + r:.1f},{ym - r:.1f}" '
                   f'stroke="{colour}" stroke-width="3"/>')
    else:
        out.append(f'<line class="shaft" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" '
                   f'y2="{y2:.1f}" stroke="{colour}" stroke-width="1.6"{dash_attr} '
                   f'marker-end="url(#{_marker_id(key)})"/>')
    # the label sits above the arrow's start, on the side it goes to
    tx = x1 + 8 if rightward else x1 - 8
    anchor = "start" if rightward else "end"
    label = escape(a.label)
    if a.is_nak:
        label = f'<tspan class="nak">{label}</tspan>'
    tags = [TAG[a.kind]] if a.kind in TAG else []
    if a.retransmit and a.kind != Kind.RETRANSMISSION:
        tags.insert(0, "retransmit")
    tag = "".join(f' <tspan class="tag" fill="{colour}" font-weight="bold">{t}</tspan>'
                  for t in tags)
    out.append(f'<text class="label" x="{tx:.1f}" y="{y1 - 5:.1f}" '
               f'text-anchor="{anchor}">{label}{tag}</text>')
    # marks: under the arrow, in the rows layout made for them, between its two lanes
    mx = min(x1, x2) + 8
    for i, (kind, text) in enumerate(a.marks):
        colour = MARK_COLOUR.get(kind, "#555555")
        out.append(f'<text class="mark" data-kind="{escape(kind)}" x="{mx:.1f}" '
                   f'y="{y1 + 12 + g.mark_row * i:.1f}" style="fill: {colour}; '
                   f'font-size: 11px">\u2691 {escape(kind)}: {escape(text)}</text>')
    out.append("</g>")
    return out


def _note(n: Note, lay: Layout, lane_index: dict, g: Geometry) -> list[str]:
    x = lay.lane_x[lane_index[n.lane]]
    y = lay.note_y[id(n)]
    w = len(n.text) * g.char + 14
    h = 18
    # centred on the lane, but never past the picture's edges (a long note on the first
    # lane would start off the left side)
    x = min(max(x, 4 + w / 2), max(lay.width - 4 - w / 2, 4 + w / 2))
    fill = NOTE_FILL.get(n.kind, NOTE_FILL["info"])
    return [f'<g class="note {escape(n.kind)}">',
            f'<rect x="{x - w / 2:.1f}" y="{y - h + 4:.1f}" width="{w:.1f}" height="{h}" '
            f'rx="3" fill="{fill}" stroke="#888"/>',
            f'<text x="{x:.1f}" y="{y - 1:.1f}" text-anchor="middle">{escape(n.text)}</text>',
            "</g>"]


def _legend(x: float, y: float) -> list[str]:
    out = ['<g class="legend">']
    for i, (key, text) in enumerate(LEGEND):
        colour, dash = KIND_STYLE[key]
        cx = x + (i % 3) * 300
        cy = y + (i // 3) * 20
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        if key == Kind.LOST.value:
            out.append(f'<line x1="{cx:.1f}" y1="{cy:.1f}" x2="{cx + 30:.1f}" y2="{cy:.1f}" '
                       f'stroke="{colour}" stroke-width="1.6"/>'
                       f'<path d="M{cx + 26},{cy - 5} L{cx + 36},{cy + 5} M{cx + 26},{cy + 5} '
                       f'L{cx + 36},{cy - 5}" stroke="{colour}" stroke-width="3"/>')
        else:
            out.append(f'<line x1="{cx:.1f}" y1="{cy:.1f}" x2="{cx + 36:.1f}" y2="{cy:.1f}" '
                       f'stroke="{colour}" stroke-width="1.6"{dash_attr} '
                       f'marker-end="url(#{_marker_id(key)})"/>')
        out.append(f'<text x="{cx + 44:.1f}" y="{cy + 4:.1f}">{escape(text)}</text>')
    out.append("</g>")
    return out


def render(d: Diagram, g: Geometry = Geometry(), heading: bool = True) -> str:
    """The diagram as an SVG document (a string), ready to save as ``.svg`` or to inline
    in HTML (``heading=False``: the page shows the title and remarks itself)."""
    remarks = d.remarks if heading else []
    summary = d.summary if heading else []
    g = replace(g, top=g.top + 14 * (len(remarks) + len(summary)) - (0 if heading else 26))
    lay = layout(d, g)
    width = max(lay.width, 960)
    lane_index = {ln: i for i, ln in enumerate(d.lanes)}
    out = [f'<svg xmlns="{SVG_NS}" width="{width}" height="{lay.height}" '
           f'viewBox="0 0 {width} {lay.height}" class="sequence-diagram">',
           f"<title>{escape(d.title)}</title>", f"<style>{STYLE}</style>"]
    out += _defs()
    out.append(f'<rect width="{width}" height="{lay.height}" fill="white"/>')
    if heading:
        out.append(f'<text class="title" x="12" y="24">{escape(d.title)}</text>')
    for i, r in enumerate(remarks):
        out.append(f'<text class="remark" x="12" y="{42 + 14 * i}" fill="#a00">'
                   f'{escape(r)}</text>')
    if summary:
        out.append('<g class="summary">')
        for i, line in enumerate(summary):
            out.append(f'<text x="12" y="{42 + 14 * (len(remarks) + i)}" '
                       f'xml:space="preserve">{escape(line)}</text>')
        out.append("</g>")
    out += _legend(24, (42 if heading else 16) + 14 * (len(remarks) + len(summary)) + 12)
    head_y = g.top - 24
    for ln, x in zip(d.lanes, lay.lane_x):
        w = len(ln.label) * g.char + 20
        out.append(f'<line class="lane" x1="{x:.1f}" y1="{head_y:.1f}" x2="{x:.1f}" '
                   f'y2="{lay.height - 10}" stroke="#999" stroke-dasharray="4 4"/>')
        out.append(f'<rect x="{x - w / 2:.1f}" y="{head_y - 22:.1f}" width="{w:.1f}" '
                   f'height="24" rx="4" fill="#f4f4f4" stroke="#555"/>')
        out.append(f'<text class="lane-head" x="{x:.1f}" y="{head_y - 6:.1f}" '
                   f'text-anchor="middle">{escape(ln.label)}</text>')
    for y, label in lay.ticks:
        out.append(f'<text class="tick" x="{g.left - 12}" y="{y - 3:.1f}" '
                   f'text-anchor="end">{escape(label)}</text>')
    for y, label in lay.gaps:
        out.append(f'<text class="gap" x="{g.left - 12}" y="{y + 4:.1f}" text-anchor="end" '
                   f'font-style="italic">{escape(label)}</text>')
        out.append(f'<line x1="{g.left - 4}" y1="{y:.1f}" x2="{width - 20}" y2="{y:.1f}" '
                   f'stroke="#ccc" stroke-dasharray="1 5"/>')
    for n in d.notes:
        out += _note(n, lay, lane_index, g)
    for a in d.arrows:
        out += _arrow(a, lay, lane_index, g)
    out.append("</svg>")
    return "\n".join(out) + "\n"

