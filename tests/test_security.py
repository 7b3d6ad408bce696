"""What an off-path sender must guess (docs/security.md): memory keys with 32 unpredictable
bits, unpredictable iovas and QP numbers, random initial PSNs in the tools; strict mode's
source-port check; and the limit on re-ACKing duplicates far behind the expected PSN."""

from __future__ import annotations

import argparse
import socket
import time

import pytest

from softrdma.enums import IBV_WR_SEND
from softrdma.qp.params import RXE_ROCE_V2_SPORT, calc_flow_label
from softrdma.soft.device import SoftDevice
from softrdma.qp.memory import AccessError
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import Context, QPCap
from softrdma.verbs_api.device import add_device, unregister_device
from softrdma.wire.icrc import set_icrc_ipv4
from softrdma.wire.opcodes import Opcode
from softrdma.wire.packet import build, parse

CAP = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)


@pytest.fixture
def devs():
    made = []

    def make(ip, name, **kw):
        # manual devices: the tests step them (or attach UDP themselves)
        d = add_device(ip, name=name, live=False, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.detach()
        unregister_device(d.name)


# -- memory keys and addresses ------------------------------------------------------------------

def _keys(seed, n=32):
    d = SoftDevice(f"sec-k{seed}", "10.66.0.1", seed=seed)
    mv = memoryview(bytearray(64))
    return d, [d.keys.register_mr(None, mv, 0).rkey for _ in range(n)]


def test_every_key_bit_is_random_across_devices_and_keys():
    keys = []
    for seed in range(64):
        keys += _keys(seed)[1]
    assert len(set(keys)) == len(keys)
    n = len(keys)  # 2048: each bit is set in n/2 +- 23 (one sigma) keys if it is random
    for bit in range(32):
        ones = sum((k >> bit) & 1 for k in keys)
        assert 0.42 * n < ones < 0.58 * n, f"bit {bit} is set in {ones} of {n} keys"


def test_keys_of_one_device_are_not_in_sequence():
    """rxe's indices count up (0x100, 0x200, ...): the high 24 bits say what comes next."""
    _, keys = _keys(None, 64)
    idx = sorted(k >> 8 for k in keys)
    steps = {b - a for a, b in zip(idx, idx[1:])}
    assert steps != {1} and max(idx) - min(idx) > 1 << 20


def test_same_seed_same_keys_and_addresses_other_seed_other_ones():
    d1, k1 = _keys(1234)
    d2, k2 = _keys(1234)
    d3, k3 = _keys(1235)
    assert k1 == k2 and d1.keys.iova_base == d2.keys.iova_base
    assert not set(k1) & set(k3)
    assert d1.keys.iova_base != d3.keys.iova_base


def test_first_mr_address_is_page_aligned_and_not_fixed():
    bases = set()
    for seed in range(16):
        d, _ = _keys(seed, 1)
        e = next(iter(d.keys.entries.values()))
        assert e.iova % 4096 == 0 and (1 << 32) <= e.iova < (1 << 47)
        bases.add(e.iova)
    assert len(bases) == 16 and 0x7F5000000000 not in bases


def test_random_keys_resolve_and_a_flipped_bit_does_not():
    d, keys = _keys(None, 8)
    for k in keys:
        e = d.keys.get(k)
        assert e is not None and e.rkey == k
        d.keys.resolve(k, None, e.iova, 64, 0, remote=True)
        for bit in (0, 7, 8, 31):
            with pytest.raises(AccessError):
                d.keys.resolve(k ^ (1 << bit), None, e.iova, 64, 0, remote=True)


# -- QP numbers ---------------------------------------------------------------------------------

def _qpns(dev, n=20):
    ctx = Context(name=dev.name)
    eps = [Endpoint(ctx, "RC", 4096, CAP, 16) for _ in range(n)]
    return ctx, [e.qp.qp_num for e in eps]


def test_qp_numbers_are_random_by_default(devs):
    ctx, nums = _qpns(devs("10.66.1.1", "sec-qpn"))
    try:
        assert len(set(nums)) == len(nums)
        assert all(16 <= q < 0xFFFFFF for q in nums)
        assert nums[0] != 16 and {b - a for a, b in zip(nums, nums[1:])} != {1}
        assert max(nums) - min(nums) > 1 << 20  # 20 uniform draws of 2^24: spread out
    finally:
        ctx.close()


def test_qp_numbers_are_sequential_in_sequential_mode_and_seeded_ones_repeat(devs):
    d = devs("10.66.1.2", "sec-qpn-seq")
    d.sequential_qpn = True
    ctx, nums = _qpns(d, 5)
    ctx.close()
    assert nums == [16, 17, 18, 19, 20]
    c1, a = _qpns(devs("10.66.1.3", "sec-qpn-s1", seed=99), 5)
    c2, b = _qpns(devs("10.66.1.4", "sec-qpn-s2", seed=99), 5)
    c1.close(), c2.close()
    assert a == b and a != [16, 17, 18, 19, 20]


# -- strict mode ----------------------------------------------------------------------------------

def _rxe_sport(lqpn, rqpn):
    """rdma_get_udp_sport with flow label 0, written out from the kernel source."""
    fl = calc_flow_label(lqpn, rqpn)
    return ((fl & 0x3FFF) ^ ((fl & 0xFC000) >> 14)) | RXE_ROCE_V2_SPORT


EXPECTED = 1000  # the PSN the victim's responder expects next (the peer's send PSN)


def _victim(devs, tag, strict):
    da = devs(f"10.66.2.{tag}", f"sec-peer{tag}")
    db = devs(f"10.66.3.{tag}", f"sec-victim{tag}")
    if strict is not None:
        db.strict = strict
    a = Endpoint(Context(name=da.name), "RC", 4096, CAP, 16)
    b = Endpoint(Context(name=db.name), "RC", 4096, CAP, 16)
    connect(a, b, EXPECTED, 2000)
    connect(b, a, 2000, EXPECTED)
    b.post_recv(b.sge(0, 64), 1)
    return da, db, a, b


def _spoofed_send(da, db, b, psn, sport):
    raw = build(Opcode.RC_SEND_ONLY, dest_qp=b.qp.qp_num, psn=psn, payload=b"injected")
    set_icrc_ipv4(raw, da.ip_packed, db.ip_packed, sport)
    db.receive(bytes(raw), da.ip_packed, db.ip_packed, sport=sport, verify_icrc=True)


def test_strict_mode_drops_a_packet_from_the_wrong_source_port_and_counts_it(devs):
    da, db, a, b = _victim(devs, 1, True)
    right = _rxe_sport(a.qp.qp_num, b.qp.qp_num)
    for wrong in (4791, right ^ 1, 0xC000):
        _spoofed_send(da, db, b, 1000, wrong)
    assert db.counters.drops.get("strict_sport") == 3
    assert len(b.cq) == 0
    _spoofed_send(da, db, b, 1000, right)  # the port the path determines: accepted
    assert len(b.cq) == 1 and b.cq.poll_all()[0].status == 0


def test_without_strict_mode_any_source_port_is_accepted_as_rxe_does(devs, monkeypatch):
    monkeypatch.delenv("SOFTRDMA_STRICT", raising=False)
    da, db, a, b = _victim(devs, 2, None)
    assert db.strict is False
    _spoofed_send(da, db, b, 1000, 4791)
    assert len(b.cq) == 1 and "strict_sport" not in db.counters.drops


def test_strict_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("SOFTRDMA_STRICT", "1")
    assert SoftDevice("sec-env", "10.66.4.1").strict is True
    monkeypatch.setenv("SOFTRDMA_STRICT", "0")
    assert SoftDevice("sec-env0", "10.66.4.1").strict is False


def test_two_strict_devices_talk_over_udp_and_refuse_a_spoofed_port(devs):
    """softrdma to softrdma in strict mode on real sockets: every packet of the connection
    comes from the path's port, so nothing legitimate is dropped."""
    da = devs("127.66.5.1", "sec-udp-a")
    db = devs("127.66.5.2", "sec-udp-b")
    da.strict = db.strict = True
    da.attach_udp(), db.attach_udp()
    a = Endpoint(Context(name=da.name), "RC", 1 << 16, CAP, 16)
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 16)
    connect(a, b, 7, 9)
    connect(b, a, 9, 7)
    b.post_recv(b.sge(0, 5000), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, 5000), 2)
    end = time.monotonic() + 5
    while (len(a.cq) < 1 or len(b.cq) < 1) and time.monotonic() < end:
        time.sleep(0.002)
    assert [w.status for w in a.cq.poll_all()] == [0] and len(b.cq.poll_all()) == 1
    assert "strict_sport" not in da.counters.drops and "strict_sport" not in db.counters.drops
    # an off-path sender with a's address but another port, at the right PSN
    b.post_recv(b.sge(0, 64), 3)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.66.5.1", 0))
    raw = build(Opcode.RC_SEND_ONLY, dest_qp=b.qp.qp_num, psn=(7 + 5) & 0xFFFFFF, payload=b"x")
    set_icrc_ipv4(raw, da.ip_packed, db.ip_packed, s.getsockname()[1])
    s.sendto(bytes(raw), ("127.66.5.2", 4791))
    s.close()
    end = time.monotonic() + 2
    while "strict_sport" not in db.counters.drops and time.monotonic() < end:
        time.sleep(0.002)
    assert db.counters.drops.get("strict_sport") == 1 and len(b.cq) == 0
    a.close(), b.close()


