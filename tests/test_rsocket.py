"""softrdma.socket's rsocket protocol (softrdma/socket/rsocket.py, docs/rsocket.md) without
the lab: the wire structures laid out as librdmacm's rsocket.c lays them out, and
softrdma-to-softrdma streams over real UDP between live soft devices on 127.0.11.x
(tests/programs/rsocket_checks.py, rsocket_stream.py), each side in a process of its own.
The lab runs (tests/interop/test_rsocket_interop.py) check the same against rstream and
riostream on kernel rxe."""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from softrdma import socket as rsock
from softrdma.socket.rsocket import (
    CONN_DATA, RS_OP_CTRL, RS_OP_SGL, RSocket, RSOptions, msg_set, scale_to_value,
    value_to_scale,
)

ROOT = Path(__file__).resolve().parent.parent
CHECKS = str(ROOT / "tests" / "programs" / "rsocket_checks.py")
STREAM = str(ROOT / "tests" / "programs" / "rsocket_stream.py")


def _env(ip: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    env.update(PYTHONPATH=str(ROOT), SOFTRDMA_IP=ip)
    return env


def _port() -> int:
    return random.randint(20000, 40000)


def _start(args: list[str], ip: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=_env(ip), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _wait_listening(p: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 0.5)
        if r and "listening" in p.stdout.readline():
            return
        if p.poll() is not None:
            break
    p.kill()
    raise AssertionError("the server never listened: " + p.communicate()[1])


def _pair(server: list[str], client: list[str], timeout: float = 240):
    srv = _start(server, "127.0.11.1")
    try:
        _wait_listening(srv)
        cli = subprocess.run([sys.executable, *client], env=_env("127.0.11.2"),
                             capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out, err = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            out, err = srv.communicate()
    return (cli.returncode, cli.stdout, cli.stderr), (srv.returncode, out, err)


# ---- the wire structures ------------------------------------------------------------------

def test_conn_data_layout_is_rs_conn_data():
    """struct rs_conn_data: u8 version, u8 flags, be16 credits, 3 reserved, u8 iomap
    scale, then target_sgl and data_buf as big-endian {be64 addr, be32 key, be32 length}."""
    raw = CONN_DATA.pack(1, 2, 384, 1, 0x1122334455667788, 0xAABBCCDD, 2,
                         0x0102030405060708, 0x01020304, 65536)
    assert len(raw) == 40
    assert raw[:8] == bytes([1, 2, 0x01, 0x80, 0, 0, 0, 1])
    assert raw[8:24] == bytes.fromhex("1122334455667788" "aabbccdd" "00000002")
    assert raw[24:40] == bytes.fromhex("0102030405060708" "01020304" "00010000")


def test_imm_and_scale_helpers_match_rsocket_c():
    assert msg_set(0, 1000) == 1000
    assert msg_set(RS_OP_SGL, 384 + 7) == (4 << 29) | 391
    assert msg_set(RS_OP_CTRL, 0) == 0xE0000000
    # rs_value_to_scale / rs_scale_to_value with 8 bits
    assert [value_to_scale(v) for v in (0, 1, 128, 256, 1024)] == [0, 1, 128, 129, 132]
    assert [scale_to_value(s) for s in (0, 1, 128, 129, 132)] == [0, 1, 128, 256, 1024]
    assert RSOptions(iomap_size=1).iomap_size == 1


def test_protocol_selects_the_rsocket_class():
    s = rsock.socket(protocol="rsocket")
    assert isinstance(s, RSocket) and s.protocol == "rsocket"
    s.close()
    assert not isinstance(rsock.socket(), RSocket)
    with pytest.raises(ValueError):
        rsock.socket(protocol="tcp")


# ---- streams over real UDP between two processes -------------------------------------------

def test_sizes_1_byte_to_4_mib_echoed():
    port = _port()
    (crc, cout, cerr), (src, sout, serr) = _pair(
        [CHECKS, "echo-server", "127.0.11.1", str(port)],
        [CHECKS, "sizes", "127.0.11.1", str(port)])
    assert crc == 0, cerr + cout
    assert src == 0, serr + sout
    assert "OK sizes 25 transfers" in cout
    assert "OK echo-server" in sout


@pytest.mark.parametrize("size,count", [(1, 500), (4096, 100), (1 << 20, 4), (4 << 20, 2)])
def test_rstream_pattern_between_processes(size, count):
    """rstream's exchange (sync, count transfers each way, byte counter verified)."""
    port = _port()
    args = ["-S", str(size), "-C", str(count), "--verify"]
    (crc, cout, cerr), (src, sout, serr) = _pair(
        [STREAM, "server", "127.0.11.1", str(port), *args],
        [STREAM, "client", "127.0.11.1", str(port), *args])
    assert crc == 0 and src == 0, cerr + serr
    assert f"rstream ok {2 * size * count} bytes" in cout and "verified" in sout


@pytest.mark.parametrize("size,count", [(64, 50), (1 << 20, 3)])
def test_riostream_pattern_between_processes(size, count):
    """riostream's exchange: riomap, then riowrite into the peer's mapped buffer."""
    port = _port()
    args = ["-S", str(size), "-C", str(count), "--verify", "--rio"]
    (crc, cout, cerr), (src, sout, serr) = _pair(
        [STREAM, "server", "127.0.11.1", str(port), *args],
        [STREAM, "client", "127.0.11.1", str(port), *args])
    assert crc == 0 and src == 0, cerr + serr
    assert f"riostream ok {2 * size * count} bytes" in cout and "verified" in sout


def _single(what: str, ip: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHECKS, what, ip, str(_port())], env=_env(ip),
                          capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_credit_exhaustion_and_back_pressure():
    p = _single("backpressure", "127.0.11.3")
    assert p.returncode == 0, p.stderr + p.stdout
    assert "OK backpressure ring 131072 bytes, credits 384 writes" in p.stdout


def test_orderly_close_both_directions_and_shutdown_wr():
    p = _single("close", "127.0.11.4")
    assert p.returncode == 0, p.stderr + p.stdout
    assert "nothing left on the device" in p.stdout
