"""QP1 (the GSI) of the soft device: 256-byte MADs received with rxe's checks, handed to a
MAD handler, and sent with rxe's framing (softrdma.soft.gsi, docs/device.md "QP1").

The expected framing comes from the real capture ``pcaps/linux-rxe/ucmatose.pcap``
(Linux 6.1 rxe, client 10.77.0.12, server 10.77.0.11), not from softrdma.
"""

from __future__ import annotations

import pytest

from softrdma.cm.mad import MAD_SIZE, AttrId, Method, build_mad, cm_mad_header
from softrdma.cm.messages import REP, REQ, build_cm, parse_cm
from softrdma.cm.qp1 import GSI_QKEY, QP1_UDP_SPORT, build_qp1
from softrdma.counters import Drop
from softrdma.soft.capture import PacketCapture
from softrdma.soft.device import SoftDevice
from softrdma.soft.gsi import MadSource
from softrdma.verbs_api import Context, add_device, remove_device
from softrdma.wire.frames import decode_frame
from softrdma.wire.icrc import icrc_ipv4
from softrdma.wire.opcodes import Opcode
from softrdma.wire.packet import build, parse
from softrdma.wire.pcap import read_pcap

from .conftest import PCAPS, wait_until as wait

CAPTURE = PCAPS / "ucmatose.pcap"
CLIENT, SERVER = "10.77.0.12", "10.77.0.11"


def _capture():
    out = []
    for r in read_pcap(CAPTURE):
        f = decode_frame(r.data, r.linktype)
        out.append((r.index, f, parse(f.payload)))
    return out


FRAMES = _capture()
QP1_FRAMES = [(i, f, p) for i, f, p in FRAMES if p.dest_qp == 1]


def req_mad(comm_id: int = 0x1234, qpn: int = 0x77) -> bytes:
    return build_cm(REQ, tid=comm_id << 8, local_comm_id=comm_id, local_qpn=qpn,
                    service_id=0x0106_4E20, starting_psn=0xABCDE, pkey=0xFFFF,
                    primary_local_lid=0xFFFF, primary_remote_lid=0xFFFF,
                    private_data=b"hello")


class Collect(list):
    def __call__(self, mad: bytes, source: MadSource) -> None:
        self.append((mad, source))


@pytest.fixture
def live_pair():
    add_device("127.0.43.1", name="qp1-a")
    add_device("127.0.43.2", name="qp1-b")
    try:
        with Context(name="qp1-a") as ca, Context(name="qp1-b") as cb:
            yield ca.device, cb.device
    finally:
        remove_device("qp1-a")
        remove_device("qp1-b")


# ------------------------------------------------------------------ live devices

def test_two_live_devices_exchange_a_cm_req_and_the_handler_answers(live_pair):
    a, b = live_pair
    got_a, got_b = Collect(), Collect()
    a.set_mad_handler(got_a)

    def answer(mad, source):  # b's "CM": record, then reply from inside the handler
        got_b.append((mad, source))
        rep = build_cm(REP, tid=parse_cm(mad).tid, local_comm_id=0x99, remote_comm_id=0x1234)
        b.send_mad(rep, source.src_ip, source.src_qp)
    b.set_mad_handler(answer)
    req = req_mad()
    a.send_mad(req, "127.0.43.2")
    assert wait(lambda: got_a), (a.counters.drops, b.counters.drops)
    mad, src = got_b[0]
    assert mad == req
    # the UDP source port is what the kernel saw on the datagram: rxe's QP1 port
    assert src == MadSource("127.0.43.1", 1, "127.0.43.2", QP1_UDP_SPORT, 0xFFFF, 0)
    rep, src_a = got_a[0]
    m = parse_cm(rep)
    assert m.name == "REP" and m.tid == parse_cm(req).tid and m.remote_comm_id == 0x1234
    assert (src_a.src_ip, src_a.src_qp, src_a.sport, src_a.psn) == ("127.0.43.2", 1, 55410, 0)
    assert (a.counters.gsi_mads_sent, a.counters.gsi_mads_rcvd) == (1, 1)
    assert (b.counters.gsi_mads_sent, b.counters.gsi_mads_rcvd) == (1, 1)
    assert a.counters.drops == {} and b.counters.drops == {}
    assert a.gsi.psn == 1 and b.gsi.psn == 1


