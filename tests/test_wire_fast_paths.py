"""The wire layer's fast paths agree with their definitions (issue 18).

- ``icrc_ipv4``/``icrc_ipv6`` take the pseudo-header's CRC state from a cache and fold the
  IPv4 ID in by table: they must equal the uncached definition for any input, buffer type,
  IP ID, cache state and overflow;
- ``icrc_ok_ipv4``/``icrc_ok_ipv6`` check a packet with one crc32 over all of it: they must
  say exactly whether the definition's ICRC equals the stored one;
- ``build`` packs each opcode's layout with one generated struct, and ``build_request`` /
  ``REQUEST_BUILDERS`` are the requester's positional form: same bytes as the header
  descriptions' reference encoder and as ``build``;
- ``parse`` returns a slotted subclass per layout: absent fields still read None.
"""

from __future__ import annotations

import random
import struct

import pytest

from softrdma.wire import icrc as I
from softrdma.wire.headers import EXT_ATTRS, HEADERS, ROCE_V2_UDP_DPORT
from softrdma.wire.opcodes import OPCODE_LIST, Opcode
from softrdma.wire.packet import (
    REQUEST_BUILDERS, DecodeError, RocePacket, build, build_request, parse,
)

OPS = [i.opcode for i in OPCODE_LIST if i is not None]


def _kinds(raw: bytes) -> list:
    return [raw, bytearray(raw), memoryview(raw), memoryview(bytearray(raw))]


@pytest.mark.parametrize("seed", range(4))
def test_cached_icrc_equals_the_definition(seed):
    rnd = random.Random(seed)
    for _ in range(1500):
        n = rnd.randrange(12, 120)
        roce = rnd.randbytes(n)
        sport, dport = rnd.randrange(1 << 16), rnd.choice([ROCE_V2_UDP_DPORT, rnd.randrange(1 << 16)])
        if rnd.random() < 0.5:
            src, dst = rnd.randbytes(4), rnd.randbytes(4)
            ip_id = rnd.choice([0, 1, 0xFFFF, rnd.randrange(1 << 16)])
            frag = rnd.choice([I.IP_DF, 0, rnd.randrange(1 << 16)])
            want = I._icrc_ipv4_ref(roce, src, dst, sport, dport, ip_id, frag)
            for buf in _kinds(roce):
                assert I.icrc_ipv4(buf, src, dst, sport, dport, ip_id, frag) == want
        else:
            src, dst = rnd.randbytes(16), rnd.randbytes(16)
            nh = rnd.choice([I.IPPROTO_UDP, rnd.randrange(256)])
            want = I._icrc_ipv6_ref(roce, src, dst, sport, dport, nh)
            for buf in _kinds(roce):
                assert I.icrc_ipv6(buf, src, dst, sport, dport, nh) == want


def test_cache_overflow_and_unhashable_addresses(monkeypatch):
    monkeypatch.setattr(I, "PREFIX_CACHE_MAX", 3)
    rnd = random.Random(9)
    src, dst = b"\x0a\x00\x00\x01", b"\x0a\x00\x00\x02"
    for i in range(20):  # more keys than the bound: emptied and refilled, never wrong
        roce = rnd.randbytes(40 + i)
        assert I.icrc_ipv4(roce, src, dst, 0xC000 + i, ip_id=i) == \
            I._icrc_ipv4_ref(roce, src, dst, 0xC000 + i, ip_id=i)
        assert len(I._prefix4) <= 3
    roce = rnd.randbytes(64)
    assert I.icrc_ipv4(roce, bytearray(src), bytearray(dst), 5) == \
        I._icrc_ipv4_ref(roce, src, dst, 5)
    assert I.icrc_ipv6(roce, bytearray(16), bytearray(16), 5) == \
        I._icrc_ipv6_ref(roce, bytes(16), bytes(16), 5)


def test_bad_ip_id_and_short_input_fail_as_the_definition_does():
    src = dst = bytes(4)
    with pytest.raises(struct.error):
        I._icrc_ipv4_ref(bytes(40), src, dst, 1, ip_id=1 << 16)
    with pytest.raises(struct.error):
        I.icrc_ipv4(bytes(40), src, dst, 1, ip_id=1 << 16)
    with pytest.raises(struct.error):
        I.icrc_ipv4(bytes(40), src, dst, 1, ip_id=-1)
    for n in (0, 5, 11):
        with pytest.raises(struct.error):
            I.icrc_ipv4(bytes(n), src, dst, 1)
    for n in (12, 15):  # no room for BTH + ICRC: the definition's answer, not the cache's
        assert I.icrc_ipv4(bytes(range(n)), src, dst, 1) == \
            I._icrc_ipv4_ref(bytes(range(n)), src, dst, 1)


@pytest.mark.parametrize("seed", range(3))
def test_icrc_ok_says_whether_the_stored_icrc_is_the_definitions(seed):
    rnd = random.Random(100 + seed)
    seen = {True: 0, False: 0}
    for _ in range(1500):
        n = rnd.randrange(16, 150)
        roce = bytearray(rnd.randbytes(n))
        v6 = rnd.random() < 0.4
        src, dst = (rnd.randbytes(16), rnd.randbytes(16)) if v6 else (rnd.randbytes(4),
                                                                      rnd.randbytes(4))
        sport, ip_id = rnd.randrange(1 << 16), rnd.choice([0, rnd.randrange(1 << 16)])

        def ref(b):
            return I._icrc_ipv6_ref(b, src, dst, sport) if v6 else \
                I._icrc_ipv4_ref(b, src, dst, sport, ip_id=ip_id)

        if rnd.random() < 0.7:
            roce[-4:] = ref(roce).to_bytes(4, "little")
        if rnd.random() < 0.4:  # a flipped bit anywhere, the masked byte 4 included
            roce[rnd.randrange(n)] ^= 1 << rnd.randrange(8)
        want = ref(roce) == int.from_bytes(roce[-4:], "little")
        seen[want] += 1
        for buf in _kinds(bytes(roce)):
            got = I.icrc_ok_ipv6(buf, src, dst, sport) if v6 else \
                I.icrc_ok_ipv4(buf, src, dst, sport, ROCE_V2_UDP_DPORT, ip_id)
            assert got is want
    assert seen[True] > 100 and seen[False] > 100  # both answers were exercised


