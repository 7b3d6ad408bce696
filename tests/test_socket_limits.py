"""What a misbehaving or dying peer can make a ``softrdma.socket`` endpoint spend (issue 26,
points 4 to 6), over real UDP on 127.0.46.x:

* a receiver SIGKILLed while its sender waits for credits in ``send()``: the sender gets
  ConnectionResetError within the documented bound (the keepalive runs in every wait);
* a sender in an endless run (``more=True`` for ever) against ``Receiver(mem_limit)``:
  memory stays bounded, and the sender is refused before it sends past the receiver's
  advertised run limit;
* announced giant messages (NORMAL records forged to announce 1 GiB): the receiver
  allocates nothing, its ``recv`` is not stalled, and both sides get a clear error;
* no reference cycle keeps the buffers of a sender that left (checked with the
  collector disabled).
"""

from __future__ import annotations

import gc
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import weakref

import pytest

from softrdma import socket as rsock
from softrdma.socket import Options, Receiver
from softrdma.socket.record import Record, RecordType

from .conftest import ROOT

ENV = dict(os.environ, PYTHONPATH=str(ROOT))
OPTS = Options()
#: a vanished peer shows after a keepalive's silence plus RC's (retry + 1) transmissions,
#: 4.096 us x 2^ack_timeout apart (docs/socket.md, "Failures": ~2.9 s)
RESET_BOUND = OPTS.keepalive + (OPTS.retry + 1) * 4.096e-6 * (1 << OPTS.ack_timeout)
MiB = 1 << 20


@pytest.fixture
def dev(live_device):
    """Live devices on loopback for this test, removed after it (conftest)."""
    return live_device


def connect_senders(rx: Receiver, n: int, src: str, address: tuple[str, int],
                    timeout: float) -> list:
    """``n`` sockets from ``src`` connected to ``rx`` at ``address``: a Receiver answers
    requests only while its application calls in, so it is drained meanwhile."""
    socks: list = []

    def connect() -> None:
        for _ in range(n):
            s = rsock.socket()
            s.settimeout(timeout)
            s.bind((src, 0))
            s.connect(address)
            socks.append(s)
    t = threading.Thread(target=connect)
    t.start()
    while t.is_alive():
        try:
            rx.recv(timeout=0.1)
        except TimeoutError:
            pass
    return socks


