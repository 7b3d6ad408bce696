"""softrdma.socket and its message queue (docs/socket.md), over real UDP on 127.0.12.x:
an echo server in another process from 0 bytes to 16 MiB; a Receiver fed by 8 sender
processes under seeded loss, checking per-sender order and frame contiguity; peers that
vanish mid-transfer in both directions; timeouts, non-blocking mode, select and asyncio."""

from __future__ import annotations

import asyncio
import os
import random
import select
import subprocess
import sys
import threading
import time

import pytest

from softrdma import socket as rsock
from softrdma.socket import Options, Receiver

from .conftest import ROOT

PROGS = ROOT / "tests" / "programs"
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
#: how long a vanished peer may take to show: a keepalive after this much silence, then
#: RC's (retry + 1) transmissions, 4.096 us x 2^ack_timeout apart (~2.9 s)
OPTS = Options()
RESET_BOUND = OPTS.keepalive + (OPTS.retry + 1) * 4.096e-6 * (1 << OPTS.ack_timeout)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)


def wait_ready(p: subprocess.Popen) -> None:
    line = p.stdout.readline()
    assert line.strip() == "READY", (line, p.stderr.read() if p.poll() is not None else "")


@pytest.fixture
def dev(live_device):
    """Live devices on loopback for this test, removed after it (conftest)."""
    return live_device


def in_use(d) -> dict:
    return {k: v for k, v in d.in_use.items() if v}


def test_echo_across_processes_from_0_bytes_to_16_mib(dev):
    srv = spawn(str(PROGS / "socket_echo.py"), "127.0.12.1", "9000")
    try:
        wait_ready(srv)
        d = dev("127.0.12.2", "sock-cli")
        rnd = random.Random(7)
        sizes = [0, 1, 31, 32, 4095, 4096, 4097, 65536, 1 << 20, 16 << 20]
        with rsock.socket() as s:
            s.settimeout(60)
            s.bind(("127.0.12.2", 0))  # this process's device
            s.connect(("127.0.12.1", 9000))
            assert s.getpeername() == ("127.0.12.1", 9000)
            assert s.getsockname()[0] == "127.0.12.2"
            for size in sizes:
                data = rnd.randbytes(size)
                assert s.send(data) == size
                back = s.recv()
                assert len(back) == size and back == data, size
        out, err = srv.communicate(timeout=30)
        assert srv.returncode == 0, err
        assert out.split() == ["ECHOED", str(len(sizes))]
        assert in_use(d) == {}  # close released every QP, CQ, MR and PD
    finally:
        srv.kill()


def test_a_receiver_and_eight_sender_processes_under_loss(dev):
    """8 processes x 250 runs of 1-4 frames (16 B .. 70 KB), 2 % of their packets lost
    once connected (seeded), the receiver's own sends lossy too: every message arrives
    once, in its sender's order, each run of frames unbroken; memory stays bounded."""
    d = dev("127.0.12.11", "mq-rx")
    limit = 1 << 20
    senders, count = 8, 250
    with Receiver(("127.0.12.11", 9100), mem_limit=limit) as rx:
        procs = [spawn(str(PROGS / "mq_sender.py"), f"127.0.12.{21 + k}", "127.0.12.11",
                       "9100", str(k), str(count), "0.02") for k in range(senders)]
        try:
            last = {k: -1 for k in range(senders)}
            run: tuple[int, int] | None = None
            done, frames_seen, peak = 0, 0, 0
            lossy = False
            while done < senders * count:
                m = rx.recv(timeout=60)
                peak = max(peak, rx.held + len(m.data))
                if not lossy and len(rx.senders) == senders:
                    d.faults.tx.random.loss, lossy = 0.02, True
                k, i, f, n = (int(x) for x in m.data.split(b":")[:4])
                frames_seen += 1
                assert m.more == (f < n - 1)
                if run is not None:  # inside a run: the same sender, the next frame
                    assert run == (k, i), f"frame of {k}:{i} inside run {run}"
                assert f == 0 or run == (k, i)
                run = (k, i) if m.more else None
                if not m.more:
                    assert i == last[k] + 1, f"sender {k}: message {i} after {last[k]}"
                    last[k] = i
                    done += 1
            for p in procs:
                out, err = p.communicate(timeout=60)
                assert p.returncode == 0, err
                assert out.strip() == f"SENT {count}"
        finally:
            for p in procs:
                p.kill()
        assert all(v == count - 1 for v in last.values())
        # bounded: the limit, plus at most one message taken past it, plus what senders
        # could still send inline on the credits they held
        slack = 70000 + senders * OPTS.slots * OPTS.inline_max
        assert peak <= limit + slack, peak
        assert d.counters.drops.get("injected_loss", 0) > 0  # the loss did happen


