"""Fault injection (softrdma.soft.faults, docs/faults.md): the spec grammar, seeded
reproducibility, and each targeted fault on two live soft devices over real UDP on
loopback, answered by the protocol as rxe answers it; the same scripted scenario on the
simulated network; crafted packets (scapy) injected into a live device; the old
SOFTRDMA_TX_LOSS variables; ``--fault`` on the tools.

No assertion here is about time: waits poll a condition with a generous bound."""

from __future__ import annotations

import os
import subprocess
import sys
from argparse import Namespace

import pytest
from scapy.layers.inet import IP, UDP

from softrdma.cli import main as cli_main
from softrdma.enums import IBV_WR_RDMA_READ, IBV_WR_SEND
from softrdma.harness.inject import inject_packet
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import Endpoint, connect, connected_pair
from softrdma.soft.device import SoftDevice
from softrdma.soft.faults import FaultError, Faults, Hit
from softrdma.soft.faultspec import parse_spec
from softrdma.tools.common import apply_fault_options
from softrdma.verbs_api import Context, QPCap
from softrdma.verbs_api.device import add_device, unregister_device
from softrdma.wire.frames import decode_frame
from softrdma.wire.opcodes import OPCODES, Opcode
from softrdma.wire.packet import build, parse
from softrdma.wire.pcap import read_pcap
from softrdma.wire.scapy_layers import roce_packet

from .conftest import wait_until as _wait

CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
MTU = 1024  # connect()'s path MTU


# -- the spec grammar ----------------------------------------------------------------------
def test_spec_parses_settings_rules_seed_and_both():
    s = parse_spec(" tx:loss=0.05, delay=2ms ; seed=7; rx:drop(RC_RDMA_READ_RESPONSE_FIRST);"
                   "both:corrupt(SEND_ONLY, field=psn, value=0x10, nth=2, count=0);"
                   "tx:delay(ACKNOWLEDGE, seconds=50us, count=0), duplicate=5%, "
                   "loss_kind=requests;")
    assert s.seed == 7
    assert s.settings == [("tx", "loss", 0.05), ("tx", "delay", 0.002),
                          ("tx", "duplicate", 0.05), ("tx", "loss_kind", "requests")]
    assert [(d, r.action) for d, r in s.rules] == [("rx", "drop"), ("tx", "corrupt"),
                                                   ("rx", "corrupt"), ("tx", "delay")]
    drop, ctx, crx, delay = (r for _, r in s.rules)
    assert drop.opcodes == {Opcode.RC_RDMA_READ_RESPONSE_FIRST} and (drop.nth, drop.count) == (1, 1)
    assert ctx is not crx  # one rule per direction: each counts its own packets
    assert ctx.opcodes == {Opcode.RC_SEND_ONLY, Opcode.UC_SEND_ONLY, Opcode.UD_SEND_ONLY}
    assert (ctx.field, ctx.value, ctx.nth, ctx.count, ctx.fix_icrc) == ("psn", 0x10, 2, 0, True)
    assert delay.seconds == pytest.approx(50e-6) and delay.count == 0
    assert delay.opcodes == {Opcode.RC_ACKNOWLEDGE}  # the name without its transport


def test_opcode_families_and_keywords():
    r = parse_spec("rx:drop(READ_RESPONSE), drop(requests), drop(0x11), drop, "
                   "corrupt(responses, field=syndrome), drop(rdma_write)").rules
    fam, req, num, anyop, syn, wr = (x for _, x in r)
    assert wr.opcodes == {op for op in Opcode if "RDMA_WRITE" in op.name}
    assert fam.opcodes == {Opcode.RC_RDMA_READ_RESPONSE_FIRST, Opcode.RC_RDMA_READ_RESPONSE_MIDDLE,
                           Opcode.RC_RDMA_READ_RESPONSE_LAST, Opcode.RC_RDMA_READ_RESPONSE_ONLY}
    assert Opcode.RC_SEND_ONLY in req.opcodes and Opcode.RC_ACKNOWLEDGE not in req.opcodes
    assert num.opcodes == {Opcode.RC_ACKNOWLEDGE} and anyop.opcodes == set(OPCODES)
    # the syndrome is only in packets that carry an AETH: the rule matches those alone
    assert Opcode.RC_RDMA_READ_RESPONSE_MIDDLE not in syn.opcodes
    assert Opcode.RC_ACKNOWLEDGE in syn.opcodes


