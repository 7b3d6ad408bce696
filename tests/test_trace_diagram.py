"""A trace (softrdma.trace, JSON lines) drawn as a sequence diagram: `softrdma diagram
RUN.jsonl` reads softrdma's own trace as well as a capture."""

from __future__ import annotations

import json

from softrdma import trace
from softrdma.cli import main
from softrdma.enums import IBV_WR_RDMA_WRITE
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair


def test_a_traced_lossy_write_is_drawn_with_its_loss_and_the_go_back(tmp_path, capsys):
    net = SimNetwork(seed=1)
    a, b = connected_pair(net, "RC")
    send = net._send
    once = []

    def lossy(src, data, dst, sport):  # the network loses PSN 102 once
        from softrdma.wire.packet import parse
        p = parse(data)
        if p.info.is_request and p.psn == 102 and not once:
            once.append(p.psn)
            net.stats["lost"] += 1
            if src.trace is not None:
                src.trace.emit(src, "drop", None, "lost", reason="sim_loss", psn=p.psn,
                               opcode=p.info.name, dest_qp=p.dest_qp, peer=b.qp.device.ip)
            return
        send(src, data, dst, sport)
    net._send = lossy
    path = tmp_path / "run.jsonl"
    with open(path, "w") as f:
        trace.enable("packet,retry,cq,drop", fmt="json", stream=f)
        try:
            a.post_send(IBV_WR_RDMA_WRITE, a.buf_sge(0, 4096), wr_id=1, remote_offset=0)
            assert net.run_until(lambda: a.ncomp(), timeout=10)
        finally:
            trace.disable()
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    sent = [r for r in recs if r["kind"] == "packet" and r["dir"] == "tx"]
    assert main(["diagram", str(path)]) == 0
    out = capsys.readouterr().out
    arrows = [x for x in out.splitlines() if "->>" in x or "-x" in x]
    assert len(arrows) == len(sent)  # one arrow per packet sent
    lost = [x for x in arrows if "-x" in x]
    assert len(lost) == 1 and "WRITE_MIDDLE psn 102 (lost)" in lost[0]
    assert any("WRITE_MIDDLE psn 102 (retransmit)" in x for x in arrows)
    assert "Note over P1: go back to PSN 102: PSN sequence NAK" in out
    assert "Note over P1: WC RDMA_WRITE SUCCESS wr_id 1" in out
