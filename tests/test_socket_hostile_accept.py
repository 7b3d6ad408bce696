"""Forged connection requests against the socket layer's listeners (issue 26, points 1
and 2): an off-path sender with only an address and a port, sending CM REQs that carry
the socket layer's hello from an address nobody listens on, over real UDP on loopback
(127.0.71.x-127.0.74.x). Such a REQ is answered with a REP that no RTU ever follows.

* one forged REQ must not hold ``accept()`` (it waited for that one connection's
  ESTABLISHED with no limit: a legitimate client behind it timed out after 25 s);
* a flood of them must not grow a ``Receiver`` or a ``listen(8)`` socket without limit
  (each held a QP and ~600 KiB of registered slots: 2,000 REQs took 1.2 GiB), and
  legitimate clients still get in during and after it;
* the half-open table evicts the oldest, times out the silent, and what it releases is
  freed at once, without the cycle collector.
"""

from __future__ import annotations

import gc
import os
import select
import ipaddress
import socket as pysocket
import threading
import time
import tracemalloc
import weakref
from typing import Any

import pytest

from softrdma import socket as rsock
from softrdma.cm.cma import CmaHeader, PortSpace, gid_from_ip, service_id
from softrdma.cm.messages import REQ, build_cm, parse_cm
from softrdma.cm.qp1 import build_qp1
from softrdma.socket import Options, Receiver
from softrdma.socket import handshake
from softrdma.socket.handshake import (
    HALF_OPEN_MAX, HANDSHAKE_TIMEOUT, REJ_EVICTED, REJ_TIMEOUT, REP_TIMEOUT, HalfOpenTable,
    rej_reason,
)
from softrdma.socket.mq import RECEIVER_BACKLOG
from softrdma.socket.record import CTRL_SLOTS, RECORD_SIZE, Hello
from softrdma.socket.rswire import ConnData
from softrdma.wire.icrc import set_icrc_ipv4
from softrdma.wire.packet import parse

#: what one half-open connection registers with the default Options: receive slots for
#: the peer's credits and the control records, and as many send slots, each a record
#: plus an inline message (conn.py)
_O = Options()
CONN_BYTES = (_O.slots + CTRL_SLOTS + max(_O.slots, 16) + 8) * (RECORD_SIZE + _O.inline_max)
#: what a half-open one registers: only the receive slots (the send slots wait for the
#: first record it sends, which a forged request never gets to)
HALF_OPEN_BYTES = (_O.slots + CTRL_SLOTS) * (RECORD_SIZE + _O.inline_max)
#: a flood's size, as in the issue's reproduction
FLOOD = 2000
#: how long a legitimate client may take to get in, retrying a refusal (the forged
#: requests may evict its own; a TCP client's SYN retransmission plays this part): one
#: handshake timeout plus slack for five helpers on two cores. Before the fix: 25 s per
#: forged request ahead of it, or never.
CONNECT_BOUND = HANDSHAKE_TIMEOUT + 30


class Forger:
    """An off-path sender: a UDP socket on an address of its own (nobody listens there,
    so the REPs go nowhere) that sends rdma_cm REQs with the socket layer's hello."""

    def __init__(self, src: str, dst: str, protocol: str = "softrdma") -> None:
        self.src, self.dst = ipaddress.ip_address(src), ipaddress.ip_address(dst)
        # the first words a server of the protocol expects: softrdma's hello, or
        # rsocket's struct rs_conn_data (version 1, 64 credits, made-up buffers)
        self.hello = Hello(_O.slots, _O.inline_max).pack() if protocol == "softrdma" \
            else ConnData(1, 0, 64, 0, 0x1000, 1, 4, 0x2000, 2, 1 << 16).pack()
        self.udp = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
        self.udp.bind((src, 0))
        self.sport = self.udp.getsockname()[1]

    def req(self, port: int, n: int) -> bytes:
        """The ``n``-th forged REQ to ``port``: its own comm ID, QPN and PSN, rdma_cm's
        defaults elsewhere, a cma header naming the forger and the socket layer's hello."""
        private = CmaHeader(self.src, self.dst, 20000 + n % 40000).pack() + self.hello
        mad = build_cm(REQ, tid=0x5000_0000 + n, private_data=private,
                       local_comm_id=0x0100_0000 + n,
                       service_id=service_id(PortSpace.TCP, port),
                       local_qpn=0x100 + n % 0xFF_0000, starting_psn=n & 0xFF_FFFF,
                       responder_resources=1, initiator_depth=1,
                       remote_cm_response_timeout=20, local_cm_response_timeout=20,
                       retry_count=6, rnr_retry_count=7, max_cm_retries=15, pkey=0xFFFF,
                       path_mtu=3, primary_local_lid=0xFFFF, primary_remote_lid=0xFFFF,
                       primary_local_gid=gid_from_ip(self.src),
                       primary_remote_gid=gid_from_ip(self.dst),
                       primary_hop_limit=64, primary_local_ack_timeout=19)
        raw = build_qp1(mad)
        set_icrc_ipv4(raw, self.src.packed, self.dst.packed, self.sport)
        return bytes(raw)

    def send(self, port: int, first: int, count: int) -> None:
        for n in range(first, first + count):
            self.udp.sendto(self.req(port, n), (str(self.dst), 4791))

    def close(self) -> None:
        self.udp.close()


