"""Cross-check softrdma's decoder against Wireshark's (tshark), an independent implementation.

tshark decodes every RoCEv2 header but does not verify the ICRC; it shows the ICRC field
as the four wire bytes read big-endian, which we compare with our stored value. Its
payload heuristics (RPC-over-RDMA and friends) would claim SEND payloads, so they are
disabled, one flag per name (a renamed heuristic makes tshark exit 1, failing loudly).
"""

from __future__ import annotations

import subprocess

import pytest

from softrdma.wire.frames import decode_frame, encode_frame
from softrdma.wire.opcodes import OPCODES, Hdr, Opcode
from softrdma.wire.packet import FIELDS_BY_HEADER, build, parse
from softrdma.wire.pcap import PcapWriter, read_pcap

from .conftest import PCAPS, RXE_PCAPS, require_tool

HEURISTICS = ["rpcrdma_infiniband", "iser_infiniband", "sdp_infiniband", "smb_direct_infiniband",
              "smcr_infiniband", "lnet_ib", "fc_infiniband", "eth_over_ib", "mellanox_eoib",
              "nvme_rdma"]
# tshark field -> our RocePacket attribute (None: handled specially)
FIELDS = {
    "infiniband.bth.opcode": "opcode", "infiniband.bth.se": "se", "infiniband.bth.m": "migreq",
    "infiniband.bth.padcnt": "pad", "infiniband.bth.tver": "tver", "infiniband.bth.p_key": "pkey",
    "infiniband.bth.destqp": "dest_qp", "infiniband.bth.a": "ackreq", "infiniband.bth.psn": "psn",
    "infiniband.reth.va": "va", "infiniband.reth.r_key": "rkey", "infiniband.reth.dmalen": "dma_len",
    "infiniband.atomiceth.swapdt": "swap_add", "infiniband.atomiceth.cmpdt": "compare",
    "infiniband.aeth.syndrome": "syndrome", "infiniband.aeth.msn": "msn",
    "infiniband.atomicacketh.origremdt": "orig", "infiniband.immdt": "imm",
    "infiniband.ieth": "ieth_rkey", "infiniband.deth.q_key": "qkey",
    "infiniband.deth.srcqp": "src_qp", "infiniband.invariant.crc": None, "data.len": None,
    "frame.number": None, "udp.dstport": None, "_ws.malformed": None,
}


def tshark_fields(path) -> dict[int, dict[str, str]]:
    exe = require_tool("tshark")
    cmd = [exe, "-n", "-r", str(path), "-d", "udp.port==4791,infiniband",
           "--disable-protocol", "tftp"]
    for h in HEURISTICS:
        cmd += ["--disable-heuristic", h]
    cmd += ["-T", "fields", "-E", "separator=|", "-E", "occurrence=f"]
    for f in FIELDS:
        cmd += ["-e", f]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {}
    for line in out.splitlines():
        vals = dict(zip(FIELDS, line.split("|")))
        rows[int(vals["frame.number"])] = vals
    return rows


def as_int(v: str) -> int:
    if v in ("True", "False"):
        return int(v == "True")
    try:
        return int(v, 0)
    except ValueError:
        return int(v.replace(":", ""), 16)  # FT_BYTES fields (ImmDt) print bare hex


def compare_capture(path) -> int:
    ts = tshark_fields(path)
    checked = 0
    for rec in read_pcap(path):
        f = decode_frame(rec.data, rec.linktype)
        if f is None or not f.is_roce:
            continue
        p = parse(f.payload)
        row = ts[rec.index]
        assert row["_ws.malformed"] == "", (path.name, rec.index, "tshark: malformed")
        ours_present = {k for h, _ in p.info.headers for k in FIELDS_BY_HEADER[h]}
        for tf, attr in FIELDS.items():
            if attr is None:
                continue
            v = row[tf]
            if attr in ("va", "rkey") and p.info.has(Hdr.ATMETH):
                pass  # tshark reports the AtomicETH VA/rkey under reth.*
            elif attr not in ours_present and attr not in {
                    "opcode", "se", "migreq", "pad", "tver", "pkey", "dest_qp", "ackreq", "psn"}:
                assert v == "", (path.name, rec.index, tf, v)
                continue
            assert v != "", (path.name, rec.index, tf, "missing in tshark")
            assert as_int(v) == int(getattr(p, attr)), (path.name, rec.index, tf, v, getattr(p, attr))
        # ICRC: tshark shows the wire bytes big-endian; ours is the little-endian integer.
        assert int(row["infiniband.invariant.crc"], 0) == int.from_bytes(
            p.icrc.to_bytes(4, "little"), "big"), (path.name, rec.index)
        # tshark's data includes the pad bytes. On QP1 it dissects the payload as a CM MAD.
        dl = int(row["data.len"] or 0)
        if p.dest_qp != 1:
            assert dl == (p.payload_len + p.pad if p.payload_len + p.pad else 0), (path.name, rec.index)
        checked += 1
    return checked


@pytest.mark.parametrize("path", RXE_PCAPS, ids=lambda p: str(p.relative_to(PCAPS)))
def test_real_captures_agree_with_tshark(path):
    assert compare_capture(path) > 0


# Opcodes that tshark 4.0 does not know (IBTA 1.5 additions) or that carry no transport.
TSHARK_UNKNOWN = {Opcode.RC_FLUSH, Opcode.RC_ATOMIC_WRITE, Opcode.CNP}


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_every_opcode_agrees_with_tshark(tmp_path, family):
    src, dst = ("10.9.0.1", "10.9.0.2") if family == "ipv4" else ("fd00::1", "fd00::2")
    path = tmp_path / f"all-{family}.pcap"
    n = 0
    with PcapWriter(path) as w:
        for op in sorted(OPCODES):
            if op in TSHARK_UNKNOWN:
                continue
            info = OPCODES[op]
            for plen in ((0, 1, 7) if info.has_payload else (0,)):
                k = op * 7 + plen
                raw = build(op, psn=(0xABC000 + k) & 0xFFFFFF, dest_qp=0x100 + k, ackreq=bool(k & 1),
                            se=bool(k & 2), va=0x1122334455667788 + k, rkey=0x1000 + k,
                            dma_len=4096 + k, syndrome=[0x1F, 0x2C, 0x60, 0x62][k % 4],
                            msn=0x10203 + k, swap_add=0xAAAA0000BBBB0000 + k,
                            compare=0x0123456789ABCDEF - k, orig=0xFEDCBA9876543210 + k,
                            imm=0xDEADBEEF - k, ieth_rkey=0xCAFE00 + k, qkey=0x11111111 + k,
                            src_qp=0x200 + k, payload=bytes((k + i) & 0xFF for i in range(plen)))
                w.write(encode_frame(raw, src=src, dst=dst, sport=0xC000 + k, ip_id=k), ts=float(k))
                n += 1
    assert compare_capture(path) == n
