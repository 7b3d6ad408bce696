"""Formatting a :class:`~softrdma.check.CheckResult`: text for people, JSON lines for tools.

Text: one line per violation, ``frame N: RULE-ID (reference): message [conversation]``,
then one summary line per flow, followed by its recovery paragraph when it lost anything
(and, with ``events``, one line per recovery event). JSON: one object per violation
(``frame rule reference message qp``), then one ``{"summary": ...}`` object per flow (its
``recovery`` inside), with ``events`` one ``{"event": ...}`` object per recovery event,
and a final ``{"result": ...}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Iterator

from . import CheckResult
from .recovery import FlowRecovery

__all__ = ["text_lines", "json_lines"]


def _in(frames: tuple[int, int] | None, frame: int) -> bool:
    return frames is None or frames[0] <= frame <= frames[1]


def text_lines(result: CheckResult, *, events: bool = False,
               frames: tuple[int, int] | None = None) -> Iterator[str]:
    """``events``: list each flow's recovery events (those in ``frames`` only, if given)."""
    for v in result.violations:
        where = f" [{v.qp}]" if v.qp else ""
        yield f"frame {v.frame}: {v.rule} ({v.reference}): {v.message}{where}"
    if result.violations:
        yield ""
    rec = _recovery_by_label(result)
    for s in result.flows:
        what = (f"{s.requests} request(s), {s.responses} response(s)" if s.transport != "UD"
                else f"{s.requests} datagram(s)")
        mtu = f", MTU {s.mtu}" if s.mtu else ""
        verdict = "ok" if not s.violations else f"{s.violations} violation(s)"
        yield f"{s.transport} {s.label}: {what}{mtu}: {verdict}"
        fr = rec.get((s.transport, s.label))
        if fr is not None and fr.eventful:
            yield f"  recovery: {fr.text()}"
            if events:
                for e in fr.events:
                    if _in(frames, e.frame):
                        yield f"    frame {e.frame}: {e.kind} ({e.direction}): {e.text}"
                if fr.events_dropped:
                    yield f"    ... {fr.events_dropped} more event(s) not kept"
    lossy = sum(1 for fr in result.recovery if fr.eventful)
    losses = f", recovery in {lossy} flow(s)" if lossy else ""
    yield (f"{result.frames} frames, {result.packets} RoCE packets{losses}: "
           + ("clean" if result.clean else f"{len(result.violations)} violation(s)"))


def _recovery_by_label(result: CheckResult) -> dict[tuple[str, str], FlowRecovery]:
    return {(fr.transport, fr.label): fr for fr in result.recovery}


def json_lines(result: CheckResult, *, events: bool = False,
               frames: tuple[int, int] | None = None) -> Iterator[str]:
    for v in result.violations:
        yield json.dumps(v.to_dict())
    rec = _recovery_by_label(result)
    for s in result.flows:
        d = asdict(s)
        fr = rec.get((s.transport, s.label))
        if fr is not None:
            d["recovery"] = fr.summary()
        yield json.dumps({"summary": d})
        if events and fr is not None:
            for e in fr.events:
                if _in(frames, e.frame):
                    yield json.dumps({"event": {"flow": fr.label, **e.to_dict()}})
    yield json.dumps({"result": {"frames": result.frames, "packets": result.packets,
                                 "violations": len(result.violations),
                                 "clean": result.clean,
                                 "flows_with_recovery": sum(1 for fr in result.recovery
                                                          if fr.eventful)}})