@pytest.fixture
def dev(live_device):
    """Live devices on loopback for this test, removed after it (conftest)."""
    return live_device


def connect_retrying(address: tuple[str, int], deadline: float) -> Any:
    """A legitimate client: connect, and try again if refused (its request may have been
    evicted by forged ones), until ``deadline``."""
    while True:
        try:
            return rsock.create_connection(address, timeout=max(0.1, deadline -
                                                                time.monotonic()))
        except (ConnectionRefusedError, TimeoutError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def live() -> int:
    """The bytes Python holds now that something can still reach (tracemalloc, after a
    collection: a released connection's QP engine is a reference cycle of the layers
    below, ~20 KiB that the collector frees on its own schedule; the MRs and buffers,
    the bulk, go at once: see the *_without_the_cycle_collector tests)."""
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


# -- one forged request ---------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["softrdma", "rsocket"])
def test_one_forged_request_does_not_hold_accept(dev, protocol):
    """Guards point 1: accept() answered the forged REQ and then waited for its
    ESTABLISHED alone, so the legitimate client behind it timed out (25 s, or for ever
    without a timeout), and with a timeout it returned the forged, never connected one.
    Now accept() returns the connection that completes, the forged one stays half-open
    (at most HANDSHAKE_TIMEOUT) and accept() never returns it. Both protocols share the
    handshake (SocketBase)."""
    port = 9600 if protocol == "softrdma" else 9601
    dev("127.0.71.1", "hostile-acc")
    forger = Forger("127.0.71.99", "127.0.71.1", protocol)
    with rsock.create_server(("127.0.71.1", port), backlog=8, protocol=protocol) as srv:
        forger.send(port, 0, 1)
        srv.settimeout(0.5)  # the forged REQ is answered: nothing completes
        with pytest.raises(TimeoutError):
            srv.accept()
        assert srv.listen_queue() == (1, 0)
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.setdefault(
            "c", rsock.create_connection(("127.0.71.1", port), timeout=20,
                                         protocol=protocol)))
        t.start()
        srv.settimeout(20)
        start = time.monotonic()
        s, peer = srv.accept()
        took = time.monotonic() - start
        t.join(20)
        c = box["c"]
        assert took < 5, f"accept took {took:.1f} s behind one forged request"
        c.sendall(b"hello")
        s.settimeout(10)
        assert s.recv(5) == b"hello"  # the legitimate client's connection, not the forger's
        assert srv.listen_queue() == (1, 0)  # the forged one: still half-open, not handed out
        c.close(), s.close()
    forger.close()


# -- floods ---------------------------------------------------------------------------------

