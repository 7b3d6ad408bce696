"""Field-by-field differences between two RoCE packets, for people to read.

A replay that fails says "frame 17 differs"; a person wants to know *how*: the PSN, the
AckReq bit, the MSN, the payload? :func:`field_diff` compares the headers the opcode
carries, field by field (BTH, then each extension header, then the payload and the ICRC),
and :func:`format_diff` lays the result out one field per line::

    frame 17 RC_ACKNOWLEDGE
      psn         expected 8474130    got 8474131
      msn         expected 13         got 14
"""

from __future__ import annotations

from typing import Any, Iterable

from ..wire.opcodes import Opcode
from ..wire.packet import RocePacket, parse

__all__ = ["FIELDS", "field_diff", "format_diff"]

#: (attribute, how to show it), in header order. A field the opcode does not carry reads
#: as None on both sides and is skipped.
FIELDS: tuple[tuple[str, str], ...] = (
    ("opcode", "op"), ("se", "d"), ("migreq", "d"), ("pad", "d"), ("tver", "d"),
    ("pkey", "x"), ("fecn", "d"), ("becn", "d"), ("dest_qp", "x"), ("ackreq", "d"),
    ("psn", "d"),
    ("va", "x"), ("rkey", "x"), ("dma_len", "d"),  # RETH / AtomicETH
    ("swap_add", "x"), ("compare", "x"),  # AtomicETH
    ("syndrome", "x"), ("msn", "d"),  # AETH
    ("orig", "x"),  # AtomicAckETH
    ("imm", "x"), ("ieth_rkey", "x"),  # ImmDt, IETH
    ("qkey", "x"), ("src_qp", "x"),  # DETH
    ("payload_len", "d"),
)


def _show(value: Any, how: str) -> str:
    if value is None:
        return "-"
    if how == "op":
        try:
            return Opcode(value).name
        except ValueError:
            return f"0x{value:02x}"
    if how == "x":
        return f"0x{value:x}"
    return str(value)


def field_diff(got: bytes | RocePacket, expected: bytes | RocePacket) -> list[tuple[str, str, str]]:
    """``[(field, expected, got), ...]`` for every header field that differs, then
    ``payload`` (first differing byte offset) and ``icrc``; empty when the packets are equal."""
    g = got if isinstance(got, RocePacket) else parse(got)
    e = expected if isinstance(expected, RocePacket) else parse(expected)
    out = []
    for name, how in FIELDS:
        gv, ev = getattr(g, name, None), getattr(e, name, None)
        if gv != ev:
            out.append((name, _show(ev, how), _show(gv, how)))
    gp, ep = bytes(g.payload), bytes(e.payload)
    if gp != ep and len(gp) == len(ep):
        at = next(i for i in range(len(gp)) if gp[i] != ep[i])
        out.append(("payload", f"byte {at} = 0x{ep[at]:02x}", f"byte {at} = 0x{gp[at]:02x}"))
    if g.icrc != e.icrc and not out:
        out.append(("icrc", f"0x{e.icrc:08x}", f"0x{g.icrc:08x}"))
    return out


def format_diff(rows: Iterable[tuple[str, str, str]], indent: str = "  ") -> list[str]:
    """One line per differing field: name, expected, got, in aligned columns."""
    rows = list(rows)
    w = max((len(r[1]) for r in rows), default=0)
    return [f"{indent}{name:<12}expected {exp:<{w}}  got {got}" for name, exp, got in rows]
