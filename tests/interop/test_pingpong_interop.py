"""rdma-core's unmodified ibv_*_pingpong on kernel rxe against softrdma, both roles."""

from __future__ import annotations

import re
import time

import pytest

from softrdma.harness.lab import HOST_IP, guest_ip

PORTS = iter(range(18600, 18999))
#: on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
ON_BOTH_KERNELS = pytest.mark.kernels("6.1", "6.12")
SIZES = {"rc": [512, 4096], "uc": [512, 4096], "srq": [512, 4096], "ud": [512, 1024]}
ON_BOTH = {("rc", 4096), ("uc", 4096), ("srq", 4096), ("ud", 1024)}  # the larger size of each
CASES = [pytest.param(k, s, marks=ON_BOTH_KERNELS) if (k, s) in ON_BOTH else (k, s)
         for k, sizes in SIZES.items() for s in sizes]


def _ok(out: str, iters: int, size: int) -> bool:
    return re.search(rf"^{size * iters * 2} bytes in [\d.]+ seconds", out, re.M) is not None and \
        re.search(rf"^{iters} iters in [\d.]+ seconds", out, re.M) is not None


def _run(lab, kind, size, iters, softrdma_is_server, env=None):
    port = next(PORTS)
    extra = "-q 4 " if kind == "srq" else ""
    rxe_cmd = f"timeout 90 ibv_{kind}_pingpong -g 1 -n {iters} -s {size} -p {port} {extra}"
    soft_cmd = f"softrdma pingpong {kind} --addr {HOST_IP} -n {iters} -s {size} -p {port} {extra}"
    if softrdma_is_server:
        srv = lab.host_start(soft_cmd, env=env)
        try:
            time.sleep(1.0)
            cli = lab.guest(0, rxe_cmd + HOST_IP, timeout=100)
            out, err = srv.communicate(timeout=100)
        finally:
            if srv.poll() is None:  # never leave a server holding UDP 4791 for the next test
                srv.kill()
                srv.communicate()
        return (srv.returncode, out, err), (cli.rc, cli.stdout, cli.stderr)
    job = lab.guest_start(0, rxe_cmd)
    time.sleep(1.0)
    cli = lab.host(soft_cmd + guest_ip(0), timeout=100, env=env)
    srv = job.wait(timeout=100)
    return (cli.rc, cli.stdout, cli.stderr), (srv.rc, srv.stdout, srv.stderr)


@pytest.mark.parametrize("role", ["softrdma-server", "softrdma-client"])
@pytest.mark.parametrize("kind,size", CASES)
def test_pingpong(scenario, kind, size, role):
    iters = 20
    (src, sout, serr), (rrc, rout, rerr) = _run(scenario, kind, size, iters,
                                                 role == "softrdma-server")
    assert src == 0, f"softrdma: {serr}\n{sout}"
    assert rrc == 0, f"rxe: {rerr}\n{rout}"
    assert _ok(sout, iters, size), sout
    assert _ok(rout, iters, size), rout
    # each side printed the other's QPN and PSN as it printed its own
    mine = re.findall(r"local address:  LID 0x0000, QPN (0x[0-9a-f]+), PSN (0x[0-9a-f]+)", sout)
    theirs = re.findall(r"remote address: LID 0x0000, QPN (0x[0-9a-f]+), PSN (0x[0-9a-f]+)", rout)
    assert mine and mine == theirs


@pytest.mark.kernels("6.1", "6.12")
@pytest.mark.parametrize("role", ["softrdma-server", "softrdma-client"])
def test_rc_pingpong_with_request_loss(scenario, role):
    """5 % of softrdma's request packets are lost (its seeded fault injection), so rxe's
    responder sends PSN-sequence NAKs and softrdma goes back N; duplicates follow when a
    retransmission overtakes an ACK.

    Only requests are dropped, and not with netem, on purpose: ibv_rc_pingpong ends as soon as
    each side has its last message and its last send acknowledged, so a lost ACK near the end
    leaves the other side retrying forever at a QP that has gone (retry_cnt 7 is infinite on
    rxe too). The lab showed this in both roles, with rxe and softrdma alike as the stranded
    side. Loss of everything, rxe's packets included, is covered by the perftest loss
    scenarios, which end with a TCP handshake."""
    lab = scenario
    iters, size = 40, 4096
    env = {"SOFTRDMA_TX_LOSS": "0.05", "SOFTRDMA_TX_LOSS_KIND": "requests"}
    (src, sout, serr), (rrc, rout, rerr) = _run(lab, "rc", size, iters, role == "softrdma-server",
                                                env=env)
    assert src == 0 and rrc == 0, f"softrdma: {serr}\nrxe: {rerr}"
    assert _ok(sout, iters, size) and _ok(rout, iters, size)
