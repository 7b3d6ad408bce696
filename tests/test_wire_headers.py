"""The header descriptions of softrdma.wire.headers against everything derived from them.

``parse`` is hand-unrolled for speed, so it is checked here against the reference decoder
:meth:`Header.unpack_from`, for every opcode, on random header bytes (reserved bits
included); ``build`` against :meth:`Header.pack_into`; the scapy layers' fields, the
RocePacket attributes, ``build``'s keywords and the dissector's documented record keys
against the descriptions.
"""

from __future__ import annotations

import inspect
import re
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from scapy.fields import BitField

import softrdma.wire.scapy_layers as sl
from softrdma.wire.headers import (
    AETH, BTH, DETH, EXT_ATTRS, HEADERS, AethType, Field, Header, Hdr, NakCode, aeth_type,
    aeth_value, compile_packer, make_syndrome,
)
from softrdma.wire.opcodes import BTH_SIZE, HDR_SIZE, ICRC_SIZE, OPCODES
from softrdma.wire.packet import RocePacket, build, parse

DOCS = Path(__file__).resolve().parent.parent / "docs" / "dissect.md"
ALL_OPS = sorted(OPCODES)


def packet_bytes(op: int, header_bytes: bytes, payload: bytes = b"") -> bytes:
    """A well-formed packet of opcode ``op`` whose extension headers are ``header_bytes``
    verbatim (whatever their bits), with a zero pad and ICRC."""
    pad = -len(payload) & 3
    bth = struct.pack("!BBHII", op, pad << 4, 0xFFFF, 0x12, 0x80000005)
    return bth + header_bytes + payload + bytes(pad) + bytes(ICRC_SIZE)


def check_parse_against_description(op: int, header_bytes: bytes) -> None:
    info = OPCODES[op]
    raw = packet_bytes(op, header_bytes, b"data")
    p = parse(raw)
    for hdr, off in info.headers:
        want = HEADERS[hdr].unpack_from(raw, off)
        got = {a: getattr(p, a) for a in want}
        assert got == want, (info.name, hdr.name)
    # and nothing else: attributes of headers the opcode lacks stay None
    present = {a for hdr, _ in info.headers for a in HEADERS[hdr].attrs}
    for a in set(EXT_ATTRS) - present:
        assert getattr(p, a) is None, (info.name, a)
    assert bytes(p.payload) == b"data"


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda op: OPCODES[op].name)
def test_parse_matches_description_all_ones_and_pattern(op):
    n = OPCODES[op].length - BTH_SIZE
    check_parse_against_description(op, b"\xff" * n)  # every reserved bit set too
    check_parse_against_description(op, bytes((7 * i + 1) & 0xFF for i in range(n)))


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(ALL_OPS), st.data())
def test_parse_matches_description_random(op, data):
    n = OPCODES[op].length - BTH_SIZE
    check_parse_against_description(op, data.draw(st.binary(min_size=n, max_size=n)))


def field_values(draw, header: Header) -> dict[str, int]:
    return {f.attr: draw(st.integers(0, (1 << f.bits) - 1))
            for f in header.fields if f.attr is not None}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(ALL_OPS), st.data())
def test_build_matches_description(op, data):
    """build writes each header as the reference encoder does, and parse reads back the
    values (masked to their widths) the description says."""
    info = OPCODES[op]
    values: dict[str, int] = {}
    for hdr, _ in info.headers:
        values.update(field_values(data.draw, HEADERS[hdr]))
    raw = build(op, payload=b"xy", **values)
    want = bytearray(info.length)
    for hdr, off in info.headers:
        HEADERS[hdr].pack_into(want, off, values)
    assert raw[BTH_SIZE:info.length] == want[BTH_SIZE:]
    p = parse(raw)
    assert {a: getattr(p, a) for a in values} == values


def test_build_masks_narrow_fields_and_zeroes_reserved():
    raw = build(0x64, qkey=0xFFFFFFFF, src_qp=0x1FFFFFF)  # UD_SEND_ONLY: DETH
    assert raw[12:20].hex() == "ffffffff00ffffff"  # resv8 zero, src_qp cut to 24 bits


def test_every_opcode_once_through_build_and_reference():
    for op in ALL_OPS:
        info = OPCODES[op]
        values = {a: (i + 1) * 0x01010101 & 0xFFFFFF for i, a in enumerate(EXT_ATTRS)}
        raw = build(op, **values)
        for hdr, off in info.headers:
            ref = HEADERS[hdr].unpack_from(raw, off)
            assert ref == {a: values[a] & ((1 << f.bits) - 1) for f in HEADERS[hdr].fields
                           if (a := f.attr) is not None}, (info.name, hdr.name)


def test_descriptions_are_self_consistent():
    for hdr, h in HEADERS.items():
        assert h.hdr is hdr and HDR_SIZE[hdr] == h.size
        assert sum(f.bits for f in h.fields) == 8 * h.size, h.name
    assert BTH.size == BTH_SIZE == 12


