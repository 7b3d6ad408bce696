"""The labs of real Linux rxe peers (softrdma.harness.lab) the interop tests run against.

Each lab has two guests: softrdma's scenarios use guest 0; guest 1 is the second kernel rxe
peer of the rxe-to-rxe rdma_cm runs (test_rdmacm_lab.py). They boot in parallel.

Two guest kernels: Debian 12's 6.1 (the default, ``$SOFTRDMA_LAB_KERNEL`` overrides it) and
6.12. A test runs on the default kernel; ``@pytest.mark.kernels("6.1", "6.12")`` runs it on
each (ids ``[6.1]``/``[6.12]``), and the ``lab612``/``scenario612`` fixtures ask for 6.12
alone. Which scenarios run on both, and why, is in docs/lab.md ("Two kernels in CI"): at
least one of every scenario class, and every scenario where the two kernels' rxe were seen
to behave differently.

One lab at a time: the interop tests are ordered by kernel at collection (the default
kernel's first, each group in file order), the first test that asks for another kernel closes
the lab it no longer needs before booting its own, and the last interop test closes the lab
that is left. So ordered, a lab kept up would never be used again; closing it leaves two
guests running instead of four, and none through the non-lab tests after this directory
(docs/lab.md, "Two kernels in CI"). A boot costs ~20-50 s, once per kernel either way.

Missing prerequisites skip these tests locally with one line naming them, and fail under
CI=true. Each test that fails keeps a pcap of its traffic in tests/interop/failed-pcaps/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from softrdma.harness.lab import Lab, LabUnavailable, kernel_choice, missing_prerequisites

from ..conftest import IN_CI

FAILED = Path(__file__).parent / "failed-pcaps"
HERE = Path(__file__).resolve().parent


def _unavailable(msg: str):
    if IN_CI:
        pytest.fail("CI=true and " + msg)
    pytest.skip(msg)


class Labs:
    """The session's labs by kernel, at most one running: :meth:`get` closes the others
    before it boots a new one. A kernel whose lab could not start is remembered, so the
    tests after the first fail (or skip) at once instead of each waiting for a boot."""

    def __init__(self) -> None:
        self.running: dict[str, Lab] = {}
        self.unavailable: dict[str, str] = {}

    def get(self, kernel: str) -> Lab:
        if kernel in self.running:
            return self.running[kernel]
        if kernel in self.unavailable:
            _unavailable(self.unavailable[kernel])
        self.close()
        miss = missing_prerequisites(kernel)
        if miss:
            self.unavailable[kernel] = ("rxe interop lab prerequisites missing: "
                                        + ", ".join(miss))
            _unavailable(self.unavailable[kernel])
        try:
            self.running[kernel] = Lab(guests=2, kernel=kernel)
        except LabUnavailable as e:
            self.unavailable[kernel] = f"the {kernel} lab did not start: {e}"
            _unavailable(self.unavailable[kernel])
        return self.running[kernel]

    def close(self) -> None:
        while self.running:
            self.running.popitem()[1].close()


_LABS = Labs()


@pytest.fixture(scope="session")
def labs():
    """The session's :class:`Labs` (closed at the end whatever happened)."""
    yield _LABS
    _LABS.close()


@pytest.fixture
def kernel(request) -> str:
    """The guest kernel of this test: its ``kernels`` parameter, else the default."""
    return getattr(request, "param", None) or kernel_choice()


@pytest.fixture
def lab(labs, kernel):
    """Two guests on this test's kernel (the default: Debian 12's 6.1, or
    ``$SOFTRDMA_LAB_KERNEL``; ``@pytest.mark.kernels(...)`` runs the test on each)."""
    return labs.get(kernel)


@pytest.fixture
def lab612(labs):
    """Two guests on Linux 6.12 (rxe with ATOMIC WRITE and FLUSH)."""
    return labs.get("6.12")


def pytest_configure(config):
    config.addinivalue_line("markers", "kernels(*series): run this interop test on each of "
                            "these guest kernels (tests/interop/conftest.py)")


def _marked_kernels(metafunc) -> list[str]:
    """Every kernel a ``kernels`` mark of this function names, on the function or on one of
    its ``pytest.param(..., marks=pytest.mark.kernels(...))`` parameter sets."""
    found = [k for m in metafunc.definition.iter_markers("kernels") for k in m.args]
    for m in metafunc.definition.iter_markers("parametrize"):
        values = m.args[1] if len(m.args) > 1 else m.kwargs.get("argvalues", ())
        for v in values:
            for pm in getattr(v, "marks", ()):
                if pm.name == "kernels":
                    found += list(pm.args)
    return found


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
    # a function with a kernels mark anywhere runs on the default kernel and every marked
    # one; pytest_collection_modifyitems then drops each item's kernels its marks leave out
    marked = _marked_kernels(metafunc)
    if marked and "kernel" in metafunc.fixturenames:
        series = list(dict.fromkeys([kernel_choice()] + marked))
        metafunc.parametrize("kernel", series, indirect=True, ids=series)


def item_kernel(item) -> str:
    """The kernel an interop item's lab runs (what the collection order groups by)."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "kernel" in callspec.params:
        return callspec.params["kernel"]
    names = getattr(item, "fixturenames", ())
    if "lab612" in names or "scenario612" in names:
        return "6.12"
    return kernel_choice()


def _is_interop(item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def _wanted(item) -> bool:
    """False for an item parametrized onto a kernel its own marks do not name."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "kernel" not in callspec.params:
        return True
    mark = item.get_closest_marker("kernels")
    allowed = mark.args if mark is not None else (kernel_choice(),)
    return callspec.params["kernel"] in allowed


def pytest_collection_modifyitems(config, items):
    dropped = [it for it in items if _is_interop(it) and not _wanted(it)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if not (_is_interop(it) and not _wanted(it))]
    # the interop items, in place among the others, grouped by kernel: the default first
    idx = [i for i, it in enumerate(items) if _is_interop(it)]
    first = kernel_choice()
    ordered = sorted((items[i] for i in idx), key=lambda it: item_kernel(it) != first)
    for i, it in zip(idx, ordered):
        items[i] = it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the fixtures' teardown (scenario's cleanup) first, on a running lab
    if nextitem is None or not _is_interop(nextitem):
        _LABS.close()


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
