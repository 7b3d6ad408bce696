"""softrdma.trace: the trace of a scripted lossy run shows the loss's consequences and
their cause as RC defines them; JSON lines parse and filter; the CLI and environment
switches work; and tracing off leaves nothing installed."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from softrdma import trace
from softrdma.enums import IBV_WR_RDMA_WRITE
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair
from softrdma.wire.packet import parse

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def traced():
    """Tracing to a buffer (JSON lines), switched off afterwards whatever happens."""
    buf = io.StringIO()

    def start(kinds="all", **kw):
        trace.enable(kinds, fmt="json", stream=buf, **kw)
        return buf
    yield start
    trace.disable()


def _records(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def _write_with_drop(drop_psn_offset: int, size: int = 8192):
    """An 8 KiB RDMA WRITE (8 packets of 1024, PSNs 100..107) on a loss-free simulated
    network that drops exactly one packet: the one ``drop_psn_offset`` after the first,
    once. Returns (network, requester, responder, first PSN)."""
    net = SimNetwork(seed=1)
    a, b = connected_pair(net, "RC")
    send = net._send
    dropped = []

    def lossy(src, data, dst, sport):
        p = parse(data)
        if p.info.is_request and p.psn == 100 + drop_psn_offset and not dropped:
            dropped.append(p.psn)
            return
        send(src, data, dst, sport)
    net._send = lossy
    return net, a, b, dropped


def test_a_lost_middle_packet_shows_the_nak_and_the_go_back(traced):
    net, a, b, dropped = _write_with_drop(3)
    buf = traced()
    a.post_send(IBV_WR_RDMA_WRITE, a.buf_sge(0, 8192), wr_id=7, remote_offset=0)
    net.run_until(lambda: a.ncomp(), timeout=10)
    assert dropped == [103]
    recs = _records(buf)
    req, resp = a.qp.qp_num, b.qp.qp_num
    # the responder saw PSN 104 where it expected 103: one PSN-sequence NAK naming 103
    naks = [r for r in recs if r["kind"] == "ack" and r.get("qpn") == resp
            and r.get("syndrome") == 0x60]
    assert [r["psn"] for r in naks] == [103], naks
    # the requester went back to 103 because of that NAK, and resent from there
    retry = [r for r in recs if r["kind"] == "retry" and r["qpn"] == req]
    assert retry[0]["action"] == "go-back-n" and retry[0]["why"] == "PSN sequence NAK" \
        and retry[0]["psn"] == 103, retry
    assert any(r["action"] == "retransmit" and r["psn"] == 103 for r in retry)
    tx = [r["psn"] for r in recs if r["kind"] == "packet" and r["dir"] == "tx"
          and r["qpn"] == req]
    assert tx[:8] == list(range(100, 108)) and tx[8] == 103, tx
    # ... and the WRITE completed once, successfully
    cq = [r for r in recs if r["kind"] == "cq" and r["qpn"] == req]
    assert [(c["wr_id"], c["status"]) for c in cq] == [(7, "SUCCESS")]
    # the order of cause and effect: NAK sent, then received, then the go-back
    order = [i for i, r in enumerate(recs) if r in (naks[0], retry[0])]
    assert order == sorted(order)


def test_a_lost_last_packet_is_recovered_by_the_timer(traced):
    """The LAST packet carries the only AckReq: nothing answers, so no NAK either; the
    retransmit timer fires (timeout 14: 4.096 us x 2^14 = 67 ms) and the requester goes
    back to the first unacknowledged PSN."""
    net, a, b, dropped = _write_with_drop(7)
    buf = traced()
    a.post_send(IBV_WR_RDMA_WRITE, a.buf_sge(0, 8192), wr_id=9, remote_offset=0)
    net.run_until(lambda: a.ncomp(), timeout=10)
    assert dropped == [107]
    recs = _records(buf)
    req = a.qp.qp_num
    assert not [r for r in recs if r["kind"] == "ack" and r.get("syndrome", 0) & 0x60]
    fired = [r for r in recs if r["kind"] == "timer" and r["qpn"] == req
             and r["action"] == "fire"]
    assert fired and fired[0]["timer"] == "retransmit"
    assert fired[0]["t"] == pytest.approx(4.096e-6 * (1 << 14), rel=0.01)
    retry = [r for r in recs if r["kind"] == "retry" and r["qpn"] == req]
    assert retry[0]["why"] == "timeout" and retry[0]["action"] == "go-back-n"
    assert recs.index(fired[0]) < recs.index(retry[0])


def test_kinds_and_qpns_filter(traced):
    net, a, b, _ = _write_with_drop(3)
    buf = traced("retry,qp", qpns=[a.qp.qp_num])
    a.post_send(IBV_WR_RDMA_WRITE, a.buf_sge(0, 8192), wr_id=1, remote_offset=0)
    net.run_until(lambda: a.ncomp(), timeout=10)
    recs = _records(buf)
    assert recs and {r["kind"] for r in recs} <= {"retry", "qp"}
    assert {r["qpn"] for r in recs if "qpn" in r} == {a.qp.qp_num}
    for r in recs:
        assert {"t", "dev", "kind", "msg"} <= set(r)


def test_text_format_is_one_line_per_event(traced):
    buf = io.StringIO()
    trace.enable("qp", fmt="text", stream=buf)
    try:
        net = SimNetwork(seed=1)
        a, b = connected_pair(net, "RC")
    finally:
        trace.disable()
    lines = buf.getvalue().splitlines()
    mine = [x for x in lines if f"qp 0x{a.qp.qp_num:x} " in x]
    assert [x.split("state ")[1] for x in mine] == ["RESET -> INIT", "INIT -> RTR",
                                                     "RTR -> RTS"]


def test_verbs_calls_are_traced_and_unwrapped_when_off(traced):
    from softrdma.verbs_api import PD, QP
    plain = QP.__dict__["post_send"]
    assert not getattr(plain, "__softrdma_traced__", False)
    buf = traced("verbs")
    assert getattr(QP.__dict__["post_send"], "__softrdma_traced__", False)
    net = SimNetwork(seed=1)
    a, b = connected_pair(net, "RC")
    calls = [r["call"] for r in _records(buf)]
    assert "PD" in calls and "QP" in calls and "QP.modify" in calls, calls
    trace.disable()
    assert QP.__dict__["post_send"] is plain and "__softrdma_traced__" not in \
        PD.__init__.__dict__
    assert a.qp.device.trace is None and a.qp.device.counters.trace is None


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown trace kind.*bogus"):
        trace.enable("packet,bogus")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_cli_trace_option_anywhere_writes_json_lines(tmp_path):
    out = tmp_path / "trace.jsonl"
    p = subprocess.run([sys.executable, "-m", "softrdma", "demo", "--trace=qp,cq",
                        "--trace-format", "json", "--trace-file", str(out),
                        "--addrs", "127.0.13.1", "127.0.13.2"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["kind"] for r in recs} == {"qp", "cq"}
    # two QPs, each RESET -> INIT -> RTR -> RTS; every completion succeeded
    rts = [r for r in recs if r["kind"] == "qp" and r["new"] == "IBV_QPS_RTS"]
    assert len(rts) == 2
    assert all(r["status"] == "SUCCESS" for r in recs if r["kind"] == "cq")


def test_cli_bad_trace_kind_is_one_line_exit_2():
    p = subprocess.run([sys.executable, "-m", "softrdma", "--trace-format", "xml", "demo"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert p.returncode == 2
    assert "--trace-format" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_environment_switch(tmp_path):
    env = _env()
    env.update(SOFTRDMA_TRACE="qp", SOFTRDMA_TRACE_FORMAT="json")
    code = ("from softrdma.harness.sim import SimNetwork\n"
            "from softrdma.harness.testing import connected_pair\n"
            "connected_pair(SimNetwork(seed=1), 'UC')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(x) for x in p.stderr.splitlines()]
    assert [r["new"] for r in recs].count("IBV_QPS_RTS") == 2


def test_a_packet_the_fault_injector_drops_is_traced_as_sent_then_dropped(traced):
    """The trace shows what the QP sent, then what the injected fault did to it."""
    net = SimNetwork(seed=1)
    a, b = connected_pair(net, "RC")
    rule = a.qp.device.faults.tx.drop("RC_RDMA_WRITE_MIDDLE")
    buf = traced("packet,drop")
    a.post_send(IBV_WR_RDMA_WRITE, a.buf_sge(0, 4096), wr_id=3, remote_offset=0)
    net.run_until(lambda: a.ncomp(), timeout=10)
    assert [h.psn for h in rule.hits] == [101]
    recs = [r for r in _records(buf) if r["dev"] == a.qp.device.name]
    tx101 = [i for i, r in enumerate(recs) if r["kind"] == "packet" and r["dir"] == "tx"
             and r["psn"] == 101]
    drops = [i for i, r in enumerate(recs) if r["kind"] == "drop"
             and r["reason"] == "injected_loss"]
    assert len(tx101) == 2  # sent (and dropped), then sent again by the go-back-N
    assert len(drops) == 1 and tx101[0] < drops[0] < tx101[1]