@pytest.mark.parametrize("spec, token", [
    ("tx:los=0.1", "'los'"),
    ("tx:loss=1.5", "loss='1.5'"),
    ("tx:loss=abc", "loss='abc'"),
    ("up:loss=0.1", "'up'"),
    ("loss=0.1", "'loss=0.1'"),
    ("seed=x", "seed='x'"),
    ("rx:drop(ACK)", "'ACK'"),
    ("rx:drop(SEND_ONLY, nth=0)", "nth=0"),
    ("rx:drop(SEND_ONLY, count=-1)", "count=-1"),
    ("rx:drop(SEND_ONLY, nht=2)", "'nht'"),
    ("rx:drop(SEND_ONLY, RC_ACKNOWLEDGE)", "'RC_ACKNOWLEDGE'"),
    ("rx:drop(SEND_ONLY, nth=1, nth=2)", "'nth' given twice"),
    ("rx:delay(ACKNOWLEDGE)", "seconds"),
    ("rx:delay(ACKNOWLEDGE, seconds=5 parsecs)", "seconds='5 parsecs'"),
    ("rx:corrupt(SEND_ONLY, field=color)", "'color'"),
    ("rx:corrupt(RC_ACKNOWLEDGE, field=rkey)", "'rkey'"),
    ("rx:corrupt(SEND_ONLY, fix_icrc=maybe)", "fix_icrc='maybe'"),
    ("rx:explode(SEND_ONLY)", "'explode'"),
    ("rx:drop(SEND_ONLY", "unbalanced '('"),
    ("rx:", "nothing after 'rx:'"),
    ("rx:loss=0.1,,drop", "empty entry"),
    ("tx:loss_kind=some", "loss_kind='some'"),
])
def test_bad_specs_name_the_token(spec, token):
    with pytest.raises(FaultError) as e:
        parse_spec(spec)
    assert token in str(e.value), str(e.value)


def test_describe_reads_back():
    d = SoftDevice("f-describe", "10.8.0.1")
    d.faults.load("tx:loss=0.25, drop(RC_ACKNOWLEDGE, nth=2, count=3); rx:corrupt(SEND_ONLY, "
                  "field=psn, value=7), delay(ACKNOWLEDGE, seconds=0.001, count=0)")
    text = d.faults.describe()
    e = SoftDevice("f-describe2", "10.8.0.2")
    e.faults.load(text)
    assert e.faults.describe() == text
    assert [r.describe() for r in e.faults.rules] == [r.describe() for r in d.faults.rules]


def test_no_faults_no_hook_and_setting_checks():
    d = SoftDevice("f-idle", "10.8.0.3")
    assert d.fault_tx is None and d.fault_rx is None  # the data path's one test
    d.faults.tx.random.loss = 0.1
    assert d.fault_tx is d.faults.tx and d.fault_rx is None
    d.faults.rx.drop("ACKNOWLEDGE")
    assert d.fault_rx is d.faults.rx
    d.faults.clear()
    assert d.fault_tx is None and d.fault_rx is None
    with pytest.raises(FaultError, match="loss=2"):
        d.faults.tx.random.loss = 2
    with pytest.raises(FaultError, match="unknown opcode 'NOPE'"):
        d.faults.rx.drop("NOPE")
    assert d.fault_rx is None  # a rule that could not be made was not added


