"""rdma_cm between two kernel rxe guests: librdmacm's rping, both ends in the lab.

No softrdma here: this proves the guest side the softrdma-vs-rxe rdma_cm tests stand on
(two guests, a server found listening with ``rdma resource show cm_id`` rather than after a
guessed sleep, netem loss on both NICs, guest jobs collected or killed). The capture on br0
does not see guest-to-guest traffic, so a failing run's pcap comes from guest 1's NIC.
docs/notes-rdmacm-lab.md has the facts behind the numbers.
"""

from __future__ import annotations

import shutil
import signal

import pytest

from softrdma.harness.lab import guest_ip

from .conftest import FAILED

# every rxe-to-rxe run on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
pytestmark = pytest.mark.kernels("6.1", "6.12")

PORTS = iter(range(7300, 7399))  # rping's default is 7174; a port per run keeps runs apart


def rping_data(i: int, size: int = 64) -> str:
    """What rping -v prints for ping ``i``: "rdma-ping-i: " and then letters from 'A' + i,
    cycling through 'A'..'z', up to ``size`` - 1 characters (the last byte is the NUL)."""
    head = f"rdma-ping-{i}: "
    c = 65 + i % 58
    body = []
    for _ in range(size - 1 - len(head)):
        body.append(chr(c))
        c = 65 if c == 122 else c + 1
    return head + "".join(body)


def test_rping_data_matches_what_rping_printed():
    # copied from a lab run (kernel rxe both ends)
    assert rping_data(0) == "rdma-ping-0: ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqr"
    assert rping_data(2) == "rdma-ping-2: CDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrst"


@pytest.mark.parametrize("loss", [None, "loss 5%"], ids=["clean", "loss5"])
def test_rping_between_two_rxe_guests(scenario, loss, tmp_path, request):
    lab = scenario
    count, port, server = 3, next(PORTS), guest_ip(0)
    if loss:
        # 5 % both ways but for DREQ/DREP (conftest's ``lossy``): rping's client exits
        # right after its DREQ and destroying the id cancels its retries, so one lost DREQ
        # hangs the server -- kernel rxe to kernel rxe too (~5 % of runs with plain netem)
        request.getfixturevalue("lossy")
    cap = lab.guest_capture(1, f"{request.node.name}.pcap")
    srv = lab.guest_start(0, f"timeout 60 rping -s -a {server} -p {port} -v -C {count}")
    try:
        assert lab.wait_cm_listen(0, port), "rping -s never listened"
        cli = lab.guest(1, f"timeout 60 rping -c -a {server} -p {port} -v -C {count}",
                        timeout=70)
        s = srv.wait(timeout=30)
    finally:
        pcap = cap.kill(signal.SIGINT)
    ok = False
    try:
        assert cli.rc == 0, f"client: {cli.stderr}\n{cli.stdout}"
        assert s.rc == 0, f"server: {s.stderr}\n{s.stdout}"
        want = [rping_data(i) for i in range(count)]
        assert cli.stdout.splitlines() == [f"ping data: {d}" for d in want]
        assert s.stdout.splitlines() == [f"server ping data: {d}" for d in want]
        # not asserted: "client DISCONNECT EVENT..." on stderr, which a client under loss
        # may not print (it can exit before its DREQ is answered)
        assert "packets captured" in pcap.stderr
        ok = True
    finally:
        if not ok and (lab.dir / f"{request.node.name}.pcap").exists():
            FAILED.mkdir(exist_ok=True)
            shutil.copy(lab.dir / f"{request.node.name}.pcap", FAILED)


def test_a_killed_rdma_cm_server_is_gone(scenario):
    """GuestJob.kill reaches a tool started under `timeout` (which moves itself and the tool
    to a process group of their own), and its rdma_cm ID goes with it."""
    lab = scenario
    port = next(PORTS)
    srv = lab.guest_start(0, f"timeout 60 rping -s -p {port} -v")
    assert lab.wait_cm_listen(0, port)
    assert srv.running()
    r = srv.kill(signal.SIGTERM, timeout=5)
    assert r.rc == -15 and "TIMEOUT" not in r.stderr, r
    assert not any(d.get("src-addr", "").endswith(f":{port}") for d in lab.cm_listeners(0))