def test_a_description_that_disagrees_with_its_format_is_refused():
    with pytest.raises(ValueError, match="crosses a word"):
        Header(None, "X", "x", "!BH", (Field("a", 12, "", attr="a"), Field("b", 12, "")))
    with pytest.raises(ValueError, match="beyond"):
        Header(None, "X", "x", "!B", (Field("a", 8, "", attr="a"), Field("b", 8, "")))


def test_the_check_can_fail():
    """A wrong description (AETH with the widths swapped) does disagree with parse."""
    wrong = Header(Hdr.AETH, "AETH", "wrong", "!I", (
        Field("syndrome", 24, "", attr="syndrome"), Field("msn", 8, "", attr="msn")))
    raw = build(0x11, syndrome=0x1F, msn=0x123456)
    p = parse(raw)
    assert wrong.unpack_from(raw, 12) != {"syndrome": p.syndrome, "msn": p.msn}
    assert AETH.unpack_from(raw, 12) == {"syndrome": p.syndrome, "msn": p.msn}


def test_compiled_packers_equal_the_reference_encoder():
    for h in HEADERS.values():
        values = {f.attr: (1 << f.bits) - 1 for f in h.fields if f.attr is not None}
        a, b = bytearray(h.size), bytearray(h.size)
        h.pack_into(a, 0, values)
        compile_packer(h, EXT_ATTRS)(b, 0, tuple(values.get(x) for x in EXT_ATTRS))
        assert a == b, h.name


def test_packet_attributes_and_build_keywords_are_the_description():
    annotated = [a for a in RocePacket.__annotations__ if a in set(EXT_ATTRS)]
    assert set(annotated) == set(EXT_ATTRS)
    assert all(getattr(RocePacket, a) is None for a in EXT_ATTRS)
    params = list(inspect.signature(build).parameters)
    assert params[params.index("va"):params.index("va") + len(EXT_ATTRS)] == list(EXT_ATTRS)


def test_unique_attribute_means_one_thing():
    """An attribute two headers share has the same width and meaning in both (RETH and
    AtomicETH va/rkey); the IETH's rkey, a key to invalidate, has its own."""
    seen: dict[str, Field] = {}
    for h in HEADERS.values():
        for f in h.fields:
            if f.attr is not None:
                if f.attr in seen:
                    assert (seen[f.attr].bits, seen[f.attr].name) == (f.bits, f.name), f.attr
                seen[f.attr] = f
    assert HEADERS[Hdr.IETH].fields[0].attr == "ieth_rkey"


# -- scapy -------------------------------------------------------------------------------

def scapy_widths(layer) -> list[tuple[str, int]]:
    """(name, bits) of a scapy layer's fields: bit fields have ``size`` in bits, the
    others ``sz`` in bytes."""
    return [(f.name, f.size if isinstance(f, BitField) else int(f.sz * 8))
            for f in layer.fields_desc]


def test_scapy_layer_fields_equal_the_description():
    for hdr, h in HEADERS.items():
        layer = sl.LAYER_BY_HDR[hdr]
        want = [(p.name, p.bits) for f in h.fields for p in (f.parts or (f,))]
        assert scapy_widths(layer) == want, h.name
        assert len(bytes(layer())) == h.size, h.name


def test_scapy_bth_fields_equal_the_description_under_aliases():
    alias = sl.BTH_FIELD_ALIASES
    want = [(alias.get(f.name, f.name), f.bits) for f in BTH.fields]
    got = [(n, b) for n, b in scapy_widths(sl.BTH) if n != "icrc"]
    assert got == want


# -- dissector ---------------------------------------------------------------------------

def test_record_keys_derived_and_documented():
    """The --json keys come from the descriptions and every one is in docs/dissect.md,
    which promises they never change."""
    documented = set(re.findall(r"`([a-z_0-9]+)`", DOCS.read_text()))
    keys = set()
    for h in HEADERS.values():
        for f in h.fields:
            if f.attr is not None:
                keys.add(h.record_key(f))
                keys.update(k for k, _ in f.derived)
    assert keys == {"reth_va", "reth_rkey", "reth_len", "aeth_syndrome", "aeth_type",
                    "aeth_value", "aeth_msn", "atomic_va", "atomic_rkey", "atomic_swap_add",
                    "atomic_compare", "atomic_orig", "imm", "ieth_rkey", "deth_qkey",
                    "deth_src_qp", "feth", "feth_plt", "feth_sel"}
    assert keys <= documented, keys - documented


# -- named values -------------------------------------------------------------------------

def test_aeth_names():
    assert aeth_type(make_syndrome(AethType.RNR_NAK, 12)) is AethType.RNR_NAK
    assert aeth_value(make_syndrome(AethType.RNR_NAK, 12)) == 12
    assert make_syndrome(AethType.NAK, 2) == NakCode.REMOTE_ACCESS_ERROR
    assert aeth_type(NakCode.PSN_SEQ_ERROR) is AethType.NAK
    assert DETH.unpack_from(bytes.fromhex("80010000ff000012")) == {"qkey": 0x80010000,
                                                                   "src_qp": 0x12}