# -- seeded reproducibility ------------------------------------------------------------------
def _run_random(seed, n=400):
    d = SoftDevice("f-seed", "10.8.1.1")
    out = []
    d.transmit = lambda data, dst, sport: out.append(data)
    d.faults.load(f"tx:loss=0.2, duplicate=0.1, corrupt=0.05; seed={seed}")
    pkts = [bytes(build(Opcode.RC_SEND_ONLY, dest_qp=0x20, psn=i, payload=bytes([i & 0xFF]) * 8))
            for i in range(n)]
    for p in pkts:
        d.faults.send(p, bytes([10, 8, 1, 2]), 0xC000)
    return out, dict(d.counters.faults), d.counters.drops.get("injected_loss", 0)


def test_same_seed_same_faults_other_seed_other_faults():
    a, b, c = _run_random(7), _run_random(7), _run_random(8)
    assert a == b
    assert a[0] != c[0]
    out, faults, lost = a
    assert faults["tx_loss"] == lost > 40 and faults["tx_duplicate"] > 10
    assert faults["tx_corrupt"] > 5
    assert len(out) == 400 - faults["tx_loss"] + faults["tx_duplicate"]


# -- live devices over UDP on loopback -------------------------------------------------------


def _pair(da, db, a_psn=5, b_psn=0xFFFFFE, b_expects=None, timeout=14):
    """An RC pair; a sends from ``a_psn``, b expects ``b_expects`` (default: the same).
    ``timeout`` 14 is 67 ms; 18 (1.07 s) where a test counts packets exactly and a busy
    host must not fire the retransmission timer on its own."""
    a = Endpoint(Context(name=da.name), "RC", 1 << 18, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", 1 << 18, CAP, 256)
    connect(a, b, a_psn, b_psn, timeout=timeout)
    connect(b, a, b_psn, a_psn if b_expects is None else b_expects, timeout=timeout)
    return a, b


def _one(ep):
    """The next completion of ``ep`` (waits for it), which must be a success."""
    assert _wait(lambda: len(ep.cq) >= 1)
    wc = ep.cq.poll_all()
    assert [w.status for w in wc] == [0], wc
    return wc[0]


@pytest.mark.parametrize("opcode, lost_index", [("RC_RDMA_READ_RESPONSE_FIRST", 0),
                                                 ("RC_RDMA_READ_RESPONSE_MIDDLE", 1)])
def test_lost_read_response_is_reread_from_its_psn_and_offset(udp_devices, tmp_path, opcode,
                                                              lost_index):
    pcap = tmp_path / "a.pcap"
    da = udp_devices("127.0.16.1", "f-ra", capture=str(pcap))
    db = udp_devices("127.0.16.2", "f-rb")
    a, b = _pair(da, db, timeout=18)
    rule = da.faults.rx.drop(opcode)
    size = 5 * MTU - 100  # FIRST, MIDDLE x3, LAST
    data = bytes((i * 7) & 0xFF for i in range(size))
    b.mr.write(data, size, 4096)
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, size), 1, remote_offset=4096)
    assert _one(a).byte_len == size
    assert a.mr.read(size, 0) == data
    assert [(h.opcode, h.psn) for h in rule.hits] == [(opcode, 5 + lost_index)]
    assert da.counters.faults["rx_drop"] == 1 and da.counters.drops["injected_loss"] == 1
    a.close(), b.close()
    da.detach()
    reads = [parse(decode_frame(r.data).payload) for r in read_pcap(pcap)]
    reads = [p for p in reads if p.opcode == Opcode.RC_RDMA_READ_REQUEST]
    # the READ, then the re-read from the lost response's PSN, offset and remaining length
    assert [(p.psn, p.va - b.mr.buf, p.dma_len) for p in reads] == [
        (5, 4096, size), (5 + lost_index, 4096 + lost_index * MTU, size - lost_index * MTU)]


