"""Targeted faults: rules that pick packets by opcode, QP and PSN and do one thing to them.

A :class:`Rule` is what a scripted error scenario says in one line: "drop the first RDMA
READ response", "corrupt the PSN of the third SEND", "delay every ACK by 5 ms". It sees
every packet of its direction, counts the packets it *matches* (opcode, QP, PSN, and for
``corrupt`` the field being present), and acts on matches ``nth`` .. ``nth + count - 1``
(``count=0``: on every match from ``nth`` on). Each packet it acted on is recorded in
:attr:`Rule.hits`, so a test or a script can assert what happened.

This module only decides and edits bytes; the device applies the outcome (softrdma.soft.
faults). Opcodes are named as :class:`~softrdma.wire.opcodes.Opcode` names
(``RC_RDMA_READ_RESPONSE_FIRST``), by the name without the transport
(``SEND_ONLY``: RC, UC and UD; ``ACKNOWLEDGE``: the RC ACK), by a family of words
(``READ_RESPONSE``: the four RC read responses; ``RDMA_WRITE``: every RDMA WRITE opcode of
RC and UC), by number (``0x11``), or as ``requests`` / ``responses`` (rxe's REQ and ACK
masks: every request, or the ACKs, atomic ACKs and read responses).
"""

from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from typing import Callable

from ..wire.headers import Hdr
from ..wire.opcodes import OPCODES, lookup

__all__ = ["Rule", "Hit", "FaultError", "ACTIONS", "FIELDS", "resolve_opcodes", "set_field"]

ACTIONS = ("drop", "duplicate", "delay", "corrupt")


class FaultError(ValueError):
    """A fault that cannot be (an unknown opcode or field, a bad number); the message names
    the offending token."""


def resolve_opcodes(pattern: str | int | None) -> frozenset[int]:
    """The opcodes a pattern names (see the module docstring); FaultError if none."""
    if pattern is None or pattern in ("*", "any"):
        return frozenset(OPCODES)
    if isinstance(pattern, int):
        if pattern not in OPCODES:
            raise FaultError(f"unknown opcode {pattern:#x}")
        return frozenset((pattern,))
    text = pattern.strip()
    if text[:2].lower() == "0x" or text.isdigit():
        try:
            return resolve_opcodes(int(text, 0))
        except ValueError:
            raise FaultError(f"unknown opcode {pattern!r}") from None
    low = text.lower()
    if low in ("requests", "responses"):
        want = low == "requests"
        return frozenset(op for op, i in OPCODES.items()
                         if (i.is_request if want else i.is_response))
    up = text.upper()
    # the exact name, else the name without the transport, else a family of words
    exact = [op for op, i in OPCODES.items() if i.name == up] or \
        [op for op, i in OPCODES.items() if i.short_name == up]
    if exact:
        return frozenset(exact)
    family = frozenset(op for op, i in OPCODES.items() if f"_{up}_" in f"_{i.name}_")
    if not family:
        raise FaultError(f"unknown opcode {pattern!r} (an Opcode name such as "
                         f"RC_RDMA_READ_RESPONSE_FIRST or ACKNOWLEDGE, a family such as "
                         f"READ_RESPONSE, requests, responses, or a number)")
    return family


@dataclass(frozen=True)
class FieldSpec:
    """Where a field lives: in header ``hdr`` (None: the BTH) at byte ``offset``, ``size``
    bytes, the bits of ``mask`` (big-endian, as on the wire)."""

    hdr: Hdr | None
    offset: int
    size: int
    mask: int


#: the fields ``corrupt`` can change; ``icrc`` is the trailer, ``payload`` its first byte.
#: ``va``/``rkey`` are the RETH's, or the atomic ETH's in atomic requests.
FIELDS: dict[str, FieldSpec | None] = {
    "opcode": FieldSpec(None, 0, 1, 0xFF),
    "se": FieldSpec(None, 1, 1, 0x80),
    "tver": FieldSpec(None, 1, 1, 0x0F),
    "pkey": FieldSpec(None, 2, 2, 0xFFFF),
    "dest_qp": FieldSpec(None, 5, 3, 0xFFFFFF),
    "ackreq": FieldSpec(None, 8, 1, 0x80),
    "psn": FieldSpec(None, 9, 3, 0xFFFFFF),
    "va": FieldSpec(Hdr.RETH, 0, 8, (1 << 64) - 1),
    "rkey": FieldSpec(Hdr.RETH, 8, 4, 0xFFFFFFFF),
    "dma_len": FieldSpec(Hdr.RETH, 12, 4, 0xFFFFFFFF),
    "syndrome": FieldSpec(Hdr.AETH, 0, 1, 0xFF),
    "msn": FieldSpec(Hdr.AETH, 1, 3, 0xFFFFFF),
    "qkey": FieldSpec(Hdr.DETH, 0, 4, 0xFFFFFFFF),
    "icrc": None,  # the last four bytes
    "payload": None,  # the first byte after the headers
}


def _field_offset(name: str, opcode: int) -> int | None:
    """Byte offset of ``name`` in a packet of ``opcode``, or None if it has no such field."""
    info = lookup(opcode)
    if info is None:
        return None
    spec = FIELDS[name]
    if spec is None:
        return -4 if name == "icrc" else (info.length if info.has_payload else None)
    if spec.hdr is None:
        return spec.offset
    off = info.offset(spec.hdr)
    if off is None and spec.hdr == Hdr.RETH and name in ("va", "rkey"):
        off = info.offset(Hdr.ATMETH)  # atomics carry va and rkey in the same places
    return None if off is None else off + spec.offset


