"""``softrdma dissect`` as a user runs it: a subprocess, its output and its exit status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from softrdma.wire.frames import encode_frame
from softrdma.wire.packet import build
from softrdma.wire.opcodes import Opcode
from softrdma.wire.pcap import PcapWriter

from .conftest import PCAPS


def run(*args):
    return subprocess.run([sys.executable, "-m", "softrdma", "dissect", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_text_output_of_a_real_capture():
    r = run(PCAPS / "fetch_add.pcap", "--verify")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 40
    first = lines[0]
    assert "RC_FETCH_ADD" in first and "qpn=0x" in first and "psn=" in first
    assert "atomic va=0x" in first and "icrc=ok" in first
    assert any("RC_ATOMIC_ACKNOWLEDGE" in ln and "aeth ACK credit=31" in ln and "orig=0x" in ln
               for ln in lines)
    assert r.stderr.strip() == "40 frames: 40 RoCE, 0 not RoCE (skipped), 0 undecodable, 0 bad ICRC"


def test_json_output_fields():
    r = run(PCAPS / "with-oob" / "write_bw.pcap", "--json")
    assert r.returncode == 0
    recs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert len(recs) == 25  # the TCP exchange frames are skipped
    assert "43 not RoCE (skipped)" in r.stderr
    w = next(x for x in recs if x["opcode_name"] == "RC_RDMA_WRITE_FIRST")
    for k in ("index", "time", "src", "dst", "sport", "dport", "qpn", "psn", "ackreq",
              "reth_va", "reth_rkey", "reth_len", "payload_len", "icrc", "icrc_ok"):
        assert k in w
    assert w["reth_len"] == 4096 and w["payload_len"] == 1024 and w["icrc_ok"] is True
    ack = next(x for x in recs if x["opcode_name"] == "RC_ACKNOWLEDGE")
    assert ack["aeth_type"] == "ACK" and ack["aeth_value"] == 31 and "reth_va" not in ack


def test_ud_fields():
    r = run(PCAPS / "ud_pingpong.pcap", "--json", "-q")
    rec = json.loads(r.stdout.splitlines()[0])
    assert rec["deth_qkey"] == 0x11111111 and rec["transport"] == "UD"
    assert r.stderr == ""


def _write(path, frames):
    with PcapWriter(path) as w:
        for i, fr in enumerate(frames):
            w.write(fr, ts=float(i))


def test_bad_icrc_fails_only_with_verify(tmp_path):
    good = encode_frame(build(Opcode.RC_SEND_ONLY_WITH_IMMEDIATE, imm=7, payload=b"x"),
                        src="10.0.0.1", dst="10.0.0.2", sport=0xC000)
    bad = bytearray(good)
    bad[-1] ^= 0x01
    p = tmp_path / "bad.pcap"
    _write(p, [good, bytes(bad)])
    r = run(p)
    assert r.returncode == 0
    assert "icrc=BAD" in r.stdout.splitlines()[1]
    r = run(p, "--verify")
    assert r.returncode == 1
    assert "1 bad ICRC" in r.stderr


def test_undecodable_frame_fails_and_non_roce_is_skipped(tmp_path):
    truncated = encode_frame(bytes([0x06]) + bytes(20), src="10.0.0.1", dst="10.0.0.2",
                             sport=0xC000, fill_icrc=False)  # WRITE_FIRST cut short
    other_udp = encode_frame(bytes(30), src="10.0.0.1", dst="10.0.0.2", sport=53, dport=53,
                             fill_icrc=False)
    arp = bytes.fromhex("ffffffffffff020000000001" "0806") + bytes(28)
    p = tmp_path / "mixed.pcap"
    _write(p, [truncated, other_udp, arp])
    r = run(p)
    assert r.returncode == 1
    assert "DECODE ERROR (truncated)" in r.stdout
    assert "3 frames: 0 RoCE, 2 not RoCE (skipped), 1 undecodable" in r.stderr


@pytest.mark.parametrize("content,needle", [(None, "no such file"),
                                            (b"hello, not a capture", "not a pcap or pcapng"),
                                            (b"\xd4\xc3\xb2\xa1\x02\x00", "header truncated")])
def test_unreadable_input_is_one_line_and_status_2(tmp_path, content, needle):
    p = tmp_path / "in.pcap"
    if content is not None:
        p.write_bytes(content)
    r = run(p)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr
    assert "Traceback" not in r.stderr


def test_directory_is_an_error(tmp_path):
    r = run(tmp_path)
    assert r.returncode == 2 and "is a directory" in r.stderr
