"""``softrdma check`` on softrdma's own trains: IPv4 IDs that are not a counter.

rxe numbers the IPv4 packets it sends, and the checker uses that order to tell a resend
that arrived late from a new go-back. softrdma sends IP ID 0, and ``k`` for segment ``k``
of a GSO train (softrdma.wire.trains), so with doorbell batching a train can carry the
packets of several WRITEs and a later resend can carry an ID lower than an earlier packet.

tests/data/softrdma_doorbell_train_loss.pcap is a real capture, taken at the server, of
two softrdma devices running Debian's ib_write_bw under ``softrdma exec`` (tutorial 13's
commands): ``-s 8192 -n 5``, MTU 4096, the client's device dropping its second
RDMA_WRITE_LAST (``--fault 'tx:drop(RDMA_WRITE_LAST, nth=2)'``). So exactly one request was
lost, before the capture point; the server NAKed it once and the client went back once.
"""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT

PCAP = ROOT / "tests" / "data" / "softrdma_doorbell_train_loss.pcap"


def _check(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "softrdma", "check", *args, str(PCAP)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_one_drop_is_one_loss_not_a_reordering():
    out = _check()
    assert "1 lost before the capture point, 0 after" in out, out
    assert "reordered" not in out and "duplicate" not in out, out
    assert "1 NAK(s), 0 RNR NAK(s); 1 go-back(s) (1 nak)" in out, out
    assert out.rstrip().endswith("recovery in 1 flow(s): clean"), out


def test_the_events_frame_by_frame():
    events = [ln.split(":")[1].split("(")[0].strip() for ln in _check("--recovery").splitlines()
              if ln.startswith("    frame ")]
    assert events == ["lost-before", "nak", "go-back"]