def test_a_live_device_sends_a_mad_to_itself(live_pair):
    a, _ = live_pair
    got = Collect()
    a.set_mad_handler(got)
    for i in range(3):
        a.send_mad(req_mad(comm_id=i + 1), a.ip)
    # loopback is delivered on the caller's thread, right after the call (no wait)
    assert [parse_cm(m).local_comm_id for m, _ in got] == [1, 2, 3]
    assert [s.psn for _, s in got] == [0, 1, 2]
    assert all(s.src_ip == s.dst_ip == "127.0.43.1" and s.sport == 55410 for _, s in got)


def test_a_live_device_without_a_handler_counts_and_answers_as_linux_cm(live_pair):
    """No consumer of the CM on b: its REQ is counted and, as Linux's ib_cm (which runs on
    every port) does with no listener, answered with REJ 8 echoing the TID; a (no
    consumer either) counts that REJ and answers nothing."""
    a, b = live_pair
    req = req_mad()
    a.send_mad(req, b.ip)
    assert wait(lambda: a.counters.drops)
    assert b.counters.drops == {"gsi_no_handler": 1} and b.counters.gsi_mads_rcvd == 0
    assert b.counters.gsi_mads_sent == 1 and a.counters.drops == {"gsi_no_handler": 1}
    got = Collect()
    a.set_mad_handler(got)
    a.send_mad(req, b.ip)
    assert wait(lambda: got)
    rej = parse_cm(got[0][0])
    sent = parse_cm(req)
    assert (rej.name, rej.reason, rej.tid, rej.remote_comm_id) == (
        "REJ", 8, sent.tid, sent.local_comm_id)
    a.set_mad_handler(None)


# ------------------------------------------------------------------ the capture

def test_the_captures_mads_replayed_reach_the_handler_intact():
    """Every QP1 frame of the capture, replayed into devices at its two addresses with the
    capture's IP IDs, passes the checks (ICRC verified) and reaches that side's handler
    with its bytes and source; the RC frames go where they went before (no QP: no_qp)."""
    server, client = SoftDevice("srv", SERVER), SoftDevice("cli", CLIENT)
    got = {SERVER: Collect(), CLIENT: Collect()}
    server.set_mad_handler(got[SERVER])
    client.set_mad_handler(got[CLIENT])
    for _, f, _ in FRAMES:
        dev = server if f.ip_dst == server.ip_packed else client
        dev.receive(f.payload, f.ip_src, f.ip_dst, ip_id=f.ip_id, sport=f.sport)
    for dev in (server, client):
        want = [(bytes(p.payload), p.psn) for _, f, p in QP1_FRAMES if f.ip_dst == dev.ip_packed]
        assert [(m, s.psn) for m, s in got[dev.ip]] == want
        other = CLIENT if dev is server else SERVER
        assert {(s.src_ip, s.src_qp, s.sport, s.dst_ip) for _, s in got[dev.ip]} == {
            (other, 1, 55410, dev.ip)}
        assert dev.counters.icrc_err == 0 and set(dev.counters.drops) == {"no_qp"}
        assert dev.counters.gsi_mads_rcvd == len(want)
    assert [parse_cm(m).name for m, _ in got[SERVER]] == ["REQ", "REQ", "RTU", "RTU",
                                                          "DREP", "DREP"]
    assert [parse_cm(m).name for m, _ in got[CLIENT]] == ["REP", "REP", "DREQ", "DREQ"]


def test_the_frames_softrdma_sends_have_the_captures_framing(tmp_path):
    """The client's first REQ sent by softrdma at the PSN the capture shows is, BTH to
    payload, the captured packet; its ICRC is valid for its own IP ID (0) and port; the
    pcap softrdma writes has rxe's UDP ports."""
    index, f, p = QP1_FRAMES[0]
    assert index == 1 and parse_cm(bytes(p.payload)).name == "REQ"
    dev = SoftDevice("cli", CLIENT)
    sent = []
    dev.transmit = lambda data, dst, sport: sent.append((data, dst, sport))
    dev.capture = PacketCapture(str(tmp_path / "out.pcap"))
    dev.gsi.psn = p.psn
    dev.send_mad(bytes(p.payload), SERVER)
    dev.capture.close()
    (data, dst, sport), = sent
    assert dst == f.ip_dst and sport == f.sport == QP1_UDP_SPORT
    assert data[:-4] == bytes(f.payload[:-4])  # BTH, DETH, the MAD: byte for byte
    icrc = icrc_ipv4(bytearray(data), f.ip_src, f.ip_dst, 55410, ip_id=0)
    assert data[-4:] == icrc.to_bytes(4, "little")
    # the capture's own packet, ICRC recomputed for IP ID 0, is our packet exactly
    theirs = bytearray(f.payload)
    theirs[-4:] = icrc_ipv4(theirs, f.ip_src, f.ip_dst, f.sport, ip_id=0).to_bytes(4, "little")
    assert bytes(theirs) == data
    (rec,) = list(read_pcap(tmp_path / "out.pcap"))
    g = decode_frame(rec.data, rec.linktype)
    assert (g.sport, g.dport, g.ip_src, g.ip_dst) == (55410, 4791, f.ip_src, f.ip_dst)
    q = parse(g.payload)
    fields = ("opcode", "se", "migreq", "pad", "tver", "pkey", "fecn", "becn", "dest_qp",
              "ackreq", "psn", "qkey", "src_qp", "payload_len")
    assert [getattr(q, k) for k in fields] == [getattr(p, k) for k in fields]
    # and a device at the server's address takes it (ICRC verified) as the server took it
    server = SoftDevice("srv", SERVER)
    got = Collect()
    server.set_mad_handler(got)
    server.receive(data, f.ip_src, f.ip_dst, sport=sport)
    assert got and got[0][0] == bytes(p.payload) and server.counters.drops == {}