def test_a_flood_of_forged_requests_leaves_a_receiver_bounded_and_open(dev):
    """Guards point 2 at the Receiver: every forged REQ became a half-open connection
    with its QP and slots (2,000 REQs: +1.2 GiB, never freed); Receiver(backlog=1024)
    never applied the backlog. Now at most RECEIVER_BACKLOG are half-open, the traced
    memory stays under a bound of that many connections (plus the legitimate ones and
    slack), and legitimate senders connect and deliver during and after the flood."""
    dev("127.0.72.1", "hostile-mq")
    forger = Forger("127.0.72.99", "127.0.72.1")
    bound = (RECEIVER_BACKLOG + 8) * CONN_BYTES + (16 << 20)
    delivered: list[bytes] = []
    tracemalloc.start()
    try:
        with Receiver(("127.0.72.1", 9700)) as rx:
            base = live()
            peak = 0
            deadline = time.monotonic() + CONNECT_BOUND
            errors: list[BaseException] = []

            def sender(i: int) -> None:
                try:
                    with connect_retrying(("127.0.72.1", 9700), deadline) as s:
                        s.send(b"legit %d" % i)
                        while f"legit {i}".encode() not in delivered and \
                                time.monotonic() < deadline:
                            time.sleep(0.02)  # stay connected until it was taken
                except BaseException as e:  # noqa: BLE001 (reported below)
                    errors.append(e)

            senders = [threading.Thread(target=sender, args=(i,)) for i in range(4)]
            for i in range(0, FLOOD, 50):
                forger.send(9700, i, 50)
                if i == FLOOD // 2:
                    for t in senders[:2]:
                        t.start()  # during the flood
                rx.progress()
                peak = max(peak, live() - base)
                assert peak < bound, f"{i + 50} forged REQs: +{peak >> 20} MiB"
                assert len(rx.half_open) <= RECEIVER_BACKLOG
            for t in senders[2:]:
                t.start()  # after it
            while len(delivered) < len(senders) and time.monotonic() < deadline \
                    and not errors:
                try:
                    delivered.append(rx.recv(timeout=0.5).data)
                except TimeoutError:
                    pass
            peak = max(peak, live() - base)
            for t in senders:
                t.join(10)
            assert not errors, errors
            assert sorted(delivered) == [b"legit %d" % i for i in range(4)]
            print(f"Receiver: +{peak / 2**20:.1f} MiB at most (bound {bound >> 20} MiB)")
            assert peak < bound, f"+{peak >> 20} MiB"
            assert len(rx.half_open) <= RECEIVER_BACKLOG
            # every forged REQ was evicted from the table, or never reached it: rdma_cm
            # forgot it while RECEIVER_BACKLOG requests waited (listen's backlog, as ucma)
            dropped = rx.listener.id.cdev.service.counters["listen_overflow"].get("REQ", 0)
            assert rx.half_open.evicted + dropped >= FLOOD - 2 * RECEIVER_BACKLOG
    finally:
        tracemalloc.stop()
        forger.close()


def test_a_flood_of_forged_requests_leaves_listen_8_bounded_and_open(dev):
    """Guards point 2 at a plain ``listen(8)`` socket: accept() answered forged REQs one
    at a time and waited on each, so nothing else got in; nothing bounded them. Now at
    most 8 are half-open, the traced memory stays under a bound of 8 + 8 connections and
    slack, and legitimate clients connect and are accepted during and after the flood."""
    dev("127.0.73.1", "hostile-l8")
    forger = Forger("127.0.73.99", "127.0.73.1")
    bound = 24 * CONN_BYTES + (16 << 20)
    got: list[bytes] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    half_open_seen: list[int] = []
    tracemalloc.start()
    try:
        srv = rsock.create_server(("127.0.73.1", 9800), backlog=8)
        base = live()

        def serve() -> None:
            srv.settimeout(0.2)
            try:
                while not stop.is_set():
                    half_open_seen.append(srv.listen_queue()[0])
                    try:
                        s, _ = srv.accept()
                    except TimeoutError:
                        continue
                    s.settimeout(10)
                    got.append(s.recv())
                    s.close()
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        server = threading.Thread(target=serve)
        server.start()
        deadline = time.monotonic() + CONNECT_BOUND
        clients: list[Any] = []

        def client(i: int) -> None:
            try:
                c = connect_retrying(("127.0.73.1", 9800), deadline)
                c.send(b"legit %d" % i)
                clients.append(c)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        peak = 0
        for i in range(0, FLOOD, 50):
            forger.send(9800, i, 50)
            if i == FLOOD // 2:
                for t in threads[:2]:
                    t.start()  # during the flood
            time.sleep(0.01)
            peak = max(peak, live() - base)
            assert peak < bound, f"{i + 50} forged REQs: +{peak >> 20} MiB"
        for t in threads[2:]:
            t.start()  # after it
        while len(got) < 4 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        peak = max(peak, live() - base)
        stop.set()
        server.join(30)
        for t in threads:
            t.join(10)
        assert not errors, errors
        assert sorted(got) == [b"legit %d" % i for i in range(4)]
        print(f"listen(8): +{peak / 2**20:.1f} MiB at most (bound {bound >> 20} MiB)")
        assert peak < bound, f"+{peak >> 20} MiB"
        assert max(half_open_seen) <= 8
        for c in clients:
            c.close()
        srv.close()
    finally:
        stop.set()
        tracemalloc.stop()
        forger.close()


# -- the table ------------------------------------------------------------------------------

