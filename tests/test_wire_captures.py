"""The wire layer against real Linux rxe captures (pcaps/linux-rxe, see its README)."""

from __future__ import annotations

import collections
import struct

import pytest

from softrdma.wire.frames import decode_frame
from softrdma.wire.icrc import icrc_from_ip_packet, icrc_ipv4, icrc_ipv6
from softrdma.wire.opcodes import OPCODES, Hdr, Opcode
from softrdma.wire.packet import parse
from softrdma.wire.pcap import read_pcap

from .conftest import PCAPS, RXE_PCAPS


def roce_frames(path):
    for rec in read_pcap(path):
        f = decode_frame(rec.data, rec.linktype)
        if f is not None and f.is_roce:
            yield rec, f


def test_captures_present():
    assert len(RXE_PCAPS) >= 20


@pytest.mark.parametrize("path", RXE_PCAPS, ids=lambda p: str(p.relative_to(PCAPS)))
def test_every_frame_decodes_verifies_and_rebuilds(path):
    n = 0
    for rec, f in roce_frames(path):
        p = parse(f.payload)
        # ICRC from the captured IP header, and through the socket-level fast path.
        assert p.icrc == f.icrc() == icrc_from_ip_packet(f.ip_packet), rec.index
        assert f.ip_version == 4
        assert icrc_ipv4(f.payload, f.ip_src, f.ip_dst, f.sport, f.dport, f.ip_id, f.ip_frag) == p.icrc
        # Rebuilding from the parsed fields gives back the identical bytes.
        assert bytes(p.to_bytes()) == bytes(f.payload), rec.index
        # rxe's transmit invariants (fact sheet A.2 / A.6)
        assert p.tver == 0 and p.pkey == 0xFFFF and not p.migreq
        assert f.sport >= 0xC000 and f.udp_checksum == 0
        assert f.ip_frag == 0x4000  # DF
        n += 1
    assert n > 0