def test_send_psn_counts_from_zero_and_dst_qpn_is_honoured():
    dev = SoftDevice("m", "127.0.43.9")
    sent = []
    dev.transmit = lambda data, dst, sport: sent.append(parse(data))
    dev.send_mad(req_mad(), "127.0.43.8")
    dev.send_mad(req_mad(), "127.0.43.8", dst_qpn=0x1234)
    assert [(q.psn, q.dest_qp, q.src_qp, q.qkey) for q in sent] == [
        (0, 1, 1, GSI_QKEY), (1, 0x1234, 1, GSI_QKEY)]
    assert dev.counters.sent_pkts == 2 and dev.counters.gsi_mads_sent == 2


def test_send_mad_refuses_what_is_not_a_mad_or_the_wrong_ip_version():
    dev = SoftDevice("m", "127.0.43.9")
    with pytest.raises(ValueError, match="256-byte"):
        dev.send_mad(bytes(255), "127.0.43.8")
    with pytest.raises(ValueError, match="IPv6"):
        dev.send_mad(bytes(256), "::1")
    assert dev.counters.sent_pkts == 0 and dev.gsi.psn == 0


def test_manual_loopback_waits_for_progress():
    dev = SoftDevice("m", "127.0.43.9")
    got = Collect()
    dev.set_mad_handler(got)
    dev.send_mad(req_mad(), dev.ip)
    assert got == []
    assert dev.progress() == 1 and len(got) == 1 and got[0][0] == req_mad()


# ------------------------------------------------------------------ what is dropped

SRC, DST = "127.0.43.21", "127.0.43.22"


def deliver(dev: SoftDevice, roce: bytearray, sport: int = QP1_UDP_SPORT) -> None:
    """``roce`` from SRC to ``dev``, with a valid ICRC (the device verifies it)."""
    src = bytes([127, 0, 43, 21])
    roce[-4:] = icrc_ipv4(roce, src, dev.ip_packed, sport).to_bytes(4, "little")
    dev.receive(roce, src, dev.ip_packed, sport=sport)


def _mad(**hdr) -> bytes:
    mad = bytearray(req_mad())
    h = dict(base_version=0, mgmt_class=1, class_version=2, method=3)
    for k, v in hdr.items():
        mad[h[k]] = v
    return bytes(mad)


