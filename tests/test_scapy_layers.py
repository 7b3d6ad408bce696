"""softrdma.wire.scapy_layers against softrdma's own wire code and real rxe captures.

scapy is a test dependency: these tests never skip. Every scapy ``Ether`` built here has
explicit ``src`` and ``dst``, otherwise scapy resolves them with ARP/ND and hangs.

1. every opcode built by ``softrdma.wire.packet.build`` + ``encode_frame`` dissects in
   scapy into the table's header chain with the same field values and payload;
2. the same packets built in scapy from the layers are byte-identical to ours, ICRC
   included (scapy's BTH computes it independently), for IPv4 and IPv6;
3. a hypothesis property version of 2 over random fields, payloads and IP headers;
4. every RoCE frame of pcaps/linux-rxe dissects to what ``parse`` says.
"""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.contrib import roce as scapy_roce
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Padding, Raw
from scapy.utils import rdpcap

import softrdma.wire.scapy_layers as sl
from softrdma.wire.frames import decode_frame, encode_frame
from softrdma.wire.opcodes import OPCODES, Hdr, Opcode
from softrdma.wire.packet import build, parse
from softrdma.wire.scapy_layers import (
    AETH, BTH, DETH, FETH, IETH, AtomicAckETH, AtomicETH, CNPPadding, ImmDt, RETH,
    header_layers, icrc_ok, roce_packet, roce_payload,
)

from .conftest import PCAPS, RXE_PCAPS

OPS = [op for op in sorted(OPCODES) if op != Opcode.CNP]
ETH_SRC = "02:00:00:00:00:01"  # encode_frame's default MACs
ETH_DST = "02:00:00:00:00:02"
ADDRS = {4: ("10.77.0.12", "10.77.0.11"), 6: ("fd00:77::12", "fd00:77::11")}
SPORT = 0xC0DE

#: scapy field -> RocePacket attribute / build() keyword, per layer.
FIELD_MAP: dict[type, dict[str, str]] = {
    BTH: {"opcode": "opcode", "solicited": "se", "migreq": "migreq", "padcount": "pad",
          "version": "tver", "pkey": "pkey", "fecn": "fecn", "becn": "becn",
          "resv6": "resv6", "dqpn": "dest_qp", "ackreq": "ackreq", "resv7": "resv7",
          "psn": "psn"},
    RETH: {"va": "va", "rkey": "rkey", "dma_len": "dma_len"},
    AETH: {"syndrome": "syndrome", "msn": "msn"},
    AtomicETH: {"va": "va", "rkey": "rkey", "swap_add": "swap_add", "compare": "compare"},
    AtomicAckETH: {"orig": "orig"},
    IETH: {"rkey": "ieth_rkey"},
    DETH: {"qkey": "qkey", "src_qp": "src_qp"},
    ImmDt: {"imm": "imm"},
    FETH: {"feth": "feth"},
}


def fields_for(op: int) -> dict:
    """Distinct, non-trivial values for every field build() takes, varied by opcode."""
    return dict(
        psn=0xABC000 | op, dest_qp=0x5A0000 | (op << 4) | 3, ackreq=True, se=op % 2 == 1,
        migreq=True, pkey=0x8000 | op, tver=0x5, fecn=True, becn=op % 3 == 0, resv6=0x15,
        resv7=0x2A,
        va=0x0123456789ABCDEF ^ op, rkey=0xDEAD0000 | op, dma_len=0x00010000 + op,
        syndrome=(0x1F + op) & 0xFF, msn=0xC0FFEE ^ op,
        swap_add=0x1111222233334444 + op, compare=0x5555666677778888 + op,
        orig=0x99AABBCCDDEEFF00 + op, imm=0x12345678 + op, ieth_rkey=0xFEEDF00D ^ op,
        qkey=0x80010000 | op, src_qp=0xABCDE0 | (op & 0xF), feth=0xC0000021 | (op << 8),
    )


def payload_of(n: int, op: int) -> bytes:
    return bytes((op + 7 * i + 1) & 0xFF for i in range(n))


def ours(op: int, f: dict, payload: bytes, ipver: int, pad: int | None = None, **ip) -> bytes:
    """softrdma's frame: build() then encode_frame() (which fills the ICRC)."""
    src, dst = ADDRS[ipver]
    return encode_frame(build(op, payload=payload, pad=pad, **f), src=src, dst=dst,
                        sport=SPORT, **ip)


