"""perftest 4.5 under ``softrdma exec`` against perftest on kernel rxe (issue 27):
rdma-core's provider in guest 0, softrdma's preload library on the host (10.77.0.1).

The set covers each family (send, read, atomic bw; send, read lat) in each role at least
once, with and without ``-R`` (rdma_cm), ``-q 4`` on one, and one scenario with 5 % loss
both ways, in both roles. ib_write_bw is in test_exec_interop.py (client) and here (-R,
server). What each test holds: both ends exit 0; each prints the other's QP numbers as its
remote ones; each side that reports prints its result row with the size and iterations
asked. Without ``softrdma exec`` the host side has no RDMA device and perftest ends at
once ("Unable to find the Infiniband/RoCE device"), failing each test: checked by running
this file with the host side's ``softrdma exec ... --`` replaced by ``env --`` (all fail).
"""

from __future__ import annotations

import re

import pytest

from softrdma.harness.lab import guest_ip
from softrdma.wire.frames import decode_frame
from softrdma.wire.pcap import read_pcap

from .exec_pair import ROLES, Ready, ok, run_pair

PORTS = iter(range(19750, 19799))  # test_exec_interop_verbs.py has 19700-19749
#: on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
ON_BOTH_KERNELS = pytest.mark.kernels("6.1", "6.12")
ON_BOTH = {"read_bw-R", "atomic_bw", "atomic_bw-R"}  # READ and both atomics, each role once

# perftest's result row; its latency columns can read "inf"/"-nan" in a TCG guest, where
# it measures the CPU's frequency as 0 (-F lets it run anyway)
_NUM = r"(?:[\d.]+|inf|-?nan)"
ROW = re.compile(rf"^\s*(\d+)\s+(\d+)\s+{_NUM}\s+{_NUM}", re.M)
_PT_QPN = re.compile(r"(local|remote) address: LID \S+ QPN (0x[0-9a-f]+)")

# (id, options, role, size, iterations, QPs): each family in each role at least once,
# -R (rdma_cm) beside perftest's own TCP exchange, -q 4 on one
PERFTEST = [
    ("send_bw", "ib_send_bw -s 4096 -n 100", "exec-server", 4096, 100, 1),
    ("send_bw-R", "ib_send_bw -R -s 4096 -n 100", "exec-client", 4096, 100, 1),
    ("read_bw-q4", "ib_read_bw -q 4 -s 16384 -n 100", "exec-client", 16384, 100, 4),
    ("read_bw-R", "ib_read_bw -R -s 16384 -n 100", "exec-server", 16384, 100, 1),
    ("write_bw-R", "ib_write_bw -R -s 65536 -n 100", "exec-server", 65536, 100, 1),
    ("atomic_bw", "ib_atomic_bw -A FETCH_AND_ADD -n 100", "exec-server", 8, 100, 1),
    ("atomic_bw-R", "ib_atomic_bw -R -A CMP_AND_SWAP -n 100", "exec-client", 8, 100, 1),
    ("send_lat", "ib_send_lat -s 64 -I 64 -n 100", "exec-client", 64, 100, 1),
    ("send_lat-R", "ib_send_lat -R -s 64 -n 100", "exec-server", 64, 100, 1),
    ("read_lat", "ib_read_lat -s 64 -n 100", "exec-server", 64, 100, 1),
    ("read_lat-R", "ib_read_lat -R -s 64 -n 100", "exec-client", 64, 100, 1),
]


# perftest 4.5's client connects its test QPs (-R) right after the second handshake on
# its rdma_cm exchange connection, while the server only then creates its listener for
# them. The exec'd client on the host is quicker than the server in its TCG guest, and
# the guest's CM rejects that REQ (no listener: REJ reason 8); perftest's retry then uses
# the ids it has just destroyed (rdma_cm_client_connection: a use after free with any
# librdmacm; softrdma answers EINVAL) and fails. Two kernel rxe guests, equally slow, do
# not meet it. So an exec'd -R client sends every CM MAD (UD to QP 1) half a second late,
# with softrdma's own fault injection: the client of a slower host.
SLOW_CM = "--fault 'tx:delay(UD_SEND_ONLY,qpn=1,count=0,seconds=0.5)'"


def perftest_pair(lab, role, opts, *, exec_opts="", timeout=90):
    """perftest ``opts`` in ``role`` (-F: no CPU-frequency check in a TCG guest)."""
    port = next(PORTS)
    cmd = f"{opts} -F -p {port}"
    ready = Ready("cm", port) if " -R" in opts else Ready("tcp", port)
    if " -R" in opts and role == "exec-client":
        exec_opts = f"{SLOW_CM} {exec_opts}"
    return run_pair(lab, role, cmd, cmd + " {addr}", ready, exec_opts=exec_opts,
                    timeout=timeout)