# -- re-ACKs of duplicates ------------------------------------------------------------------------

def _acks(dev):
    sent = []
    dev.transmit = lambda data, dst, sport: sent.append(parse(data))
    return sent


def test_duplicates_far_behind_are_not_reacked_one_for_one(devs):
    da, db, a, b = _victim(devs, 3, False)
    sent = _acks(db)
    right = _rxe_sport(a.qp.qp_num, b.qp.qp_num)
    db.now = 10.0
    for i in range(100):  # an attacker sweeping PSNs more than 256 behind the expected one
        _spoofed_send(da, db, b, (EXPECTED - 300 - 7 * i) & 0xFFFFFF, right)
    assert len(sent) == 1  # the first one is answered, the other 99 are not
    assert db.counters.drops.get("duplicate_ack_limited", 0) == 99
    assert db.counters.duplicate_request == 100 and len(b.cq) == 0
    db.now = 10.5  # time passes: a requester that really is that far behind hears again
    _spoofed_send(da, db, b, (EXPECTED - 5000) & 0xFFFFFF, right)
    assert len(sent) == 2 and sent[-1].opcode == Opcode.RC_ACKNOWLEDGE
    assert sent[-1].psn == EXPECTED - 1  # what rxe's re-ACK says: expected PSN - 1


def test_duplicates_of_a_retransmission_are_reacked_one_for_one_as_rxe_does(devs):
    da, db, a, b = _victim(devs, 4, False)
    sent = _acks(db)
    right = _rxe_sport(a.qp.qp_num, b.qp.qp_num)
    db.now = 3.0
    for psn in range(EXPECTED - 128, EXPECTED):  # go-back-N: rxe keeps <= 128 PSNs in flight
        _spoofed_send(da, db, b, psn, right)
    assert len(sent) == 128 and {p.psn for p in sent} == {EXPECTED - 1}
    assert {p.opcode for p in sent} == {Opcode.RC_ACKNOWLEDGE} and {p.syndrome for p in sent} == {0x1F}
    assert "duplicate_ack_limited" not in db.counters.drops


