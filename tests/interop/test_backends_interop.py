"""One program, two backends: softrdma's ibverbs backend on kernel rxe in the guest talks to
softrdma's soft backend on the host, and the Python path's cost on rxe beside pyverbs and
ib_write_bw.

tests/programs/verbs_peer.py is a plain softrdma.verbs_api program; only its ``-d`` differs
between the two sides (``rxe0`` in the guest, forced onto the ibverbs backend with
SOFTRDMA_BACKEND=ibverbs, so the test cannot pass on a soft device by accident;
``softrdma0`` on the host at the lab address). RC SEND with immediate, RDMA WRITE, RDMA READ
and a UD datagram go both ways and each side checks what it received.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from softrdma.harness.lab import HOST_IP, Result, guest_ip

ROOT = Path(__file__).resolve().parents[2]
PROG = ROOT / "tests" / "programs" / "verbs_peer.py"
PYTHON = ROOT / ".venv" / "bin" / "python"
GUEST_ENV = "env PYTHONDONTWRITEBYTECODE=1 SOFTRDMA_BACKEND=ibverbs"
PORTS = iter(range(19700, 19799))


@pytest.mark.kernels("6.1", "6.12")
@pytest.mark.parametrize("guest_role", ["server", "client"])
def test_one_program_on_rxe_through_ctypes_and_on_the_soft_device(scenario, guest_role):
    lab = scenario
    port = next(PORTS)
    guest = f"cd /tmp && {GUEST_ENV} timeout 150 {PYTHON} {PROG} -d rxe0 -g 1"
    host = [str(PYTHON), str(PROG), "-d", "softrdma0", "-g", "1"]
    env = {"SOFTRDMA_IP": HOST_IP}
    if guest_role == "server":
        job = lab.guest_start(0, f"{guest} server {port}")
        time.sleep(1.0)
        h = lab.host(host + ["client", guest_ip(0), str(port)], timeout=170, env=env)
        g = job.wait(timeout=170)
    else:
        srv = lab.host_start(host + ["server", str(port)], env=env)
        try:
            time.sleep(1.0)
            g = lab.guest(0, f"{guest} client {HOST_IP} {port}", timeout=170)
            out, err = srv.communicate(timeout=170)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.communicate()
        h = Result(srv.returncode, out, err)
    assert g.rc == 0 and f"verbs_peer ok: {guest_role} on rxe0" in g.stdout, \
        f"guest: {g.stdout}\n{g.stderr}"
    host_role = "client" if guest_role == "server" else "server"
    assert h.rc == 0 and f"verbs_peer ok: {host_role} on softrdma0" in h.stdout, \
        f"host: {h.stdout}\n{h.stderr}"


def test_bench_verbs_on_rxe_prints_all_three_paths(lab):
    """softrdma bench verbs -d rxe0 in the guest: the softrdma row (the ibverbs backend via
    ``softrdma run`` and the pyverbs layer), Debian's pyverbs and ib_write_bw, each with a
    number; the table is printed for the log (-s shows it)."""
    r = lab.guest(0, f"cd /tmp && env PYTHONDONTWRITEBYTECODE=1 timeout 600 {PYTHON} -m "
                     f"softrdma bench verbs -d rxe0 --small-iters 1000 --big-iters 100",
                  timeout=620)
    print(r.stdout)
    assert r.rc == 0, r.stdout + r.stderr
    rows = {line[:34].strip(): line[34:] for line in r.stdout.splitlines()
            if line.startswith(("ib_write_bw", "pyverbs", "softrdma"))}
    assert set(rows) == {"ib_write_bw (perftest, C)", "pyverbs (Cython)",
                         "softrdma (libibverbs via ctypes)"}, r.stdout
    for name, cells in rows.items():
        nums = re.findall(r"([\d,]+(?:\.\d+)?)(?: \([\d.]+x\))?", cells)
        assert len(nums) == 2 and all(float(n.replace(",", "")) > 0 for n in nums), \
            (name, cells)
