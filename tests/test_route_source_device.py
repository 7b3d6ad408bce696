"""A program that names only the remote address works as on an rxe host (issue 27): the
route's source address gets a soft device when rdma_cm needs one (softrdma/rdmacm/addr.py
``interface_device``; docs/cm.md, "Interface devices").

A veth pair joins this host (route-h0, 10.202.0.1/24) to a network namespace (route-n0,
10.202.0.2/24 in ``route-ns``). A server under ``softrdma exec --addr 10.202.0.2`` runs in
the namespace; a client on the host names only 10.202.0.2: no ``-I``, no ``--addr``, the
default device left on loopback. Before the rule, each client ended with
``RDMA_CM_EVENT_ADDR_ERROR, error -101`` (softrdma rping and udaddy; rping and ucmatose
under exec). The bind rule has its own test: a listener binding 10.202.0.2 with no
``--addr`` gets a device there (before: ENODEV); and a client naming this host's own
10.202.0.1, which another process serves, goes over loopback (before: -101). The
refusals are run inside the namespace, whose only route is 10.202.0.0/24: a destination
with no route, the rule switched off, and UDP 4791 taken on the route's source as kernel
rxe takes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from ipaddress import ip_address
from pathlib import Path

import pytest

from .conftest import IN_CI, require_tool

NS, HOST_IF, NS_IF = "route-ns", "route-h0", "route-n0"
HOST_IP, NS_IP = "10.202.0.1", "10.202.0.2"
NS_IP2 = "10.202.0.3"  # route-n0's secondary address
DOWN_IF, DOWN_IP = "route-d0", "10.202.9.1"  # in the namespace, never up
#: a generous bound for one tool's whole run (three messages on a veth)
TIMEOUT = 90
#: nothing pins the programs' device (an empty SOFTRDMA_IP is no pin), interface devices
#: on, whatever this test run's own environment says
ENV = {"SOFTRDMA_IP": "", "SOFTRDMA_AUTO_DEVICES": "1"}


def _sh(*argv: str, ns: bool = False) -> None:
    subprocess.run((["ip", "netns", "exec", NS] if ns else []) + list(argv), check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def veth():
    """The namespace and the veth pair (removed afterwards: deleting the namespace takes
    its end of the pair, and the pair goes with it)."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI=true and not root: a network namespace needs root")
        pytest.skip("needs root for a network namespace")
    require_tool("ip")
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)
    _sh("ip", "netns", "add", NS)
    try:
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NS)
        _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _sh("ip", "link", "set", "lo", "up", ns=True)
        _sh("ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF, ns=True)
        _sh("ip", "link", "set", NS_IF, "up", ns=True)
        # a secondary address, and an address on an interface that stays down
        _sh("ip", "addr", "add", f"{NS_IP2}/24", "dev", NS_IF, ns=True)
        _sh("ip", "link", "add", DOWN_IF, "type", "veth", "peer", "name", "route-d1", ns=True)
        _sh("ip", "addr", "add", f"{DOWN_IP}/24", "dev", DOWN_IF, ns=True)
        from softrdma.exec.build import library_path
        library_path()  # built once, before any server waits on the build
        yield
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)


def _env(**extra: str) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, **ENV, **extra,
            "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _softrdma(*argv: str, ns: bool = False) -> list[str]:
    return (["ip", "netns", "exec", NS] if ns else []) + [sys.executable, "-m", "softrdma",
                                                          *argv]


def _run(argv: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT,
                          env=_env(**extra))


def _serve(*server: str, pin: bool):
    """Start ``softrdma exec -- SERVER`` in the namespace (``--addr 10.202.0.2`` if
    ``pin``) and return once its rdma_listen returned 0 (its rdma_* trace on stderr)."""
    addr = ["--addr", NS_IP] if pin else []
    p = subprocess.Popen(_softrdma("exec", *addr, "--", *server, ns=True),
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=_env(SOFTRDMA_EXEC_CM_TRACE="1"))
    _wait_listening(p)
    return p


