"""Captures recorded with scripts/record_captures.py on the lab (pcaps/lab-*): rxe-to-rxe
and rxe-to-softrdma runs. Every frame decodes and verifies; softrdma's own frames, as the
bridge saw them, carry what its ICRC assumed (IPv4 ID 0, DF) and rxe's UDP source ports; and
the rxe-to-rxe runs replay byte for byte with softrdma in either role."""

from __future__ import annotations

from pathlib import Path

import pytest

from softrdma.qp.params import udp_sport_for_path, udp_sport_for_qpn
from softrdma.harness.replay import load_capture, replay_side
from softrdma.wire.frames import decode_frame
from softrdma.wire.packet import parse
from softrdma.wire.pcap import read_pcap

LAB = sorted((Path(__file__).resolve().parent.parent / "pcaps").glob("lab-*/*.pcap"))


def test_lab_captures_exist():
    assert len(LAB) >= 8


@pytest.mark.parametrize("path", LAB, ids=lambda p: p.name)
def test_every_frame_decodes_rebuilds_and_verifies(path):
    n = 0
    for rec in read_pcap(path):
        f = decode_frame(rec.data, rec.linktype)
        if f is None or not f.is_roce:
            continue
        p = parse(f.payload)
        assert p.icrc == f.icrc(), rec.index
        assert bytes(p.to_bytes()) == bytes(f.payload)
        if f.src == "10.77.0.1":  # softrdma's packets, as they appeared on the wire
            assert f.ip_id == 0 and f.ip_frag == 0x4000
            assert f.sport >= 0xC000
        n += 1
    assert n > 0


@pytest.mark.parametrize("path", [p for p in LAB if "softrdma" in p.name], ids=lambda p: p.name)
def test_softrdma_source_ports_are_rxes(path):
    frames = [(decode_frame(r.data), parse(decode_frame(r.data).payload)) for r in read_pcap(path)]
    soft = [(f, p) for f, p in frames if f.src == "10.77.0.1"]
    peer = [(f, p) for f, p in frames if f.src != "10.77.0.1"]
    my_qpn = peer[0][1].dest_qp
    for f, p in soft:
        if p.info.transport.name == "UD":
            assert f.sport == udp_sport_for_qpn(p.src_qp)
        else:
            assert f.sport == udp_sport_for_path(0, my_qpn, p.dest_qp)


@pytest.mark.parametrize("ip", ["10.77.0.11", "10.77.0.12"])
@pytest.mark.parametrize("path", [p for p in LAB if "rxe-rxe" in p.name], ids=lambda p: p.name)
def test_rxe_to_rxe_runs_replay_byte_for_byte(path, ip):
    res = replay_side(load_capture(str(path)), ip, device_name="labreplay")
    assert res.mismatches == [] and len(res.sent) == len(res.expected) > 0