def test_lost_ack_is_answered_by_retransmission_and_the_duplicate_by_a_new_ack(udp_devices):
    da = udp_devices("127.0.16.3", "f-aa")
    db = udp_devices("127.0.16.4", "f-ab")
    a, b = _pair(da, db)
    rule = db.faults.tx.drop("RC_ACKNOWLEDGE", nth=2)
    for i in range(3):  # one at a time: the next message's ACK would cover a lost one
        b.post_recv(b.sge(1000 * i, 1000), 10 + i)
        a.mr.write(bytes([i + 1]) * 100, 100, 100 * i)
        a.post_send(IBV_WR_SEND, a.sge(100 * i, 100), i)
        assert _one(a).wr_id == i
    assert len(rule.hits) == 1 and rule.hits[0].opcode == "RC_ACKNOWLEDGE"
    assert db.counters.faults["tx_drop"] == 1
    assert da.counters.completer_retry_err >= 1  # a's retransmit timer fired
    assert db.counters.duplicate_request >= 1  # b saw the SEND again and ACKed it again
    wcs = []
    assert _wait(lambda: wcs.extend(b.cq.poll_all()) or len(wcs) >= 3)
    assert [(w.wr_id, w.status, w.byte_len) for w in wcs] == [(10 + i, 0, 100) for i in range(3)]
    assert [b.mr.read(100, 1000 * i) for i in range(3)] == [bytes([i + 1]) * 100 for i in range(3)]
    a.close(), b.close()


@pytest.mark.parametrize("where", ["rx", "tx"])
def test_corrupted_icrc_is_counted_dropped_and_the_send_still_completes(udp_devices, where):
    da = udp_devices("127.0.16.5", "f-ia")
    db = udp_devices("127.0.16.6", "f-ib", raw_rx=True)  # raw receive: IPv4 ICRCs are verified
    a, b = _pair(da, db)
    faults = db.faults.rx if where == "rx" else da.faults.tx
    rule = faults.corrupt("RC_SEND_ONLY", field="icrc")
    b.post_recv(b.sge(0, 200), 1)
    a.mr.write(b"x" * 200, 200)
    a.post_send(IBV_WR_SEND, a.sge(0, 200), 2)
    assert _one(a).wr_id == 2
    assert _one(b).byte_len == 200 and b.mr.read(200, 0) == b"x" * 200
    assert len(rule.hits) == 1
    assert db.counters.icrc_err == 1 and db.counters.drops["bad_icrc"] == 1
    assert (da if where == "tx" else db).counters.faults[f"{where}_corrupt"] == 1
    assert da.counters.completer_retry_err >= 1  # the copy that got through was the resend
    a.close(), b.close()


