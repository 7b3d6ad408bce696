"""Choosing the backend: soft devices first, libibverbs devices beside them, forced by
SOFTRDMA_BACKEND or set_backend; a machine without libibverbs or devices sees only soft
devices, silently; ``soft`` never loads libibverbs. And the dispatch: a hardware parent
makes the verbs_api class (or a subclass, such as pyverbs-compat's) take its hardware
variant, below the subclass in the MRO."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from softrdma import verbs_api as v
from softrdma.ibverbs import devices, dispatch, ffi

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


def test_variants_sit_between_the_subclass_and_the_verbs_api_class():
    from softrdma.ibverbs import objects as o
    from softrdma.pyverbs_compat import cq as pcq, pd as ppd, qp as pqp
    names = [k.__name__ for k in dispatch.variant(ppd.PD).__mro__]
    assert names == ["PD", "PD", "CascadeClose", "HwPD", "PD", "Resource", "object"]
    assert dispatch.variant(v.PD).__mro__[1] is o.HwPD
    assert dispatch.variant(v.PD).__name__ == "PD"
    assert dispatch.variant(pcq.CQ).__mro__[3] is o.HwCQ
    assert dispatch.variant(ppd.PD) is dispatch.variant(ppd.PD)  # made once
    for cls in (v.Context, v.PD, v.MR, v.MW, v.CQ, v.CompChannel, v.SRQ, v.AH):
        assert issubclass(dispatch.variant(cls), cls)
    # a QP is one class on both backends; the backend is the implementation it holds
    assert pqp.QPEx.__mro__[1:3] == (pqp.QP, pqp.CascadeClose) and v.QP in pqp.QPEx.__mro__
    assert not any(k.__module__.startswith("softrdma.ibverbs") for k in pqp.QPEx.__mro__)


def test_a_hardware_parent_picks_the_variant_a_soft_one_does_not():
    made = []

    class FakeHwPD(v.PD):
        def __init__(self, parent):  # stands in for the hardware __init__
            made.append(parent)

    class Parent:
        _hw_variant = staticmethod(lambda cls: FakeHwPD)

    p = Parent()
    pd = v.PD(p)
    assert type(pd) is FakeHwPD and isinstance(pd, v.PD) and made == [p]
    with v.Context(name=None) as ctx:  # soft: the class itself
        assert type(v.PD(ctx)) is v.PD
