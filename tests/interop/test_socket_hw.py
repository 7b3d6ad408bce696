"""softrdma's rdma_cm, socket layer, message queue and rsocket on kernel rxe through
librdmacm (the hardware backend, softrdma.ibverbs.cma), in the lab:

- in guest 0, on its ``rxe0`` (``SOFTRDMA_BACKEND=ibverbs``): tests/hw/test_rdmacm_hw.py,
  every test of which must pass (rdma_cm's event and synchronous styles, the message
  socket, the message queue and rsocket, both ends in the guest);
- a message socket between softrdma on the host (the soft backend) and softrdma on
  ``rxe0`` in the guest (librdmacm), each side the server in turn;
- softrdma's rsocket on ``rxe0`` against librdmacm's own rsocket (rstream, rdmacm-utils),
  in the guest, each side the server in turn.

In the guest, kernel rxe holds UDP 4791, so a soft device could not open there: a run that
did not go through librdmacm fails instead of passing on the soft backend.
"""

from __future__ import annotations

import select
import time

from softrdma.harness.lab import HOST_IP, guest_ip

from .test_backend_conformance import HW_ENV, PYTHON, ROOT, run_in_guest

PROGS = ROOT / "tests" / "programs"
PORTS = iter(range(7400, 7499))  # the other lab tests use 7300-7398 and 7600-7998
GUEST_ENV = f"SOFTRDMA_BACKEND=ibverbs PYTHONPATH={ROOT} PYTHONDONTWRITEBYTECODE=1"


def _rdma_ucm(lab) -> None:
    """librdmacm needs /dev/infiniband/rdma_cm; a guest has no udev to load rdma_ucm."""
    r = lab.guest(0, "modprobe rdma_ucm && test -c /dev/infiniband/rdma_cm", timeout=30)
    assert r.ok, r.stderr


def _guest_py(args: str, limit: int = 200) -> str:
    return f"cd /tmp && env {GUEST_ENV} timeout {limit} {PYTHON} {args}"


def _ready(p, word: str, timeout: float = 60) -> None:
    """Wait for the host process to print a line containing ``word``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.5)[0]:
            line = p.stdout.readline()
            if word in line:
                return
            if not line and p.poll() is not None:
                break
    p.kill()
    raise AssertionError(f"the host side never said {word!r}: {p.communicate()[1][-2000:]}")


def test_rdmacm_socket_mq_and_rsocket_tests_on_rxe0_in_the_guest(lab):
    _rdma_ucm(lab)
    # PYTHONPATH: this tree's softrdma before any installed one (the pytest plugin loads
    # softrdma before the rootdir is on sys.path)
    run_in_guest(lab, "rdmacm-hw-rxe0", ROOT / "tests" / "hw" / "test_rdmacm_hw.py",
                 {**HW_ENV, "PYTHONPATH": str(ROOT)}, "", collect_env=HW_ENV)


def test_socket_host_client_to_rxe0_server(scenario):
    lab = scenario
    _rdma_ucm(lab)
    port = next(PORTS)
    srv = lab.guest_start(0, _guest_py(f"{PROGS / 'socket_echo.py'} {guest_ip(0)} {port}"))
    assert lab.wait_cm_listen(0, port), f"no listener: {srv.kill().stderr}"
    cli = lab.host(["python3", str(PROGS / "socket_check.py"), guest_ip(0), str(port),
                    "--bind", HOST_IP], timeout=240, env={"SOFTRDMA_IP": HOST_IP})
    out = srv.wait(timeout=60)
    assert cli.ok and cli.stdout.split() == ["OK", "8"], (cli.stdout, cli.stderr[-2000:])
    assert out.ok and out.stdout.split() == ["READY", "ECHOED", "8"], (out.stdout, out.stderr)


def test_socket_rxe0_client_to_host_server(scenario):
    lab = scenario
    _rdma_ucm(lab)
    port = next(PORTS)
    srv = lab.host_start(["python3", str(PROGS / "socket_echo.py"), HOST_IP, str(port)])
    try:
        _ready(srv, "READY")
        cli = lab.guest(0, _guest_py(f"{PROGS / 'socket_check.py'} {HOST_IP} {port}"),
                        timeout=240)
        out, err = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
    assert cli.ok and cli.stdout.split() == ["OK", "8"], (cli.stdout, cli.stderr[-2000:])
    assert srv.returncode == 0 and out.split() == ["ECHOED", "8"], (out, err[-2000:])


def _rstream_pair(lab, softrdma_is_server: bool) -> tuple:
    """rstream (librdmacm's rsocket) and tests/programs/rsocket_stream.py (softrdma's
    rsocket on rxe0), both in guest 0, 64 KiB x 20 each way, every byte verified."""
    port = next(PORTS)
    ip = guest_ip(0)
    soft = f"{PROGS / 'rsocket_stream.py'} {{role}} {ip} {port} -S 65536 -C 20 --verify " \
           f"--timeout 150"
    rstream = f"timeout 170 rstream -p {port} -S 65536 -C 20 -T v"
    if softrdma_is_server:
        srv = lab.guest_start(0, _guest_py(soft.format(role="server")))
        assert lab.wait_cm_listen(0, port), f"no listener: {srv.kill().stderr}"
        cli = lab.guest(0, f"{rstream} -s {ip}", timeout=200)
    else:
        srv = lab.guest_start(0, f"{rstream} -b {ip}")
        assert lab.wait_cm_listen(0, port), f"no listener: {srv.kill().stderr}"
        cli = lab.guest(0, _guest_py(soft.format(role="client")), timeout=200)
    return cli, srv.wait(timeout=120)


def test_rsocket_on_rxe0_against_librdmacms_rstream_softrdma_server(scenario):
    cli, srv = _rstream_pair(scenario, softrdma_is_server=True)
    assert cli.ok, (cli.stdout, cli.stderr)
    assert srv.ok and "rstream ok" in srv.stdout, (srv.stdout, srv.stderr[-2000:])


def test_rsocket_on_rxe0_against_librdmacms_rstream_softrdma_client(scenario):
    cli, srv = _rstream_pair(scenario, softrdma_is_server=False)
    assert srv.ok, (srv.stdout, srv.stderr)
    assert cli.ok and "rstream ok" in cli.stdout, (cli.stdout, cli.stderr[-2000:])
