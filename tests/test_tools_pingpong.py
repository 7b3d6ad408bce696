"""``softrdma pingpong`` as two real processes on loopback, and its exchange format against
the bytes rdma-core's ibv_*_pingpong put on the wire (pcaps/linux-rxe/with-oob)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from softrdma.tools.pingpong import encode_dest, parse_dest

from .conftest import PCAPS, require_tool

SOFT = [sys.executable, "-m", "softrdma"]
_port = iter(range(19515, 19999))


def _run_pair(kind, extra=(), server_addr="127.0.0.31", client_addr="127.0.0.32"):
    port = str(next(_port))
    srv = subprocess.Popen(SOFT + ["pingpong", kind, "-p", port, "-a", server_addr, *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)
        cli = subprocess.run(SOFT + ["pingpong", kind, "-p", port, "-a", client_addr, *extra,
                                     server_addr], capture_output=True, text=True, timeout=60)
        out, err = srv.communicate(timeout=60)
    finally:
        srv.kill()
    return cli, (srv.returncode, out, err)


@pytest.mark.parametrize("kind", ["rc", "uc", "ud", "srq"])
def test_pingpong_between_two_processes(kind):
    cli, (src, sout, serr) = _run_pair(kind, ["-n", "50", "-s", "1000", "-c"])
    assert cli.returncode == 0, cli.stderr
    assert src == 0, serr
    for out, me, peer in ((cli.stdout, "127.0.0.32", "127.0.0.31"), (sout, "127.0.0.31", "127.0.0.32")):
        lines = out.splitlines()
        assert re.match(rf"  local address:  LID 0x0000, QPN 0x[0-9a-f]{{6}}, PSN 0x[0-9a-f]{{6}}, "
                        rf"GID ::ffff:{re.escape(me)}$", lines[0])
        assert any(re.match(rf"  remote address: LID 0x0000, QPN 0x[0-9a-f]{{6}}, PSN "
                            rf"0x[0-9a-f]{{6}}, GID ::ffff:{re.escape(peer)}$", ln) for ln in lines)
        assert re.match(r"100000 bytes in \d+\.\d\d seconds = \d+\.\d\d Mbit/sec$", lines[-2])
        assert re.match(r"50 iters in \d+\.\d\d seconds = \d+\.\d\d usec/iter$", lines[-1])
        assert "Invalid data" not in out  # -c: every received buffer held the sent pattern


def test_pingpong_larger_than_mtu_and_events():
    cli, (src, sout, serr) = _run_pair("rc", ["-n", "20", "-s", "10000", "-e", "-m", "1024",
                                              "--counters"])
    assert cli.returncode == 0 and src == 0, cli.stderr + serr
    assert "400000 bytes in" in cli.stdout
    counters = dict(ln.split(": ") for ln in cli.stdout.splitlines() if ln.startswith(("sent_pkts", "rcvd_pkts", "rdma_recvs")))
    # 20 messages of 10000 B at MTU 1024 = 10 packets each, plus one ACK per peer message
    assert int(counters["sent_pkts"]) == 20 * 10 + 20
    assert int(counters["rdma_recvs"]) == 20


def _oob_messages(name):
    exe = require_tool("tshark")
    out = subprocess.run([exe, "-r", str(PCAPS / "with-oob" / name), "-Y", "tcp.len>0", "-T",
                          "fields", "-e", "ip.src", "-e", "tcp.payload"],
                         capture_output=True, text=True, check=True).stdout
    return [(ln.split()[0], bytes.fromhex(ln.split()[1])) for ln in out.splitlines()]


@pytest.mark.parametrize("name", ["rc_pingpong.pcap", "ud_pingpong.pcap"])
def test_exchange_bytes_match_rdma_core(name):
    msgs = _oob_messages(name)
    assert [len(m) for _, m in msgs] == [52, 52, 5]
    for _, m in msgs[:2]:
        lid, qpn, psn, gid = parse_dest(m)
        assert encode_dest(lid, qpn, psn, gid) == m  # byte for byte, NUL padding included
        assert gid[:12] == bytes(10) + b"\xff\xff"
    assert msgs[2][1] == b"done\0"


def test_srq_exchange_is_256_records_each_way():
    msgs = _oob_messages("srq_pingpong.pcap")
    by_src = {}
    for src, m in msgs:
        by_src[src] = by_src.get(src, b"") + m
    client, server = by_src["10.77.0.12"], by_src["10.77.0.11"]
    assert len(server) == 256 * 52 and len(client) == 256 * 52 + 5
    recs = [client[i:i + 52] for i in range(0, 256 * 52, 52)]
    used = [parse_dest(r) for r in recs if parse_dest(r)[1]]
    assert len(used) == 2  # the run used -q 2; the other 254 records are zero-filled
    assert recs[-1] == encode_dest(0, 0, 0, bytes(16))


def test_unreachable_server_is_one_line():
    port = str(next(_port))
    r = subprocess.run(SOFT + ["pingpong", "rc", "-p", port, "-a", "127.0.0.33", "127.0.0.34"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "Couldn't connect to 127.0.0.34" in r.stderr and "Traceback" not in r.stderr


def test_peer_speaking_another_format():
    port = next(_port)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.35", port))
    ls.listen(1)
    cli = subprocess.Popen(SOFT + ["pingpong", "rc", "-p", str(port), "-a", "127.0.0.36",
                                   "127.0.0.35"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    conn, _ = ls.accept()
    conn.recv(52)
    conn.sendall(b"6.06" + bytes(12) + b"garbage that is not a pingpong record" + bytes(100))
    out, err = cli.communicate(timeout=60)
    conn.close()
    ls.close()
    assert cli.returncode == 1
    assert "not an rdma-core pingpong message" in err and "Traceback" not in err


def test_address_in_use_and_unknown_device():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.37", 4791))
    try:
        r = subprocess.run(SOFT + ["pingpong", "rc", "-a", "127.0.0.37"], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 1 and "in use" in r.stderr and "Traceback" not in r.stderr
    finally:
        s.close()
    r = subprocess.run(SOFT + ["pingpong", "rc", "-d", "mlx5_0"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "unknown device" in r.stderr