def test_corrupted_psn_is_a_sequence_error_that_the_protocol_recovers(udp_devices):
    """A well-formed packet with a wrong PSN (the ICRC recomputed): the responder sees a
    PSN ahead of the one it expects, NAKs, and the requester resends from the NAKed PSN."""
    da = udp_devices("127.0.16.7", "f-pa")
    db = udp_devices("127.0.16.8", "f-pb")
    a, b = _pair(da, db, timeout=18)
    rule = da.faults.tx.corrupt("RC_SEND_FIRST", field="psn", value=5 + 2)
    size = 3 * MTU
    b.post_recv(b.sge(0, size), 1)
    a.mr.write(bytes(range(256)) * (size // 256), size)
    a.post_send(IBV_WR_SEND, a.sge(0, size), 2)
    assert _one(a).wr_id == 2
    assert _one(b).byte_len == size and b.mr.read(size, 0) == bytes(range(256)) * (size // 256)
    assert [(h.opcode, h.psn) for h in rule.hits] == [("RC_SEND_FIRST", 5)]
    assert db.counters.out_of_seq_request == 1  # one NAK; the rest dropped as out of sequence
    assert db.counters.drops["psn_out_of_seq"] >= 1
    assert da.counters.sent_pkts == 6  # the message again, from PSN 5
    a.close(), b.close()


@pytest.mark.parametrize("seconds", [0.01, 0.12])
def test_delayed_acks_still_complete_in_order(udp_devices, seconds):
    """ACKs held 10 ms (under the 67 ms timeout) or 120 ms (over it: the requester times
    out and resends, the responder answers the duplicates); every SEND completes, in order,
    and is delivered once."""
    da = udp_devices("127.0.16.9", "f-da")
    db = udp_devices("127.0.16.10", "f-db")
    a, b = _pair(da, db)
    rule = db.faults.tx.delay("ACKNOWLEDGE", seconds=seconds, count=0)
    for i in range(5):
        b.post_recv(b.sge(100 * i, 100), 10 + i)
    b.post_recv(b.sge(1000, 100), 99)  # must stay unused: duplicates are not delivered
    for i in range(5):
        a.mr.write(bytes([i + 1]) * 100, 100, 100 * i)
        a.post_send(IBV_WR_SEND, a.sge(100 * i, 100), i)
    wcs = []
    assert _wait(lambda: wcs.extend(a.cq.poll_all()) or len(wcs) >= 5)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, 0) for i in range(5)]
    assert len(rule.hits) >= 1 and db.counters.faults["tx_delay"] == len(rule.hits)
    assert db.faults.line.held == len(rule.hits)  # each went through the delay line ...
    assert _wait(lambda: len(db.faults.line) == 0)  # ... and left it
    if seconds > 0.067:
        assert da.counters.completer_retry_err >= 1 and db.counters.duplicate_request >= 1
    rwc = []
    assert _wait(lambda: rwc.extend(b.cq.poll_all()) or len(rwc) >= 5)
    assert [w.wr_id for w in rwc] == [10 + i for i in range(5)]
    assert [b.mr.read(100, 100 * i) for i in range(5)] == [bytes([i + 1]) * 100 for i in range(5)]
    a.close(), b.close()


def test_duplicated_request_is_answered_and_delivered_once(udp_devices):
    da = udp_devices("127.0.16.11", "f-ua")
    db = udp_devices("127.0.16.12", "f-ub")
    a, b = _pair(da, db, timeout=18)
    rule = da.faults.tx.duplicate("RC_SEND_ONLY")
    b.post_recv(b.sge(0, 100), 1)
    b.post_recv(b.sge(100, 100), 2)  # a second receive the duplicate must not consume
    a.mr.write(b"d" * 100, 100)
    a.post_send(IBV_WR_SEND, a.sge(0, 100), 3)
    assert _one(a).wr_id == 3
    assert _wait(lambda: db.counters.duplicate_request >= 1)  # the copy was seen and ACKed
    assert _wait(lambda: db.counters.rcvd_pkts >= 2)
    wc = b.cq.poll_all()
    assert [(w.wr_id, w.byte_len) for w in wc] == [(1, 100)]
    assert len(rule.hits) == 1 and da.counters.faults["tx_duplicate"] == 1
    assert da.counters.sent_pkts == 2  # both copies went on the wire
    # the QP goes on: the second receive takes the next message
    a.post_send(IBV_WR_SEND, a.sge(0, 50), 4)
    assert _one(a).wr_id == 4
    assert [(w.wr_id, w.byte_len) for w in (_one(b),)] == [(2, 50)]
    a.close(), b.close()


def test_random_impairments_both_ways_on_live_devices(udp_devices):
    """Every random impairment at once, both directions, both devices (ICRCs verified:
    raw receive): the messages all complete, in order, with their data, and each kind of
    fault was injected."""
    da = udp_devices("127.0.16.17", "f-xa", raw_rx=True)
    db = udp_devices("127.0.16.18", "f-xb", raw_rx=True)
    a, b = _pair(da, db)
    spec = ("both:loss=0.03, duplicate=0.1, reorder=0.1, reorder_delay=1ms, corrupt=0.03, "
            "delay=200us, jitter=500us; seed=11")
    da.faults.load(spec)
    db.faults.load(spec)
    n, size = 40, 2500  # three packets each
    for i in range(n):
        b.post_recv(b.sge(size * i, size), i)
    for i in range(n):
        a.mr.write(bytes([i + 1]) * size, size, size * i)
        a.post_send(IBV_WR_SEND, a.sge(size * i, size), i)
    wcs, rwcs = [], []
    assert _wait(lambda: wcs.extend(a.cq.poll_all()) or len(wcs) >= n, timeout=60)
    assert _wait(lambda: rwcs.extend(b.cq.poll_all()) or len(rwcs) >= n, timeout=60)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, 0) for i in range(n)]
    assert [(w.wr_id, w.status, w.byte_len) for w in rwcs] == [(i, 0, size) for i in range(n)]
    assert all(b.mr.read(size, size * i) == bytes([i + 1]) * size for i in range(n))
    seen = {k.split("_", 1)[1] for d in (da, db) for k in d.counters.faults}
    assert {"loss", "duplicate", "reorder", "corrupt", "delay"} <= seen, seen
    assert da.counters.icrc_err + db.counters.icrc_err >= 1  # the corruption was caught
    a.close(), b.close()


