"""Multicast under ``softrdma exec`` and ``softrdma mckey``: librdmacm's unmodified mckey
(rdmacm-utils) joins, sends and receives on softrdma, with itself and with softrdma's
mckey tool, both roles; a C program's ibv_attach_mcast/ibv_detach_mcast get the verbs
core's and rxe's answers. Processes on 127.0.3.6x, groups 239.3.2.x.

A receiver is ready to be sent to when its device has a socket bound to the group
(/proc/net/udp: ``group:4791``), which it makes when the join attaches its QP; mckey's
sender then pauses 3 s (its wait "for the SM") before it sends.
"""

from __future__ import annotations

import socket

import pytest

from .conftest import require_tool
from .exec_pair import SOFT, Server, compile_program, exec_argv, run

RECV_IP, SEND_IP = "127.0.3.61", "127.0.3.62"


def group_bound(group: str) -> bool:
    """Some socket of this host is bound to ``group``:4791 (a device joined it)."""
    want = "%08X:12B7" % int.from_bytes(socket.inet_aton(group), "little")
    with open("/proc/net/udp") as f:
        return any(row.split()[1] == want for row in f.readlines()[1:])


@pytest.fixture(scope="module")
def mckey() -> str:
    return require_tool("mckey")


def c_mckey(ip: str, group: str, *extra: str) -> list[str]:
    return exec_argv(ip, "mckey", "-m", group, "-b", ip, *extra)


def soft_mckey(ip: str, group: str, *extra: str) -> list[str]:
    return [*SOFT, "mckey", "-m", group, "-b", ip, *extra]


def exchange(receiver: list[str], sender: list[str], group: str) -> tuple:
    """Start the receiver, wait for its join, run the sender; both results."""
    with Server(receiver) as srv:
        srv.until(lambda: group_bound(group), f"a socket on {group}:4791")
        sent = run(sender, timeout=90)
        got = srv.finish(60)
    return got, sent


def joined_and_done(r, role: str, group: str) -> None:
    """mckey's lines for a run that joined ``group`` and moved every message."""
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0] == f"mckey: starting {role}"
    assert f"mckey: joined dgid: ::ffff:{group} mlid 0x0 sl 0" in lines
    assert "data transfers complete" in lines and lines[-1] == "return status 0"


@pytest.mark.parametrize("recv_c,send_c", [(True, True), (False, True), (True, False)],
                         ids=["c-to-c", "c-to-softrdma", "softrdma-to-c"])
def test_mckey_sender_to_receiver(mckey, recv_c, send_c):
    """The receiver (-C 5) gets all 5 of the sender's messages (mckey waits for exactly
    that many completions: it ends only if all arrived)."""
    group = {(True, True): "239.3.2.1", (False, True): "239.3.2.2",
             (True, False): "239.3.2.3"}[(recv_c, send_c)]
    receiver = (c_mckey if recv_c else soft_mckey)(RECV_IP, group, "-C", "5")
    if not recv_c:
        receiver += ["--timeout", "30"]
    sender = (c_mckey if send_c else soft_mckey)(SEND_IP, group, "-s", "-C", "5")
    got, sent = exchange(receiver, sender, group)
    joined_and_done(sent, "client", group)
    joined_and_done(got, "server", group)
    assert "receiving data transfers" in got.stdout.splitlines()
    assert "initiating data transfers" in sent.stdout.splitlines()


def test_unmapped_address_is_enotsupp_as_on_rocev2(mckey):
    """-M (an AF_IB group): the kernel's RoCEv2 join answers ENOTSUPP (524), so mckey
    prints "failure joining: Unknown error 524"; softrdma's mckey says the same."""
    for argv in (exec_argv(SEND_IP, "mckey", "-M", "ff15::3:2", "-b", SEND_IP),
                 [*SOFT, "mckey", "-M", "ff15::3:2", "-b", SEND_IP, "--pause", "0"]):
        r = run(argv, timeout=60)
        assert "mckey: failure joining: Unknown error 524" in r.stdout + r.stderr, r
        assert r.stdout.splitlines()[-1] == "return status -1"


def test_c_attach_and_detach_answers(tmp_path):
    """ibv_attach_mcast: EINVAL (22) for an RC QP and for a unicast GID; detaching a
    group not attached is EINVAL; attaching twice is 0 (one attach); the limits are
    rxe's (8192 groups, 56 QPs per group, 0x70000 attaches)."""
    exe = compile_program(tmp_path, "mcast_attach")
    r = run(exec_argv("127.0.3.63", exe), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "limits 8192 56 458752", "rc_attach 22", "unicast_attach 22", "detach_unattached 22",
        "attach 0", "attach_again 0", "detach 0", "detach_again 22"]