# -- the tools' initial PSNs ----------------------------------------------------------------------

def _frozen_clock_and_pid(monkeypatch):
    """rdma-core seeds lrand48 with getpid() * time(NULL): two tools started by one process
    in one second would pick the same PSNs, and anyone can recompute them."""
    import os
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)


def test_pingpong_initial_psns_do_not_follow_from_pid_and_time(devs, monkeypatch):
    from softrdma.tools import pingpong
    d = devs("10.66.6.1", "sec-pp")
    a = argparse.Namespace(kind="srq", size=64, num_qp=4, rx_depth=8, events=False, ib_port=1,
                           gid_idx=1)
    _frozen_clock_and_pid(monkeypatch)
    s1, s2 = pingpong._Side(a, d), pingpong._Side(a, d)
    monkeypatch.undo()
    try:
        assert s1.psns != s2.psns
        assert len(set(s1.psns + s2.psns)) == 8 and all(0 <= p < 1 << 24 for p in s1.psns)
    finally:
        s1.ctx.close(), s2.ctx.close()


def test_perf_initial_psns_do_not_follow_from_pid_and_time(devs, monkeypatch):
    from softrdma.tools import perf
    d = devs("10.66.6.2", "sec-perf")
    a = argparse.Namespace(verb="write", lat=False)
    _frozen_clock_and_pid(monkeypatch)
    p1, p2 = perf.Perf(a, d, True), perf.Perf(a, d, False)
    monkeypatch.undo()
    try:
        psns1 = [p1.rng.getrandbits(24) for _ in range(4)]
        psns2 = [p2.rng.getrandbits(24) for _ in range(4)]
        assert psns1 != psns2
    finally:
        p1.ctx.close(), p2.ctx.close()