def set_field(data: bytes, name: str, value: int | None) -> bytes:
    """``data`` with field ``name`` set to ``value`` (None: its lowest bit flipped)."""
    b = bytearray(data)
    off = _field_offset(name, b[0])
    if off is None or len(b) < 16:
        return data
    spec = FIELDS[name]
    if spec is None:  # icrc (4 bytes, little-endian on the wire) or one payload byte
        size, mask = (4, 0xFFFFFFFF) if name == "icrc" else (1, 0xFF)
    else:
        size, mask = spec.size, spec.mask
    start = off if off >= 0 else len(b) + off
    if start + size > len(b):
        return data
    old = int.from_bytes(b[start:start + size], "big")
    shift = (mask & -mask).bit_length() - 1
    if value is None:
        new = old ^ (1 << shift)
    else:
        new = (old & ~mask) | ((value << shift) & mask)
    b[start:start + size] = new.to_bytes(size, "big")
    return bytes(b)


@dataclass(frozen=True)
class Hit:
    """One packet a rule acted on: its index among the packets of the direction (1 is the
    first packet the device sent or received since the faults were set up), its opcode
    name, destination QP and PSN (as they were before any corruption)."""

    frame: int
    opcode: str
    qpn: int
    psn: int


@dataclass(eq=False)
class Rule:
    """One targeted fault. Make them with the direction's methods
    (``dev.faults.rx.drop("READ_RESPONSE_FIRST")``), not directly.

    ``action`` is one of :data:`ACTIONS`; ``seconds`` (delay), ``copies`` (duplicate),
    ``field``/``value``/``fix_icrc`` (corrupt) are that action's arguments."""

    action: str
    opcode: str | int | None = None
    nth: int = 1
    count: int = 1
    qpn: int | None = None
    psn: int | None = None
    seconds: float = 0.0
    copies: int = 1
    field: str = "icrc"
    value: int | None = None
    fix_icrc: bool | None = None
    matched: int = 0  # packets matched so far (acted on or not)
    hits: list[Hit] = dc_field(default_factory=list)  # the packets it acted on
    opcodes: frozenset[int] = dc_field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise FaultError(f"unknown action {self.action!r} (one of {', '.join(ACTIONS)})")
        if self.nth < 1:
            raise FaultError(f"nth={self.nth}: the first match is nth=1")
        if self.count < 0:
            raise FaultError(f"count={self.count}: 0 (every match) or more")
        if self.copies < 1:
            raise FaultError(f"copies={self.copies}: at least 1")
        if self.seconds < 0:
            raise FaultError(f"seconds={self.seconds}: not negative")
        ops = resolve_opcodes(self.opcode)
        if self.action == "corrupt":
            if self.field not in FIELDS:
                raise FaultError(f"unknown field {self.field!r} (one of {', '.join(FIELDS)})")
            ops = frozenset(op for op in ops if _field_offset(self.field, op) is not None)
            if not ops:
                raise FaultError(f"no packet of opcode {self.opcode!r} has field {self.field!r}")
            if self.fix_icrc is None:
                # a header field set to a wrong value models a peer that sent it: the packet
                # stays well-formed; the ICRC itself (or fix_icrc=False) is a line error
                self.fix_icrc = self.field != "icrc"
        self.opcodes = ops

    @property
    def done(self) -> bool:
        """True once the rule has acted ``count`` times (never for ``count=0``)."""
        return self.count > 0 and self.matched >= self.nth + self.count - 1

    def take(self, data: bytes, frame: int) -> bool:
        """Count ``data`` if it matches; True if the rule acts on it (and record the hit)."""
        if data[0] not in self.opcodes or len(data) < 12:
            return False
        qpn = int.from_bytes(data[5:8], "big")
        psn = int.from_bytes(data[9:12], "big")
        if (self.qpn is not None and qpn != self.qpn) or (self.psn is not None and psn != self.psn):
            return False
        self.matched += 1
        k = self.matched - self.nth
        if k < 0 or (self.count and k >= self.count):
            return False
        info = lookup(data[0])
        self.hits.append(Hit(frame, info.name if info else hex(data[0]), qpn, psn))
        return True

    def corrupt(self, data: bytes, fix: Callable[[bytes], bytes]) -> bytes:
        """``data`` with this rule's field changed; ``fix`` recomputes the ICRC."""
        out = set_field(data, self.field, self.value)
        return fix(out) if self.fix_icrc else out

    def describe(self) -> str:
        """The rule as spec text (what ``Faults.load`` reads back)."""
        args = [str(self.opcode) if self.opcode is not None else "any"]
        if self.nth != 1:
            args.append(f"nth={self.nth}")
        if self.count != 1:
            args.append(f"count={self.count}")
        for k in ("qpn", "psn", "value"):
            v = getattr(self, k)
            if v is not None:
                args.append(f"{k}={v:#x}")
        if self.action == "delay":
            args.append(f"seconds={self.seconds:g}")
        if self.action == "duplicate" and self.copies != 1:
            args.append(f"copies={self.copies}")
        if self.action == "corrupt":
            args.append(f"field={self.field}")
            if self.fix_icrc != (self.field != "icrc"):
                args.append(f"fix_icrc={int(bool(self.fix_icrc))}")
        return f"{self.action}({', '.join(args)})"
