"""``softrdma replay`` and the conversation splitter (softrdma/harness/conversations.py)
over every capture in pcaps/, and over mutated copies: each mutation of a packet the real
endpoint sent must be reported at its frame, naming the field, with exit status 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from softrdma.cli import main
from softrdma.harness.conversations import conversations, replay_conversations
from softrdma.harness.replay import load_capture

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pcap_mutate as pm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ALL_PCAPS = sorted((ROOT / "pcaps").rglob("*.pcap"))
SERVER, CLIENT = "10.77.0.11", "10.77.0.12"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["replay", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("path", ALL_PCAPS, ids=[str(p.relative_to(ROOT / "pcaps"))
                                                 for p in ALL_PCAPS])
def test_every_capture_replays_identically(path, capsys):
    rc, out, err = _run(capsys, str(path), "--json", *(["--inline"] if "inline" in path.name
                                                        else []))
    assert rc == 0, out + err
    sides = [json.loads(line) for line in out.splitlines()]
    replayed = [s for s in sides if s["status"] != "refused"]
    assert replayed and all(s["status"] == "identical" for s in replayed), out
    # the only conversations refused are the CM's, on QP1
    for s in sides:
        if s["status"] == "refused":
            assert s["conversation"]["a"][1] == s["conversation"]["b"][1] == 1, s
            assert "QP1" in s["reason"]


@pytest.mark.parametrize("name,expect", [
    # four RC connections over one SRQ on each side
    ("srq_pingpong", [("RC", 0x14), ("RC", 0x15), ("RC", 0x16), ("RC", 0x17)]),
    # two rdma_cm connections, plus the CM on QP1
    ("ucmatose", [("UD", 1), ("RC", 0x21), ("RC", 0x22)]),
    # a UD QP each side (0x25 on the client, 0x24 on the server), plus the CM
    ("udaddy", [("UD", 1), ("UD", 0x24)]),
    ("rping", [("UD", 1), ("RC", 0x11)]),
])
def test_multi_qp_captures_split_into_their_conversations(name, expect):
    convs = conversations(load_capture(str(ROOT / "pcaps" / "linux-rxe" / f"{name}.pcap")))
    got = sorted((cv.transport, min(q for _, q in (cv.a, cv.b))) for cv in convs)
    assert got == sorted(expect)
    # every RoCE packet of the capture is in exactly one conversation
    assert sum(len(cv.packets) for cv in convs) == len(
        load_capture(str(ROOT / "pcaps" / "linux-rxe" / f"{name}.pcap")))


def test_cm_connections_take_their_flow_label_from_the_req(capsys):
    """rdma_cm's QPs use the REQ's flow label for their UDP source port (rping: 52901,
    not the 49441 two QPs 0x11 would get without one): the replay must find it."""
    rc, out, _ = _run(capsys, str(ROOT / "pcaps/linux-rxe/rping.pcap"), "--ip", SERVER,
                      "--qpn", "0x11")
    assert rc == 0, out
    assert "as 10.77.0.11 qpn 0x11: identical (18 packets)" in out


def _mutated(tmp_path: Path, name: str, frame: int, **fields) -> str:
    recs = pm.edit(pm.load(ROOT / "pcaps" / "linux-rxe" / f"{name}.pcap"), frame, **fields)
    out = tmp_path / f"{name}-{frame}.pcap"
    out.write_bytes(pm.to_bytes(recs))
    return str(out)


@pytest.mark.parametrize("name,frame,fields,field", [
    ("rc_pingpong", 6, {"msn": 9}, "msn"),  # the server's first ACK
    ("rc_pingpong", 6, {"syndrome": 0x60}, "syndrome"),  # ... made a PSN sequence NAK
    ("write_bw", 3, {"psn": 9999}, "psn"),  # a WRITE MIDDLE of the client's
    ("write_bw", 5, {"ackreq": 1}, "ackreq"),  # rxe asks for an ACK only on the LAST
    ("fetch_add", 6, {"msn": 7}, "msn"),  # the second ATOMIC ACKNOWLEDGE
    ("ud_pingpong", 3, {"sport": 40000}, "udp_sport"),  # UD: the port follows the QPN
])
def test_a_mutated_packet_is_reported_at_its_frame_and_field(tmp_path, capsys, name, frame,
                                                            fields, field):
    path = _mutated(tmp_path, name, frame, **fields)
    sender = load_capture_src(pm.load(path)[frame - 1])
    rc, out, _ = _run(capsys, path, "--ip", sender, "--json")
    assert rc == 1, out
    (side,) = [json.loads(line) for line in out.splitlines()]
    assert side["status"] == "different"
    first = side["differences"][0]
    assert first["frame"] == frame, side
    assert field in [f["field"] for f in first["fields"]], side


def test_text_output_names_the_frame_and_the_field(tmp_path, capsys):
    path = _mutated(tmp_path, "rc_pingpong", 6, msn=9)
    rc, out, _ = _run(capsys, path)
    assert rc == 1
    assert "as 10.77.0.11 qpn 0x11: DIFFERENT" in out
    assert "response 0, frame 6 (RC_ACKNOWLEDGE):" in out
    assert "    ! msn: expected 9, got 1" in out.splitlines()
    cap = next(x for x in out.splitlines() if x.strip().startswith("capture :"))
    assert "msn=9" in cap and cap.split()[2] == "6"  # the captured frame, dissected
    assert "as 10.77.0.12 qpn 0x11: identical" in out  # the other side is untouched


def test_a_missing_answer_is_reported(tmp_path, capsys):
    """Frame 6 (the server's ACK) removed: the server-side replay sends one more response
    than the capture holds."""
    recs = pm.drop(pm.load(ROOT / "pcaps/linux-rxe/rc_pingpong.pcap"), 6)
    path = tmp_path / "dropped.pcap"
    path.write_bytes(pm.to_bytes(recs))
    rc, out, _ = _run(capsys, str(path), "--ip", SERVER, "--json")
    assert rc == 1
    side = json.loads(out.splitlines()[0])
    assert side["sent"] == side["expected"] + 1, side
    diffs = side["differences"]
    # aligned by PSN, the rest pair with their own: the one difference is softrdma's ACK
    # of the first SEND, which the capture lacks
    assert diffs[0]["kind"] == "response" and diffs[0]["index"] == 0
    assert "psn" in [f["field"] for f in diffs[0]["fields"]]
    assert diffs[-1]["sent_by"] == "softrdma" and len(diffs) == 1


def test_one_sided_flow_is_refused_with_its_reason(tmp_path):
    recs = pm.load(ROOT / "pcaps/linux-rxe/write_bw.pcap")
    keep = [r for r in recs if pm.packet(r) is None or
            load_capture_src(r) != SERVER]
    path = tmp_path / "one-sided.pcap"
    path.write_bytes(pm.to_bytes(pm.renumber(keep)))
    convs = conversations(load_capture(str(path)))
    assert len(convs) == 1 and convs[0].refused and "one direction" in convs[0].refused
    (r,) = [r for r in replay_conversations(load_capture(str(path)), ip=CLIENT)]
    assert r.result is None


def load_capture_src(rec) -> str:
    from softrdma.wire.frames import decode_frame
    import ipaddress
    f = decode_frame(rec.data, rec.linktype)
    return str(ipaddress.ip_address(f.ip_src))


def test_flows_on_different_ports_pair_when_unambiguous(tmp_path):
    """A non-rxe implementation may pick the two directions' UDP source ports apart:
    one flow each way between two addresses is still one conversation."""
    recs = pm.load(ROOT / "pcaps/linux-rxe/send_bw.pcap")
    for i, r in enumerate(recs):
        if pm.packet(r) is not None and load_capture_src(r) == SERVER:
            recs = pm.edit(recs, r.index, sport=50000)
    path = tmp_path / "ports.pcap"
    path.write_bytes(pm.to_bytes(recs))
    convs = conversations(load_capture(str(path)))
    assert len(convs) == 1 and convs[0].refused is None
    assert {convs[0].a[1], convs[0].b[1]} == {0x1A}


@pytest.mark.parametrize("argv,msg", [
    (["/nonexistent.pcap"], "no such file"),
    (["{pcap}", "--qpn", "zz"], "invalid integer: 'zz'"),
    (["{pcap}", "--qpn", "0x1000000"], "0x1000000 is not a QP number"),
    (["{pcap}", "--max-diffs", "-1"], "-1 is not at least 0"),
    (["{pcap}", "--ip", "10.0.0.300"], "not an IP address"),
    (["{pcap}", "--qpn", "0x99"], "no conversation has an endpoint matching --qpn 0x99"),
])
def test_usage_errors_are_one_line_exit_2(capsys, argv, msg):
    pcap = str(ROOT / "pcaps/linux-rxe/rc_pingpong.pcap")
    argv = [a.replace("{pcap}", pcap) for a in argv]
    with pytest.raises(SystemExit) as e:
        rc = main(["replay", *argv])
        raise SystemExit(rc)
    _, err = capsys.readouterr()
    assert e.value.code == 2
    assert msg in err and len(err.strip().splitlines()) == 1, err


def test_an_answer_after_the_capture_ends_is_reported_not_compared(capsys):
    """with-oob/srq_pingpong.pcap ends with the server's SEND (frame 73, PSN 8228033 to
    QP 0x14) whose ACK the capture did not catch: softrdma's ACK is set aside."""
    rc, out, _ = _run(capsys, str(ROOT / "pcaps/linux-rxe/with-oob/srq_pingpong.pcap"),
                      "--ip", CLIENT, "--qpn", "0x14")
    assert rc == 0, out
    assert "as 10.77.0.12 qpn 0x14: identical (3 packets); 1 answer(s) after the " \
           "capture's end not compared" in out


