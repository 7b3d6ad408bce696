"""perftest 4.5 (ib_*_bw, ib_*_lat) on kernel rxe against `softrdma perf`, both roles."""

from __future__ import annotations

import re
import time

import pytest

from softrdma.harness.lab import HOST_IP, guest_ip

PORTS = iter(range(18800, 18999))
#: on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
ON_BOTH_KERNELS = pytest.mark.kernels("6.1", "6.12")
# every bandwidth and atomic case (not the latency ones: the same opcodes again)
ON_BOTH = {"write_bw", "read_bw", "send_bw", "atomic_fetch_add", "atomic_cmp_swap"}
ON_BOTH_CM = {"send_bw", "read_bw"}  # -R: the rdma_cm exchange, one SEND and one READ

# (name, perftest command, softrdma command, result row size and iterations)
CASES = [
    ("write_bw", "ib_write_bw -x 1 -n 50 -s 8192 -F", "softrdma perf write -n 50 -s 8192", 8192, 50),
    ("read_bw", "ib_read_bw -x 1 -n 50 -s 8192 -F", "softrdma perf read -n 50 -s 8192", 8192, 50),
    ("send_bw", "ib_send_bw -x 1 -n 50 -s 3000 -F", "softrdma perf send -n 50 -s 3000", 3000, 50),
    ("atomic_fetch_add", "ib_atomic_bw -x 1 -n 50 -A FETCH_AND_ADD -F",
     "softrdma perf atomic -n 50 -A FETCH_AND_ADD", 8, 50),
    ("atomic_cmp_swap", "ib_atomic_bw -x 1 -n 50 -A CMP_AND_SWAP -F",
     "softrdma perf atomic -n 50 -A CMP_AND_SWAP", 8, 50),
    ("send_lat_inline", "ib_send_lat -x 1 -n 50 -s 64 -I 64 -F",
     "softrdma perf send --lat -n 50 -s 64 -I 64", 64, 50),
    ("write_lat", "ib_write_lat -x 1 -n 50 -s 64 -F", "softrdma perf write --lat -n 50 -s 64", 64, 50),
    ("read_lat", "ib_read_lat -x 1 -n 50 -s 64 -F", "softrdma perf read --lat -n 50 -s 64", 64, 50),
]
# perftest's result row. Its latency columns can read "inf"/"-nan" inside a TCG guest, where
# it measures the CPU frequency as 0 (-F ignores that); the row must still be there with
# the right size and iteration count.
_NUM = r"(?:[\d.]+|inf|-?nan)"
ROW = re.compile(rf"^\s*(\d+)\s+(\d+)\s+{_NUM}\s+{_NUM}", re.M)


def run_case(lab, rxe, soft, softrdma_is_server, env=None):
    port = next(PORTS)
    if softrdma_is_server:
        p = lab.host_start(f"{soft} -p {port} --addr {HOST_IP}", env=env)
        try:
            time.sleep(1.5)
            g = lab.guest(0, f"timeout 120 {rxe} -p {port} {HOST_IP}", timeout=140)
            out, err = p.communicate(timeout=140)
        finally:
            if p.poll() is None:  # never leave a server holding UDP 4791 for the next test
                p.kill()
                p.communicate()
        return (p.returncode, out, err), (g.rc, g.stdout, g.stderr)
    job = lab.guest_start(0, f"timeout 120 {rxe} -p {port}")
    time.sleep(1.5)
    r = lab.host(f"{soft} -p {port} --addr {HOST_IP} {guest_ip(0)}", timeout=140, env=env)
    g = job.wait(140)
    return (r.rc, r.stdout, r.stderr), (g.rc, g.stdout, g.stderr)


# perftest's RDMA-read latency server only serves; its client reports
SERVER_SILENT = {"read_lat"}


