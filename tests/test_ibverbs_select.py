"""Choosing the backend: soft devices first, libibverbs devices beside them, forced by
SOFTRDMA_BACKEND or set_backend; a machine without libibverbs or devices sees only soft
devices, silently; ``soft`` never loads libibverbs. And what a context's backend picks:
the implementation each verbs_api object holds, its class staying the same."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from softrdma import verbs_api as v
from softrdma.ibverbs import devices, ffi

HW = devices.list_devices()
no_devices = pytest.mark.skipif(bool(HW), reason="this machine has libibverbs devices")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: val for k, val in os.environ.items() if k != "SOFTRDMA_BACKEND"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=e, timeout=120)


@pytest.fixture
def backend():
    yield v.set_backend
    v.set_backend(None)


def test_soft_never_loads_libibverbs():
    r = _run("import sys\n"
             "from softrdma.verbs_api import Context, PD, get_device_list, PyverbsRDMAError\n"
             "names = [d.name for d in get_device_list()]\n"
             "with Context() as c: PD(c)\n"
             "try: Context(name='rxe0')\n"
             "except PyverbsRDMAError as e: assert e.error_code == 19, e\n"
             "maps = open('/proc/self/maps').read()\n"
             "print(names, 'libibverbs' in maps,\n"
             "      [m for m in sys.modules if m.startswith('softrdma.ibverbs')])\n",
             SOFTRDMA_BACKEND="soft", SOFTRDMA_PROGRESS="manual")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[b'softrdma0'] False []", r.stdout


@no_devices
def test_auto_on_a_machine_without_devices_is_soft_and_silent():
    r = _run("from softrdma.verbs_api import Context, get_device_list\n"
             "assert [d.name for d in get_device_list()] == [b'softrdma0']\n"
             "with Context() as c: assert c.name == 'softrdma0'\n",
             SOFTRDMA_PROGRESS="manual")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


@no_devices
def test_ibverbs_forced_without_devices_is_enodev_naming_why(backend):
    backend("ibverbs")
    assert v.get_device_list() == []
    for name in (None, "rxe0"):
        with pytest.raises(v.PyverbsRDMAError) as e:
            v.Context(name=name)
        assert e.value.error_code == errno.ENODEV
        assert "backend is ibverbs" in str(e.value)
        assert "no RDMA device" in str(e.value) or "cannot be loaded" in str(e.value)


def test_without_the_library(backend, monkeypatch):
    ffi.reset("libibverbs-absent.so.99")
    try:
        assert ffi.lib() is None and "cannot be loaded" in ffi.load_error()
        assert devices.list_devices() == []
        backend("auto")
        from softrdma.verbs_api.device import soft_devices
        assert [d.name for d in v.get_device_list()] == [d.name.encode() for d in soft_devices()]
        with pytest.raises(v.PyverbsRDMAError) as e:
            v.Context(name="rxe0")  # not soft, not found: the soft "no such device"
        assert e.value.error_code == errno.ENODEV
        backend("ibverbs")
        with pytest.raises(v.PyverbsRDMAError) as e:
            v.Context()
        assert e.value.error_code == errno.ENODEV and "libibverbs-absent" in str(e.value)
    finally:
        ffi.reset()


def test_bad_backend_names(backend, monkeypatch):
    with pytest.raises(v.PyverbsRDMAError) as e:
        backend("hardware")
    assert e.value.error_code == errno.EINVAL
    backend(None)
    monkeypatch.setenv("SOFTRDMA_BACKEND", "rdma")
    with pytest.raises(v.PyverbsRDMAError) as e:
        v.get_backend()
    assert e.value.error_code == errno.EINVAL and "SOFTRDMA_BACKEND" in str(e.value)
    monkeypatch.setenv("SOFTRDMA_BACKEND", "Soft")
    assert v.get_backend() == "soft"


def test_no_object_is_a_variant():
    from softrdma.pyverbs_compat import device as pdev, qp as pqp
    # every object, the context too, is one class on both backends; the backend is the
    # implementation it holds, so no subclass of it mixes in libibverbs
    for cls in (v.Context, v.PD, v.MR, v.MW, v.CQ, v.CompChannel, v.SRQ, v.AH, v.QP,
                pqp.QPEx, pdev.Context):
        assert not any(k.__module__.startswith("softrdma.ibverbs") for k in cls.__mro__), cls


def test_the_context_picks_each_objects_implementation():
    from softrdma.ibverbs.objects import BACKEND
    from softrdma.verbs_api import soft_qp
    from softrdma.verbs_api.base import Backend
    from softrdma.verbs_api.pd import SoftPD
    made = []

    class FakeImpl:  # stands in for a hardware implementation
        extras = frozenset()

        def __init__(self, owner, *args):
            made.append((type(owner).__name__, args))

    fake = Backend("fake", **{k: FakeImpl for k in ("PD", "MR", "MW", "CompChannel", "CQ",
                                                      "AH", "SRQ", "QP")})
    with v.Context(name=None) as ctx:  # soft: the soft implementations
        assert type(v.PD(ctx).impl) is SoftPD and ctx.backend.QP is soft_qp.SoftQP
        ctx.backend = fake  # (an instance attribute: this context only)
        pd = v.PD(ctx)
        assert type(pd) is v.PD and type(pd.impl) is FakeImpl and made == [("PD", ())]
        pd.close = lambda: None  # FakeImpl cannot be destroyed
        ctx.children.pop(pd)
    assert BACKEND.name == "ibverbs" and BACKEND.QP.__name__ == "HwQP"
