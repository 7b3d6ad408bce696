"""The text form of a fault plan: ``SOFTRDMA_FAULTS`` and the tools' ``--fault`` option.

Grammar (whitespace around tokens is ignored; names are case-insensitive except opcodes,
which are matched upper-cased anyway)::

    spec     := clause { ";" clause }
    clause   := "seed=" INT
              | dir ":" entry { "," entry }
    dir      := "tx" | "rx" | "both"
    entry    := setting "=" value                         random impairment, per packet
              | action [ "(" [ arg { "," arg } ] ")" ]    targeted rule
    setting  := loss | duplicate | reorder | corrupt      probabilities 0..1 (or "5%")
              | delay | jitter | reorder_delay            seconds ("0.002", "2ms", "50us")
              | loss_kind                                 "all" or "requests" (ACKs and
                                                          responses are never lost at random)
    action   := drop | duplicate | delay | corrupt
    arg      := [ key "=" ] value                         the first positional arg is opcode
    key      := opcode | nth | count | qpn | psn | seconds | copies | field | value | fix_icrc

Examples::

    tx:loss=0.05;seed=7
    rx:drop(RC_RDMA_READ_RESPONSE_FIRST)
    tx:drop(ACKNOWLEDGE, nth=2, count=3), delay=1ms
    rx:corrupt(SEND_ONLY, field=icrc); tx:delay(ACKNOWLEDGE, seconds=5ms, count=0)

:func:`parse_spec` raises :class:`~softrdma.soft.faultrules.FaultError` naming the token
it could not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .faultrules import ACTIONS, FaultError, Rule

__all__ = ["FaultSpec", "parse_spec", "SETTINGS", "parse_seconds"]

#: random impairments by name: the parser for their value
PROBABILITIES = ("loss", "duplicate", "reorder", "corrupt")
TIMES = ("delay", "jitter", "reorder_delay")
SETTINGS = PROBABILITIES + TIMES + ("loss_kind",)
LOSS_KINDS = ("all", "requests")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_INT_ARGS = ("nth", "count", "qpn", "psn", "copies", "value")
_ARGS = ("opcode", "seconds", "field", "fix_icrc") + _INT_ARGS
_ENTRY = re.compile(r"^([A-Za-z_]+)\s*(?:\((.*)\))?$", re.S)


@dataclass
class FaultSpec:
    """A parsed spec: the seed (None: keep the device's), the settings and the rules, each
    with its direction (``"tx"`` or ``"rx"``), in the order written."""

    seed: int | None = None
    settings: list[tuple[str, str, float | str]] = field(default_factory=list)
    rules: list[tuple[str, Rule]] = field(default_factory=list)


def _split(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside parentheses."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise FaultError(f"unbalanced ')' in {text.strip()!r}")
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise FaultError(f"unbalanced '(' in {text.strip()!r}")
    out.append("".join(cur))
    return out


def parse_seconds(text: str, what: str) -> float:
    """``0.002``, ``2ms``, ``50us``, ``1s``: seconds, not negative."""
    t = text.strip().lower()
    m = re.fullmatch(r"([0-9.e+-]+)\s*(s|ms|us|ns)?", t)
    try:
        v = float(m.group(1)) * _UNITS[m.group(2) or "s"] if m else None
    except ValueError:
        v = None
    if v is None or not v >= 0 or v == float("inf"):
        raise FaultError(f"{what}={text.strip()!r}: not a time (seconds, or with ms/us/ns)")
    return v


def _probability(text: str, what: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise FaultError(f"{what}={t!r}: not a probability (0..1, or a percentage)")
    return v


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip(), 0)
    except ValueError:
        raise FaultError(f"{what}={text.strip()!r}: not an integer") from None


def _bool(text: str, what: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise FaultError(f"{what}={text.strip()!r}: not a boolean (0/1, true/false)")


def _rule(action: str, body: str | None, entry: str) -> Rule:
    kw: dict[str, object] = {}
    args = [a.strip() for a in _split(body, ",")] if body and body.strip() else []
    for i, arg in enumerate(args):
        key, eq, val = arg.partition("=")
        if not eq:
            if i:
                raise FaultError(f"{arg!r} in {entry!r}: only the first argument (the opcode) "
                                 f"goes without a name")
            key, val = "opcode", arg
        key = key.strip().lower()
        if key not in _ARGS:
            raise FaultError(f"unknown argument {key!r} in {entry!r} (one of {', '.join(_ARGS)})")
        if key in kw:
            raise FaultError(f"{key!r} given twice in {entry!r}")
        if key in _INT_ARGS:
            kw[key] = _int(val, key)
        elif key == "seconds":
            kw[key] = parse_seconds(val, key)
        elif key == "fix_icrc":
            kw[key] = _bool(val, key)
        elif key == "field":
            kw[key] = val.strip().lower()
        else:
            kw[key] = val.strip()
    if action == "delay" and "seconds" not in kw:
        raise FaultError(f"{entry!r}: delay needs seconds=...")
    try:
        return Rule(action, **kw)  # type: ignore[arg-type]
    except FaultError as e:
        raise FaultError(f"{entry!r}: {e}") from None


def parse_spec(text: str) -> FaultSpec:
    """Read a spec (see the module docstring); FaultError names the token it cannot read."""
    spec = FaultSpec()
    for clause in _split(text, ";"):
        clause = clause.strip()
        if not clause:
            continue
        head, colon, rest = clause.partition(":")
        if not colon:
            key, eq, val = clause.partition("=")
            if eq and key.strip().lower() == "seed":
                spec.seed = _int(val, "seed")
                continue
            raise FaultError(f"{clause!r}: expected 'tx:...', 'rx:...', 'both:...' or 'seed=N'")
        d = head.strip().lower()
        if d not in ("tx", "rx", "both"):
            raise FaultError(f"unknown direction {head.strip()!r} in {clause!r} "
                             f"(tx, rx or both)")
        dirs = ("tx", "rx") if d == "both" else (d,)
        entries = [e.strip() for e in _split(rest, ",")]
        if not any(entries):
            raise FaultError(f"{clause!r}: nothing after '{head.strip()}:'")
        for entry in entries:
            if not entry:
                raise FaultError(f"empty entry in {clause!r}")
            name, eq, val = entry.partition("=")
            name = name.strip().lower()
            if eq and "(" not in name:
                for di in dirs:
                    spec.settings.append((di, name, _setting(name, val, entry)))
                continue
            m = _ENTRY.match(entry)
            if not m or m.group(1).lower() not in ACTIONS:
                word = (m.group(1) if m else entry).strip()
                raise FaultError(f"unknown fault {word!r} in {clause!r} (settings: "
                                 f"{', '.join(SETTINGS)}; rules: "
                                 f"{', '.join(a + '(...)' for a in ACTIONS)})")
            for di in dirs:  # one Rule per direction: each counts its own packets
                spec.rules.append((di, _rule(m.group(1).lower(), m.group(2), entry)))
    return spec


def _setting(name: str, val: str, entry: str) -> float | str:
    if name in PROBABILITIES:
        return _probability(val, name)
    if name in TIMES:
        return parse_seconds(val, name)
    if name == "loss_kind":
        v = val.strip().lower()
        if v not in LOSS_KINDS:
            raise FaultError(f"loss_kind={val.strip()!r}: one of {', '.join(LOSS_KINDS)}")
        return v
    raise FaultError(f"unknown setting {name!r} in {entry!r} (one of {', '.join(SETTINGS)}; "
                     f"rules are written {', '.join(a + '(...)' for a in ACTIONS)})")