def test_a_sender_blocked_on_credits_notices_its_receiver_killed(dev):
    """Guards issue 26 point 4: the keepalive probe ran only in ``recv``, so a sender
    waiting for credits in ``send()`` when its receiver was SIGKILLed stayed blocked for
    ever. Now every wait on the hub runs it: ConnectionResetError within the bound."""
    code = ("import sys, time; from softrdma import socket as r; "
            "from softrdma.verbs_api import add_device; add_device('127.0.46.1'); "
            "srv = r.create_server(('127.0.46.1', 9460)); print('READY', flush=True); "
            "c, _ = srv.accept(); print('ACCEPTED', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "READY"
        dev("127.0.46.2", "lim-tx")
        s = rsock.socket()
        s.settimeout(60)  # far beyond the bound: a TimeoutError would be the bug
        s.bind(("127.0.46.2", 0))
        s.connect(("127.0.46.1", 9460))
        assert p.stdout.readline().strip() == "ACCEPTED"
        outcome: dict = {}
        blocked = threading.Event()

        def sender() -> None:
            try:
                for i in range(10_000):
                    if i == 2 * OPTS.slots:  # credits spent and the backlog full
                        blocked.set()
                    s.send(b"x" * 100)
            except BaseException as e:
                outcome["error"], outcome["at"] = e, time.monotonic()
        t = threading.Thread(target=sender, daemon=True)
        t.start()
        assert blocked.wait(30)
        time.sleep(1.5)  # the receiver never reads: the sender waits for credits
        assert t.is_alive() and not outcome
        killed = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        t.join(2 * RESET_BOUND + 5)
        assert not t.is_alive(), "send() still blocked after the receiver died"
        assert isinstance(outcome["error"], ConnectionResetError), outcome
        assert outcome["at"] - killed < 2 * RESET_BOUND + 1, (outcome["at"] - killed)
        s.close()
    finally:
        p.kill()
        p.wait(10)


def _endless(src: str, port: int, frame: int, count: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "programs" / "mq_endless.py"),
                             src, "127.0.46.11", str(port), str(frame), str(count), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def _drive(rx: Receiver, p: subprocess.Popen, limit: float = 90) -> tuple[str, int]:
    """Run the receiver until the sender process prints its outcome; returns it and the
    peak of Python memory traced meanwhile (above what was traced at the start)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(l.strip() for l in p.stdout),
                              daemon=True)
    reader.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    end = time.monotonic() + limit
    while len(lines) < 2 and p.poll() is None and time.monotonic() < end:
        try:
            rx.recv(timeout=0.2)
        except TimeoutError:
            pass
    assert lines[:1] == ["CONNECTED"], (lines, p.stderr.read() if p.poll() else "")
    outcome = lines[1:]
    assert outcome, "the sender printed nothing"
    # the sender's departure, and the errors, reach the receiver: after the ABORT record
    # is acknowledged and the CM's DREQ arrives -- a few round trips, but on a loaded
    # machine (CI) they have taken more than 4 s; 30 s bounds them with a wide margin
    end = time.monotonic() + 30
    while rx.conns and time.monotonic() < end:
        try:
            rx.recv(timeout=0.2)
        except TimeoutError:
            pass
    return outcome[0], tracemalloc.get_traced_memory()[1] - base


@pytest.fixture
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def test_an_endless_run_is_refused_by_the_sender_before_it_is_sent(dev, traced):
    """Guards issue 26 point 5: a run in progress was exempt from ``mem_limit`` and had
    no length limit, so ``Receiver(mem_limit=8 MiB)`` held a sender's 1 MiB frames for
    ever (600 MiB) and the sender never blocked. Now the hello tells the sender the
    receiver's largest run, and ``send`` refuses the frame that would exceed it with
    OSError(EMSGSIZE) naming the limit; the receiver holds at most the limit."""
    dev("127.0.46.11", "lim-mq")
    limit = 8 * MiB
    with Receiver(("127.0.46.11", 9461), mem_limit=limit) as rx:
        p = _endless("127.0.46.12", 9461, MiB, 40)
        try:
            outcome, peak = _drive(rx, p)
        finally:
            p.kill()
            p.wait(10)
        assert outcome.startswith("ERR OSError [Errno 90]"), outcome
        assert f"max_run of {limit} bytes" in outcome and outcome.endswith("after 8"), outcome
        # what the receiver allocated: the 8 frames, and a frame's copy in transit
        assert peak < limit + 4 * MiB, peak
        assert rx.in_memory == 0 and not rx.conns  # the unfinished run went with it


def test_a_sender_that_ignores_the_limit_is_told_why_it_was_dropped(dev, traced):
    """Guards issue 26 point 5, for a sender that does not check (one predating the
    hello's limits): the receiver refuses the frame whose run passes ``max_run`` with a
    ProtocolError naming the field and the limit, before allocating anything for it,
    and tells the sender in an ABORT record: its ``send`` raises ConnectionResetError
    with the reason. The receiver's memory stays within twice the limit."""
    dev("127.0.46.11", "lim-mq")
    limit = 8 * MiB
    with Receiver(("127.0.46.11", 9462), mem_limit=limit) as rx:
        p = _endless("127.0.46.13", 9462, MiB, 40, "--blind")
        try:
            outcome, peak = _drive(rx, p)
        finally:
            p.kill()
            p.wait(10)
        assert outcome.startswith("ERR ConnectionResetError"), outcome
        assert f"max_run of {limit} bytes" in outcome, outcome
        assert peak < 2 * limit + 4 * MiB, peak
        (sender, error), = rx.errors
        assert sender[0] == "127.0.46.13"
        assert isinstance(error, rsock.ProtocolError) and "max_run" in str(error), error
        assert rx.in_memory == 0 and not rx.conns


def test_announced_giant_messages_allocate_nothing(dev, traced):
    """Guards issue 26 point 6: three 32-byte NORMAL records announcing 1 GiB each made
    the receiver allocate (and zero) 3 GiB, stalling ``recv`` for seconds, because the
    first incomplete message of every connection was read whatever the limit. Now an
    announcement over the receiver's ``max_message`` (here its ``mem_limit``) is a
    ProtocolError before any allocation, and each forger is told why."""
    dev("127.0.46.21", "lim-rx")
    dev("127.0.46.22", "lim-forger")
    limit = 8 * MiB
    with Receiver(("127.0.46.21", 9463), mem_limit=limit) as rx:
        socks = connect_senders(rx, 3, "127.0.46.22", ("127.0.46.21", 9463), timeout=30)
        assert len(socks) == 3 and len(rx.conns) == 3
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for s in socks:  # forged: a message nobody registered, announced as 1 GiB
            assert s._conn.send_control(Record(RecordType.NORMAL, seq=0, length=1 << 30,
                                               rkey=1, addr=0))
        slowest, end = 0.0, time.monotonic() + 30
        while rx.conns and time.monotonic() < end:
            began = time.monotonic()
            try:
                rx.recv(timeout=0.2)
            except TimeoutError:
                pass
            slowest = max(slowest, time.monotonic() - began)
        peak = tracemalloc.get_traced_memory()[1] - base
        assert peak < 4 * MiB, peak
        assert slowest < 3, slowest  # (the bug: ~6.7 s zeroing 3 GiB)
        assert len(rx.errors) == 3
        for _, error in rx.errors:
            assert isinstance(error, rsock.ProtocolError)
            assert f"max_message of {limit} bytes" in str(error), error
        for s in socks:
            with pytest.raises(ConnectionResetError, match=f"max_message of {limit} bytes"):
                s.recv()
            s.close()


def test_a_dropped_senders_read_buffer_is_freed_without_the_collector(dev, traced):
    """Guards issue 26 point 6's tail: after the senders left, their READ buffers stayed
    resident until gc.collect(), held by reference cycles (MR -> its implementation ->
    owner -> MR; a connection's error -> its traceback -> a frame -> the connection).
    With the collector off, a dropped sender's buffer must be freed as soon as it is
    dropped, and its connection must not survive: whether its READ failed, or it broke
    the protocol (an announcement over the limit, a ProtocolError kept in rx.errors)."""
    dev("127.0.46.31", "lim-rx2")
    dev("127.0.46.32", "lim-tx2")
    with Receiver(("127.0.46.31", 9464), mem_limit=64 * MiB) as rx:
        def connect():
            s = rsock.socket()
            s.settimeout(30)
            s.bind(("127.0.46.32", 0))
            t = threading.Thread(target=s.connect, args=(("127.0.46.31", 9464),))
            t.start()
            while t.is_alive():
                try:
                    rx.recv(timeout=0.1)
                except TimeoutError:
                    pass
            (conn, _), = rx.conns.values()
            return s, weakref.ref(conn)

        def announce(s, length: int) -> None:
            # a message announced with a key that is not there
            assert s._conn.send_control(Record(RecordType.NORMAL, seq=0, length=length,
                                               rkey=1, addr=0))
            end = time.monotonic() + 30
            while rx.conns and time.monotonic() < end:
                try:
                    rx.recv(timeout=0.2)
                except TimeoutError:
                    pass
            assert not rx.conns

        first, ref = connect()
        gc.collect()
        gc.disable()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            announce(first, 32 * MiB)  # allocated, then the READ fails: dropped
            peak = tracemalloc.get_traced_memory()[1] - base
            left = tracemalloc.get_traced_memory()[0] - base
            assert peak >= 32 * MiB  # the buffer was allocated ...
            assert left < 4 * MiB, left  # ... and freed without gc.collect()
            assert ref() is None, gc.get_referrers(ref())
            second, ref = connect()
            announce(second, 128 * MiB)  # over the limit: refused, dropped
            assert isinstance(rx.errors[-1][1], rsock.ProtocolError)
            assert ref() is None, gc.get_referrers(ref())
        finally:
            gc.enable()
        first.close()
        second.close()


def test_senders_in_the_middle_of_runs_share_the_limit_without_deadlock(dev):
    """Guards issue 26 point 5's design: runs in progress count against ``mem_limit``
    (on main each connection's first incomplete message, and every run in progress, was
    exempt, so four senders each in a 2 MiB run made a 2 MiB receiver hold all of them)
    -- yet the queue never deadlocks with every sender in the middle of a run: the
    oldest run may always grow to its end. Every run arrives whole and in order, and
    what the receiver holds stays within twice the limit."""
    dev("127.0.46.41", "lim-rx3")
    dev("127.0.46.42", "lim-tx3")
    limit, frame, frames, runs, senders = 2 * MiB, 512 << 10, 4, 4, 4
    with Receiver(("127.0.46.41", 9465), mem_limit=limit) as rx:
        socks = connect_senders(rx, senders, "127.0.46.42", ("127.0.46.41", 9465), timeout=60)
        failures: list = []

        def send_runs(k: int, s) -> None:
            try:
                for r in range(runs):
                    for f in range(frames):
                        s.send(bytes([k, r, f]) * (frame // 3), more=f < frames - 1)
            except BaseException as e:
                failures.append(e)
        threads = [threading.Thread(target=send_runs, args=(k, s), daemon=True)
                   for k, s in enumerate(socks)]
        for th in threads:
            th.start()
        got: dict[tuple, list[int]] = {}
        peak, current = 0, None
        for _ in range(senders * runs * frames):
            m = rx.recv(timeout=60)  # a deadlock would be a TimeoutError here
            held = rx.held + sum(c.held for c, _ in rx.conns.values())
            peak = max(peak, held + len(m.data))
            k, r, f = m.data[:3]
            assert current in (None, (k, r)), "frames of two runs interleaved"
            current = (k, r) if m.more else None
            got.setdefault((k, r), []).append(f)
        assert not failures, failures
        assert all(got[(k, r)] == list(range(frames)) for k in range(senders)
                   for r in range(runs))
        assert peak <= 2 * limit + frame, peak
        for th in threads:
            th.join(10)
        for s in socks:
            s.close()


def test_an_application_that_does_not_read_holds_twice_the_limit_at_most(dev):
    """Guards issue 26 point 5's bound when the application stops reading: runs past
    the limit are allowed one at a time, and only once the application took every
    complete run (else each sender's run in turn would go past the limit and the
    queue would hold them all: on main, all 8 MiB with a 2 MiB limit)."""
    dev("127.0.46.51", "lim-rx4")
    dev("127.0.46.52", "lim-tx4")
    limit, frame, frames, senders = 2 * MiB, 512 << 10, 4, 4
    with Receiver(("127.0.46.51", 9466), mem_limit=limit) as rx:
        socks = connect_senders(rx, senders, "127.0.46.52", ("127.0.46.51", 9466), timeout=60)

        def send_run(k: int, s) -> None:
            for f in range(frames):
                s.send(bytes([k, f]) * (frame // 2), more=f < frames - 1)
        threads = [threading.Thread(target=send_run, args=(k, s), daemon=True)
                   for k, s in enumerate(socks)]
        for th in threads:
            th.start()
        peak, end = 0, time.monotonic() + 6
        while time.monotonic() < end:  # the receiver runs; the application reads nothing
            rx.progress()
            peak = max(peak, rx.held + sum(c.held for c, _ in rx.conns.values()))
            time.sleep(0.01)
        assert peak <= 2 * limit, peak
        assert rx.held >= limit  # (it did take what it could)
        got = [rx.recv(timeout=60) for _ in range(senders * frames)]  # then it reads
        runs = [(m.data[0], m.data[1]) for m in got]
        for i in range(0, len(runs), frames):  # each run whole, frames in order
            assert runs[i:i + frames] == [(runs[i][0], f) for f in range(frames)], runs
        for th in threads:
            th.join(10)
        for s in socks:
            s.close()


def test_the_hello_limits_interoperate_with_peers_that_predate_them(dev):
    """Guards the wire change (docs/socket.md, "Hello"): the limits ride behind the 12
    bytes of the version-1 hello under a feature flag, so a peer that predates them
    reads its 12 bytes as before, and a hello without the flag (zero-padded by rdma_cm
    to 56 bytes) means "limits unknown". Such an old sender still talks to a Receiver;
    when it sends past the limit it cannot have known, the receiver refuses it all the
    same (a ProtocolError, no ABORT it would not understand: it sees a reset)."""
    from softrdma.socket.conn import Connection
    from softrdma.socket.record import FEATURE_INLINE, FEATURE_LIMITS, HELLO_SIZE, Hello

    new = Hello(64, 4096, FEATURE_INLINE | FEATURE_LIMITS, max_message=MiB, max_run=2 * MiB)
    wire = new.pack() + bytes(56 - len(new.pack()))
    assert Hello.unpack(wire) == new
    # what a version-1 parser reads: its five fields, the unknown flag bit aside
    assert struct.unpack_from("!4sBBHI", wire) == (b"SRS1", 1, 3, 64, 4096)
    v1 = Hello(64, 4096).pack()
    assert len(v1) == HELLO_SIZE and Hello.unpack(v1 + bytes(44)).max_message is None
    with pytest.raises(rsock.ProtocolError, match="FEATURE_LIMITS"):
        Hello.unpack(new.pack()[:HELLO_SIZE])  # the flag without the fields

    class OldConnection(Connection):
        def hello(self) -> Hello:
            return Hello(self.opts.slots, self.opts.inline_max)  # version 1, no limits

        def check_size(self, n: int) -> None:
            pass  # (an old sender knows no limits)

    class OldSocket(rsock.socket):
        def _make_conn(self, hub, cmid):
            return OldConnection(hub, cmid, self.options)

    dev("127.0.46.61", "lim-rx5")
    dev("127.0.46.62", "lim-old")
    with Receiver(("127.0.46.61", 9467), mem_limit=MiB) as rx:
        s = OldSocket()
        s.settimeout(30)
        s.bind(("127.0.46.62", 0))
        t = threading.Thread(target=s.connect, args=(("127.0.46.61", 9467),))
        t.start()
        while t.is_alive():
            try:
                rx.recv(timeout=0.1)
            except TimeoutError:
                pass
        assert s._conn.peer.max_message == MiB  # it got the limits (and ignores them)
        s.send(b"old but welcome")
        s.send(b"z" * 100_000)
        assert rx.recv(timeout=30).data == b"old but welcome"
        assert rx.recv(timeout=30).data == b"z" * 100_000
        s.send(b"y" * (2 * MiB))  # past the limit it could not know
        end = time.monotonic() + 30
        while rx.conns and time.monotonic() < end:
            try:
                rx.recv(timeout=0.2)
            except TimeoutError:
                pass
        (_, error), = rx.errors
        assert isinstance(error, rsock.ProtocolError) and f"max_message of {MiB}" in str(error)
        with pytest.raises(ConnectionResetError):
            for _ in range(100):
                s.send(b"x")
                time.sleep(0.05)
        s.close()


def test_an_rsocket_sender_with_keepalive_notices_its_receiver_killed(dev):
    """Guards issue 26 point 4 for rsocket: its keepalive (SO_KEEPALIVE, a 0-byte RDMA
    WRITE) did go out from a blocked ``send``, but rsocket's REQ asks for retry_cnt 7,
    which rxe takes as "retransmit for ever", so it never failed and the sender stayed
    blocked. Now a keepalive unacknowledged for KEEPALIVE_GIVE_UP retransmission
    periods (8 x 268 ms) breaks the connection."""
    from softrdma.socket import rsconn

    give_up = getattr(rsconn, "KEEPALIVE_GIVE_UP", 8)  # (so main fails on the wait)

    code = ("import time; from softrdma import socket as r; "
            "from softrdma.verbs_api import add_device; add_device('127.0.46.71'); "
            "srv = r.create_server(('127.0.46.71', 9468), protocol='rsocket'); "
            "print('READY', flush=True); c, _ = srv.accept(); print('ACCEPTED', flush=True); "
            "time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "READY"
        dev("127.0.46.72", "lim-rs")
        opts = rsconn.RSOptions(keepalive=1.0)
        s = rsock.socket(protocol="rsocket", options=opts)
        s.settimeout(60)
        s.bind(("127.0.46.72", 0))
        s.connect(("127.0.46.71", 9468))
        assert p.stdout.readline().strip() == "ACCEPTED"
        outcome: dict = {}

        def sender() -> None:
            try:
                while True:
                    s.sendall(b"x" * 65536)
            except BaseException as e:
                outcome["error"], outcome["at"] = e, time.monotonic()
        t = threading.Thread(target=sender, daemon=True)
        t.start()
        time.sleep(3)  # the receiver never reads: its buffer fills, the sender waits
        assert t.is_alive() and not outcome
        killed = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        bound = opts.keepalive + give_up * 4.096e-6 * (1 << opts.ack_timeout)
        t.join(2 * bound + 5)
        assert not t.is_alive(), "rsocket send() still blocked after the receiver died"
        assert isinstance(outcome["error"], ConnectionResetError), outcome
        assert outcome["at"] - killed < 2 * bound + 1, (outcome["at"] - killed)
        s.close()
    finally:
        p.kill()
        p.wait(10)


def test_a_sender_failed_before_its_established_was_seen_is_in_errors(dev, traced):
    """A sender can break the protocol before the receiver saw its ESTABLISHED: its RTU
    and its first records read in one pass of the receiver, the records failing it while
    it is still half-open. Its error goes to ``Receiver.errors`` all the same (it was
    dropped without a trace, and CI once saw the test above find ``errors`` empty).
    Here the receiver answers the request, then stops reading while the blind sender's
    RTU and announcements of 1 MiB frames (past the 2 MiB ``max_run``) pile up."""
    dev("127.0.46.11", "lim-mq")
    limit = 2 * MiB
    with Receiver(("127.0.46.11", 9463), mem_limit=limit) as rx:
        p = _endless("127.0.46.14", 9463, MiB, 40, "--blind")
        try:
            end = time.monotonic() + 60
            while not len(rx.half_open) and time.monotonic() < end:
                rx.progress()
                time.sleep(0.001)
            assert len(rx.half_open) == 1
            time.sleep(1.0)  # the REP went: its RTU and records arrive, unread
            outcome, _ = _drive(rx, p)
        finally:
            p.kill()
            p.wait(10)
        assert outcome.startswith("ERR ConnectionResetError"), outcome
        (sender, error), = rx.errors
        assert sender[0] == "127.0.46.14"
        assert isinstance(error, rsock.ProtocolError) and "max_run" in str(error), error
        assert rx.in_memory == 0 and not rx.conns and not len(rx.half_open)