def test_inject_scapy_packets_into_a_live_device(udp_devices):
    da = udp_devices("127.0.16.13", "f-ja")
    db = udp_devices("127.0.16.14", "f-jb")
    # b expects PSN 5; a will send from 6: the injected WRITE (PSN 5) goes first
    a, b = _pair(da, db, a_psn=6, b_expects=5)
    sport = da.qps[a.qp.qp_num].src_port  # the port a's packets come from
    base = db.counters.malformed_pkts
    # hostile: a RETH-carrying opcode cut short, and an opcode no table has
    short = bytes(IP(src=da.ip, dst=db.ip) / UDP(sport=sport, dport=4791, chksum=0)
                  / roce_packet(0x0A, dqpn=b.qp.qp_num, psn=5, va=b.mr.buf, rkey=b.mr.rkey,
                                dma_len=5, payload=b"hello"))[28:28 + 14]
    db.inject(short, src=da.ip)
    db.inject(bytes([0x1F]) + bytes(19), src=da.ip)
    assert db.counters.malformed_pkts == base + 2
    assert db.counters.drops["malformed_truncated"] == 1
    assert db.counters.drops["malformed_unknown_opcode"] == 1
    # well-formed: an RDMA WRITE from a's address, built with softrdma's scapy layers
    pkt = (IP(src=da.ip, dst=db.ip) / UDP(sport=sport, dport=4791, chksum=0)
           / roce_packet(0x0A, dqpn=b.qp.qp_num, psn=5, va=b.mr.buf + 64, rkey=b.mr.rkey,
                         dma_len=5, payload=b"hello", ackreq=1))
    inject_packet(db, pkt)
    assert b.mr.read(5, 64) == b"hello"
    assert db.counters.faults["rx_injected"] == 3
    # and the device keeps working: a's real traffic (PSN 6 on) flows
    b.post_recv(b.sge(0, 50), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, 50), 2)
    assert _one(a).wr_id == 2 and _one(b).byte_len == 50
    a.close(), b.close()


def test_inject_with_a_stale_icrc_is_caught_where_icrcs_are_checked():
    d = SoftDevice("f-inj", "10.8.2.1")
    raw = bytes(build(Opcode.RC_SEND_ONLY, dest_qp=0x20, psn=1, payload=b"hi"))
    d.inject(raw, src="10.8.2.2", fix_icrc=False)  # ICRC left 0: wrong
    assert d.counters.drops == {"bad_icrc": 1}
    d.inject(raw, src="10.8.2.2")  # fixed: passes the ICRC, then: no such QP
    assert d.counters.drops == {"bad_icrc": 1, "no_qp": 1}


