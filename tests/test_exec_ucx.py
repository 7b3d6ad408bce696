"""``softrdma exec``: UCX (Debian's ucx-utils 1.13), unmodified, on softrdma0.

``ucx_info -d`` must list softrdma0 with its verbs transports, and ``ucx_perftest`` must
run tag and put tests, latency and bandwidth, between two processes each under ``softrdma
exec`` on its own loopback address, with ``UCX_TLS=rc_verbs,ud_verbs``.

Two things stand outside softrdma, both described in docs/exec.md ("UCX"):

* UCX lists an IB device only if ``/dev/infiniband/<dev_name>`` is a character device the
  user may read and write (``uct_ib_device_is_accessible``). A host without RDMA drivers
  has no such node: ``softrdma exec --dev-infiniband`` runs the program in a mount
  namespace of its own whose ``/dev`` has them (:mod:`softrdma.exec.devnodes`, root or
  not); the host's ``/dev`` is not touched.
* UCX's UD transport reads a RoCE packet's L3 type from ``wc.sl``, where mlx5 reports it
  and rxe (and softrdma, as rxe) report the SL, 0: it then compares the wrong 16 bytes of
  the receive buffer's GRH area with its GID and drops every UD packet (the
  "UD endpoint ... unhandled timeout error" of two kernel rxe hosts).
  ``UCX_UD_VERBS_ETH_DGID_CHECK=n`` turns that check off.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from .exec_pair import compile_program, free_port, pair, tcp_port

SOFT = [sys.executable, "-m", "softrdma"]
SERVER, CLIENT = "127.0.8.1", "127.0.8.2"

def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (apt-get install ucx-utils; scripts/setup does)"
    return path


pytestmark = pytest.mark.usefixtures("exec_library")


@pytest.fixture
def under_exec():
    """``under_exec(addr, *argv, opts=())``: the command line running ``argv`` under
    ``softrdma exec --dev-infiniband [opts] --addr addr``."""
    def command(addr: str, *argv: str, opts: tuple[str, ...] = ()) -> list[str]:
        return [*SOFT, "exec", "--dev-infiniband", *opts, "--addr", addr, "--", *argv]
    return command


@pytest.fixture
def ucx_env(monkeypatch):
    """The settings UCX needs on softrdma (module docstring), for the programs started."""
    monkeypatch.setenv("UCX_TLS", "rc_verbs,ud_verbs")
    monkeypatch.setenv("UCX_UD_VERBS_ETH_DGID_CHECK", "n")


@pytest.mark.parametrize("form", [(), ("--ld-library-path",)], ids=["preload", "libdir"])
def test_ucx_info_lists_softrdma0_with_its_verbs_transports(under_exec, form):
    """``ucx_info -d``: UCX opens softrdma0 (device, port and GID queries, a PD, the
    RoCE GID it picks) and lists its memory domain with rc_verbs and ud_verbs on port 1.
    Guards the queries UCX makes of a device before it will use it, in both forms. In
    the LD_LIBRARY_PATH form softrdma's libibverbs.so.1 comes in with UCX's dlopen'ed
    libuct_ib, libpython with it in that local scope: its start-up must make libpython
    global, or importing _cffi_backend fails ("undefined symbol: PyExc_SystemError") and
    UCX finds no device."""
    r = subprocess.run(under_exec(SERVER, _tool("ucx_info"), "-d", opts=form),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "# Memory domain: softrdma0" in out, out
    md = out[out.index("# Memory domain: softrdma0"):]
    md = md[:md.find("# Memory domain:", 1)] if "# Memory domain:" in md[1:] else md
    for tl in ("rc_verbs", "ud_verbs"):
        assert re.search(rf"#\s+Transport: {tl}\n#\s+Device: softrdma0:1\n", md), md
    assert "not supported by softrdma" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_without_dev_infiniband_ucx_uses_softrdma0_only_if_the_node_exists():
    """Why ``--dev-infiniband`` exists: UCX lists softrdma0, which ``ibv_get_device_list``
    returns, only if ``/dev/infiniband/uverbs0`` is a character device the user may read
    and write -- on a host without an RDMA driver (this one, as CI's) it skips it
    silently; a host with one (rxe loaded) has the node and needs no option."""
    node = "/dev/infiniband/uverbs0"
    usable = os.path.exists(node) and os.access(node, os.R_OK | os.W_OK)
    r = subprocess.run([*SOFT, "exec", "--addr", SERVER, "--", _tool("ucx_info"), "-d"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "# Memory domain: tcp" in r.stdout, r.stdout
    assert ("# Memory domain: softrdma0" in r.stdout) == usable, r.stdout


def _perftest(under_exec, test: str, *extra: str, server_opts: tuple[str, ...] = ()) -> str:
    """``ucx_perftest -t test`` between two exec'd processes (``server_opts``: softrdma
    exec's options for the server); the client's output, after checking both exit 0 and
    the client prints its result table's final row."""
    perftest, port = _tool("ucx_perftest"), free_port()
    cli, srv = pair(under_exec(SERVER, perftest, "-p", port, opts=server_opts),
                    under_exec(CLIENT, perftest, SERVER, "-p", port, "-t", test, *extra),
                    tcp_port(port), timeout=90)
    rc, out, err = srv.returncode, srv.stdout, srv.stderr
    assert cli.returncode == 0, (cli.stdout, cli.stderr, out, err)
    assert rc == 0, (out, err)
    final = [ln for ln in cli.stdout.splitlines() if ln.startswith("Final:")]
    assert len(final) == 1, cli.stdout
    # Final: <iterations> <lat 50%> <lat avg> <lat overall> <bw avg> <bw overall> ...
    assert final[0].split()[1] == "100", final
    assert "Fatal" not in cli.stderr + err and "Caught signal" not in cli.stderr + err
    assert "not supported by softrdma" not in cli.stderr + err  # every verb UCX calls
    return cli.stdout


@pytest.mark.parametrize("test,extra,env", [
    ("tag_lat", [], {}), ("tag_bw", [], {}),
    ("tag_bw", ["-s", "65536"], {"UCX_RNDV_THRESH": "16k"}),
    ("ucp_put_lat", [], {}), ("ucp_put_bw", ["-s", "4096"], {}),
    ("put_lat", ["-d", "softrdma0:1", "-x", "rc_verbs"], {}),
    ("put_bw", ["-d", "softrdma0:1", "-x", "rc_verbs", "-s", "4096", "-D", "zcopy"], {}),
])
def test_ucx_perftest_runs_between_two_exec_programs(under_exec, ucx_env, monkeypatch,
                                                     tmp_path, test, extra, env):
    """ucx_perftest's tag-matching and put tests, latency and bandwidth, between two
    processes under softrdma exec: UCP wires the endpoints up over ud_verbs (its auxiliary
    transport: rc_verbs alone is "no auxiliary transport") and runs the test over rc_verbs
    (``ep_cfg[0]: tag(rc_verbs/softrdma0:1)``); 64 KiB tags above a 16 KiB
    ``UCX_RNDV_THRESH`` take UCP's rendezvous protocol (the receiver RDMA READs the
    sender's buffer; UCX's own threshold keeps 64 KiB eager, as SEND fragments); ``put_lat``/``put_bw`` are the UCT-level
    tests, straight on one rc_verbs interface (``-D zcopy``: RDMA WRITE from a registered
    buffer). Guards what UCX needed of softrdma:
    a C ``grh.flow_label`` is a u32 of which the GRH keeps 20 bits (UCX sets ~0, and
    ``ibv_create_ah``/``ibv_modify_qp`` failed EINVAL), and a destroyed QP's pending async
    event goes with it (UCX's async thread read ``element.qp->qp_num`` of a NULL QP and
    the client died of SIGSEGV as a test ended)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rndv, trace = "UCX_RNDV_THRESH" in env, tmp_path / "server.trace"
    _perftest(under_exec, test, "-n", "100", *extra,
              server_opts=("--trace=packet", "--trace-file", str(trace)) if rndv else ())
    if rndv:  # the receiving server fetched the data
        assert " tx RC_RDMA_READ_REQUEST " in trace.read_text()


def test_a_destroyed_qps_pending_async_event_goes_with_it(tmp_path):
    """tests/programs/exec_async_destroyed.c: an SRQ-attached QP moved to ERR raises
    IBV_EVENT_QP_LAST_WQE_REACHED; destroyed while that event is pending, the QP takes it
    along (as uverbs), so ibv_get_async_event on the O_NONBLOCK async_fd is EAGAIN -- not
    an event whose element.qp is NULL, which UCX dereferenced (the deterministic form of
    the SIGSEGV the perftest runs above met at their end)."""
    exe = compile_program(tmp_path, "exec_async_destroyed")
    r = subprocess.run([*SOFT, "exec", "--addr", "127.0.8.3", "--", exe], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:2] == ["OK pending", "OK dropped"], r.stdout
