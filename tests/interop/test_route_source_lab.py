"""Programs that name only the remote address, against kernel rxe (issue 27, "the device
model stays softrdma's"): ``rping -c -a 10.77.0.11`` with no ``-I`` (softrdma's and
Debian's under ``softrdma exec``), ``cmatose``/``udaddy -s 10.77.0.11`` with no ``-b``,
and an exec'd listener binding 10.77.0.1 with no ``--addr``, as one runs them on an rxe
host, where the device is simply there on the netdev.

softrdma's side is the lab's namespace, whose one interface (br0) holds 10.77.0.1, the
route's source for the guests. Nothing pins the programs' device there: SOFTRDMA_IP is
emptied (an empty value is no pin) and neither ``-I`` nor ``softrdma exec --addr`` is
given, so the default device sits on loopback and the connection can only leave through
the interface device rdma_cm makes on 10.77.0.1 (docs/cm.md, "Interface devices").
Before that rule, each client here ended with ``RDMA_CM_EVENT_ADDR_ERROR, error -101``
and each server's ``rdma_bind_addr`` with ENODEV.
"""

from __future__ import annotations

from softrdma.harness.lab import HOST_IP, guest_ip

from .test_rdmacm_interop import (
    UCMATOSE_CLIENT, UCMATOSE_SERVER, UDADDY_CLIENT, UDADDY_SERVER, rxe_server,
)
from .test_rdmacm_lab import rping_data

PORTS = iter(range(19500, 19549))  # the other lab files use 7300-7998, 18600-18999, 19600-
G0 = guest_ip(0)
COUNT = 3
#: no pinned address, interface devices on, whatever the test run's own environment says
ENV = {"SOFTRDMA_IP": "", "SOFTRDMA_AUTO_DEVICES": "1"}


def _pings(out: str, prefix: str) -> None:
    for i in range(COUNT):
        assert f"{prefix}ping data: {rping_data(i)}" in out, out


def _against_rxe_server(lab, soft_cmd: str, port: int):
    """rping -s on guest 0's kernel rxe, ``soft_cmd`` as its client on the host side;
    (client's Result, rxe's Result) once both ended."""
    srv = lab.guest_start(0, f"timeout 60 rping -s -a {G0} -p {port} -v -C {COUNT}")
    assert lab.wait_cm_listen(0, port), "rping -s never listened"
    cli = lab.host(soft_cmd, timeout=70, env=ENV)
    return cli, srv.wait(timeout=30)


def test_softrdma_rping_names_only_the_guest(scenario):
    """``softrdma rping -c -a 10.77.0.11 -C 3`` without -I against rping on kernel rxe:
    rdma_cm finds the route's source 10.77.0.1, a device comes up on it, and every ping's
    data is printed on both sides."""
    lab, port = scenario, next(PORTS)
    cli, rxe = _against_rxe_server(lab, f"softrdma rping -c -a {G0} -p {port} -v -C {COUNT}",
                                   port)
    assert cli.rc == 0 and rxe.rc == 0, f"softrdma: {cli.stderr}\nrxe: {rxe.stderr}"
    assert cli.stdout.splitlines() == [f"ping data: {rping_data(i)}" for i in range(COUNT)]
    _pings(rxe.stdout, "server ")


def test_c_rping_under_exec_names_only_the_guest(scenario):
    """Debian's rping -c under ``softrdma exec`` with no --addr, naming only 10.77.0.11,
    against rping on kernel rxe: the same connection from the unmodified C program."""
    lab, port = scenario, next(PORTS)
    cli, rxe = _against_rxe_server(
        lab, f"softrdma exec -- rping -c -a {G0} -p {port} -v -C {COUNT}", port)
    assert cli.rc == 0 and rxe.rc == 0, f"exec: {cli.stderr}\nrxe: {rxe.stderr}"
    _pings(cli.stdout, "")
    _pings(rxe.stdout, "server ")


def test_c_rping_server_under_exec_binds_the_interface_address(scenario):
    """Debian's rping -s -a 10.77.0.1 under ``softrdma exec`` with no --addr: its
    ``rdma_bind_addr`` gets a device on br0's address (before: ENODEV), and rping -c on
    kernel rxe connects to it."""
    lab, port = scenario, next(PORTS)
    srv = lab.host_start(f"softrdma exec -- rping -s -a {HOST_IP} -p {port} -v -C {COUNT}",
                         env=ENV)
    try:
        # the guest's client tries again while the exec'd server is still starting (a REJ
        # before its rdma_listen), as a real client would be restarted
        rxe = lab.guest(0, f"for i in $(seq 20); do timeout 30 rping -c -a {HOST_IP} "
                           f"-p {port} -v -C {COUNT} && break; sleep 0.5; done", timeout=120)
        out, err = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    assert srv.returncode == 0 and rxe.rc == 0, f"exec: {err}\nrxe: {rxe.stderr}"
    _pings(out, "server ")
    _pings(rxe.stdout, "")


def test_softrdma_cmatose_names_only_the_guest(scenario):
    """``softrdma cmatose -s 10.77.0.11`` without -b against ucmatose on kernel rxe: two
    connections, data both ways, the disconnects, as test_rdmacm_interop's with -b."""
    lab, port = scenario, next(PORTS)
    opts = f"-p {port} -c 2 -C 5"
    soft, rxe = rxe_server(lab, f"ucmatose -b {G0} {opts}", port,
                           f"softrdma cmatose -s {G0} {opts}", env=ENV)
    assert soft.rc == 0 and rxe.rc == 0, f"softrdma: {soft.stderr}\nrxe: {rxe.stderr}"
    assert soft.stdout.splitlines() == UCMATOSE_CLIENT
    assert rxe.stdout.splitlines() == UCMATOSE_SERVER


def test_softrdma_udaddy_names_only_the_guest(scenario):
    """``softrdma udaddy -s 10.77.0.11`` without -b against udaddy on kernel rxe (its
    fixed port 7174, the UDP port space): SIDR from the interface device, then UD data."""
    lab = scenario
    soft, rxe = rxe_server(lab, f"udaddy -b {G0} -c 2", 7174,
                           f"softrdma udaddy -s {G0} -c 2", ps="UDP", env=ENV)
    assert soft.rc == 0 and rxe.rc == 0, f"softrdma: {soft.stderr}\nrxe: {rxe.stderr}"
    assert soft.stdout.splitlines() == UDADDY_CLIENT
    assert rxe.stdout.splitlines() == UDADDY_SERVER