def test_the_device_takes_bytes_and_the_harness_reads_scapy_packets():
    """The device knows no scapy: a scapy packet handed to it is refused (its bytes would be
    IP/UDP/BTH read as a BTH); the harness takes the BTH part and the IP source from it."""
    d = SoftDevice("f-inj2", "10.8.2.1")
    pkt = IP(src="10.8.2.2", dst="10.8.2.1") / UDP(sport=0xC001, dport=4791, chksum=0) \
        / roce_packet(0x04, dqpn=0x20, psn=1, payload=b"hi")
    with pytest.raises(TypeError, match="inject_packet"):
        d.inject(pkt)
    assert d.counters.rcvd_pkts == 0
    inject_packet(d, pkt)  # from 10.8.2.2: a good ICRC for it, then no such QP
    assert d.counters.drops == {"no_qp": 1}
    inject_packet(d, pkt, src="10.8.2.3", fix_icrc=False)  # the scapy ICRC (0): wrong
    assert d.counters.drops == {"no_qp": 1, "bad_icrc": 1}


# -- the same scripted scenarios on the simulated network ------------------------------------
def test_targeted_rules_on_the_simulated_network():
    with SimNetwork(seed=3) as net:
        a, b = connected_pair(net, "RC")
        rule = a.device.faults.rx.drop("RC_RDMA_READ_RESPONSE_MIDDLE")
        slow = b.device.faults.tx.delay("ACKNOWLEDGE", seconds=0.5, count=0)  # > the timeout
        size = 5 * MTU - 100
        data = bytes((i * 3) & 0xFF for i in range(size))
        b.mr.write(data, size, 0)
        a.post_send(IBV_WR_RDMA_READ, a.buf_sge(0, size), 1, remote_offset=0)
        b.post_recv(b.buf_sge(0, 100), 2)
        a.post_send(IBV_WR_SEND, a.buf_sge(0, 100), 3)
        assert net.run_until(lambda: a.ncomp() >= 2 and b.ncomp() >= 1, timeout=30)
        wcs = a.cq.poll_all()
        assert [(w.wr_id, w.status) for w in wcs] == [(1, 0), (3, 0)]
        assert a.mr.read(size, 0) == data
        assert [h.opcode for h in rule.hits] == ["RC_RDMA_READ_RESPONSE_MIDDLE"]
        assert rule.hits[0].psn == 101  # the second response of the READ sent with PSN 100
        # every ACK held 0.5 s, beyond the 67 ms timeout: the requester resent on its timer
        assert len(slow.hits) >= 1 and b.device.faults.line.held == len(slow.hits)
        assert a.device.counters.completer_retry_err >= 1 and net.now >= 0.5
        assert b.cq.poll_all()[0].byte_len == 100
        a.close(), b.close()


def test_simulated_link_and_live_direction_draw_alike():
    """The simulator's link is an Impairments: the same profile and seed, the same fate."""
    import random
    from softrdma.harness.sim import LinkProfile
    from softrdma.soft.faults import Impairments
    pkts = [bytes([4]) + bytes([i]) * 30 for i in range(200)]
    prof = dict(loss=0.1, duplicate=0.1, corrupt=0.1, reorder=0.1, jitter=1e-3, delay=1e-5)
    r1, r2 = random.Random(5), random.Random(5)
    one = [LinkProfile(**prof).impair(r1, p, 0.0, lambda k: None) for p in pkts]
    two = [Impairments(**prof).impair(r2, p, 0.0, lambda k: None) for p in pkts]
    assert one == two and sum(not x for x in one) > 5