def ext_layer(layer: type, f: dict):
    """One extension layer built straight from its scapy fields (not via roce_packet)."""
    if layer is RETH:
        return RETH(va=f["va"], rkey=f["rkey"], dma_len=f["dma_len"])
    if layer is AETH:
        return AETH(syndrome=f["syndrome"], msn=f["msn"])
    if layer is AtomicETH:
        return AtomicETH(va=f["va"], rkey=f["rkey"], swap_add=f["swap_add"],
                         compare=f["compare"])
    if layer is AtomicAckETH:
        return AtomicAckETH(orig=f["orig"])
    if layer is IETH:
        return IETH(rkey=f["ieth_rkey"])
    if layer is DETH:
        return DETH(qkey=f["qkey"], src_qp=f["src_qp"])
    if layer is ImmDt:
        return ImmDt(imm=f["imm"])
    if layer is FETH:
        v = f["feth"]
        return FETH(resv=v >> 6, sel=(v >> 4) & 3, plt=v & 0xF)
    raise AssertionError(layer)


def scapy_frame(op: int, f: dict, payload: bytes, ipver: int, pad: int | None = None,
                ip_id: int = 0, ttl: int = 64, tos: int = 0, flow_label: int = 0):
    """The same frame crafted in scapy, with the IP/UDP fields encode_frame writes:
    IPv4 DF, TTL 64, ID 0, TOS 0 / IPv6 hop limit 64, traffic class 0, flow label 0,
    UDP checksum 0 (unless told otherwise). The ICRC is left to scapy's BTH."""
    src, dst = ADDRS[ipver]
    if pad is None:
        pad = -len(payload) & 3
    if ipver == 4:
        l3 = IP(src=src, dst=dst, id=ip_id, flags="DF", ttl=ttl, tos=tos)
    else:
        l3 = IPv6(src=src, dst=dst, hlim=ttl, tc=tos, fl=flow_label)
    pkt = BTH(opcode=op, solicited=int(f["se"]), migreq=int(f["migreq"]), padcount=pad,
              version=f["tver"], pkey=f["pkey"], fecn=int(f["fecn"]), becn=int(f["becn"]),
              resv6=f["resv6"], dqpn=f["dest_qp"], ackreq=int(f["ackreq"]),
              resv7=f["resv7"], psn=f["psn"])
    for layer in header_layers(op):
        pkt = pkt / ext_layer(layer, f)
    data = payload + b"\0" * pad
    if data:
        pkt = pkt / Raw(load=data)
    return Ether(src=ETH_SRC, dst=ETH_DST) / l3 / UDP(sport=SPORT, dport=4791, chksum=0) / pkt


def chain(pkt) -> list[type]:
    """The layer classes from BTH on, Raw included, Padding excluded."""
    layers = pkt.layers()
    return [c for c in layers[layers.index(BTH):] if c is not Padding]


def expected_chain(op: int, data_len: int) -> list[type]:
    return [BTH, *header_layers(op), *([Raw] if data_len else [])]


def check_dissection(d, op: int, expect: dict, payload: bytes, pad: int) -> None:
    """``d`` (dissected by scapy) carries exactly ``expect`` (build()'s keywords)."""
    assert chain(d) == expected_chain(op, len(payload) + pad)
    bth = d[BTH]
    for sattr, attr in FIELD_MAP[BTH].items():
        want = pad if attr == "pad" else (op if attr == "opcode" else expect[attr])
        assert int(getattr(bth, sattr)) == int(want), (hex(op), "BTH", sattr)
    for layer in header_layers(op):
        got = d[layer]
        for sattr, attr in FIELD_MAP[layer].items():
            assert int(getattr(got, sattr)) == int(expect[attr]), (hex(op), layer.name, sattr)
    assert roce_payload(d) == payload
    if len(payload) + pad:
        assert d[Raw].load == payload + b"\0" * pad


# --- 1. softrdma builds, scapy dissects ---------------------------------------------

@pytest.mark.parametrize("ipver", [4, 6])
@pytest.mark.parametrize("plen", [0, 1, 5])
@pytest.mark.parametrize("op", OPS, ids=lambda op: OPCODES[op].name)
def test_scapy_dissects_softrdma_frames(op, plen, ipver):
    f = fields_for(op)
    payload = payload_of(plen, op)
    frame = ours(op, f, payload, ipver)
    d = Ether(frame)
    assert d[UDP].dport == 4791 and d[UDP].sport == SPORT
    check_dissection(d, op, f, payload, -plen & 3)
    # ... and agrees with softrdma's own parser of the same bytes, field by field
    fr = decode_frame(frame)
    p = parse(fr.payload)
    for layer in (BTH, *header_layers(op)):
        for sattr, attr in FIELD_MAP[layer].items():
            assert int(getattr(d[layer], sattr)) == int(getattr(p, attr)), (layer.name, sattr)
    assert roce_payload(d) == bytes(p.payload)
    # scapy's dissected icrc is the wire bytes read big-endian; RocePacket.icrc is zlib's.
    assert d[BTH].icrc == int.from_bytes(frame[-4:], "big")
    assert d[BTH].icrc.to_bytes(4, "big") == p.icrc.to_bytes(4, "little")
    assert icrc_ok(d)  # scapy recomputes the ICRC encode_frame wrote
    assert bytes(d) == frame  # re-serialising the dissection changes nothing


