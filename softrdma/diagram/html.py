"""A diagram as one HTML page: the SVG inline, a summary, and the packets as a table.

Self-contained (no script, no external font or stylesheet): open it in any browser, mail
it, attach it to an issue. Hovering an arrow shows its ``softrdma dissect`` line (the
SVG's ``<title>``) and thickens it; the table below lists the same packets, one row
each, with the frame number when they came from a capture.
"""

from __future__ import annotations

from html import escape

from . import svg
from .layout import format_time
from .model import Diagram, Kind

__all__ = ["render"]

_PAGE_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; }
.remark { color: #a00; }
table { border-collapse: collapse; font-family: monospace; font-size: 12px; margin-top: 1em; }
th, td { border-bottom: 1px solid #ddd; padding: 2px 8px; text-align: left; white-space: nowrap; }
tr.lost td { color: #c62828; } tr.retransmission td { color: #d35400; }
tr.duplicate td { color: #7b1fa2; } tr.bad-icrc td { color: #8d6e63; }
td.marks { color: #c62828; white-space: normal; }
pre.marks { font-size: 12px; background: #f8f8f8; padding: 0.5em; }
.diagram { overflow-x: auto; }
"""


#: how the summary line counts each kind
_COUNTED = {Kind.RETRANSMISSION.value: "retransmitted", Kind.DUPLICATE.value: "duplicates",
            Kind.LOST.value: "lost", Kind.BAD_ICRC.value: "with a bad ICRC"}


def _summary(d: Diagram) -> str:
    c = d.counts()
    parts = [f"{len(d.arrows)} packets"] + [f"{n} {_COUNTED[k]}" for k, n in c.items()
                                            if n and k != Kind.NORMAL.value]
    parts.append(f"{len(d.lanes)} endpoints")
    return ", ".join(parts)


def render(d: Diagram) -> str:
    t0 = min([a.send_time for a in d.arrows] + [n.time for n in d.notes] or [0.0])
    rows = []
    for i, a in enumerate(sorted(d.arrows, key=lambda a: a.send_time), 1):
        arrived = "–" if a.recv_time is None else format_time(a.recv_time - t0)
        rows.append(
            f'<tr class="{a.kind.value}"><td>{a.frame if a.frame is not None else i}</td>'
            f"<td>{format_time(a.send_time - t0)}</td><td>{arrived}</td>"
            f"<td>{escape(a.src.label)}</td><td>{escape(a.dst.label)}</td>"
            f"<td>{a.kind.value}{' (retransmit)' if a.retransmit and a.kind != Kind.RETRANSMISSION else ''}</td>"
            f"<td>{escape(a.label)}</td>"
            f'<td class="marks">{escape("; ".join(f"{k}: {t}" for k, t in a.marks))}</td>'
            f"<td>{escape(a.detail)}</td></tr>")
    remarks = "".join(f'<p class="remark">{escape(r)}</p>' for r in d.remarks)
    if d.summary:
        remarks += f'<pre class="marks">{escape(chr(10).join(d.summary))}</pre>\n'
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(d.title)}</title>
<style>{_PAGE_STYLE}</style>
</head>
<body>
<h1>{escape(d.title)}</h1>
{remarks}<p class="summary">{escape(_summary(d))}. Time flows down; hover an arrow for its
packet, decoded.</p>
<div class="diagram">
{svg.render(d, heading=False)}</div>
<h2>Packets</h2>
<table class="packets">
<tr><th>#</th><th>sent</th><th>arrived</th><th>from</th><th>to</th><th>kind</th><th>label</th><th>marks</th><th>softrdma dissect</th></tr>
{chr(10).join(rows)}
</table>
</body>
</html>
"""