def check_perftest(ours, rxe, role: str, opts: str, size: int, iters: int,
                   nqp: int) -> None:
    """Both exit 0, each names the other's QPs, and each side that reports (ib_read_lat's
    server does not) prints the result row: ``size``, and ``iters`` per QP."""
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    mine, theirs = ({s: [q for w, q in _PT_QPN.findall(r.stdout) if w == s]
                     for s in ("local", "remote")} for r in (ours, rxe))
    assert len(mine["local"]) == nqp and mine["local"] == theirs["remote"], ok(ours, rxe)
    assert theirs["local"] == mine["remote"], ok(ours, rxe)
    if " -R" in opts:
        for out in (ours.stdout, rxe.stdout):
            assert "Data ex. method : rdma_cm" in out, out
    client, server = (rxe, ours) if role == "exec-server" else (ours, rxe)
    for r in (client, server) if not opts.startswith("ib_read_lat") else (client,):
        rows = ROW.findall(r.stdout)
        assert rows and (int(rows[-1][0]), int(rows[-1][1])) == (size, iters * nqp), r.stdout


@pytest.mark.parametrize("opts,role,size,iters,nqp",
                         [pytest.param(*c[1:], marks=ON_BOTH_KERNELS) if c[0] in ON_BOTH
                          else c[1:] for c in PERFTEST],
                         ids=[c[0] for c in PERFTEST])
def test_perftest_under_exec_against_rxe(scenario, opts, role, size, iters, nqp):
    """perftest under softrdma exec against perftest on kernel rxe (see PERFTEST)."""
    ours, rxe = perftest_pair(scenario, role, opts)
    check_perftest(ours, rxe, role, opts, size, iters, nqp)


# ---- loss -------------------------------------------------------------------------------

@ON_BOTH_KERNELS
@pytest.mark.parametrize("role", ROLES)
def test_perftest_with_loss_under_exec_against_rxe(scenario, role, tmp_path):
    """ib_send_bw, 100 SENDs of 4 KiB (4 packets each), with 5 % loss both ways: tc netem
    on the guest's NIC (what rxe sends: ACKs, NAKs) and softrdma exec's own --fault on the
    host's device (what softrdma sends). Each side's go-back-N and retransmit timer
    recover every loss, the counts come out whole, and softrdma's trace shows that there
    was something to recover: its requester going back (client), or its responder's NAKs
    and answered duplicates (server)."""
    trace = tmp_path / "exec.trace"
    assert scenario.netem(0, "loss 5%").ok
    ours, rxe = perftest_pair(scenario, role, "ib_send_bw -s 4096 -n 100",
                              exec_opts=f"--fault 'tx:loss=0.05;seed=5' --trace retry,ack "
                                        f"--trace-file {trace}", timeout=150)
    check_perftest(ours, rxe, role, "ib_send_bw", 4096, 100, 1)
    text = trace.read_text()
    seen = "go back to PSN" in text if role == "exec-client" else "NAK PSN_SEQ_ERROR" in text
    assert seen, text[-3000:]


def _rxe_answers(pcap, rxe_ip: str) -> list[tuple[str, int]]:
    """What rxe sent in a capture: ("ACK" or "NAK", PSN) for each RC ACKNOWLEDGE."""
    out = []
    for rec in read_pcap(pcap):
        f = decode_frame(rec.data, rec.linktype)
        if f is None or f.dport != 4791 or f.src != rxe_ip or f.payload[0] != 0x11:
            continue
        psn = int.from_bytes(f.payload[9:12], "big")
        out.append(("NAK" if f.payload[12] >> 5 == 3 else "ACK", psn))
    return out


@ON_BOTH_KERNELS
def test_one_lost_write_packet_against_rxe(scenario, tmp_path):
    """The kernel-rxe facts behind ib_write_bw's crawl under loss (docs/exec.md, "Against
    kernel rxe in the lab"): one RDMA WRITE packet the exec'd client never sends (its
    --fault drops the 100th WRITE MIDDLE, in the second of 20 64 KiB writes) makes rxe
    answer exactly one NAK (PSN sequence error, naming that PSN) and drop what follows
    without a word, and softrdma goes back to that PSN at once: no timeout, no NAK
    ignored, the transfer whole. -u 20 (a 4.3 s retransmit timer instead of 67 ms): a
    guest starved of CPU for 67 ms would otherwise ACK late, a timeout would start a retry
    first, and the NAK would be ignored, as rxe ignores it."""
    lab, trace, pcap = scenario, tmp_path / "exec.trace", tmp_path / "one-loss.pcap"
    cap = lab.capture(pcap)
    try:
        ours, rxe = perftest_pair(lab, "exec-client", "ib_write_bw -u 20 -s 65536 -n 20",
                                  exec_opts="--fault 'tx:drop(RDMA_WRITE_MIDDLE,nth=100)' "
                                            f"--trace retry --trace-file {trace}")
    finally:
        cap.terminate()
        cap.wait(timeout=10)
    check_perftest(ours, rxe, "exec-client", "ib_write_bw", 65536, 20, 1)
    text = trace.read_text()
    back = re.findall(r"go back to PSN (\d+): PSN sequence NAK", text)
    assert len(back) == 1 and "timeout" not in text and "ignored" not in text, text
    naks = [psn for kind, psn in _rxe_answers(pcap, guest_ip(0)) if kind == "NAK"]
    assert naks == [int(back[0])], naks
