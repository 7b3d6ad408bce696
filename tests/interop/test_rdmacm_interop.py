"""rdma_cm: softrdma against kernel rxe and the unmodified librdmacm tools, both roles.

rping (data lines checked on both ends, three sizes, and under 5 % loss), ucmatose (4
connections, and under loss), udaddy (no loss: nothing retransmits UD data, see
docs/notes-rdmacm-lab.md), rdma_server/rdma_client (the synchronous rdma_create_ep API;
tests/programs/rdma_server.py and rdma_client.py are the C examples on softrdma.rdmacm), a
connection rejected with private data by either side (tests/programs/rdmacm_reject.py,
run on the real pyverbs in the guest), and one softrdma server with clients from both
guests at once.

softrdma runs in the lab's namespace on 10.77.0.1; guest 0 (10.77.0.11) is the rxe peer,
guest 1 (10.77.0.12) the second client of the last scenarios. "Loss" is 5 % both ways of
everything but DREQ and DREP (netem in the guest; see _PRIO_LOSS for why). A lost CM MAD
costs one CM retry (~4.3 s with the kernel's response timeout 20), so the bounds below
allow for a few of those. Every tool's output goes to files, not pipes: rping -v -S 8000
prints 80 KB.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from softrdma.harness.lab import HOST_IP, Result, guest_ip
from softrdma.tools.rping import ping_data

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
PORTS = iter(range(7600, 7699))  # a port per run; udaddy's is fixed (7174)
LOSS = True
#: on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
ON_BOTH_KERNELS = pytest.mark.kernels("6.1", "6.12")
G0 = guest_ip(0)
SOFT_ENV = {"SOFTRDMA_IP": HOST_IP}  # the programs' default device (the tools use -a/-b/-I)

UCMATOSE_SERVER = ["cmatose: starting server", "initiating data transfers", "completing sends",
                   "receiving data transfers", "data transfers complete",
                   "cmatose: disconnecting", "disconnected", "test complete", "return status 0"]
UCMATOSE_CLIENT = ["cmatose: starting client", "cmatose: connecting", "receiving data transfers",
                   "sending replies", "data transfers complete", "test complete",
                   "return status 0"]
UDADDY_SERVER = ["udaddy: starting server", "receiving data transfers", "sending replies",
                 "data transfers complete", "test complete", "return status 0"]
UDADDY_CLIENT = ["udaddy: starting client", "udaddy: connecting", "initiating data transfers",
                 "receiving data transfers", "data transfers complete", "test complete",
                 "return status 0"]


_OUT = iter(range(1, 10**6))


def _guest_start(lab, g, cmd, timeout):
    """Start ``cmd`` in guest ``g`` with its output in files of the lab directory (which
    the guests share): a guest job's pipes are read only when it is collected, so rping -v
    -S 8000 (80 KB of output) would block on a full pipe."""
    name = f"rdmacm-{next(_OUT)}"
    out, err = lab.dir / f"{name}.out", lab.dir / f"{name}.err"
    return lab.guest_start(g, f"timeout {timeout} {cmd} >{out} 2>{err}"), out, err


def _guest_wait(job, timeout):
    job, out, err = job
    r = job.wait(timeout=timeout)
    return Result(r.rc, out.read_text() if out.exists() else "",
                  (err.read_text() if err.exists() else "") + r.stderr)


def _soft_listening(lab, proc, timeout: float = 30) -> None:
    """Until the softrdma server's device holds UDP 4791 in the namespace, then a moment for
    its listen (the device is made before the tool binds its rdma_cm id)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"softrdma server exited {proc.returncode}")
        if ":4791" in lab.host(["ss", "-Huln", "sport = :4791"], timeout=10).stdout:
            time.sleep(1.0)
            return
        time.sleep(0.1)
    raise AssertionError("the softrdma server never bound UDP 4791")


