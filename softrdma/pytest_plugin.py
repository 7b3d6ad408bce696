"""softrdma's pytest plugin: protocol tests against softrdma, on a simulated network, over
real UDP, against real captures and against kernel rxe. Installing softrdma registers it
(the ``pytest11`` entry point); docs/testing.md is the guide.

Fixtures:

- ``softrdma_seed``: this test's seed (``--softrdma-seed N``, default 0, or
  ``@pytest.mark.softrdma_seed(N)``); shown in the header and in a failed test's report.
- ``sim_network(**link) -> SimNetwork``: a factory of seeded simulated networks (``loss``,
  ``duplicate``, ``reorder``, ``corrupt``, ``delay``, ``jitter``, ``reorder_delay``).
- ``qp_pair(qp_type="RC", transport="sim", **kw) -> QpPair``: two connected endpoints.
- ``soft_device``: a live soft device on a free loopback address.
- ``softrdma_replay``: ``.assert_matches(pcap, ip, **kw)``, a capture replay that fails
  with a field-by-field diff.
- ``rxe_lab``: (session) real Linux rxe in a VM, or one line saying what is missing.
- ``softrdma_capture``: the packet tap behind ``--softrdma-keep-captures DIR``.

Loading this module must stay cheap for every pytest run on a machine with softrdma
installed: it imports pytest and the standard library only; each fixture imports the stack
when a test asks for it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

DEFAULT_SEED = 0
_REPORTS = pytest.StashKey[dict]()  # item -> {"setup"|"call"|"teardown": TestReport}


# -- options, markers, header ----------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("softrdma", "softrdma protocol-test fixtures")
    g.addoption("--softrdma-seed", type=int, default=None, metavar="N",
                help=f"seed of softrdma's simulated networks and devices (default "
                     f"{DEFAULT_SEED}); a failed test's report names the one it ran with")
    g.addoption("--softrdma-keep-captures", default=None, metavar="DIR",
                help="for each failed test, write what the softrdma fixtures' devices sent "
                     "and received to DIR/<test id>.pcap")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "softrdma_seed(n): run this test with softrdma seed n (overrides "
                   "--softrdma-seed)")


def pytest_report_header(config: pytest.Config) -> str:
    return f"softrdma: seed {_session_seed(config)} (--softrdma-seed N to change)"


def _session_seed(config: pytest.Config) -> int:
    seed = config.getoption("--softrdma-seed", None)
    return DEFAULT_SEED if seed is None else seed


def _seed_of(item: pytest.Item) -> int:
    m = item.get_closest_marker("softrdma_seed")
    return int(m.args[0]) if m is not None and m.args else _session_seed(item.config)


def _capture_path(item: pytest.Item) -> Path | None:
    keep = item.config.getoption("--softrdma-keep-captures", None)
    if not keep:
        return None
    return Path(keep) / (re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid).strip("_") + ".pcap")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    item.stash.setdefault(_REPORTS, {})[rep.when] = rep
    names = getattr(item, "fixturenames", ())
    if rep.failed and rep.when in ("setup", "call") and "softrdma_seed" in names:
        seed = _seed_of(item)
        text = f"seed {seed}: rerun with --softrdma-seed {seed}" \
            if item.get_closest_marker("softrdma_seed") is None else \
            f"seed {seed}, pinned by @pytest.mark.softrdma_seed"
        path = _capture_path(item)
        if path is not None and "softrdma_capture" in names:
            text += f"\ncapture of the test's packets: {path}"
        rep.sections.append(("softrdma", text))


def _failed(item: pytest.Item) -> bool:
    return any(r.failed for r in item.stash.get(_REPORTS, {}).values())


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture
def softrdma_seed(request: pytest.FixtureRequest) -> int:
    """The seed of this test's simulated networks and devices: ``--softrdma-seed N``
    (default 0, so a run is the same every time), or ``@pytest.mark.softrdma_seed(N)``."""
    return _seed_of(request.node)


@pytest.fixture
def softrdma_capture(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The :class:`~softrdma.harness.fixtures.PacketTap` the other fixtures' devices record
    into when ``--softrdma-keep-captures DIR`` is given (None otherwise: nothing recorded).
    If the test fails, its packets are written to ``DIR/<test id>.pcap``."""
    path = _capture_path(request.node)
    if path is None:
        yield None
        return
    from softrdma.harness.fixtures import PacketTap
    tap = PacketTap()
    yield tap
    if _failed(request.node):
        tap.write(path)


