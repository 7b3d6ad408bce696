"""pyverbs.cmid and pyverbs.cm_enums on softrdma's rdma_cm, and the device net-interface
lookup rdma-core's rdma_cm tests do (SOFTRDMA_NETDEV=1)."""

from __future__ import annotations

import json
import os
import random
import subprocess

from softrdma.pyverbs_compat import _netdev

from .test_pyverbs_compat import PROGRAMS, run


def test_cmid_program_connects_sends_and_writes_through_unchanged_pyverbs():
    port = str(random.randint(20000, 30000))
    p = run([str(PROGRAMS / "pyverbs_cmid_pingpong.py"), "auto", port], timeout=120,
            SOFTRDMA_NETDEV="1")
    if "EADDRINUSE" in p.stderr or "in use" in p.stderr:  # another engineer's port: once more
        p = run([str(PROGRAMS / "pyverbs_cmid_pingpong.py"), "auto", str(int(port) + 1)],
                timeout=120, SOFTRDMA_NETDEV="1")
    assert p.returncode == 0 and "cmid ok" in p.stdout, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("address "))
    _, ifname, ip, mac = line.split()
    assert ifname == "lo:softrdma0" and ip.startswith("127.") and mac.startswith("02:00:7f:")


def test_without_softrdma_netdev_the_device_has_no_net_interface_as_rxe():
    p = run([str(PROGRAMS / "pyverbs_cmid_pingpong.py"), "auto", "20999"], timeout=60)
    assert p.returncode != 0 and "no net interface" in p.stderr, p.stdout + p.stderr


def test_netdev_lookups_answer_only_for_soft_devices():
    from softrdma.verbs_api import add_device, remove_device
    add_device("127.0.0.9", name="softrdma-nd-test", live=False)
    _netdev.install()
    try:
        base = "/sys/class/infiniband/softrdma-nd-test/device/net/"
        assert os.path.exists(base) and os.path.exists("/sys/class/infiniband/softrdma-nd-test")
        assert not os.path.exists("/sys/class/infiniband/softrdma-nd-test/device/nope")
        assert not os.path.exists("/sys/class/infiniband/no-such-dev-xyz/device/net/")
        assert os.path.exists("/")  # everything else: the real os.path.exists
        assert subprocess.check_output(["ls", base]) == b"lo:softrdma-nd-test\n"
        out = json.loads(subprocess.check_output(["ip", "-j", "addr", "show",
                                                  "lo:softrdma-nd-test"]).decode())
        assert out[0]["addr_info"][0]["local"] == "127.0.0.9"
        assert out[0]["address"] == "02:00:7f:00:00:09"
        assert subprocess.check_output(["echo", "real"], text=True) == "real\n"
    finally:
        _netdev.uninstall()
        remove_device("softrdma-nd-test")
    assert not os.path.exists(base)
    assert os.path.exists is _netdev._real_exists


def test_cm_enums_are_softrdma_rdmacm_enums():
    from softrdma.pyverbs_compat import cm_enums as ce
    from softrdma.rdmacm import enums as re_
    assert ce.rdma_cm_event_type is re_.rdma_cm_event_type
    assert ce.rdma_port_space is re_.rdma_port_space
    assert ce.RDMA_CM_EVENT_ESTABLISHED is re_.RDMA_CM_EVENT_ESTABLISHED
    for n in ("RAI_PASSIVE", "RDMA_OPTION_ID", "RDMA_OPTION_ID_ACK_TIMEOUT", "RDMA_PS_UDP",
              "RDMA_PS_TCP", "RDMA_PS_IB", "RDMA_PS_IPOIB"):
        assert getattr(ce, n) == getattr(re_, n), n
    assert ce.RDMA_MC_JOIN_FLAG_FULLMEMBER == 0 and ce.RDMA_CM_JOIN_MC_ATTR_ADDRESS == 1


def test_cmid_classes_subclass_softrdma_rdmacm_and_a_join_needs_a_device():
    """pyverbs' CMID is softrdma.rdmacm's; join_multicast on an id bound to no device yet
    is EINVAL, as the kernel's rdma_join_multicast answers (tests/test_rdmacm_mcast.py
    has the joins that work)."""
    import errno

    import pytest

    from softrdma.errors import PyverbsRDMAError
    from softrdma.pyverbs_compat import cmid as c
    from softrdma.rdmacm import cmid as rc
    for n in ("CMEventChannel", "CMEvent", "CMID", "AddrInfo", "ConnParam", "UDParam"):
        assert issubclass(getattr(c, n), getattr(rc, n)), n
    with c.CMEventChannel() as ch:
        cid = c.CMID(ch)
        with pytest.raises(PyverbsRDMAError) as ei:
            cid.join_multicast(addr=c.AddrInfo(src="224.0.0.1"))
        assert ei.value.error_code == errno.EINVAL
        cid.close()