def _wait_listening(p: subprocess.Popen) -> None:
    """Until the exec'd server's rdma_listen returned 0 (its trace line on stderr)."""
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "rdma_listen -> 0" in line:
            return
    p.kill()
    raise AssertionError(f"the server never listened: {lines} {p.communicate()}")


def _pair(server: list[str], client: list[str]) -> tuple[str, str]:
    """The server in the namespace, its device pinned to 10.202.0.2 (as before the rule),
    the client on the host; both outputs (each exit 0)."""
    srv = _serve(*server, pin=True)
    try:
        cli = _run(client)
        # a client that failed leaves the server waiting: say why at once
        assert cli.returncode == 0, f"client: {cli.stdout}\n{cli.stderr}"
        out, err = srv.communicate(timeout=TIMEOUT)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    assert srv.returncode == 0, f"server: {out}\n{err}"
    return out, cli.stdout


def _pings(prefix: str, count: int = 3) -> list[str]:
    from softrdma.tools.rping import ping_data
    data = [ping_data(i, 64).split(b"\0")[0].decode() for i in range(count)]
    return [f"{prefix}ping data: {d}" for d in data]


RPING_SERVER = ["rping", "-s", "-a", NS_IP, "-v", "-C", "3"]


def test_softrdma_rping_names_only_the_remote_address(veth):
    """``softrdma rping -c -a 10.202.0.2`` without -I: a device comes up on the route's
    source 10.202.0.1 and rping's three pings go through."""
    out, cli = _pair(RPING_SERVER, _softrdma("rping", "-c", "-a", NS_IP, "-v", "-C", "3"))
    assert cli.splitlines() == _pings("")
    assert out.splitlines() == _pings("server ")


def test_c_rping_under_exec_names_only_the_remote_address(veth, tmp_path):
    """Debian's rping -c under ``softrdma exec`` with no --addr, naming only 10.202.0.2;
    ``--pcap`` captures on the device that came up, ``softrdma-10.202.0.1``, every packet
    of the connection going between the veth's two addresses."""
    pcap = tmp_path / "cli-{name}.pcap"
    out, cli = _pair(RPING_SERVER, _softrdma("exec", "--pcap", str(pcap), "--", "rping",
                                             "-c", "-a", NS_IP, "-v", "-C", "3"))
    assert cli.splitlines() == _pings("")
    assert _pings("server ")[-1] in out.splitlines()
    from softrdma.harness.replay import load_capture
    pkts = load_capture(str(tmp_path / f"cli-softrdma-{HOST_IP}.pcap"))
    ends = {(str(ip_address(p.src)), str(ip_address(p.dst))) for p in pkts}
    assert ends == {(HOST_IP, NS_IP), (NS_IP, HOST_IP)}, ends


def test_c_ucmatose_under_exec_names_only_the_remote_address(veth):
    """Debian's ucmatose -s 10.202.0.2 under ``softrdma exec`` with no --addr, against
    ucmatose -b 10.202.0.2 in the namespace: a connection, data both ways, a disconnect."""
    out, cli = _pair(["ucmatose", "-b", NS_IP, "-C", "3"],
                     _softrdma("exec", "--", "ucmatose", "-s", NS_IP, "-C", "3"))
    assert cli.splitlines()[-2:] == ["test complete", "return status 0"]
    assert "disconnected" in out.splitlines() and out.splitlines()[-1] == "return status 0"


def test_softrdma_udaddy_names_only_the_remote_address(veth):
    """``softrdma udaddy -s 10.202.0.2`` without -b against Debian's udaddy in the
    namespace: the UD path (SIDR) from the interface device, data both ways."""
    out, cli = _pair(["udaddy", "-b", NS_IP, "-c", "1"],
                     _softrdma("udaddy", "-s", NS_IP, "-c", "1"))
    assert cli.splitlines()[-2:] == ["test complete", "return status 0"]
    assert out.splitlines()[-1] == "return status 0"