class FakeConn:
    def __init__(self) -> None:
        self.established = False
        self.error: BaseException | None = None


def test_the_half_open_table_evicts_the_oldest_and_times_out_the_silent(monkeypatch):
    """The table's rules, on a scripted clock: at most ``limit``, the oldest evicted for
    a newer request (REJ_EVICTED), a connection silent for HANDSHAKE_TIMEOUT turned away
    (REJ_TIMEOUT), a completed one handed over once, a failed one released. The
    deadline is the socket layer's own: three REP timeouts of rdma_cm's default."""
    assert REP_TIMEOUT == pytest.approx(4.096)
    assert HANDSHAKE_TIMEOUT == pytest.approx(3 * 4.096)
    now = [100.0]
    monkeypatch.setattr(handshake, "time", type("T", (), {"monotonic": lambda: now[0]}))
    released: list[tuple[Any, bytes]] = []
    t: HalfOpenTable[FakeConn] = HalfOpenTable(
        2, ready=lambda c: c.established, release=lambda e, why: released.append((e, why)))
    a, b, c = FakeConn(), FakeConn(), FakeConn()
    t.admit(a, ("10.0.0.1", 1))
    now[0] += 1
    t.admit(b, ("10.0.0.2", 2))
    t.admit(c, ("10.0.0.3", 3))  # full: a, the oldest, goes
    assert len(t) == 2 and [(e.conn, why) for e, why in released] == [(a, REJ_EVICTED)]
    b.established = True
    done = t.completed()
    assert [e.conn for e in done] == [b] and done[0].peer == ("10.0.0.2", 2)
    assert t.completed() == [] and len(t) == 1
    now[0] += HANDSHAKE_TIMEOUT  # c has waited its whole deadline
    assert t.completed() == []
    assert released[-1][0].conn is c and released[-1][1] == REJ_TIMEOUT
    d = FakeConn()
    t.admit(d, ("10.0.0.4", 4))
    d.error = ConnectionResetError()
    assert t.completed() == [] and len(t) == 0 and released[-1][0].conn is d
    assert (t.evicted, t.timed_out, t.failed) == (1, 1, 1)
    with pytest.raises(ValueError):
        HalfOpenTable(0, ready=bool, release=lambda e, why: None)


def test_evicted_connections_die_without_the_cycle_collector(dev):
    """What a Receiver turns away is freed when it goes, not at the next gc pass: with
    the collector off, an evicted half-open connection, its QP's memory regions and their
    buffers are gone as soon as the table drops them (a closed MR and its soft half kept
    each other alive, with the 300 KiB buffer: the flood's memory stayed until gc)."""
    dev("127.0.74.1", "hostile-gc")
    forger = Forger("127.0.74.99", "127.0.74.1")
    gc.collect()
    gc.disable()
    try:
        with Receiver(("127.0.74.1", 9900), backlog=2) as rx:
            refs: list[weakref.ref] = []
            for n in range(6):
                forger.send(9900, n, 1)
                end = time.monotonic() + 10
                while len(rx.half_open) < min(n + 1, 2) or \
                        rx.half_open.evicted < n - 1:
                    rx.progress()
                    assert time.monotonic() < end, "the forged REQ never arrived"
                    time.sleep(0.01)
                for e in rx.half_open:
                    assert e.conn.send_mr is None  # (registered at its first record)
                    refs += [weakref.ref(e.conn), weakref.ref(e.conn.recv_mr)]
            assert rx.half_open.evicted == 4 and len(rx.half_open) == 2
            live = {id(o) for e in rx.half_open for o in (e.conn, e.conn.recv_mr)}
            dead = [r for r in refs if r() is None]
            alive = [r() for r in refs if r() is not None and id(r()) not in live]
            assert not alive, f"released but alive without gc: {alive[:3]}"
            assert len(dead) >= 4 * 2
    finally:
        gc.enable()
        forger.close()


