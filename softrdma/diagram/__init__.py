"""Sequence diagrams of RoCE traffic: what happened between the endpoints, drawn.

Sources build a neutral :class:`~.model.Diagram` (lanes, arrows, notes); renderers draw
it. Nothing here changes what it draws.

* :func:`from_capture` (:mod:`.capture`): a pcap/pcapng file, by conversation;
* :class:`SimRecorder` (:mod:`.simrec`): a run on the simulated network, true losses and all;
* :func:`from_events` (:mod:`.events`): a list of dicts, e.g. a JSON-lines trace;
* :class:`Stretch` (:mod:`.stretch`): frames A-B or seconds T0-T1 of a long capture,
  read as a stream (``from_capture(load(path, stretch))``);
* :func:`annotate` (:mod:`.annotate`): marks beside the arrows of given frames and a
  summary block, e.g. the checker's recovery report through :func:`recovery_marks`;
* :func:`render` picks the renderer from a format name or a file suffix: ``svg``
  (:mod:`.svg`), ``html`` (:mod:`.html`), ``mermaid`` (:mod:`.mermaid`, ``.mmd``).

docs/diagrams.md shows what the pictures mean.
"""

from __future__ import annotations

import os

from . import html, mermaid, svg
from .annotate import Mark, annotate, recovery_marks
from .capture import from_capture
from .events import from_events, from_trace
from .model import Arrow, Diagram, Kind, Lane, Note
from .simrec import SimRecorder
from .stretch import Stretch

__all__ = ["Arrow", "Diagram", "Kind", "Lane", "Note", "SimRecorder", "from_capture", "from_trace",
           "from_events", "render", "format_for", "FORMATS", "write", "Mark", "annotate",
           "recovery_marks", "Stretch"]

#: format name -> renderer; suffixes map onto them in :func:`format_for`
FORMATS = {"svg": svg.render, "html": html.render, "mermaid": mermaid.render}
_SUFFIXES = {".svg": "svg", ".html": "html", ".htm": "html", ".mmd": "mermaid",
             ".mermaid": "mermaid"}


def format_for(path: str | os.PathLike[str]) -> str | None:
    """The format a file name's suffix asks for, or None."""
    return _SUFFIXES.get(os.path.splitext(str(path))[1].lower())


def render(d: Diagram, fmt: str) -> str:
    """``d`` drawn as ``fmt`` (``svg``, ``html`` or ``mermaid``)."""
    return FORMATS[fmt](d)


def write(d: Diagram, path: str | os.PathLike[str], fmt: str | None = None) -> str:
    """Render ``d`` into ``path`` (the format from ``fmt`` or the suffix); return the
    format used. Raises ValueError for a suffix that names no format."""
    fmt = fmt or format_for(path)
    if fmt is None:
        raise ValueError(f"{path}: cannot tell the format from the suffix (use .svg, .html "
                         f"or .mmd, or --format)")
    text = render(d, fmt)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return fmt
