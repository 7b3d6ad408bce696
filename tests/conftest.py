"""Shared test helpers.

``require_tool`` is the only way a test may depend on an external program: locally a
missing tool skips with one line naming it; under CI (``CI=true``) it fails, so CI can never
silently skip a check.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
PCAPS = ROOT / "pcaps" / "linux-rxe"
RXE_PCAPS = sorted(PCAPS.rglob("*.pcap"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (apt-get install {name}; scripts/setup installs it)"
        if IN_CI:
            pytest.fail(f"CI=true and a prerequisite is missing: {msg}")
        pytest.skip(msg)
    return path


def wait_until(cond: Callable[[], Any], timeout: float = 10.0) -> bool:
    """Poll ``cond`` (every millisecond) until it is true or ``timeout`` seconds pass;
    whether it became true. For live devices, whose progress threads work meanwhile."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


@pytest.fixture(scope="session")
def exec_library():
    """softrdma exec's preload library, built once for the session, before two launchers
    of a test would both build it (the exec test files use it: ``pytestmark``)."""
    from softrdma.exec.build import library_path
    return library_path()


@pytest.fixture
def live_device():
    """A factory of live soft devices on loopback: ``live_device(ip, name)`` registers
    one (its progress thread on); each is removed after the test, retried while the
    test's ids and sockets close."""
    from softrdma.verbs_api.device import add_device, remove_device
    made: list[str] = []

    def make(ip: str, name: str) -> Any:
        made.append(name)
        return add_device(ip, name=name)
    yield make
    for name in made:
        for _ in range(100):
            try:
                remove_device(name)
                break
            except Exception:
                time.sleep(0.05)


@pytest.fixture
def udp_devices():
    """A factory of live soft devices on UDP: ``udp_devices(ip, name, **attach_udp_kw)``;
    each is detached and unregistered after the test."""
    from softrdma.verbs_api.device import add_device, unregister_device
    made = []

    def make(ip: str, name: str, **kw: Any) -> Any:
        d = add_device(ip, name=name)
        d.attach_udp(**kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.detach()
        unregister_device(d.name)


@pytest.fixture(scope="module", params=["packets", "trains"])
def link_mode(request):
    """For a module that imports ``SimNetwork`` and uses this fixture
    (``pytestmark = pytest.mark.usefixtures("link_mode")``): every test of the module
    twice, packet by packet, then with the link carrying trains as UDP GSO/GRO do (``SimNetwork(trains=True)``: the train coalescing, the IPv4
    ICRC fix-up and the receive path's train shortcuts)."""
    mod = request.module
    plain = mod.SimNetwork
    if request.param == "trains":
        mod.SimNetwork = functools.partial(plain, trains=True)
    yield request.param
    mod.SimNetwork = plain