def test_icrc_ok_ignores_only_the_masked_bth_byte():
    src, dst = b"\x0a\x00\x00\x01", b"\x0a\x00\x00\x02"
    raw = build(Opcode.RC_SEND_ONLY, dest_qp=0x11, psn=3, payload=b"abcdefgh")
    raw[-4:] = I.icrc_ipv4(raw, src, dst, 0xC001, ip_id=77).to_bytes(4, "little")
    assert I.icrc_ok_ipv4(bytes(raw), src, dst, 0xC001, ip_id=77)
    assert not I.icrc_ok_ipv4(bytes(raw), src, dst, 0xC001, ip_id=78)
    assert not I.icrc_ok_ipv4(bytes(raw), src, dst, 0xC002, ip_id=77)
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        assert I.icrc_ok_ipv4(bytes(bad), src, dst, 0xC001, ip_id=77) is (i == 4), i


def _max_fields() -> dict[str, int]:
    return {f.attr: (1 << f.bits) - 1 for h in HEADERS.values() for f in h.fields
            if f.attr is not None}


@pytest.mark.parametrize("op", OPS)
def test_build_writes_what_the_reference_encoder_writes(op):
    values = _max_fields()
    for vals in (values, {k: i + 1 for i, k in enumerate(values)}):
        raw = build(op, **vals)
        want = bytearray(OPCODE_LIST[op].length)
        for h, off in OPCODE_LIST[op].headers:
            HEADERS[h].pack_into(want, off, vals)
        assert raw[12:OPCODE_LIST[op].length] == want[12:], OPCODE_LIST[op].name


@pytest.mark.parametrize("seed", range(3))
def test_build_request_is_build_with_positional_fields(seed):
    rnd = random.Random(seed)
    for _ in range(400):
        op = rnd.choice(OPS)
        kw = dict(psn=rnd.randrange(1 << 24), dest_qp=rnd.randrange(1 << 24),
                  ackreq=rnd.random() < 0.5, se=rnd.random() < 0.5, va=rnd.randrange(1 << 64),
                  rkey=rnd.randrange(1 << 32), dma_len=rnd.randrange(1 << 32),
                  swap_add=rnd.randrange(1 << 64), compare=rnd.randrange(1 << 64),
                  imm=rnd.choice([None, rnd.randrange(1 << 32)]),
                  ieth_rkey=rnd.choice([None, rnd.randrange(1 << 32)]),
                  qkey=rnd.randrange(1 << 32), src_qp=rnd.randrange(1 << 24),
                  payload=rnd.randbytes(rnd.randrange(70)))
        want = build(op, **kw)
        got = build_request(op, *kw.values())
        assert type(got) is bytearray and got == want, OPCODE_LIST[op].name
        assert REQUEST_BUILDERS[op](op, *kw.values()) == want


def test_build_request_refuses_unknown_opcodes_as_build_does():
    unknown = next(o for o in range(256) if OPCODE_LIST[o] is None)
    with pytest.raises(ValueError):
        build(unknown)
    with pytest.raises(ValueError):
        build_request(unknown, 0, 0, False, False, 0, 0, 0, 0, 0, 0, 0, 0, 0, b"")


@pytest.mark.parametrize("op", OPS)
def test_parsed_packet_reads_absent_fields_as_none(op):
    raw = bytes(build(op, **_max_fields(), payload=b"xyz"))
    p = parse(raw)
    assert isinstance(p, RocePacket) and not hasattr(p, "__dict__")
    carried = {a for h, _ in OPCODE_LIST[op].headers for a in HEADERS[h].attrs}
    for a in EXT_ATTRS:
        if a in carried:
            assert getattr(p, a) is not None, a
        else:
            assert getattr(p, a) is None, a
    assert p.icrc == int.from_bytes(raw[-4:], "little")
    assert p.payload_offset == OPCODE_LIST[op].length
    assert isinstance(p.payload, memoryview) and bytes(p.payload) == b"xyz"
    assert p.to_bytes() == raw


def test_parse_keeps_the_given_buffer_and_its_errors():
    raw = build(Opcode.RC_RDMA_WRITE_ONLY, va=1, rkey=2, dma_len=3, payload=b"12345")
    for buf in _kinds(bytes(raw)):
        p = parse(buf)
        assert p.buf is buf and bytes(p.payload) == b"12345"
    for bad, reason in ((bytes(15), "truncated"), (b"\xff" + bytes(20), "unknown_opcode"),
                        (bytes(raw[:20]), "truncated")):
        with pytest.raises(DecodeError) as e:
            parse(bad)
        assert e.value.reason == reason
    padded = bytearray(build(Opcode.RC_SEND_ONLY, payload=b""))
    padded[1] |= 0x30  # pad 3 with no payload
    with pytest.raises(DecodeError) as e:
        parse(bytes(padded))
    assert e.value.reason == "bad_pad"
