"""Formatting a :class:`~softrdma.check.CheckResult`: text for people, JSON lines for tools.

Text: one line per violation, ``frame N: RULE-ID (reference): message [conversation]``,
then one summary line per flow. JSON: one object per violation (``frame rule reference
message qp``), then one ``{"summary": ...}`` object per flow and a final ``{"result": ...}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Iterator

from . import CheckResult

__all__ = ["text_lines", "json_lines"]


def text_lines(result: CheckResult) -> Iterator[str]:
    for v in result.violations:
        where = f" [{v.qp}]" if v.qp else ""
        yield f"frame {v.frame}: {v.rule} ({v.reference}): {v.message}{where}"
    if result.violations:
        yield ""
    for s in result.flows:
        what = (f"{s.requests} request(s), {s.responses} response(s)" if s.transport != "UD"
                else f"{s.requests} datagram(s)")
        mtu = f", MTU {s.mtu}" if s.mtu else ""
        verdict = "ok" if not s.violations else f"{s.violations} violation(s)"
        yield f"{s.transport} {s.label}: {what}{mtu}: {verdict}"
    yield (f"{result.frames} frames, {result.packets} RoCE packets: "
           + ("clean" if result.clean else f"{len(result.violations)} violation(s)"))


def json_lines(result: CheckResult) -> Iterator[str]:
    for v in result.violations:
        yield json.dumps(v.to_dict())
    for s in result.flows:
        yield json.dumps({"summary": asdict(s)})
    yield json.dumps({"result": {"frames": result.frames, "packets": result.packets,
                                 "violations": len(result.violations),
                                 "clean": result.clean}})
