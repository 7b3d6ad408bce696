"""The rdma_cm programs the rxe interop tests run (tests/programs/rdma_server.py,
rdma_client.py, rdmacm_reject.py), against each other on loopback: each process its own
soft device on an address of 127.0.9.0/24. tests/interop/test_rdmacm_interop.py runs them
against librdmacm's rdma_server/rdma_client and the real pyverbs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .test_tools_rdmacm import _env, _wait_bound

PROGRAMS = Path(__file__).parent / "programs"


def _pair(prog, srv_ip, cli_ip, srv_args, cli_args):
    srv = subprocess.Popen([sys.executable, str(PROGRAMS / prog[0]), *srv_args],
                           env=_env(srv_ip), text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        _wait_bound(srv_ip)
        cli = subprocess.run([sys.executable, str(PROGRAMS / prog[1]), *cli_args],
                             env=_env(cli_ip), text=True, capture_output=True, timeout=60)
        out, err = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    return cli, (srv.returncode, out, err)


def test_rdma_server_and_client():
    srv_ip, cli_ip = "127.0.9.201", "127.0.9.202"
    cli, (rc, out, err) = _pair(("rdma_server.py", "rdma_client.py"), srv_ip, cli_ip,
                                ["-s", srv_ip, "-p", "7495"], ["-s", srv_ip, "-p", "7495"])
    assert cli.returncode == 0 and rc == 0, (cli.stderr, err)
    assert out.splitlines() == ["rdma_server: start", "rdma_server: end 0"]
    assert cli.stdout.splitlines() == ["rdma_client: start", "rdma_client: end 0"]


def test_reject_with_private_data():
    srv_ip, cli_ip = "127.0.9.205", "127.0.9.206"
    cli, (rc, out, err) = _pair(("rdmacm_reject.py", "rdmacm_reject.py"), srv_ip, cli_ip,
                                ["server", srv_ip, "7497", "no thanks"],
                                ["client", srv_ip, "7497", "hello"])
    assert cli.returncode == 0 and rc == 0, (cli.stderr, err)
    assert out.splitlines() == ["listening", "request data: " + (b"hello" + bytes(51)).hex(),
                                "rejected"]
    assert cli.stdout.splitlines() == ["event: RDMA_CM_EVENT_REJECTED", "status: 28",
                                       "private data: " + (b"no thanks" + bytes(139)).hex()]