@pytest.fixture
def sim_network(softrdma_seed: int, softrdma_capture: Any) -> Iterator[Callable[..., Any]]:
    """A factory of simulated networks: ``net = sim_network(loss=0.05, reorder=0.1)``
    returns a :class:`~softrdma.harness.sim.SimNetwork` seeded with ``softrdma_seed``
    (``seed=`` overrides), whose link settings are ``loss``, ``duplicate``, ``reorder``,
    ``corrupt`` (probabilities), ``delay``, ``jitter``, ``reorder_delay`` (seconds).
    Every network made is closed (its devices unregistered) after the test."""
    from softrdma.harness.fixtures import TappedSimNetwork
    made: list[Any] = []

    def make(*, seed: int | None = None, **link: Any) -> Any:
        net = TappedSimNetwork(seed=softrdma_seed if seed is None else seed,
                               tap=softrdma_capture, **link)
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()


@pytest.fixture
def qp_pair(softrdma_seed: int, softrdma_capture: Any) -> Iterator[Callable[..., Any]]:
    """A factory of connected QP pairs: ``a, b = pair = qp_pair("RC")``.

    ``qp_pair(qp_type="RC", transport="sim", *, net=None, mr_size=1 << 20, cap=None,
    cqe=4096, psns=(100, 0xFFFFF0), mtu=1500, a_attrs=None, b_attrs=None, **link)``:
    ``qp_type`` is ``"RC"``, ``"UC"`` or ``"UD"``; ``transport="sim"`` puts the pair on
    ``net`` (from ``sim_network``) or on a new network seeded with ``softrdma_seed`` with
    the ``link`` settings (``loss=0.05``); ``transport="udp"`` on two live devices bound to
    UDP 4791 on free loopback addresses. Returns a
    :class:`~softrdma.harness.fixtures.QpPair`: ``.a``, ``.b`` (Endpoints: ``post_send``,
    ``post_recv``, ``buf_sge``, ``ncomp``, ``cq``, ``mr``, ``qp``), ``.net`` (sim) and
    ``.run_until(cond, timeout)``. Everything is closed after the test."""
    from softrdma.harness.fixtures import make_pair
    made: list[Any] = []

    def make(qp_type: str = "RC", transport: str = "sim", **kw: Any) -> Any:
        kw.setdefault("seed", softrdma_seed + len(made))
        pair = make_pair(qp_type, transport, tap=softrdma_capture, **kw)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


@pytest.fixture
def soft_device(softrdma_seed: int, softrdma_capture: Any) -> Iterator[Any]:
    """A live :class:`~softrdma.soft.device.SoftDevice` bound to UDP 4791 on a free loopback
    address (``.name``, ``.ip``): open it with ``Context(name=soft_device.name)``. Stopped
    and unregistered after the test, whatever contexts are left open."""
    from softrdma.harness.fixtures import close_device, live_device
    dev, ctx = live_device(seed=softrdma_seed, tap=softrdma_capture)
    yield dev
    close_device(dev, ctx)


@pytest.fixture
def softrdma_replay() -> Any:
    """``softrdma_replay.assert_matches("linux-rxe/rc_pingpong.pcap", "10.77.0.11")``:
    replay a real capture with softrdma as one endpoint; a difference fails with a readable
    diff (:class:`~softrdma.harness.fixtures.Replay`; ``.run(pcap, ip)`` returns the diff).
    ``pcap`` is a path, or the name of a capture installed with softrdma
    (:mod:`softrdma.data`), so a test needs no source checkout."""
    from softrdma.harness.fixtures import Replay
    return Replay()


@pytest.fixture(scope="session")
def rxe_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A :class:`softrdma.harness.lab.Lab` with one guest: real Linux rxe (``rxe0`` at
    10.77.0.11) in a VM beside softrdma (10.77.0.1). Booted once per session. Without its
    prerequisites the test skips with one line naming them (fails when ``CI=true``)."""
    from softrdma.harness import lab as labmod
    miss = labmod.missing_prerequisites()
    if miss:
        _lab_unavailable(f"rxe_lab needs {', '.join(miss)}: install them with "
                         "scripts/setup (root; see docs/lab.md, 'Prerequisites')")
    try:
        lab = labmod.Lab(guests=1, workdir=str(tmp_path_factory.mktemp("rxe-lab")))
    except labmod.LabUnavailable as e:
        _lab_unavailable(f"rxe_lab did not start: {e}")
    yield lab
    lab.close()


def _lab_unavailable(msg: str) -> None:
    # softrdma's rule for prerequisites: skip locally, fail under CI so it never goes unseen
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {msg}", pytrace=False)
    pytest.skip(msg)