def test_the_replay_takes_the_path_mtu_from_the_capture(tmp_path):
    """A capture made with path MTU 4096 (jumbo frames) replays byte for byte: the replaying
    device and QP use the MTU the capture's segmentation shows, not a fixed 1024 (which
    would cut the READ responses at 1024 bytes)."""
    from softrdma.enums import IBV_MTU_4096, IBV_WR_RDMA_READ, IBV_WR_SEND
    from softrdma.harness.replay import replay_side
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.soft.capture import PacketCapture

    net = SimNetwork(seed=5)
    a, b = connected_pair(net, "RC", mtu=9000, a_attrs={"path_mtu": IBV_MTU_4096},
                          b_attrs={"path_mtu": IBV_MTU_4096})
    path = tmp_path / "jumbo.pcap"
    cap = PacketCapture(str(path), clock=lambda: net.now)
    a.device.capture = cap
    b.post_recv(b.buf_sge(0, 8000), wr_id=1)
    a.post_send(IBV_WR_SEND, a.buf_sge(0, 8000), wr_id=2)
    a.post_send(IBV_WR_RDMA_READ, a.buf_sge(16384, 10000), wr_id=3, remote_offset=32768)
    assert net.run_until(lambda: a.ncomp() >= 2 and b.ncomp() >= 1)
    cap.close()
    packets = load_capture(str(path))
    assert max(c.pkt.payload_len for c in packets) == 4096
    for ip in {packets[0].src, packets[0].dst}:
        res = replay_side(packets, ".".join(map(str, ip)), device_name="jumbo0")
        assert res.mismatches == [] and len(res.sent) == len(res.expected) > 0