def test_this_hosts_own_address_served_by_another_process(veth):
    """rping -c -a 10.202.0.1 on the host, where another process's device holds
    10.202.0.1: the route's source is the destination itself, so the client goes from its
    default device over loopback (as to a loopback address) instead of fighting the server
    for the address; before, ADDR_ERROR -101."""
    srv = subprocess.Popen(_softrdma("exec", "--addr", HOST_IP, "--", "rping", "-s", "-a",
                                     HOST_IP, "-v", "-C", "3"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_env(SOFTRDMA_EXEC_CM_TRACE="1"))
    try:
        _wait_listening(srv)
        cli = _run(_softrdma("exec", "--", "rping", "-c", "-a", HOST_IP, "-v", "-C", "3"))
        assert cli.returncode == 0, f"client: {cli.stdout}\n{cli.stderr}"
        out, err = srv.communicate(timeout=TIMEOUT)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    assert srv.returncode == 0, f"server: {out}\n{err}"
    assert cli.stdout.splitlines() == _pings("")


def test_a_c_listener_on_an_interface_address_gets_a_device(veth):
    """Debian's rping -s -a 10.202.0.2 under ``softrdma exec`` with no --addr: its
    rdma_bind_addr finds no device on 10.202.0.2 and gets one (before: ENODEV); the client
    on the host is pinned to 10.202.0.1, as before the rule."""
    srv = _serve(*RPING_SERVER, pin=False)
    try:
        cli = _run(_softrdma("exec", "--addr", HOST_IP, "--", "rping", "-c", "-a", NS_IP,
                             "-v", "-C", "3"))
        assert cli.returncode == 0, f"client: {cli.stdout}\n{cli.stderr}"
        out, err = srv.communicate(timeout=TIMEOUT)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    assert srv.returncode == 0, f"server: {out}\n{err}"
    assert cli.stdout.splitlines() == _pings("")
    assert _pings("server ")[-1] in out.splitlines()


def test_a_secondary_address_gets_a_device_with_its_interfaces_mac(veth):
    """rping -s -a 10.202.0.3, route-n0's secondary address (which SIOCGIFADDR does not
    report), with no --addr: the listener's device is on route-n0 (its GID 0 from
    route-n0's MAC, as rxe's), and a client pinned on the host connects to it."""
    srv = _serve("rping", "-s", "-a", NS_IP2, "-v", "-C", "1", pin=False)
    try:
        cli = _run(_softrdma("exec", "--addr", HOST_IP, "--", "rping", "-c", "-a", NS_IP2,
                             "-v", "-C", "1"))
        assert cli.returncode == 0, f"client: {cli.stdout}\n{cli.stderr}"
        out, err = srv.communicate(timeout=TIMEOUT)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    assert srv.returncode == 0, f"server: {out}\n{err}"
    assert cli.stdout.splitlines() == _pings("", 1)
    info = _run(["ip", "netns", "exec", NS, sys.executable, "-c",
                 "from softrdma.soft.netdev import netdev_for_ip, interface_of;"
                 f"n = netdev_for_ip('{NS_IP2}'); print(n.ifname, n.mac.hex(), "
                 f"interface_of('{NS_IP2}')[0])"])
    mac = subprocess.run(["ip", "netns", "exec", NS, "cat", f"/sys/class/net/{NS_IF}/address"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert info.stdout.split() == [NS_IF, mac.replace(":", ""), NS_IF], info


def test_resolve_with_no_wildcard_or_own_source_uses_one_device_for_the_process(
        veth, monkeypatch):
    """In this process: rdma_resolve_addr to 10.202.0.2 with no source, with 0.0.0.0 and
    with 10.202.0.1 itself all resolve on the one device ``softrdma-10.202.0.1``, made
    by the first; when the ids are gone the device stays registered (the process's, like
    the default device) with its UDP socket closed."""
    from softrdma.rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID
    from softrdma.rdmacm import enums as ce
    from softrdma.verbs_api.device import find_device, unregister_device
    monkeypatch.setenv("SOFTRDMA_AUTO_DEVICES", "1")
    name = f"softrdma-{HOST_IP}"
    unregister_device(name)
    ch = CMEventChannel()
    ids = []
    try:
        for src in (None, "0.0.0.0", HOST_IP):
            cid = CMID(ch)
            ids.append(cid)
            cid.resolve_addr(AddrInfo(src=src, dst=NS_IP, dst_service="7999"))
            ev = CMEvent(ch, 10.0)
            assert ev.event_type == ce.rdma_cm_event_type.RDMA_CM_EVENT_ADDR_RESOLVED, \
                (src, ev.event_str(), ev.status)
            assert cid.id.cdev.device is find_device(name), src
        dev = find_device(name)
        assert dev.udp is not None and dev.ip == HOST_IP
        for cid in ids:
            cid.close()
        ids.clear()
        assert find_device(name) is dev and dev.udp is None
    finally:
        for cid in ids:
            cid.close()
        ch.close()
        unregister_device(name)


# ---- what does not get a device -----------------------------------------------------------

def test_a_destination_with_no_route_is_enetunreach(veth):
    """No route to 10.203.0.9 in the namespace: no route's source, no device, and rping
    reports ADDR_ERROR -101 (ENETUNREACH) as on Linux, both softrdma's and Debian's."""
    r = _run(_softrdma("rping", "-c", "-a", "10.203.0.9", "-C", "1", ns=True))
    assert r.returncode != 0
    assert "RDMA_CM_EVENT_ADDR_ERROR, error -101" in r.stderr, r.stderr
    r = _run(_softrdma("exec", "--", "rping", "-c", "-a", "10.203.0.9", "-C", "1", ns=True))
    assert r.returncode != 0
    assert "RDMA_CM_EVENT_ADDR_ERROR, error -101" in r.stdout + r.stderr, (r.stdout, r.stderr)


def test_softrdma_auto_devices_0_leaves_the_route_source_without_a_device(veth):
    """``SOFTRDMA_AUTO_DEVICES=0``: the route's source gets no device (ADDR_ERROR -101),
    and a bind to the interface's address is ENODEV, as before the rule."""
    r = _run(_softrdma("exec", "--", "rping", "-c", "-a", HOST_IP, "-C", "1", ns=True),
             SOFTRDMA_AUTO_DEVICES="0")
    assert "RDMA_CM_EVENT_ADDR_ERROR, error -101" in r.stdout + r.stderr, (r.stdout, r.stderr)
    r = _run(_softrdma("exec", "--", "rping", "-s", "-a", NS_IP, "-C", "1", ns=True),
             SOFTRDMA_AUTO_DEVICES="0")
    assert r.returncode != 0
    assert "rdma_bind_addr: No such device" in r.stdout + r.stderr, (r.stdout, r.stderr)


def test_an_interface_that_is_down_gets_no_device(veth):
    """rping -s -a 10.202.9.1, an address of route-d0, which is down: still this host's
    address (a UDP socket could bind it), but no UP interface, so no device: ENODEV, as
    rdma_bind_addr answers for an address no RDMA device has."""
    r = _run(_softrdma("exec", "--", "rping", "-s", "-a", DOWN_IP, "-C", "1", ns=True))
    assert r.returncode != 0
    assert "rdma_bind_addr: No such device" in r.stdout + r.stderr, (r.stdout, r.stderr)


_HOLD_4791 = r'''
import socket, subprocess, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 4791))       # what kernel rxe's UDP tunnel holds
r = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=60)
print(r.returncode)
print(r.stdout + r.stderr)
'''


def test_udp_4791_taken_on_the_route_source_is_a_clear_eaddrinuse(veth):
    """UDP 4791 held on the namespace's wildcard address, as kernel rxe holds it: the
    route's source 10.202.0.2 cannot get a device, rping reports ADDR_ERROR -98
    (EADDRINUSE) and softrdma's log says which address and what to do."""
    r = _run(["ip", "netns", "exec", NS, sys.executable, "-c", _HOLD_4791, sys.executable,
              "-m", "softrdma", "exec", "--", "rping", "-c", "-a", HOST_IP, "-C", "1"])
    rc, _, out = r.stdout.partition("\n")
    assert rc.strip() != "0", r.stdout
    assert "RDMA_CM_EVENT_ADDR_ERROR, error -98" in out, out
    assert f"no soft device on {NS_IP} ({NS_IF}): UDP port 4791 on {NS_IP} is taken" in out
