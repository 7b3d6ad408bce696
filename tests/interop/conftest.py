"""Session fixture: one lab of real Linux rxe peers (softrdma.harness.lab) for all interop tests.

The lab has two guests: softrdma's scenarios use guest 0; guest 1 is the second kernel rxe
peer of the rxe-to-rxe rdma_cm runs (test_rdmacm_lab.py). They boot in parallel.

Missing prerequisites skip these tests locally with one line naming them, and fail under
CI=true. Each test that fails keeps a pcap of its traffic in tests/interop/failed-pcaps/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from softrdma.harness.lab import Lab, LabUnavailable, missing_prerequisites

from ..conftest import IN_CI

FAILED = Path(__file__).parent / "failed-pcaps"


@pytest.fixture(scope="session")
def lab():
    miss = missing_prerequisites()
    if miss:
        msg = "rxe interop lab prerequisites missing: " + ", ".join(miss)
        if IN_CI:
            pytest.fail("CI=true and " + msg)
        pytest.skip(msg)
    try:
        lb = Lab(guests=2)
    except LabUnavailable as e:
        if IN_CI:
            pytest.fail(f"CI=true and the lab did not start: {e}")
        pytest.skip(str(e))
    yield lb
    lb.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item._interop_failed = rep.failed


@pytest.fixture
def scenario(lab, request, tmp_path):
    """Capture the scenario's RoCE traffic; keep the pcap if the test fails; undo netem and
    kill what the scenario left running on either side."""
    pcap = tmp_path / f"{request.node.name}.pcap"
    cap = lab.capture(pcap)
    yield lab
    cap.terminate()
    cap.wait(timeout=10)
    lab.netem_clear()
    lab.kill_guest_jobs()  # a guest server a failed scenario never collected
    lab.kill_host_procs()  # whatever a failed scenario left running on the softrdma side
    if getattr(request.node, "_interop_failed", False) and pcap.exists():
        FAILED.mkdir(exist_ok=True)
        shutil.copy(pcap, FAILED / pcap.name)