CASES = {
    # name: (RoCE packet, drop reason)
    "good": (lambda: build_qp1(req_mad()), None),
    "wrong_qkey": (lambda: build_qp1(req_mad(), qkey=0x11111111), Drop.GSI_QKEY),
    "ud_qkey_high_bit": (lambda: build_qp1(req_mad(), qkey=0x80000000), Drop.GSI_QKEY),
    "short_mad": (lambda: build(Opcode.UD_SEND_ONLY, dest_qp=1, qkey=GSI_QKEY, src_qp=1,
                                payload=req_mad()[:255]), Drop.GSI_MAD_SIZE),
    "long_mad": (lambda: build(Opcode.UD_SEND_ONLY, dest_qp=1, qkey=GSI_QKEY, src_qp=1,
                               payload=req_mad() + bytes(4)), Drop.GSI_MAD_SIZE),
    "send_with_imm": (lambda: build(Opcode.UD_SEND_ONLY_WITH_IMMEDIATE, dest_qp=1,
                                    qkey=GSI_QKEY, src_qp=1, imm=7, payload=req_mad()),
                      Drop.GSI_OPCODE),
    "rc_send": (lambda: build(Opcode.RC_SEND_ONLY, dest_qp=1, payload=req_mad()),
                Drop.GSI_OPCODE),
    "perf_mgmt_class": (lambda: build_qp1(_mad(mgmt_class=0x04, class_version=1)),
                        Drop.GSI_MAD_CLASS),
    "base_version": (lambda: build_qp1(_mad(base_version=2)), Drop.GSI_MAD_BASE_VERSION),
    "class_version": (lambda: build_qp1(_mad(class_version=1)), Drop.GSI_MAD_CLASS_VERSION),
    "method_get": (lambda: build_qp1(_mad(method=Method.GET)), Drop.GSI_MAD_METHOD),
    "wrong_pkey": (lambda: build_qp1(req_mad(), pkey=0x8001), Drop.BAD_PKEY),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_rxe_drops_on_qp1_is_counted_under_its_reason(case):
    make, reason = CASES[case]
    dev = SoftDevice("m", DST)
    got = Collect()
    dev.set_mad_handler(got)
    deliver(dev, make())
    if reason is None:
        assert len(got) == 1 and dev.counters.drops == {} and dev.counters.gsi_mads_rcvd == 1
        assert got[0][1] == MadSource(SRC, 1, DST, QP1_UDP_SPORT, 0xFFFF, 0)
    else:
        assert got == [] and dev.counters.gsi_mads_rcvd == 0
        assert dev.counters.drops == {reason.value: 1} and dev.counters.dropped_pkts == 1
    assert dev.counters.rcvd_pkts == 1


def test_every_gsi_drop_reason_is_exercised():
    assert {r for _, r in CASES.values() if r is not None and r.value.startswith("gsi_")} | {
        Drop.GSI_NO_HANDLER} == {d for d in Drop if d.value.startswith("gsi_")}


def test_a_cm_mad_without_a_handler_is_counted_and_answered():
    """No handler: the MAD is counted as such and the REQ answered (REJ 8) as Linux's CM
    does; this manual device has no transport, so the answer is counted there."""
    dev = SoftDevice("m", DST)
    deliver(dev, build_qp1(req_mad()))
    assert dev.counters.drops == {"gsi_no_handler": 1, "no_transport": 1}
    assert dev.counters.gsi_mads_rcvd == 0 and dev.counters.gsi_mads_sent == 1
    got = Collect()
    dev.set_mad_handler(got)
    deliver(dev, build_qp1(req_mad()))
    dev.set_mad_handler(None)
    deliver(dev, build_qp1(req_mad()))
    assert len(got) == 1 and dev.counters.drops["gsi_no_handler"] == 2
    assert dev.counters.gsi_mads_sent == 2


def test_qpn_0_and_the_reserved_qpns_are_still_dropped():
    dev = SoftDevice("m", DST)
    dev.set_mad_handler(Collect())
    for qpn, reason in ((0, "qp0"), (2, "no_qp"), (15, "no_qp")):
        deliver(dev, build(Opcode.UD_SEND_ONLY, dest_qp=qpn, qkey=GSI_QKEY, src_qp=1,
                           payload=req_mad()))
        assert dev.counters.drops.get(reason), (qpn, dev.counters.drops)
    assert dev.counters.gsi_mads_rcvd == 0 and sum(dev.counters.drops.values()) == 3


def test_a_bad_icrc_on_qp1_is_dropped_before_the_gsi():
    dev = SoftDevice("m", DST)
    got = Collect()
    dev.set_mad_handler(got)
    dev.receive(build_qp1(req_mad()), bytes([127, 0, 43, 21]), dev.ip_packed, sport=55410)
    assert got == [] and dev.counters.drops == {"bad_icrc": 1}


def test_a_handler_that_raises_is_counted_and_the_device_goes_on():
    dev = SoftDevice("m", DST)
    calls = []

    def bad(mad, source):
        calls.append(mad)
        raise RuntimeError("CM bug")
    dev.set_mad_handler(bad)
    deliver(dev, build_qp1(req_mad()))
    deliver(dev, build_qp1(req_mad()))
    assert len(calls) == 2 and dev.counters.gsi_handler_errors == 2
    assert dev.counters.gsi_mads_rcvd == 2 and dev.counters.drops == {}


def test_a_mad_class_the_cm_does_not_take_never_reaches_it():
    """Sanity of the crafted MADs above: a class-0x04 MAD built from scratch."""
    mad = build_mad(cm_mad_header(AttrId.REQ, 1).replace(mgmt_class=0x04))
    assert len(mad) == MAD_SIZE
    dev = SoftDevice("m", DST)
    got = Collect()
    dev.set_mad_handler(got)
    deliver(dev, build_qp1(mad))
    assert got == [] and dev.counters.drops == {"gsi_mad_class": 1}
