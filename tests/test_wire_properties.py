"""Property tests for the wire codec: round trips, and only documented errors on bad input."""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from softrdma.wire.frames import FrameError, decode_frame, encode_frame, LINKTYPE_RAW
from softrdma.wire.icrc import icrc_from_ip_packet
from softrdma.wire.opcodes import OPCODES
from softrdma.wire.packet import DecodeError, FIELDS_BY_HEADER, build, parse
from softrdma.wire.pcap import PcapError, PcapWriter, read_pcap

u = lambda bits: st.integers(0, (1 << bits) - 1)  # noqa: E731

BTH_FIELDS = dict(psn=u(24), dest_qp=u(24), ackreq=st.booleans(), se=st.booleans(),
                  migreq=st.booleans(), pkey=u(16), tver=u(4), fecn=st.booleans(),
                  becn=st.booleans(), resv6=u(6), resv7=u(7))
EXT_FIELDS = dict(va=u(64), rkey=u(32), dma_len=u(32), syndrome=u(8), msn=u(24),
                  swap_add=u(64), compare=u(64), orig=u(64), imm=u(32), ieth_rkey=u(32),
                  qkey=u(32), src_qp=u(24), feth=u(32))


@st.composite
def packets(draw):
    op = draw(st.sampled_from(sorted(OPCODES)))
    fields = {k: draw(s) for k, s in BTH_FIELDS.items()}
    for hdr, _ in OPCODES[op].headers:
        for k in FIELDS_BY_HEADER[hdr]:
            fields[k] = draw(EXT_FIELDS[k])
    payload = draw(st.binary(max_size=300))
    return op, fields, payload


@settings(max_examples=400, deadline=None)
@given(packets())
def test_build_parse_build_is_identity(pkt):
    op, fields, payload = pkt
    raw = build(op, payload=payload, icrc=0x12345678, **fields)
    p = parse(raw)
    assert p.opcode == op
    for k, v in fields.items():
        assert getattr(p, k) == v, k
    assert bytes(p.payload) == payload
    assert p.pad == -len(payload) & 3
    assert len(raw) == OPCODES[op].length + len(payload) + p.pad + 4
    assert raw[len(raw) - 4 - p.pad:len(raw) - 4] == bytes(p.pad)  # zero pad bytes
    assert p.icrc == 0x12345678
    assert p.to_bytes() == raw


@settings(max_examples=300, deadline=None)
@given(packets(), st.sampled_from(["fd00::1", "10.1.2.3"]), u(16), u(16))
def test_frame_round_trip_and_icrc(pkt, src, sport, ip_id):
    op, fields, payload = pkt
    dst = "fd00::2" if ":" in src else "10.3.2.1"
    raw = build(op, payload=payload, **fields)
    frame = encode_frame(raw, src=src, dst=dst, sport=sport, ip_id=ip_id)
    f = decode_frame(frame)
    assert f.src == src and f.dst == dst and f.sport == sport and f.dport == 4791
    p = parse(f.payload)
    assert p.icrc == f.icrc() == icrc_from_ip_packet(f.ip_packet)
    assert bytes(p.payload) == payload
    # The frame tools in other link types see the same packet.
    g = decode_frame(encode_frame(raw, src=src, dst=dst, sport=sport, ip_id=ip_id,
                                  linktype=LINKTYPE_RAW), LINKTYPE_RAW)
    assert bytes(g.payload) == bytes(f.payload)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=120))
def test_parse_arbitrary_bytes_only_raises_decode_error(data):
    try:
        p = parse(data)
    except DecodeError as e:
        assert e.reason in {"truncated", "unknown_opcode", "bad_pad"}
        return
    # Whatever parses is self-consistent.
    assert p.info.length + p.payload_len + p.pad + 4 == len(data)
    assert p.payload_len >= 0


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packets(), st.data())
def test_mutated_packets_only_raise_decode_error(pkt, data):
    op, fields, payload = pkt
    raw = bytearray(build(op, payload=payload, **fields))
    kind = data.draw(st.sampled_from(["truncate", "pad", "opcode", "flip"]))
    if kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "pad":
        raw[1] = (raw[1] & 0xCF) | (data.draw(st.integers(0, 3)) << 4)
    elif kind == "opcode":
        raw[0] = data.draw(u(8))
    else:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        p = parse(raw)
    except DecodeError:
        return
    assert p.info.length + p.payload_len + p.pad + 4 == len(raw)


def test_specific_malformed_packets():
    with pytest.raises(DecodeError, match="shorter than BTH"):
        parse(b"\x04" * 15)
    with pytest.raises(DecodeError, match="not a known RoCE opcode") as e:
        parse(bytes([0x15]) + bytes(15))
    assert e.value.reason == "unknown_opcode"
    # An RDMA WRITE FIRST needs 12 + 16 + 4 bytes.
    with pytest.raises(DecodeError, match="needs 32 bytes") as e:
        parse(bytes([0x06]) + bytes(30))
    assert e.value.reason == "truncated"
    # A SEND_ONLY with no payload cannot have a pad count of 3.
    raw = bytearray(build(0x04))
    raw[1] |= 0x30
    with pytest.raises(DecodeError, match="pad count 3") as e:
        parse(raw)
    assert e.value.reason == "bad_pad"


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([1, 101, 113, 276, 0, 228, 229, 147]))
def test_decode_frame_arbitrary_bytes(data, linktype):
    try:
        f = decode_frame(data, linktype)
    except FrameError:
        return
    if f is not None:
        assert len(f.payload) <= len(data)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=200), u(40)), max_size=10),
       st.booleans())
def test_pcap_round_trip(records, nano):
    buf = io.BytesIO()
    with PcapWriter(buf, nanosecond=nano, close=False) as w:
        for data, ts in records:
            w.write(data, ts_ns=ts * 1000)
    buf.seek(0)
    got = list(read_pcap(buf))
    assert [r.data for r in got] == [d for d, _ in records]
    assert [r.ts_ns for r in got] == [ts * 1000 for _, ts in records]
    assert [r.index for r in got] == list(range(1, len(records) + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 200))
def test_corrupt_pcap_only_raises_pcap_error(junk, cut):
    buf = io.BytesIO()
    with PcapWriter(buf, close=False) as w:
        w.write(b"x" * 50, ts=1.0)
        w.write(b"y" * 30, ts=2.0)
    good = buf.getvalue()
    for data in (junk, good[:cut] + junk, good[:cut]):
        try:
            list(read_pcap(io.BytesIO(data)))
        except PcapError:
            pass


def test_pcapng_written_by_scapy_reads_like_classic(tmp_path):
    from scapy.utils import PcapNgWriter, rdpcap
    from .conftest import PCAPS
    src = PCAPS / "read_bw.pcap"
    pkts = rdpcap(str(src))
    ng = tmp_path / "x.pcapng"
    with PcapNgWriter(str(ng)) as w:
        for p in pkts:
            w.write(p)
    classic = list(read_pcap(src))
    new = list(read_pcap(ng))
    assert [r.data for r in new] == [r.data for r in classic]
    assert [r.linktype for r in new] == [r.linktype for r in classic]
    assert [r.ts_ns // 1000 for r in new] == [r.ts_ns // 1000 for r in classic]


def test_pcap_header_is_standard():
    buf = io.BytesIO()
    PcapWriter(buf, close=False).close()
    magic, vmaj, vmin, _, _, snap, lt = struct.unpack("<IHHiIII", buf.getvalue())
    assert (magic, vmaj, vmin, lt) == (0xA1B2C3D4, 2, 4, 1)
