"""Unmodified C programs under ``softrdma exec`` against kernel rxe (issue 27): the same
Debian binaries on both sides, rdma-core's provider on the guest, softrdma's preload
library on the host. Each scenario runs in both roles where the tool has two."""

from __future__ import annotations

import re
import time

import pytest

from softrdma.harness.lab import HOST_IP, guest_ip

from .test_rdmacm_lab import rping_data

# the whole file on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
pytestmark = pytest.mark.kernels("6.1", "6.12")

PORTS = iter(range(19600, 19699))
EXEC = f"softrdma exec --addr {HOST_IP} -- "


def _pingpong_ok(out: str, iters: int, size: int) -> bool:
    return re.search(rf"^{size * iters * 2} bytes in [\d.]+ seconds", out, re.M) is not None \
        and re.search(rf"^{iters} iters in [\d.]+ seconds", out, re.M) is not None


@pytest.mark.parametrize("role", ["exec-server", "exec-client"])
def test_ibv_rc_pingpong_under_exec_against_rxe(scenario, role):
    """ibv_rc_pingpong -g 1 under softrdma exec and on kernel rxe: 20 round trips of
    4 KiB each way, each side printing the other's QPN and PSN as its peer's."""
    lab, port, iters, size = scenario, next(PORTS), 20, 4096
    cmd = f"ibv_rc_pingpong -g 1 -n {iters} -s {size} -p {port} "
    if role == "exec-server":
        srv = lab.host_start(EXEC + cmd)
        try:
            time.sleep(2.0)  # the library's first call starts Python in the program
            rxe = lab.guest(0, "timeout 90 " + cmd + HOST_IP, timeout=100)
            out, err = srv.communicate(timeout=100)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.communicate()
        ours = (srv.returncode, out, err)
    else:
        job = lab.guest_start(0, "timeout 90 " + cmd)
        time.sleep(1.0)
        r = lab.host(EXEC + cmd + guest_ip(0), timeout=100)
        ours, rxe = (r.rc, r.stdout, r.stderr), job.wait(timeout=100)
    assert ours[0] == 0 and rxe.rc == 0, f"exec: {ours[2]}\nrxe: {rxe.stderr}"
    assert _pingpong_ok(ours[1], iters, size) and _pingpong_ok(rxe.stdout, iters, size)
    mine = re.findall(r"local address:  LID 0x0000, QPN (0x[0-9a-f]+)", ours[1])
    theirs = re.findall(r"remote address: LID 0x0000, QPN (0x[0-9a-f]+)", rxe.stdout)
    assert mine and mine == theirs


@pytest.mark.parametrize("role", ["exec-server", "exec-client"])
def test_rping_under_exec_against_rxe(scenario, role):
    """librdmacm's rping -v -C 3 under softrdma exec and on kernel rxe: the connection
    through both rdma_cms, and every ping's data as rping prints it, on both sides."""
    lab, port, count = scenario, next(PORTS), 3
    if role == "exec-client":
        srv = lab.guest_start(0, f"timeout 60 rping -s -a {guest_ip(0)} -p {port} -v -C {count}")
        assert lab.wait_cm_listen(0, port), "rping -s never listened"
        r = lab.host(EXEC + f"rping -c -a {guest_ip(0)} -p {port} -v -C {count}", timeout=70)
        ours, rxe = (r.rc, r.stdout, r.stderr), srv.wait(timeout=30)
    else:
        srv = lab.host_start(EXEC + f"rping -s -a {HOST_IP} -p {port} -v -C {count}")
        try:
            # the guest's client tries again while the exec'd server is still starting (a
            # REJ before its rdma_listen), as a real client would be restarted
            rxe = lab.guest(0, f"for i in $(seq 20); do timeout 30 rping -c -a {HOST_IP} "
                               f"-p {port} -v -C {count} && break; sleep 0.5; done",
                            timeout=120)
            out, err = srv.communicate(timeout=60)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.communicate()
        ours = (srv.returncode, out, err)
    assert ours[0] == 0 and rxe.rc == 0, f"exec: {ours[2]}\nrxe: {rxe.stderr}"
    for i in range(count):
        assert f"ping data: {rping_data(i)}" in ours[1], ours[1]
        assert f"ping data: {rping_data(i)}" in rxe.stdout, rxe.stdout


def test_ib_write_bw_under_exec_against_rxe(scenario):
    """perftest's ib_write_bw, the client under softrdma exec, the server on kernel rxe:
    200 RDMA WRITEs of 64 KiB, both sides print their result row."""
    lab, port = scenario, next(PORTS)
    cmd = f"ib_write_bw -n 200 -s 65536 -p {port} "
    job = lab.guest_start(0, "timeout 90 " + cmd)
    time.sleep(1.0)
    r = lab.host(EXEC + cmd + guest_ip(0), timeout=100)
    rxe = job.wait(timeout=100)
    assert r.rc == 0 and rxe.rc == 0, f"exec: {r.stderr}\nrxe: {rxe.stderr}"
    for out in (r.stdout, rxe.stdout):
        assert re.search(r"^\s*65536\s+200\s+[\d.]+\s+[\d.]+", out, re.M), out
