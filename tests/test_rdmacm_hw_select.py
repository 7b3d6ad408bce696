"""Which backend rdma_cm runs on (softrdma.ibverbs.cma_select), without a device: the soft
backend never loads librdmacm or the hardware modules; ``ibverbs`` makes every channel
librdmacm's (on a machine without /dev/infiniband/rdma_cm: ENODEV, not a soft channel);
``auto`` keeps channels soft and takes the device for an AddrInfo whose address a kernel
RDMA device holds, read from sysfs. tests/hw/test_rdmacm_hw.py runs the same on rxe0."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from softrdma.ibverbs import cma_select
from softrdma.rdmacm import RAI_PASSIVE, AddrInfo, CMEventChannel, CMID
from softrdma.rdmacm import cmid as soft_cmid
from softrdma.verbs_api import PyverbsRDMAError, set_backend

from .conftest import ROOT

HAS_RDMA_CM = os.path.exists("/dev/infiniband/rdma_cm")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "SOFTRDMA_BACKEND"}
    e.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=e, timeout=120)


@pytest.fixture
def backend():
    yield set_backend
    set_backend(None)


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    """A fake /sys/class/infiniband with rxe0 holding 10.77.0.11 at GID index 1."""
    gids = tmp_path / "rxe0" / "ports" / "1" / "gids"
    gids.mkdir(parents=True)
    (gids / "0").write_text("fe80:0000:0000:0000:5054:00ff:fe00:0011\n")
    (gids / "1").write_text("0000:0000:0000:0000:0000:ffff:0a4d:000b\n")
    (gids / "2").write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
    monkeypatch.setattr(cma_select, "SYSFS_GIDS", str(tmp_path / "*/ports/*/gids/*"))
    return tmp_path


def test_soft_never_loads_librdmacm_or_the_hardware_modules():
    r = _run("import sys\n"
             "from softrdma.rdmacm import CMEventChannel, CMID, AddrInfo, RAI_PASSIVE\n"
             "ch = CMEventChannel(); CMID(ch).close(); ch.close()\n"
             "try: CMID(AddrInfo(src='10.77.0.11', flags=RAI_PASSIVE))\n"
             "except Exception as e: assert 'no RDMA device' in str(e), e\n"
             "print('librdmacm' in open('/proc/self/maps').read(),\n"
             "      [m for m in sys.modules if m.startswith('softrdma.ibverbs')])\n",
             SOFTRDMA_BACKEND="soft", SOFTRDMA_PROGRESS="manual")
    assert r.stdout.strip() == "False []", (r.stdout, r.stderr[-2000:])


@pytest.mark.skipif(HAS_RDMA_CM, reason="this machine has /dev/infiniband/rdma_cm")
def test_forced_ibverbs_channel_is_librdmacms_and_says_why_it_cannot_be(backend):
    backend("ibverbs")
    with pytest.raises(PyverbsRDMAError) as ei:
        CMEventChannel()
    assert ei.value.error_code == errno.ENODEV and "rdma_ucm" in str(ei.value)


def test_auto_keeps_a_channel_soft(backend):
    backend("auto")
    with CMEventChannel() as ch:
        assert type(ch) is soft_cmid.CMEventChannel


def test_the_gid_tables_decide_under_auto(sysfs, backend):
    backend("auto")
    assert cma_select.hw_holds_address("10.77.0.11")
    assert not cma_select.hw_holds_address("10.77.0.12")
    assert cma_select.on_hardware(AddrInfo(src="10.77.0.11", flags=RAI_PASSIVE))
    assert not cma_select.on_hardware(AddrInfo(src="10.77.0.12", flags=RAI_PASSIVE))
    assert not cma_select.on_hardware(AddrInfo(src="0.0.0.0", flags=RAI_PASSIVE))
    assert not cma_select.on_hardware(AddrInfo(dst="10.77.0.11", dst_service="1"))
    assert not cma_select.on_hardware(None)  # a new channel
    backend("soft")
    assert not cma_select.on_hardware(AddrInfo(src="10.77.0.11", flags=RAI_PASSIVE))
    backend("ibverbs")
    assert cma_select.on_hardware(None)


@pytest.mark.skipif(HAS_RDMA_CM, reason="this machine has /dev/infiniband/rdma_cm")
def test_an_addrinfo_on_a_device_address_goes_to_librdmacm(sysfs, backend):
    backend("auto")
    with pytest.raises(PyverbsRDMAError) as ei:  # librdmacm's answer here, not a soft id
        CMID(AddrInfo(src="10.77.0.11", src_service="7000", flags=RAI_PASSIVE))
    assert ei.value.error_code == errno.ENODEV and "librdmacm" in str(ei.value)


def test_a_soft_device_keeps_its_address(sysfs, backend, monkeypatch):
    backend("auto")
    monkeypatch.setattr(cma_select, "_soft_holds_address", lambda ip: True)
    assert not cma_select.on_hardware(AddrInfo(src="10.77.0.11", flags=RAI_PASSIVE))