# --- 2. scapy builds, byte for byte equal to softrdma (ICRC included) ------------------

@pytest.mark.parametrize("ipver", [4, 6])
@pytest.mark.parametrize("plen", [0, 1, 5])
@pytest.mark.parametrize("op", OPS, ids=lambda op: OPCODES[op].name)
def test_scapy_built_frames_equal_softrdma(op, plen, ipver):
    f = fields_for(op)
    payload = payload_of(plen, op)
    expect = ours(op, f, payload, ipver)
    pkt = scapy_frame(op, f, payload, ipver)
    got = bytes(pkt)
    assert got[-4:] == expect[-4:], "ICRC: scapy and softrdma disagree"
    assert got == expect
    check_dissection(pkt, op, f, payload, -plen & 3)  # the crafted packet, not re-dissected
    # roce_packet() builds the same stack from build()-style keywords
    p2 = pkt.copy()
    p2[UDP].remove_payload()
    p2 = p2 / roce_packet(op, payload=payload, **f)
    assert bytes(p2) == expect


# --- 3. property version of 2 ---------------------------------------------------------

u8, u16, u24, u32, u64 = (st.integers(0, (1 << n) - 1) for n in (8, 16, 24, 32, 64))
field_strategy = st.fixed_dictionaries(dict(
    psn=u24, dest_qp=u24, ackreq=st.booleans(), se=st.booleans(), migreq=st.booleans(),
    pkey=u16, tver=st.integers(0, 15), fecn=st.booleans(), becn=st.booleans(),
    resv6=st.integers(0, 63), resv7=st.integers(0, 127), va=u64, rkey=u32, dma_len=u32,
    syndrome=u8, msn=u24, swap_add=u64, compare=u64, orig=u64, imm=u32, ieth_rkey=u32,
    qkey=u32, src_qp=u24, feth=u32,
))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(OPS), f=field_strategy, payload=st.binary(max_size=64),
       pad=st.none() | st.integers(0, 3), ipver=st.sampled_from([4, 6]), ip_id=u16,
       ttl=u8, tos=u8, flow_label=st.integers(0, (1 << 20) - 1))
def test_property_scapy_equals_softrdma(op, f, payload, pad, ipver, ip_id, ttl, tos,
                                        flow_label):
    ip = dict(ttl=ttl, tos=tos)
    if ipver == 4:
        ip["ip_id"] = ip_id
    else:
        ip["flow_label"] = flow_label
    expect = ours(op, f, payload, ipver, pad=pad, **ip)
    got = bytes(scapy_frame(op, f, payload, ipver, pad=pad, **ip))
    assert got == expect
    real_pad = -len(payload) & 3 if pad is None else pad
    check_dissection(Ether(expect), op, f, payload, real_pad)


# --- 4. real rxe captures ---------------------------------------------------------------

@pytest.mark.parametrize("path", RXE_PCAPS, ids=lambda p: str(p.relative_to(PCAPS)))
def test_rxe_captures_dissect_like_parse(path):
    n = 0
    for pkt in rdpcap(str(path)):
        raw = bytes(pkt.original)
        if UDP not in pkt or pkt[UDP].dport != 4791:
            continue
        fr = decode_frame(raw)
        p = parse(fr.payload)
        assert isinstance(pkt, Ether) and BTH in pkt
        assert chain(pkt) == expected_chain(p.opcode, p.payload_len + p.pad)
        bth = pkt[BTH]
        assert (bth.opcode, bth.psn, bth.dqpn, bth.ackreq, bth.padcount) == (
            p.opcode, p.psn, p.dest_qp, int(p.ackreq), p.pad)
        for layer in (BTH, *header_layers(p.opcode)):
            for sattr, attr in FIELD_MAP[layer].items():
                assert int(getattr(pkt[layer], sattr)) == int(getattr(p, attr)), (
                    path.name, layer.name, sattr)
        assert roce_payload(pkt) == bytes(p.payload)
        assert bth.icrc.to_bytes(4, "big") == p.icrc.to_bytes(4, "little")
        assert icrc_ok(pkt)
        assert bytes(pkt) == raw
        n += 1
    assert n > 0


def test_captures_cover_the_extension_headers():
    seen: set[type] = set()
    for path in RXE_PCAPS:
        for pkt in rdpcap(str(path)):
            seen.update(c for c in pkt.layers() if c in sl.HDR_BY_LAYER)
    assert {RETH, AETH, AtomicETH, AtomicAckETH, DETH} <= seen


# --- the bindings and helpers themselves ---------------------------------------------------

