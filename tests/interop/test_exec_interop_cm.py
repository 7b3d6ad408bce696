"""librdmacm's tools under ``softrdma exec`` against the same Debian binaries on kernel rxe
(issue 27): ucmatose, udaddy, rdma_server/rdma_client, rstream and riostream, each in
both roles, the host side on 10.77.0.1, guest 0's rdma_cm and rxe on 10.77.0.11.

Each test holds both ends' exit status and what the tool prints: ucmatose's and udaddy's
steps to "return status 0", rdma_server/rdma_client's "end 0" (each exits 0 only on its
completions), rstream/riostream's result line (bytes, transfers) with -T v (every byte
checked against rstream's counter). Without ``softrdma exec`` the host side has no RDMA
device and each tool ends at once (librdmacm: "No RDMA devices were detected"), failing
each test: checked by running this file with the host side's ``softrdma exec ... --``
replaced by ``env --`` (all 10 fail).

The tools run as on an rxe host: servers bound to the wildcard address, clients naming
only the server (no -b), rdma_cm picking the device on the route's source address. On the
host side that device is there because ``softrdma exec --addr 10.77.0.1`` put it there;
without --addr the clients end with RDMA_CM_EVENT_ADDR_ERROR -101 today. Issue 27 asks for
a soft device on the route's source address when rdma_cm needs one; with that, every test
here can drop --addr (exec_pair.EXEC), and should.
"""

from __future__ import annotations

import pytest

from .exec_pair import ROLES, Ready, ok, run_pair
from .test_rdmacm_interop import (UCMATOSE_CLIENT, UCMATOSE_SERVER, UDADDY_CLIENT,
                                  UDADDY_SERVER)

PORTS = iter(range(19800, 19899))
#: on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
ON_BOTH_KERNELS = pytest.mark.kernels("6.1", "6.12")


def _by_role(role, ours, rxe):
    """(server's Result, client's Result)."""
    return (ours, rxe) if role == "exec-server" else (rxe, ours)


@ON_BOTH_KERNELS
@pytest.mark.parametrize("role", ROLES)
def test_ucmatose_under_exec_against_rxe(scenario, role):
    """ucmatose -c 2 -C 10: two RC connections through both rdma_cms, ten SENDs each way on
    each, disconnected by the server."""
    port = next(PORTS)
    opts = f"-p {port} -c 2 -C 10"
    ours, rxe = run_pair(scenario, role, f"ucmatose {opts}",
                         f"ucmatose -s {{addr}} {opts}",
                         Ready("cm", port))
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    server, client = _by_role(role, ours, rxe)
    assert server.stdout.splitlines() == UCMATOSE_SERVER, ok(ours, rxe)
    assert client.stdout.splitlines() == UCMATOSE_CLIENT, ok(ours, rxe)


@pytest.mark.parametrize("role", ROLES)
def test_udaddy_under_exec_against_rxe(scenario, role):
    """udaddy -c 2: UD ids, SIDR request and reply (the server's QPN and Q_Key), SENDs
    through an AH made from the event's address, both ways (port 7174, udaddy's own)."""
    ours, rxe = run_pair(scenario, role, "udaddy -c 2", "udaddy -s {addr} -c 2",
                         Ready("cm", 7174, ps="UDP"))
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    server, client = _by_role(role, ours, rxe)
    assert server.stdout.splitlines() == UDADDY_SERVER, ok(ours, rxe)
    assert client.stdout.splitlines() == UDADDY_CLIENT, ok(ours, rxe)


@pytest.mark.parametrize("role", ROLES)
def test_rdma_server_client_under_exec_against_rxe(scenario, role):
    """rdma_server / rdma_client: rdma_getaddrinfo, rdma_create_ep with a QP, a 16-byte
    SEND each way through rdma_verbs.h's helpers (rdma_post_recv, rdma_post_send,
    rdma_get_recv_comp); each ends "end 0" only if its completions came."""
    port = next(PORTS)
    ours, rxe = run_pair(scenario, role, f"rdma_server -p {port}",
                         f"rdma_client -s {{addr}} -p {port}", Ready("cm", port))
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    server, client = _by_role(role, ours, rxe)
    assert server.stdout.splitlines()[-2:] == ["rdma_server: start", "rdma_server: end 0"]
    assert client.stdout.splitlines()[-2:] == ["rdma_client: start", "rdma_client: end 0"]


# (tool, size, count, rstream's size_str of size, of the total both ways)
STREAMS = [("rstream", 10000, 20, "9.7k", "390k"), ("riostream", 65536, 10, "64k", "1.2m")]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("tool,size,count,ssize,total",
                         [pytest.param(*STREAMS[0], marks=ON_BOTH_KERNELS), STREAMS[1]],
                         ids=[s[0] for s in STREAMS])
def test_rsocket_tools_under_exec_against_rxe(scenario, tool, size, count, ssize, total, role):
    """rstream (rsend/rrecv) and riostream (riomap'd buffers written by riowrite, RDMA
    WRITE into the program's memory) with -T v: every byte checked by both ends; both
    print the transfer's result line (size, transfers, total both ways)."""
    port = next(PORTS)
    opts = f"-p {port} -S {size} -C {count} -T v"
    ours, rxe = run_pair(scenario, role, f"{tool} {opts}",
                         f"{tool} -s {{addr}} {opts}", Ready("retry", port, refused="refused"))
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    for r in (ours, rxe):
        rows = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("custom")]
        assert len(rows) == 1 and rows[0][1:5] == [ssize, str(count), "1", total], r.stdout
