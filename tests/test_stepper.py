"""Step mode (softrdma/harness/stepper.py): one event per step, faults at chosen packets,
and what RC does about each, as IBTA and rxe define it."""

from __future__ import annotations

import io

import pytest

from softrdma.harness.stepper import Stepper


@pytest.fixture
def stepper():
    made = []

    def make(*a, **kw):
        s = Stepper(*a, out=io.StringIO(), **kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def _has(lines, *words):
    return [x for x in lines if all(w in x for w in words)]


def test_one_step_is_one_delivery(stepper):
    s = stepper("RC", seed=1)
    s.write(4096)  # 4 packets of 1024 (path MTU 1024), PSNs 100..103
    assert len(s.pending) == 4
    lines = s.step()
    assert len(s.pending) == 3
    assert [x for x in lines if " rx " in x] and "RC_RDMA_WRITE_FIRST" in lines[0]


def test_a_dropped_middle_packet_is_nakked_and_resent(stepper):
    s = stepper("RC", seed=1)
    inj = s.drop(opcode="RC_RDMA_WRITE_MIDDLE", nth=2)
    s.write(4096)
    assert inj.hit == [("RC_RDMA_WRITE_MIDDLE", 102)]
    s.run()
    lines = [f"{r['dev']} {r['kind']} {r['msg']}" for r in s.log]
    assert _has(lines, "ack", "PSN 103 arrived, 102 expected")
    assert _has(lines, "ack", "NAK PSN_SEQ_ERROR PSN 102")
    assert _has(lines, "retry", "go back to PSN 102: PSN sequence NAK")
    wcs = s.completions("a")
    assert [(w.wr_id, w.status) for w in wcs] == [(2, 0)]


def test_a_duplicated_send_is_answered_but_delivered_once(stepper):
    s = stepper("RC", seed=1)
    s.duplicate(opcode="RC_SEND_ONLY")
    s.send(100)
    s.run()
    msgs = [r["msg"] for r in s.log]
    assert [m for m in msgs if m.startswith("duplicate request PSN 100")]
    recv = [w for w in s.completions("b")]
    assert len(recv) == 1 and recv[0].byte_len == 100


def test_no_receive_posted_gives_rnr_then_the_retry_succeeds(stepper):
    s = stepper("RC", seed=1)
    s.send(64, post_recv=False)
    s.run(max_steps=3)  # the SEND arrives, the RNR NAK comes back
    msgs = [r["msg"] for r in s.log]
    assert [m for m in msgs if m.startswith("RNR NAK PSN 100")]
    assert [m for m in msgs if "RNR NAK for PSN 100: wait" in m]
    s.recv(64)
    s.run()
    assert [w.status for w in s.completions("a")] == [0]
    assert [w.byte_len for w in s.completions("b")] == [64]


def test_a_delayed_first_packet_reorders(stepper):
    s = stepper("RC", seed=1)
    s.delay(0.001, opcode="RC_RDMA_WRITE_FIRST")
    s.write(2048)  # FIRST (held back 1 ms) and LAST
    s.run()
    msgs = [r["msg"] for r in s.log]
    # LAST overtook FIRST: a gap at 100, then FIRST arrives late and the rest is resent
    assert [m for m in msgs if m == "NAK PSN_SEQ_ERROR PSN 100"]
    assert [w.status for w in s.completions("a")] == [0]


def test_lines_are_printed(stepper):
    out = io.StringIO()
    s = Stepper("UC", seed=2, out=out)
    try:
        s.write(100)
        s.run()
    finally:
        s.close()
    text = out.getvalue()
    assert " a packet tx UC_RDMA_WRITE_ONLY" in text and " b packet rx UC_RDMA_WRITE_ONLY" in text


def test_a_lost_read_response_is_read_again_from_its_offset(stepper):
    """rxe req_retry (IBTA 9.7.5.1.4): a READ retried from PSN p asks again only for what is
    missing: va + (p - first PSN) x MTU, length reduced by as much."""
    s = stepper("RC", seed=1)
    s.drop(opcode="READ_RESPONSE_MIDDLE", sender="b")  # the response at PSN 101
    s.read(4096)
    s.run()
    reqs = [r for r in s.log if r["kind"] == "packet" and r.get("dir") == "tx"
            and r["opcode"] == "RC_RDMA_READ_REQUEST"]
    assert [r["psn"] for r in reqs] == [100, 101]
    va0 = int(reqs[0]["msg"].split("va=")[1].split()[0], 16)
    va1 = int(reqs[1]["msg"].split("va=")[1].split()[0], 16)
    assert va1 - va0 == 1024
    assert "dma_len=3072" in reqs[1]["msg"]
    assert [(w.status, w.byte_len) for w in s.completions("a")] == [(0, 4096)]