# -- environment and command line ---------------------------------------------------------
def test_env_faults_and_the_older_tx_loss_variables(udp_devices, monkeypatch):
    monkeypatch.setenv("SOFTRDMA_FAULTS", "rx:drop(ACKNOWLEDGE, nth=2); seed=3")
    monkeypatch.setenv("SOFTRDMA_TX_LOSS", "0.25")
    monkeypatch.setenv("SOFTRDMA_TX_LOSS_KIND", "requests")
    d = udp_devices("127.0.16.15", "f-env")
    assert d.faults.tx.random.loss == 0.25 and d.faults.tx.random.loss_kind == "requests"
    assert d.faults.describe() == ("tx:loss=0.25, loss_kind=requests; "
                                   "rx:drop(ACKNOWLEDGE, nth=2)")
    d.detach()
    d.attach_udp()  # read once per device: re-attaching does not add the rule again
    assert len(d.faults.rules) == 1


def test_bad_env_spec_fails_the_attach_naming_the_token(monkeypatch):
    monkeypatch.setenv("SOFTRDMA_FAULTS", "tx:loss=0.1;rx:drop(SEND_ONLY, nht=1)")
    d = add_device("127.0.16.16", name="f-badenv")
    try:
        with pytest.raises(FaultError, match="SOFTRDMA_FAULTS: .*'nht'"):
            d.attach_udp()
        assert d.udp is None and d.progress_thread is None
        assert d.faults.rules == []  # nothing of the spec applied
        with pytest.raises(FaultError, match="'nht'"):  # and it still fails: not skipped
            d.attach_udp()
    finally:
        unregister_device(d.name)


def test_fault_option_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["pingpong", "rc", "--fault", "rx:drop(ACK)"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'ACK'" in err and "--fault" in err


def test_fault_options_join_the_environment(monkeypatch):
    monkeypatch.setenv("SOFTRDMA_FAULTS", "tx:loss=0.1")
    apply_fault_options(Namespace(fault=["rx:drop(ACKNOWLEDGE)", "seed=4"]))
    assert os.environ["SOFTRDMA_FAULTS"] == "tx:loss=0.1;rx:drop(ACKNOWLEDGE);seed=4"
    apply_fault_options(Namespace(fault=[]))  # no option: the environment as it was
    assert os.environ["SOFTRDMA_FAULTS"] == "tx:loss=0.1;rx:drop(ACKNOWLEDGE);seed=4"


def test_fault_option_reaches_the_tool_device():
    """``softrdma demo`` with --fault: the device's counters show the fault and the
    operations still succeed (the protocol recovers)."""
    r = subprocess.run([sys.executable, "-m", "softrdma", "demo", "--addrs", "127.0.16.20",
                        "127.0.16.21", "--fault", "tx:drop(RC_SEND_LAST)", "--fault", "seed=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo: all operations verified" in r.stdout
    # the first device's first multi-packet SEND lost its LAST packet, and recovered
    assert "injected faults: tx_drop 1" in r.stdout, r.stdout


def test_faults_object_is_per_device_and_hits_are_records():
    d1, d2 = SoftDevice("f-p1", "10.8.3.1"), SoftDevice("f-p2", "10.8.3.2")
    assert isinstance(d1.faults, Faults) and d1.faults is not d2.faults
    rule = d1.faults.tx.drop("SEND_ONLY", nth=2, count=2)
    sent = []
    d1.transmit = lambda data, dst, sport: sent.append(parse(data).psn)
    for psn in range(6):
        d1.faults.send(bytes(build(Opcode.RC_SEND_ONLY, dest_qp=0x33, psn=psn)), b"\x0a\x08\x03\x02",
                       0xC000)
    assert sent == [0, 3, 4, 5] and rule.matched == 6 and rule.done
    assert rule.hits == [Hit(2, "RC_SEND_ONLY", 0x33, 1), Hit(3, "RC_SEND_ONLY", 0x33, 2)]
    assert d1.counters.as_dict()["fault_tx_drop"] == 2
    assert d1.counters.as_dict()["drop_injected_loss"] == 2