def test_every_table_header_has_a_layer():
    assert set(sl.LAYER_BY_HDR) == set(Hdr)
    for op, info in OPCODES.items():
        assert [sl.HDR_BY_LAYER[c] for c in header_layers(op)] == [h for h, _ in info.headers]


def test_scapy_ack_binding_replaced_and_subclass_compatible():
    d = Ether(ours(Opcode.RC_ACKNOWLEDGE, fields_for(0x11), b"", 4))
    assert type(d[BTH].payload) is AETH
    assert d[scapy_roce.AETH] is d[AETH]  # scapy's own AETH class still finds it
    assert "AETH" in d and d["AETH"].msn == fields_for(0x11)["msn"]


def test_aeth_syndrome_display():
    a = AETH(syndrome=0x1F, msn=3)
    assert a.kind.name == "ACK"
    assert "ACK credit=31" in a.mysummary()
    assert "RNR_NAK" in AETH(syndrome=0x2C).get_field("syndrome").i2repr(None, 0x2C)
    assert AETH(syndrome=0x62).kind.name == "NAK"


def test_feth_word_property():
    fe = FETH()
    fe.feth = 0xC0000021
    assert (fe.sel, fe.plt, fe.feth) == (2, 1, 0xC0000021)
    assert bytes(fe) == bytes.fromhex("c0000021")


def test_opcode_names_extended():
    for op in (0x16, 0x17, 0x1C, 0x1D):
        assert BTH(opcode=op).sprintf("%BTH.opcode%") == OPCODES[op].name


def test_default_opcode_for_first_extension_layer():
    assert (BTH() / RETH()).opcode == Opcode.RC_RDMA_WRITE_ONLY
    assert (BTH() / DETH()).opcode == Opcode.UD_SEND_ONLY
    assert (BTH() / AETH()).opcode == Opcode.RC_ACKNOWLEDGE
    assert (BTH(opcode=0x0C) / RETH()).opcode == 0x0C  # explicit wins


def test_cnp_still_scapy():
    f = dict(dest_qp=0x1234, becn=True)
    frame = encode_frame(build(Opcode.CNP, **f), src=ADDRS[4][0], dst=ADDRS[4][1], sport=SPORT)
    pkt = (Ether(src=ETH_SRC, dst=ETH_DST)
           / IP(src=ADDRS[4][0], dst=ADDRS[4][1], id=0, flags="DF", ttl=64)
           / UDP(sport=SPORT, dport=4791, chksum=0) / scapy_roce.cnp(0x1234))
    assert bytes(pkt) == frame
    assert chain(Ether(frame)) == [BTH, CNPPadding]


def test_ethernet_padding_is_not_payload():
    """A 58-byte frame padded to Ethernet's 60: the pad is not RoCE payload. (scapy's own
    BTH.compute_icrc counts it, so recomputing naively would give a wrong ICRC.)"""
    frame = ours(Opcode.RC_SEND_ONLY, fields_for(4), b"", 4)
    assert len(frame) == 58
    d = Ether(frame + b"\0\0")
    assert Padding in d and roce_payload(d) == b""
    assert icrc_ok(d)


def test_icrc_ok_detects_corruption():
    frame = bytearray(ours(Opcode.RC_SEND_ONLY, fields_for(4), b"hello", 6))
    assert icrc_ok(Ether(bytes(frame)))
    frame[-6] ^= 1  # a payload byte
    assert not icrc_ok(Ether(bytes(frame)))


def test_roce_packet_fields():
    # like build(): fields of headers the opcode lacks are ignored, unknown names are not
    p = roce_packet(Opcode.RC_SEND_ONLY, qkey=1)
    assert p.layers() == [BTH] and p.opcode == Opcode.RC_SEND_ONLY
    with pytest.raises(TypeError):
        roce_packet(Opcode.RC_SEND_ONLY, qky=1)
    p = roce_packet(Opcode.RC_SEND_LAST_WITH_INVALIDATE, rkey=1, ieth_rkey=2, payload=b"ab")
    assert p[IETH].rkey == 2 and p[BTH].padcount == 2 and p[Raw].load == b"ab\0\0"
    with pytest.raises(ValueError):
        roce_packet(0x7F)


def test_module_doctest():
    assert doctest.testmod(sl).failed == 0


def test_softrdma_does_not_import_scapy():
    code = (
        "import importlib, pkgutil, sys, softrdma\n"
        "skip = {'softrdma.__main__', 'softrdma.wire.scapy_layers'}\n"
        "for m in pkgutil.walk_packages(softrdma.__path__, 'softrdma.'):\n"
        "    if m.name not in skip:\n"
        "        importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m == 'scapy' or m.startswith('scapy.')\n"
        "       or m == 'softrdma.wire.scapy_layers']\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