# Opcode counts stated in pcaps/linux-rxe/README.md (written when the captures were made).
EXPECTED_COUNTS = {
    "rc_pingpong.pcap": {"RC_SEND_FIRST": 12, "RC_SEND_MIDDLE": 24, "RC_SEND_LAST": 12, "RC_ACKNOWLEDGE": 18},
    "uc_pingpong.pcap": {"UC_SEND_FIRST": 10, "UC_SEND_LAST": 10},
    "ud_pingpong.pcap": {"UD_SEND_ONLY": 10},
    "srq_pingpong.pcap": {"RC_SEND_ONLY": 12, "RC_ACKNOWLEDGE": 12},
    "send_bw.pcap": {"RC_SEND_FIRST": 20, "RC_SEND_MIDDLE": 20, "RC_SEND_LAST": 20, "RC_ACKNOWLEDGE": 20},
    "inline_send.pcap": {"RC_SEND_ONLY": 20, "RC_ACKNOWLEDGE": 20},
    "write_bw.pcap": {"RC_RDMA_WRITE_FIRST": 20, "RC_RDMA_WRITE_MIDDLE": 120, "RC_RDMA_WRITE_LAST": 20,
                      "RC_ACKNOWLEDGE": 20},
    "read_bw.pcap": {"RC_RDMA_READ_REQUEST": 20, "RC_RDMA_READ_RESPONSE_FIRST": 20,
                     "RC_RDMA_READ_RESPONSE_MIDDLE": 120, "RC_RDMA_READ_RESPONSE_LAST": 20},
    "fetch_add.pcap": {"RC_FETCH_ADD": 20, "RC_ATOMIC_ACKNOWLEDGE": 20},
    "cmp_swap.pcap": {"RC_COMPARE_SWAP": 20, "RC_ATOMIC_ACKNOWLEDGE": 20},
    # rdma_cm: the CM MADs travel as UD Send Only on QP1
    "rping.pcap": {"UD_SEND_ONLY": 5, "RC_SEND_ONLY": 12, "RC_ACKNOWLEDGE": 15,
                   "RC_RDMA_READ_REQUEST": 3, "RC_RDMA_READ_RESPONSE_ONLY": 3,
                   "RC_RDMA_WRITE_ONLY": 3},
    "udaddy.pcap": {"UD_SEND_ONLY": 2, "UD_SEND_ONLY_WITH_IMMEDIATE": 20},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_opcode_counts_match_capture_readme(name):
    counts = collections.Counter(parse(f.payload).name for _, f in roce_frames(PCAPS / name))
    assert dict(counts) == EXPECTED_COUNTS[name]


def test_segmentation_at_active_mtu_1024():
    # rc_pingpong -s 4096 over MTU 1024: FIRST/MIDDLE carry exactly the MTU, and the
    # AckReq bit is set on the last packet only (fact sheet A.10).
    for _, f in roce_frames(PCAPS / "rc_pingpong.pcap"):
        p = parse(f.payload)
        if p.info.send:
            assert p.payload_len == 1024
            assert p.ackreq == p.info.last


def test_read_response_psns_and_aeth():
    # A read of 8192 B at MTU 1024 takes 8 PSNs; the responses use them in order and carry
    # an AETH (ACK, credit 31) on FIRST and LAST only.
    frames = [parse(f.payload) for _, f in roce_frames(PCAPS / "read_bw.pcap")]
    reqs = {p.psn: p for p in frames if p.opcode == Opcode.RC_RDMA_READ_REQUEST}
    psns = sorted(reqs)
    assert all((b - a) & 0xFFFFFF == 8 for a, b in zip(psns, psns[1:]))
    for p in frames:
        if p.info.is_response:
            assert (p.syndrome is not None) == (p.opcode != Opcode.RC_RDMA_READ_RESPONSE_MIDDLE)
            if p.syndrome is not None:
                assert p.syndrome == 0x1F


def test_ud_deth_and_grh_sizes():
    for _, f in roce_frames(PCAPS / "ud_pingpong.pcap"):
        p = parse(f.payload)
        assert p.qkey == 0x11111111  # ibv_ud_pingpong's Q_Key
        assert p.payload_len == 512


# An independent anchor: a CNP captured from a ConnectX-4 Lx (scapy's test suite), whose
# ICRC was computed by hardware, not by any software implementation.
CX4_CNP = bytes.fromhex(
    "e41d2dab2bc27cfe90643b320800"
    "45c2003c718c400040119161" "0a001101" "0a001201"
    "000012b700280000"
    "8100ffff4000011800000000" + "00" * 16 + "82fd002a")


def test_hardware_cnp_vector():
    f = decode_frame(CX4_CNP)
    p = parse(f.payload)
    assert p.opcode == Opcode.CNP and p.becn and p.dest_qp == 0x118
    assert f.icrc() == p.icrc == 0x2A00FD82
    assert icrc_ipv4(f.payload, f.ip_src, f.ip_dst, f.sport, ip_id=0x718C) == 0x2A00FD82


def _covered(ip_packet: bytes) -> list[bool]:
    """Per byte of an IPv4 packet: True if the ICRC covers it (fact sheet A.5)."""
    ihl = (ip_packet[0] & 0xF) * 4
    masked = {1, 8, 10, 11, ihl + 6, ihl + 7, ihl + 8 + 4}
    return [i not in masked for i in range(len(ip_packet) - 4)]


def _one_frame_per_opcode():
    seen = {}
    for path in RXE_PCAPS:
        for _, f in roce_frames(path):
            op = f.payload[0]
            if op not in seen:
                seen[op] = bytes(f.ip_packet)
    return seen


@pytest.mark.parametrize("op", sorted(_one_frame_per_opcode()), ids=lambda o: OPCODES[o].name)
def test_every_single_bit_flip_in_covered_region_breaks_icrc(op):
    ip = bytearray(_one_frame_per_opcode()[op])
    good = struct.unpack("<I", ip[-4:])[0]
    assert icrc_from_ip_packet(ip) == good
    for i, covered in enumerate(_covered(ip)):
        for bit in range(8):
            ip[i] ^= 1 << bit
            # IPv4 header fields must stay parseable for the IHL byte; flipping IHL is
            # still a covered change and must change the CRC whenever it can be computed.
            try:
                c = icrc_from_ip_packet(ip)
            except ValueError:
                c = None
            if covered:
                assert c != good, (i, bit)
            elif c is not None:
                assert c == good, (i, bit)  # masked fields: TOS, TTL, checksums, FECN/BECN
            ip[i] ^= 1 << bit


def test_opcode_table_layouts_match_rxe():
    # Offsets from rxe_opcode.c as summarised in the fact sheet (A.3/A.4).
    expect = {
        Opcode.RC_SEND_ONLY: ((), 12),
        Opcode.RC_SEND_LAST_WITH_IMMEDIATE: (((Hdr.IMMDT, 12),), 16),
        Opcode.RC_RDMA_WRITE_FIRST: (((Hdr.RETH, 12),), 28),
        Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: (((Hdr.RETH, 12), (Hdr.IMMDT, 28)), 32),
        Opcode.RC_RDMA_READ_REQUEST: (((Hdr.RETH, 12),), 28),
        Opcode.RC_RDMA_READ_RESPONSE_MIDDLE: ((), 12),
        Opcode.RC_RDMA_READ_RESPONSE_ONLY: (((Hdr.AETH, 12),), 16),
        Opcode.RC_ATOMIC_ACKNOWLEDGE: (((Hdr.AETH, 12), (Hdr.ATMACK, 16)), 24),
        Opcode.RC_COMPARE_SWAP: (((Hdr.ATMETH, 12),), 40),
        Opcode.RC_SEND_ONLY_WITH_INVALIDATE: (((Hdr.IETH, 12),), 16),
        Opcode.RC_FLUSH: (((Hdr.FETH, 12), (Hdr.RETH, 16)), 32),
        Opcode.RC_ATOMIC_WRITE: (((Hdr.RETH, 12),), 28),
        Opcode.UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: (((Hdr.RETH, 12), (Hdr.IMMDT, 28)), 32),
        Opcode.UD_SEND_ONLY_WITH_IMMEDIATE: (((Hdr.DETH, 12), (Hdr.IMMDT, 20)), 24),
    }
    for op, (headers, length) in expect.items():
        info = OPCODES[op]
        assert info.headers == headers, op.name
        assert info.length == length, op.name
    # Every RC request opcode 0x00-0x0b has a UC twin at +0x20 with the same layout.
    for op in range(0x00, 0x0C):
        assert OPCODES[op].headers == OPCODES[op + 0x20].headers
        assert OPCODES[op].short_name == OPCODES[op + 0x20].short_name
    assert set(OPCODES) == set(range(0x00, 0x15)) | {0x16, 0x17, 0x1C, 0x1D} | set(
        range(0x20, 0x2C)) | {0x64, 0x65, 0x81}
    # Receive-WQE consumption (rxe RWR mask): the first packet of a send, write-with-imm.
    rwr = {o for o, i in OPCODES.items() if i.consumes_rwqe}
    assert rwr == {0x00, 0x04, 0x05, 0x09, 0x0B, 0x17, 0x20, 0x24, 0x25, 0x29, 0x2B, 0x64, 0x65}


def test_ipv6_icrc_matches_generic_path():
    from softrdma.wire.frames import encode_frame
    from softrdma.wire.packet import build
    roce = build(Opcode.RC_SEND_ONLY_WITH_IMMEDIATE, dest_qp=0x123, psn=99, imm=0xDEADBEEF, payload=b"abcde")
    fr = encode_frame(roce, src="fd00::1", dst="fd00::2", sport=0xC001, tos=0x60, flow_label=0xABCDE, ttl=7)
    f = decode_frame(fr)
    s, d = f.ip_src, f.ip_dst
    assert f.ip_version == 6 and f.flow_label == 0xABCDE
    assert icrc_ipv6(f.payload, s, d, 0xC001) == f.icrc() == parse(f.payload).icrc