def test_a_listening_socket_frees_what_it_evicts_without_the_cycle_collector(dev):
    """The same for a listening socket, whose half-open connections have a hub (CQ, PD,
    completion channel) and a CM channel each: with the collector off, the connections
    and hubs it evicts are gone at once."""
    dev("127.0.74.2", "hostile-gc2")
    forger = Forger("127.0.74.98", "127.0.74.2")
    gc.collect()
    gc.disable()
    try:
        with rsock.create_server(("127.0.74.2", 9901), backlog=2) as srv:
            srv.settimeout(0.05)
            refs: list[weakref.ref] = []
            for n in range(6):
                forger.send(9901, n, 1)
                end = time.monotonic() + 10
                while srv.listen_queue()[0] < min(n + 1, 2) or \
                        srv._half_open.evicted < n - 1:
                    with pytest.raises(TimeoutError):
                        srv.accept()  # nothing completes; the requests are answered
                    assert time.monotonic() < end, "the forged REQ never arrived"
                for e in srv._half_open:
                    refs += [weakref.ref(e.conn), weakref.ref(e.extra),
                             weakref.ref(e.conn.recv_mr)]
            assert srv._half_open.evicted == 4 and srv.listen_queue() == (2, 0)
            live = {id(o) for e in srv._half_open for o in (e.conn, e.extra,
                                                            e.conn.recv_mr)}
            alive = [r() for r in refs if r() is not None and id(r()) not in live]
            assert not alive, f"released but alive without gc: {alive[:3]}"
            assert sum(r() is None for r in refs) >= 4 * 3
    finally:
        gc.enable()
        forger.close()


def test_the_accept_queue_is_bounded_by_the_backlog_and_keeps_moving(dev):
    """Completed connections not yet accepted are the backlog proper, as TCP's accept
    queue: with ``listen(1)`` and one waiting, the next request is rejected and its
    client is told why (REJ_BACKLOG in the REJ's private data); the waiting one keeps
    being driven (what its client sends arrives) and is accepted later. Before, the
    backlog counted only requests not yet answered, and the REJ said nothing."""
    dev("127.0.75.1", "hostile-aq")
    with rsock.create_server(("127.0.75.1", 9950), backlog=1) as srv:
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.setdefault(
            "a", rsock.create_connection(("127.0.75.1", 9950), timeout=20)))
        t.start()
        end = time.monotonic() + 20
        while srv.listen_queue() != (0, 1):  # progress as accept() does, taking nothing
            srv._listener_progress()
            assert time.monotonic() < end, srv.listen_queue()
            time.sleep(0.01)
        t.join(20)
        a = box["a"]
        a.send(b"sent before accept")
        refused: list[BaseException] = []

        def second() -> None:
            try:
                rsock.create_connection(("127.0.75.1", 9950), timeout=20).close()
            except ConnectionRefusedError as e:
                refused.append(e)
        t = threading.Thread(target=second)
        t.start()
        while t.is_alive() and time.monotonic() < end:
            srv._listener_progress()
            time.sleep(0.01)
        t.join(1)
        assert refused and "backlog full" in str(refused[0]), refused
        assert srv.listen_queue() == (0, 1)
        srv.settimeout(10)
        s, _ = srv.accept()
        s.settimeout(10)
        assert s.recv() == b"sent before accept"
        a.close(), s.close()


@pytest.mark.parametrize("protocol", ["softrdma", "rsocket"])
def test_a_select_loop_sees_a_connection_complete(dev, protocol):
    """A select() loop with a non-blocking accept(), a forged request ahead of the
    client: accept() returned the forged, never connected one at once (its deadline
    had passed), and now it must return the client's. accept() no longer waits for the
    RTU, so it answers a request and raises BlockingIOError; the listener's descriptor
    must then become readable again when the connection completes (its ESTABLISHED
    comes to the listener's channel), or the loop waits for ever with it ready."""
    port = 9960 if protocol == "softrdma" else 9961
    dev("127.0.75.2", "hostile-sel")
    dev("127.0.75.3", "hostile-sel-c")  # the client's own device: the CM over UDP

    def client() -> None:
        c = rsock.socket(protocol=protocol)
        c.settimeout(20)
        c.bind(("127.0.75.3", 0))
        c.connect(("127.0.75.2", port))
        box["c"] = c
    forger = Forger("127.0.75.99", "127.0.75.2", protocol)
    with rsock.create_server(("127.0.75.2", port), protocol=protocol) as srv:
        srv.setblocking(False)
        forger.send(port, 0, 1)
        box: dict[str, Any] = {}
        t = threading.Thread(target=client)
        t.start()
        end = time.monotonic() + 20
        got = None
        while got is None:
            left = end - time.monotonic()
            assert left > 0, "the listener never became readable for the completion"
            r, _, _ = select.select([srv.fileno()], [], [], left)
            if not r:
                continue
            try:
                got = srv.accept()
            except BlockingIOError:
                pass  # answered: the REP is out, the RTU not yet in
        t.join(20)
        s, peer = got
        assert peer[0] == "127.0.75.3", peer  # the client, not the forger
        box["c"].sendall(b"ok")
        s.settimeout(10)
        assert s.recv(2) == b"ok"
        box["c"].close(), s.close()
    forger.close()


