"""Fixed layouts of big-endian words and byte strings: the description CM messages share.

A :class:`Layout` is what :class:`softrdma.wire.headers.Header` is for the RoCE headers: a
struct format and the :class:`~softrdma.wire.headers.Field` list packed into it, most
significant bits first, checked at import to fill every word exactly. CM messages also
carry 128-bit GIDs and 72-byte ARI blocks, so an item may be a byte string (``16s``): it
holds one field, ``bits`` = 8 x its length, whose value is ``bytes``.

Unlike ``Header.pack_into`` (the datapath's, which masks), :meth:`Layout.pack_into`
refuses a value that does not fit its field: CM fields are built from parameters a user
or a peer supplied, and a silently truncated QPN or PSN is a bug to report, not to send.

    >>> from softrdma.wire.headers import Field
    >>> L = Layout("demo", "!I2s", (Field("qpn", 24, "a QPN", attr="qpn"),
    ...                              Field("resv", 8, "reserved"),
    ...                              Field("tag", 16, "two bytes", attr="tag")))
    >>> raw = bytearray(L.size)
    >>> L.pack_into(raw, 0, {"qpn": 0x21, "tag": b"ok"})
    >>> raw.hex(), L.unpack_from(raw)
    ('000021006f6b', {'qpn': 33, 'tag': b'ok'})
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Mapping

from ..wire.headers import Field

__all__ = ["Layout", "LayoutError", "Value"]

Value = int | bytes
_ITEM_BITS = {"B": 8, "H": 16, "I": 32, "Q": 64}
_ITEM = re.compile(r"(\d*)([BHIQs])")


class LayoutError(ValueError):
    """A value that does not fit the field it is meant for (too wide, wrong type)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A run of fields: ``fmt`` (``!`` then B/H/I/Q words and ``Ns`` byte strings) and the
    fields that fill it. ``items`` pairs each struct item with its ``(field, shift)``
    list (shift from the LSB; a byte-string item has one field, shift 0)."""

    name: str
    fmt: str
    fields: tuple[Field, ...]
    struct: struct.Struct = field(init=False)
    size: int = field(init=False)
    items: tuple[tuple[str, tuple[tuple[Field, int], ...]], ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.fmt.startswith("!"):
            raise ValueError(f"{self.name}: the format must be big-endian ('!')")
        s = struct.Struct(self.fmt)
        object.__setattr__(self, "struct", s)
        object.__setattr__(self, "size", s.size)
        pending = list(self.fields)
        items = []
        for count, code in _ITEM.findall(self.fmt[1:]):
            if code == "s":
                width = 8 * int(count or 1)
                kinds = [("s", width)]
            else:
                kinds = [(code, _ITEM_BITS[code])] * int(count or 1)
            for kind, width in kinds:
                group, used = [], 0
                while used < width:
                    if not pending:
                        raise ValueError(f"{self.name}: fields end inside a {width}-bit item")
                    f = pending.pop(0)
                    used += f.bits
                    group.append((f, width - used))
                if used != width:
                    raise ValueError(f"{self.name}: field {group[-1][0].name} crosses an item")
                if kind == "s" and len(group) != 1:
                    raise ValueError(f"{self.name}: a byte string holds exactly one field")
                items.append((kind, tuple(group)))
        if pending:
            raise ValueError(f"{self.name}: fields beyond the struct format")
        attrs = [f.attr for f in self.fields if f.attr is not None]
        if len(attrs) != len(set(attrs)):
            raise ValueError(f"{self.name}: a field name is used twice")
        object.__setattr__(self, "items", tuple(items))

    @property
    def attrs(self) -> tuple[str, ...]:
        """The named (non-reserved) fields, in wire order."""
        return tuple(f.attr for f in self.fields if f.attr is not None)

    def field(self, attr: str) -> Field:
        for f in self.fields:
            if f.attr == attr:
                return f
        raise KeyError(attr)

    def offsets(self) -> dict[str, tuple[int, int, int]]:
        """``{attr: (byte offset, first bit, bits)}`` from the start of the layout; the
        first bit counts from the most significant bit of that byte, as the IBTA tables'
        ``Byte[Bit]`` notation does (docs and tests read the layout through this)."""
        out, pos = {}, 0
        for kind, group in self.items:
            width = group[0][0].bits if kind == "s" else _ITEM_BITS[kind]
            for f, shift in group:
                msb = pos * 8 + (width - shift - f.bits)
                if f.attr is not None:
                    out[f.attr] = (msb // 8, msb % 8, f.bits)
            pos += width // 8
        return out

    def unpack_from(self, buf: bytes | bytearray | memoryview, offset: int = 0
                    ) -> dict[str, Value]:
        """``{attr: value}`` of the layout at ``offset``; reserved bits are not decoded."""
        out: dict[str, Value] = {}
        for word, (kind, group) in zip(self.struct.unpack_from(buf, offset), self.items):
            if kind == "s":
                f = group[0][0]
                if f.attr is not None:
                    out[f.attr] = bytes(word)
                continue
            for f, shift in group:
                if f.attr is not None:
                    out[f.attr] = (word >> shift) & ((1 << f.bits) - 1)
        return out

    def pack_into(self, buf: bytearray | memoryview, offset: int,
                  values: Mapping[str, Value | None]) -> None:
        """Write the layout at ``offset`` from ``{attr: value}``. Missing or None is zero
        (all zero bytes for a byte string); reserved fields are zero; a byte string
        shorter than its field is zero-padded. Raises :class:`LayoutError` for a value
        that does not fit, and for a name the layout does not have."""
        unknown = set(values) - set(self.attrs)
        if unknown:
            raise LayoutError(f"{self.name} has no field {', '.join(sorted(unknown))}")
        words: list[int | bytes] = []
        for kind, group in self.items:
            if kind == "s":
                f = group[0][0]
                v = values.get(f.attr) if f.attr is not None else None
                if v is None:
                    v = b""
                if not isinstance(v, (bytes, bytearray, memoryview)):
                    raise LayoutError(f"{self.name}.{f.attr} takes bytes, not {type(v).__name__}")
                if len(v) > f.bits // 8:
                    raise LayoutError(f"{self.name}.{f.attr} holds {f.bits // 8} bytes, "
                                      f"got {len(v)}")
                words.append(bytes(v))
                continue
            w = 0
            for f, shift in group:
                if f.attr is None:
                    continue
                v = values.get(f.attr) or 0
                if isinstance(v, bool):
                    v = int(v)
                if not isinstance(v, int):
                    raise LayoutError(f"{self.name}.{f.attr} takes an int, not {type(v).__name__}")
                if not 0 <= v < (1 << f.bits):
                    raise LayoutError(f"{self.name}.{f.attr} is a {f.bits}-bit field: "
                                      f"{v:#x} does not fit")
                w |= v << shift
            words.append(w)
        self.struct.pack_into(buf, offset, *words)