def test_a_server_that_vanishes_resets_the_client_within_the_bound(dev):
    srv = spawn(str(PROGS / "socket_echo.py"), "127.0.12.31", "9200", "--die-after", "3")
    try:
        wait_ready(srv)
        d = dev("127.0.12.32", "sock-cli2")
        s = rsock.socket()
        s.settimeout(30)
        s.bind(("127.0.12.32", 0))
        s.connect(("127.0.12.31", 9200))
        for i in range(3):
            s.send(b"x" * 100)
            assert s.recv() == b"x" * 100
        srv.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ConnectionResetError):
            s.recv()
        took = time.monotonic() - t0
        assert took < 2 * RESET_BOUND + 1, (took, RESET_BOUND)
        s.close()
        assert in_use(d) == {}
    finally:
        srv.kill()


def test_a_client_that_vanishes_mid_transfer_resets_the_server(dev):
    d = dev("127.0.12.41", "sock-srv")
    code = ("import os, sys; from softrdma import socket as r; "
            "from softrdma.verbs_api import add_device; add_device('127.0.12.42'); "
            "s = r.create_connection(('127.0.12.41', 9300)); "
            "[s.send(b'y' * 70000) for _ in range(5)]; os._exit(4)")
    with rsock.create_server(("127.0.12.41", 9300)) as srv:
        p = subprocess.Popen([sys.executable, "-c", code], env=ENV, cwd=ROOT)
        srv.settimeout(30)
        conn, peer = srv.accept()
        conn.settimeout(30)
        got = 0
        t0 = None
        with pytest.raises(ConnectionResetError):
            while True:
                msg = conn.recv()  # the announced 70 KB messages it can still read ...
                got += 1
                assert msg == b"y" * 70000
                if p.poll() is not None and t0 is None:
                    t0 = time.monotonic()
        assert p.wait(10) == 4
        took = time.monotonic() - (t0 or time.monotonic())
        assert took < 2 * RESET_BOUND + 1
        conn.close()
    assert in_use(d) == {}


def test_errors_a_user_can_rely_on(dev):
    dev("127.0.12.51", "sock-e")
    with rsock.create_server(("127.0.12.51", 9400)) as srv:
        with pytest.raises(ConnectionRefusedError):
            rsock.create_connection(("127.0.12.51", 9401), timeout=10)  # nobody there
        # rdma_cm needs the server's accept() to answer, unlike TCP's backlog: the
        # client connects from a thread
        box = {}
        t = threading.Thread(target=lambda: box.setdefault(
            "c", rsock.create_connection(("127.0.12.51", 9400), timeout=10)))
        t.start()
        srv.settimeout(10)
        s, peer = srv.accept()
        t.join(10)
        c = box["c"]
        assert peer[0] == "127.0.12.51"
        s.settimeout(0.2)
        with pytest.raises(TimeoutError):
            s.recv()
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            s.recv()
        r, _, _ = select.select([s.fileno()], [], [], 0)
        c.send(b"ping")
        r, _, _ = select.select([s.fileno()], [], [], 5)
        assert r == [s.fileno()]
        s.settimeout(5)
        assert s.recv() == b"ping"
        buf = bytearray(2)
        c.send(b"too big for two bytes")
        with pytest.raises(ValueError):
            s.recv_into(buf)
        assert s.recv() == b"too big for two bytes"  # still there
        c.close()
        with pytest.raises(EOFError):
            s.recv()
        with pytest.raises(BrokenPipeError):
            s.send(b"after the peer closed")
        s.close()
        with pytest.raises(OSError):
            c.send(b"closed")