def test_a_silent_half_open_sender_is_rejected_at_its_deadline(dev):
    """A forged REQ whose RTU never comes: the Receiver answers it with a REP, and at
    the table's deadline (shortened here from HANDSHAKE_TIMEOUT) rejects it with a REJ
    that says why, to the address the REQ named, and frees it. Before, the connection
    stayed until the CM gave up on its own (65 s at rdma_cm's default, hours if the REQ
    asked) and the Receiver kept it for ever."""
    dev("127.0.76.1", "hostile-dl")
    forger = Forger("127.0.76.99", "127.0.76.1")
    inbox = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    inbox.bind(("127.0.76.99", 4791))  # where the REP and REJ go
    inbox.settimeout(10)
    try:
        with Receiver(("127.0.76.1", 9970)) as rx:
            rx.half_open.timeout = 1.0
            forger.send(9970, 0, 1)
            end = time.monotonic() + 20
            while rx.half_open.timed_out == 0:
                rx.progress()
                assert time.monotonic() < end, len(rx.half_open)
                time.sleep(0.02)
            assert len(rx.half_open) == 0 and not rx.conns
            answers = []
            while not answers or answers[-1].name != "REJ":
                answers.append(parse_cm(parse(inbox.recv(2048)).payload))
            assert answers[0].name == "REP" and answers[-1].name == "REJ"
            rej = answers[-1]
            assert rej.remote_comm_id == 0x0100_0000  # the forged REQ's comm ID
            assert bytes(rej.private_data).rstrip(b"\0") == REJ_TIMEOUT
            assert rej_reason(rej.private_data) == ": " + REJ_TIMEOUT.decode()
    finally:
        inbox.close()
        forger.close()


def test_a_large_backlog_still_keeps_at_most_half_open_max(dev):
    """create_server's default backlog (128) would let a flood hold 128 half-open
    connections, 71 MiB and 512 descriptors (a CQ's and a CM channel's pipes each):
    half-open ones are capped at HALF_OPEN_MAX whatever the backlog, as Linux caps the
    SYN queue with tcp_max_syn_backlog."""
    dev("127.0.76.2", "hostile-max")
    forger = Forger("127.0.76.98", "127.0.76.2")
    with rsock.create_server(("127.0.76.2", 9980)) as srv:
        fds = len(os.listdir("/proc/self/fd"))
        srv.settimeout(0.05)
        forger.send(9980, 0, 100)
        end = time.monotonic() + 20
        while srv.listen_queue()[0] < HALF_OPEN_MAX or \
                srv._half_open.evicted < 100 - HALF_OPEN_MAX:
            with pytest.raises(TimeoutError):
                srv.accept()
            assert srv.listen_queue()[0] <= HALF_OPEN_MAX
            assert time.monotonic() < end, srv.listen_queue()
        assert srv.listen_queue() == (HALF_OPEN_MAX, 0)
        assert len(os.listdir("/proc/self/fd")) - fds <= 4 * HALF_OPEN_MAX + 8
    forger.close()


def test_a_half_open_connection_registers_only_its_receive_slots(dev):
    """A forged REQ makes the listener register the receive slots the peer may fill at
    once (68 x 4,128 bytes, 274 KiB), not the send slots too (another 290 KiB, until the
    connection sends its first record): 32 half-open connections at a Receiver hold
    about half of what they did (17.6 MiB)."""
    dev("127.0.72.61", "hostile-half")
    forger = Forger("127.0.72.69", "127.0.72.61")
    tracemalloc.start()
    try:
        with Receiver(("127.0.72.61", 9760)) as rx:
            base = live()
            forger.send(9760, 0, RECEIVER_BACKLOG)
            deadline = time.monotonic() + 20
            while len(rx.half_open) < RECEIVER_BACKLOG and time.monotonic() < deadline:
                rx.progress()
                time.sleep(0.01)
            assert len(rx.half_open) == RECEIVER_BACKLOG
            grown = live() - base
            per = grown / RECEIVER_BACKLOG
            print(f"{per / 1024:.0f} KiB per half-open connection")
            # receive slots plus 48 KiB for the QP, its queues and the rdma_cm id
            assert per < HALF_OPEN_BYTES + (48 << 10), f"{per / 1024:.0f} KiB each"
    finally:
        tracemalloc.stop()
        forger.close()
