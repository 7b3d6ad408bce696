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


def _boot(kernel: str | None):
    miss = missing_prerequisites(kernel)
    if miss:
        msg = "rxe interop lab prerequisites missing: " + ", ".join(miss)
        if IN_CI:
            pytest.fail("CI=true and " + msg)
        pytest.skip(msg)
    try:
        return Lab(guests=2, kernel=kernel)
    except LabUnavailable as e:
        if IN_CI:
            pytest.fail(f"CI=true and the lab did not start: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def lab():
    """Two guests on the default kernel (Debian 12's 6.1, or ``$SOFTRDMA_LAB_KERNEL``)."""
    lb = _boot(None)
    yield lb
    lb.close()


@pytest.fixture(scope="session")
def lab612():
    """Two guests on Linux 6.12 (rxe with ATOMIC WRITE and FLUSH)."""
    lb = _boot("6.12")
    yield lb
    lb.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item._interop_failed = rep.failed


def _scenario(lab, request, tmp_path):
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


@pytest.fixture
def scenario(lab, request, tmp_path):
    """Capture the scenario's RoCE traffic; keep the pcap if the test fails; undo netem and
    kill what the scenario left running on either side."""
    yield from _scenario(lab, request, tmp_path)


@pytest.fixture
def scenario612(lab612, request, tmp_path):
    """:func:`scenario` on the Linux 6.12 lab."""
    yield from _scenario(lab612, request, tmp_path)


# ---- loss that spares the last goodbye ---------------------------------------------

# 5 % loss, both ways, of every RoCE packet but the CM's DREQ and DREP, all set up in guest
# 0 (the host's kernel has no netem): netem on its NIC's egress (what rxe sends) and on
# ifb0, where its NIC's ingress (what softrdma sends) is redirected, each under a prio qdisc
# whose first band, without netem, takes what a u32 filter finds to be a DREQ or DREP (MAD
# attribute 0x0015/0x0016 at byte 64 of the IP packet: IPv4 20 + UDP 8 + BTH 12 + DETH 8
# + 16 into the MAD header). Every other CM MAD (REQ, REP, RTU) may be lost and is retried.
# Why spare those two: both tools end with a process sending its last disconnect message and
# exiting. rping's client sends its DREQ and exits, and destroying the id cancels the DREQ's
# retransmissions (in the kernel's CM as in softrdma's), so with that one packet lost the
# server waits for a DISCONNECTED that never comes: rping between two kernel rxe hosts hangs
# the same way. ucmatose's client answers the server's DREQs and exits; the kernel's CM
# outlives the process and answers a retransmitted DREQ, softrdma's CM goes with the
# process, so a lost DREP leaves ucmatose's server retrying its DREQ until it gives up
# (~70 s, then it passes; docs/notes-rdmacm-lab.md).
_PRIO_LOSS = ("tc qdisc replace dev {dev} root handle 1: prio bands 3 priomap "
              "1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 && "
              "tc qdisc add dev {dev} parent 1:2 handle 20: netem loss 5% && "
              "tc filter add dev {dev} parent 1: protocol ip prio 1 u32 "
              "match ip protocol 17 0xff match ip dport 4791 0xffff "
              "match u16 0x0015 0xffff at 64 flowid 1:1 && "
              "tc filter add dev {dev} parent 1: protocol ip prio 2 u32 "
              "match ip protocol 17 0xff match ip dport 4791 0xffff "
              "match u16 0x0016 0xffff at 64 flowid 1:1")


@pytest.fixture
def lossy(scenario):
    """5 % loss both ways but for DREQ and DREP (above); undone afterwards (the scenario
    fixture removes the NIC's root qdisc)."""
    lab = scenario
    nic = lab.nics[0]
    r = lab.guest(0, " && ".join([
        "modprobe ifb numifbs=0", "ip link add ifb0 type ifb", "ip link set ifb0 up",
        f"tc qdisc add dev {nic} handle ffff: ingress",
        f"tc filter add dev {nic} parent ffff: protocol ip u32 match ip dport 4791 0xffff "
        "action mirred egress redirect dev ifb0",
        _PRIO_LOSS.format(dev=nic), _PRIO_LOSS.format(dev="ifb0")]))
    try:
        assert r.ok, r.stderr
        yield lab
        # still in place both ways (how many were dropped is chance: not asserted)
        stats = lab.guest(0, f"tc -s qdisc show dev {nic}; tc -s qdisc show dev ifb0").stdout
        print(stats)
        assert stats.count("qdisc netem 20:") == 2, stats
    finally:
        lab.guest(0, f"tc qdisc del dev {nic} ingress 2>/dev/null; "
                     "ip link del ifb0 2>/dev/null; true")