def soft_server(lab, soft_cmd, rxe_cmds, *, env=None, timeout=60):
    """softrdma serves; each of ``rxe_cmds`` ({guest: command}) runs as a client at once.
    Returns (softrdma's Result, [each client's Result])."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        srv = lab.host_start(soft_cmd, env=env, stdout=out, stderr=err)
        try:
            _soft_listening(lab, srv)
            jobs = [_guest_start(lab, g, cmd, timeout) for g, cmd in rxe_cmds.items()]
            clis = [_guest_wait(j, timeout + 10) for j in jobs]
            srv.wait(timeout=timeout)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()
        out.seek(0)
        err.seek(0)
        return Result(srv.returncode, out.read(), err.read()), clis


def rxe_server(lab, rxe_cmd, port, soft_cmd, *, ps="TCP", env=None, timeout=60):
    """rxe (guest 0) serves, softrdma connects. Returns (softrdma's Result, rxe's)."""
    job = _guest_start(lab, 0, rxe_cmd, timeout)
    assert lab.wait_cm_listen(0, port, ps), f"{rxe_cmd!r} never listened"
    cli = lab.host(soft_cmd, timeout=timeout + 10, env=env)
    return cli, _guest_wait(job, timeout + 10)


def run(lab, role, *, rxe_srv, rxe_cli, soft_srv, soft_cli, port, ps="TCP", env=None,
        timeout=60):
    """One exchange in ``role``; returns (softrdma's Result, rxe's Result).

    rping (rdma-core 44) has a teardown race of its own: the client's main thread destroys
    the event channel while its cm thread is still in ``rdma_get_cm_event``, which then
    fails with EBADF and the thread calls ``exit(-1)`` (status 255) after the exchange
    itself succeeded. An exchange that ends in exactly that is run again (up to 3 times):
    the real tool needs it, whatever the peer."""
    if role == "softrdma-server":
        for _ in range(3):
            soft, (rxe,) = soft_server(lab, soft_srv, {0: rxe_cli}, env=env, timeout=timeout)
            if not _cm_thread_teardown_race(rxe):
                break
        return soft, rxe
    return rxe_server(lab, rxe_srv, port, soft_cli, ps=ps, env=env, timeout=timeout)


def _cm_thread_teardown_race(r: Result) -> bool:
    """rping's cm thread lost the race with its main thread's teardown (see :func:`run`)."""
    return r.rc == 255 and r.stderr.rstrip().endswith("rdma_get_cm_event: Bad file descriptor")


def _ok(r: Result, who: str) -> None:
    assert r.rc == 0, f"{who} exited {r.rc}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def _pings(size: int, count: int) -> list[str]:
    return [ping_data(i, size).split(b"\0")[0].decode() for i in range(count)]


ROLES = ["softrdma-server", "softrdma-client"]


# ---- loss (rping and ucmatose) --------------------------------------------------------

# 5 % loss sparing DREQ and DREP: the ``lossy`` fixture of tests/interop/conftest.py.


# ---- rping ----------------------------------------------------------------------------

@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("size,loss", [(64, None), pytest.param(1000, None, marks=ON_BOTH_KERNELS),
                                       (8000, None),
                                       pytest.param(1000, LOSS, marks=ON_BOTH_KERNELS)],
                         ids=["64", "1000", "8000", "1000-loss5"])
def test_rping(scenario, role, size, loss, request):
    lab, port, count = scenario, next(PORTS), 10
    if loss:
        request.getfixturevalue("lossy")
    opts = f"-p {port} -v -V -C {count} -S {size}"
    soft, rxe = run(lab, role, port=port, timeout=90 if loss else 60,
                    rxe_srv=f"rping -s -a {G0} {opts}",
                    soft_cli=f"softrdma rping -c -a {G0} -I {HOST_IP} {opts}",
                    soft_srv=f"softrdma rping -s -a {HOST_IP} {opts}",
                    rxe_cli=f"rping -c -a {HOST_IP} {opts}")
    _ok(soft, "softrdma rping")
    _ok(rxe, "rxe rping")
    client, server = (rxe, soft) if role == "softrdma-server" else (soft, rxe)
    want = _pings(size, count)
    assert client.stdout.splitlines() == [f"ping data: {d}" for d in want]
    assert server.stdout.splitlines() == [f"server ping data: {d}" for d in want]


# ---- ucmatose -------------------------------------------------------------------------

@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("loss", [pytest.param(None, marks=ON_BOTH_KERNELS), LOSS],
                         ids=["clean", "loss5"])
def test_ucmatose(scenario, role, loss, request):
    lab, port = scenario, next(PORTS)
    if loss:
        request.getfixturevalue("lossy")
    opts = f"-p {port} -c 4 -C 10"
    soft, rxe = run(lab, role, port=port, timeout=90 if loss else 60,
                    rxe_srv=f"ucmatose -b {G0} {opts}",
                    soft_cli=f"softrdma cmatose -s {G0} -b {HOST_IP} {opts}",
                    soft_srv=f"softrdma cmatose -b {HOST_IP} {opts}",
                    rxe_cli=f"ucmatose -s {HOST_IP} {opts}")
    _ok(soft, "softrdma cmatose")
    _ok(rxe, "ucmatose")
    client, server = (rxe, soft) if role == "softrdma-server" else (soft, rxe)
    assert server.stdout.splitlines() == UCMATOSE_SERVER
    assert client.stdout.splitlines() == UCMATOSE_CLIENT


# ---- udaddy (no loss: see the module docstring) ---------------------------------------

@pytest.mark.kernels("6.1", "6.12")
@pytest.mark.parametrize("role", ROLES)
def test_udaddy(scenario, role):
    lab = scenario
    soft, rxe = run(lab, role, port=7174, ps="UDP",
                    rxe_srv=f"udaddy -b {G0} -c 2",
                    soft_cli=f"softrdma udaddy -s {G0} -b {HOST_IP} -c 2",
                    soft_srv=f"softrdma udaddy -b {HOST_IP} -c 2",
                    rxe_cli=f"udaddy -s {HOST_IP} -c 2")
    _ok(soft, "softrdma udaddy")
    _ok(rxe, "udaddy")
    client, server = (rxe, soft) if role == "softrdma-server" else (soft, rxe)
    assert server.stdout.splitlines() == UDADDY_SERVER
    assert client.stdout.splitlines() == UDADDY_CLIENT


# ---- rdma_server / rdma_client (rdma_create_ep) ---------------------------------------

@pytest.mark.kernels("6.1", "6.12")
@pytest.mark.parametrize("role", ROLES)
def test_rdma_server_client(scenario, role):
    lab, port = scenario, next(PORTS)
    soft, rxe = run(lab, role, port=port, env=SOFT_ENV,
                    rxe_srv=f"rdma_server -p {port}",
                    soft_cli=f"python3 {PROGRAMS / 'rdma_client.py'} -s {G0} -p {port}",
                    soft_srv=f"python3 {PROGRAMS / 'rdma_server.py'} -s {HOST_IP} -p {port}",
                    rxe_cli=f"rdma_client -s {HOST_IP} -p {port}")
    _ok(soft, "softrdma program")
    _ok(rxe, "librdmacm example")
    # each checked the 16-byte message it got (the C one exits 0 only on completions)
    server, client = ("rdma_server", "rdma_client")
    s, c = (soft, rxe) if role == "softrdma-server" else (rxe, soft)
    assert s.stdout.splitlines() == [f"{server}: start", f"{server}: end 0"]
    assert c.stdout.splitlines() == [f"{client}: start", f"{client}: end 0"]


# ---- reject with private data ---------------------------------------------------------

def _padded(text: str, size: int) -> str:
    return (text.encode() + bytes(size - len(text))).hex()


@pytest.mark.parametrize("role", ["softrdma-rejects", "rxe-rejects"])
def test_reject_with_private_data(scenario, role):
    """The REJ's private data (148 bytes on the wire, the event reports all 148) reaches
    the other side's REJECTED event; the REQ's (56 bytes after rdma_cm's header) reaches
    the rejecting side's CONNECT_REQUEST."""
    lab, port = scenario, next(PORTS)
    prog = PROGRAMS / "rdmacm_reject.py"
    soft_pv = f"python3 {prog}"
    rxe_pv = f"/usr/bin/python3 {prog} --pyverbs"  # the real pyverbs, over librdmacm
    if role == "softrdma-rejects":
        req, rej = "rxe asks", "softrdma says no"
        soft, (rxe,) = soft_server(lab, f"{soft_pv} server {HOST_IP} {port} '{rej}'",
                                   {0: f"{rxe_pv} client {HOST_IP} {port} '{req}'"},
                                   env=SOFT_ENV)
        server, client = soft, rxe
    else:
        req, rej = "softrdma asks", "rxe says no"
        soft, rxe = rxe_server(lab, f"{rxe_pv} server {G0} {port} '{rej}'", port,
                               f"{soft_pv} client {G0} {port} '{req}'", env=SOFT_ENV)
        server, client = rxe, soft
    _ok(soft, "softrdma")
    _ok(rxe, "pyverbs on rxe")
    assert server.stdout.splitlines() == ["listening", f"request data: {_padded(req, 56)}",
                                          "rejected"]
    lines = client.stdout.splitlines()
    assert lines[0] == "event: RDMA_CM_EVENT_REJECTED"
    assert lines[-1] == f"private data: {_padded(rej, 148)}"
    if client is soft:  # pyverbs 44's CMEvent has no status
        assert lines[1] == "status: 28"  # IB_CM_REJ_CONSUMER_DEFINED
    assert len(lines) == (3 if client is soft else 2)


# ---- one softrdma server, clients from both guests at once ----------------------------

def test_cmatose_server_with_two_rxe_clients(scenario):
    lab, port = scenario, next(PORTS)
    soft, clis = soft_server(lab, f"softrdma cmatose -b {HOST_IP} -p {port} -c 4 -C 10",
                             {g: f"ucmatose -s {HOST_IP} -p {port} -c 2 -C 10" for g in (0, 1)})
    for i, c in enumerate(clis):
        _ok(c, f"ucmatose in guest {i}")
        assert c.stdout.splitlines() == UCMATOSE_CLIENT
    _ok(soft, "softrdma cmatose")
    assert soft.stdout.splitlines() == UCMATOSE_SERVER


@pytest.mark.kernels("6.1", "6.12")
def test_rping_persistent_server_with_two_rxe_clients(scenario):
    """rping -P serves one connection after the other; both guests' clients start at once
    (the second waits in the listen backlog) and each gets its own pings back."""
    lab, port = scenario, next(PORTS)
    counts = {0: 5, 1: 3}
    with tempfile.TemporaryFile("w+") as out:
        srv = lab.host_start(f"softrdma rping -s -P -a {HOST_IP} -p {port} -v", stdout=out)
        try:
            _soft_listening(lab, srv)
            jobs = {g: _guest_start(lab, g, f"rping -c -a {HOST_IP} -p {port} -v -V -C {n}",
                                    60) for g, n in counts.items()}
            clis = {g: _guest_wait(j, 70) for g, j in jobs.items()}
            time.sleep(0.5)
            assert srv.poll() is None, "rping -P stopped serving"
        finally:
            srv.kill()
            _, err = srv.communicate()
        out.seek(0)
        lines = out.read().splitlines()
    for g, c in clis.items():
        _ok(c, f"rping in guest {g}")
        assert c.stdout.splitlines() == [f"ping data: {d}" for d in _pings(64, counts[g])]
    assert sorted(lines) == sorted(f"server ping data: {d}"
                                   for n in counts.values() for d in _pings(64, n)), err