def test_asyncio_face(dev):
    dev("127.0.12.61", "sock-a")

    async def main():
        srv = rsock.create_server(("127.0.12.61", 9500))
        cli = rsock.socket()

        async def serve():
            conn, _ = await srv.aaccept()
            for _ in range(3):
                await conn.asend(await conn.arecv())
            return conn

        task = asyncio.create_task(serve())
        await asyncio.get_running_loop().run_in_executor(
            None, cli.connect, ("127.0.12.61", 9500))
        out = []
        for word in (b"one", b"two" * 3000, b"three"):
            await cli.asend(word)
            out.append(await cli.arecv())
        conn = await task
        cli.close()
        conn.close()
        srv.close()
        return out
    assert asyncio.run(asyncio.wait_for(main(), 30)) == [b"one", b"two" * 3000, b"three"]


def _step_until(rx: Receiver, done, what: str, bound: float = 30.0) -> None:
    """Drive ``rx`` by hand (what ``recv`` does) until ``done()``."""
    deadline = time.monotonic() + bound
    while not done():
        assert time.monotonic() < deadline, f"{what} never happened"
        rx.progress()
        time.sleep(0.005)


def _until(done, what: str, bound: float = 30.0) -> None:
    deadline = time.monotonic() + bound
    while not done():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.005)


def test_a_sender_that_sent_and_left_before_the_receiver_looked(dev):
    """Guards the tutorial's flake (12-rdma-cm-and-sockets, "One receiver, many
    senders"): a sender connects, sends a run, closes and disconnects while the Receiver
    is not looking (a loaded machine). Its records are in the CQ, its ESTABLISHED and
    DISCONNECTED on the listener's channel; the DISCONNECTED must be handled after the
    CQ is drained, so its CLOSE makes it a goodbye. It was handled before: a half-open
    sender was failed ("disconnected without closing") and turned away with its
    messages (recv timed out), an admitted one dropped with a false error."""
    dev("127.0.7.1", "mq-left")
    queued = lambda rx: rx.channel.channel.pending()  # CM events waiting, none taken

    go = threading.Event()

    def producer(addr, name):
        with rsock.create_connection(addr, timeout=30) as s:
            assert go.wait(60)
            s.send(name + b": header", more=True)
            s.send(name + b": body")

    with Receiver(("127.0.7.1", 9600)) as rx:
        # 1. half-open: the REP goes out, then the receiver looks away until the sender
        # has come and gone (its ESTABLISHED and DISCONNECTED both queued)
        go.set()
        t = threading.Thread(target=producer, args=(("127.0.7.1", 9600), b"p1"))
        t.start()
        _step_until(rx, lambda: len(rx.half_open) == 1, "p1's REQ")
        t.join(60)
        assert not t.is_alive()
        _until(lambda: queued(rx) >= 2, "p1's ESTABLISHED and DISCONNECTED")
        got = [rx.recv(timeout=30) for _ in range(2)]
        assert [(m.data, m.more) for m in got] == [(b"p1: header", True), (b"p1: body", False)]
        # 2. admitted (ESTABLISHED seen), then it sends, closes and leaves unseen
        go.clear()
        t = threading.Thread(target=producer, args=(("127.0.7.1", 9600), b"p2"))
        t.start()
        _step_until(rx, lambda: len(rx.half_open) == 1, "p2's REQ")
        _step_until(rx, lambda: not rx.half_open and rx.conns, "p2's ESTABLISHED")
        go.set()
        t.join(60)
        assert not t.is_alive()
        _until(lambda: queued(rx) >= 1, "p2's DISCONNECTED")
        got = [rx.recv(timeout=30) for _ in range(2)]
        assert [(m.data, m.more) for m in got] == [(b"p2: header", True), (b"p2: body", False)]
        _step_until(rx, lambda: not rx.conns, "p2 dropped")
        assert list(rx.errors) == []  # they said goodbye: neither is an error
        assert rx.half_open.failed == 0
