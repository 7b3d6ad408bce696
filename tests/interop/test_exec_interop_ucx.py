"""UCX (Debian's ucx-utils 1.13) under ``softrdma exec`` against UCX on kernel rxe in guest
0, both roles, and UCX between the two kernel rxe guests (issue 27).

UCX's UD transport, which UCP needs to wire up its RC endpoints, drops every RoCE packet
from a device that reports the SL in ``wc.sl`` where mlx5 reports the L3 type -- rxe, and
softrdma with it -- unless ``UCX_UD_VERBS_ETH_DGID_CHECK=n`` (docs/exec.md, UCX). Without
it two kernel rxe guests abort (``ud_ep.c:276 Fatal: UD endpoint ... unhandled timeout
error``, after ~35 s, with ``UCX_IB_GID_INDEX=1`` too), and so do softrdma exec and rxe;
with it both pairs run. The abort is not a test here (35 s for a fact about UCX); the
runs with the setting are.

Each test holds both exit statuses, the client's final row (100 iterations), and the
transport and device UCX chose on each side (``UCX_LOG_LEVEL=info``'s ``ep_cfg[0]:
...(rc_verbs/softrdma0:1)`` and ``(rc_verbs/rxe0:1)``). UCX looks for
``/dev/infiniband/uverbs*`` before it opens a device: ``--dev-infiniband`` gives the
exec'd side one. Without ``softrdma exec`` the host side has no RDMA device ("UCX ERROR no
usable transports/devices (asked rc_verbs,ud_verbs on all devices)", ucx_perftest exits
255), failing each exec test (checked with the host side's ``softrdma exec ... --``
replaced by ``env --``).
"""

from __future__ import annotations

import re
import time

import pytest

from softrdma.harness.lab import guest_ip

from .exec_pair import Ready, ok, run_pair

PORTS = iter(range(19900, 19949))
UCX_ENV = {"UCX_TLS": "rc_verbs,ud_verbs", "UCX_UD_VERBS_ETH_DGID_CHECK": "n",
           "UCX_LOG_LEVEL": "info"}
_GUEST_ENV = " ".join(f"{k}={v}" for k, v in UCX_ENV.items())
FINAL = re.compile(r"^Final:\s+100\s", re.M)


def _ep_cfg(r, device: str) -> bool:
    """UCX's info line for the endpoint (UCX logs to stdout): the RC transport on
    ``device``'s port 1."""
    return re.search(rf"ep_cfg\[0\]: \w+\(rc_verbs/{device}:1\)", r.stdout + r.stderr) \
        is not None


# (role, ucx_perftest test): tag matching and RMA put, one each way
UCX_CASES = [("exec-client", "tag_lat"), ("exec-server", "ucp_put_bw")]


@pytest.mark.parametrize("role,test", UCX_CASES, ids=[f"{t}-{r}" for r, t in UCX_CASES])
def test_ucx_perftest_under_exec_against_rxe(scenario, role, test):
    """ucx_perftest -t TEST -n 100 over rc_verbs (wired up over ud_verbs), softrdma0 on
    the host under softrdma exec, rxe0 in the guest."""
    port = next(PORTS)
    server = f"ucx_perftest -p {port}"
    client = f"ucx_perftest {{addr}} -p {port} -t {test} -n 100"
    guest = f"env {_GUEST_ENV} "
    srv, cli = (server, guest + client) if role == "exec-server" else (guest + server, client)
    ours, rxe = run_pair(scenario, role, srv, cli, Ready("tcp", port),
                         exec_opts="--dev-infiniband", env=UCX_ENV, timeout=90)
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    client_out = rxe.stdout if role == "exec-server" else ours.stdout
    assert FINAL.search(client_out), ok(ours, rxe)
    assert _ep_cfg(ours, "softrdma0") and _ep_cfg(rxe, "rxe0"), ok(ours, rxe)


def test_ucx_perftest_between_two_rxe_guests(scenario):
    """The same UCX between the two kernel rxe guests, with UCX_UD_VERBS_ETH_DGID_CHECK=n:
    what the setting does for rxe itself (without it: the abort above)."""
    lab, port = scenario, next(PORTS)
    job = lab.guest_start(0, f"{_GUEST_ENV} timeout 90 ucx_perftest -p {port}")
    deadline = time.monotonic() + 30
    while f":{port} " not in lab.guest(0, "ss -Htln", timeout=20).stdout:
        assert time.monotonic() < deadline and job.running(), "ucx_perftest never listened"
        time.sleep(0.2)
    cli = lab.guest(1, f"{_GUEST_ENV} timeout 90 ucx_perftest {guest_ip(0)} -p {port} "
                       f"-t tag_lat -n 100", timeout=100)
    srv = job.wait(timeout=100)
    assert cli.rc == 0 and srv.rc == 0, ok(cli, srv)
    assert FINAL.search(cli.stdout), cli.stdout
    assert _ep_cfg(cli, "rxe0") and _ep_cfg(srv, "rxe0"), ok(cli, srv)