def check(soft, rxe, size, iters, name="", softrdma_is_server=False):
    (src, sout, serr), (rrc, rout, rerr) = soft, rxe
    assert src == 0, f"softrdma failed:\n{serr}\n{sout}"
    assert rrc == 0, f"perftest failed:\n{rerr}\n{rout}"
    reporting = [sout, rout]
    if name in SERVER_SILENT:
        reporting = [rout] if softrdma_is_server else [sout]
    for out in reporting:
        rows = ROW.findall(out)
        assert rows, out
        assert (int(rows[-1][0]), int(rows[-1][1])) == (size, iters), out


@pytest.mark.parametrize("role", ["softrdma-server", "softrdma-client"])
@pytest.mark.parametrize("name,rxe,soft,size,iters",
                         [pytest.param(*c, marks=ON_BOTH_KERNELS) if c[0] in ON_BOTH else c
                          for c in CASES], ids=[c[0] for c in CASES])
def test_perftest(scenario, name, rxe, soft, size, iters, role):
    soft_res, rxe_res = run_case(scenario, rxe, soft, role == "softrdma-server")
    check(soft_res, rxe_res, size, iters, name, role == "softrdma-server")


@pytest.mark.kernels("6.1", "6.12")
@pytest.mark.parametrize("role", ["softrdma-server", "softrdma-client"])
@pytest.mark.parametrize("name,rxe,soft,size,iters", [c for c in CASES if c[0] in ("write_bw", "read_bw")],
                         ids=["write_bw", "read_bw"])
def test_perftest_with_loss(scenario, name, rxe, soft, size, iters, role):
    """5 % loss both ways: netem in the guest, softrdma's own injection on its side."""
    assert scenario.netem(0, "loss 5%").ok
    soft_res, rxe_res = run_case(scenario, rxe, soft, role == "softrdma-server",
                                 env={"SOFTRDMA_TX_LOSS": "0.05"})
    check(soft_res, rxe_res, size, iters, name, role == "softrdma-server")


# -R: the exchange over an rdma_cm connection and the test's QPs connected by rdma_cm
# (no GID index: rdma_cm picks the GID from the IP address)
CM_CASES = [
    ("send_bw", "ib_send_bw -R -n 100 -s 3000 -F", "softrdma perf send -R -n 100 -s 3000",
     3000, 100),
    ("write_bw", "ib_write_bw -R -n 100 -s 8192 -F", "softrdma perf write -R -n 100 -s 8192",
     8192, 100),
    ("read_bw", "ib_read_bw -R -n 100 -s 8192 -F", "softrdma perf read -R -n 100 -s 8192",
     8192, 100),
    ("atomic_fetch_add", "ib_atomic_bw -R -n 50 -F", "softrdma perf atomic -R -n 50", 8, 50),
    ("send_lat_inline", "ib_send_lat -R -n 50 -s 64 -I 64 -F",
     "softrdma perf send --lat -R -n 50 -s 64 -I 64", 64, 50),
    ("write_lat", "ib_write_lat -R -n 50 -s 64 -F", "softrdma perf write --lat -R -n 50 -s 64",
     64, 50),
    ("read_lat", "ib_read_lat -R -n 50 -s 64 -F", "softrdma perf read --lat -R -n 50 -s 64",
     64, 50),
]


@pytest.mark.parametrize("role", ["softrdma-server", "softrdma-client"])
@pytest.mark.parametrize("name,rxe,soft,size,iters",
                         [pytest.param(*c, marks=ON_BOTH_KERNELS) if c[0] in ON_BOTH_CM else c
                          for c in CM_CASES], ids=[c[0] for c in CM_CASES])
def test_perftest_rdma_cm(scenario, name, rxe, soft, size, iters, role):
    soft_res, rxe_res = run_case(scenario, rxe, soft, role == "softrdma-server")
    check(soft_res, rxe_res, size, iters, name, role == "softrdma-server")
    for out in (soft_res[1], rxe_res[1]):
        assert "rdma_cm QPs\t : ON" in out and "Data ex. method : rdma_cm" in out, out
