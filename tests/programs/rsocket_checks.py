#!/usr/bin/env python3
"""Scenarios of softrdma.socket's rsocket protocol run by tests/test_rsocket.py, each in a
process of its own with its device pinned by SOFTRDMA_IP (127.0.11.x, real UDP):

    rsocket_checks.py echo-server ADDR PORT      # echo a byte stream until EOF
    rsocket_checks.py sizes ADDR PORT            # 1 B .. 4 MiB through the echo server
    rsocket_checks.py backpressure ADDR PORT     # a reader that does not read
    rsocket_checks.py close ADDR PORT            # orderly close both ways, shutdown(WR)

Prints "OK <scenario> ..." and exits 0 when every check held."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from softrdma import socket as rsock  # noqa: E402
from softrdma.socket.rsocket import RSOptions  # noqa: E402

SIZES = [1, 2, 3, 15, 16, 17, 63, 64, 65, 1000, 2047, 2048, 2049, 4095, 4096, 4097,
         65535, 65536, 65537, 131071, 131072, 131073, 1 << 20, (1 << 22) - 1, 1 << 22]


def pattern(n: int, seed: int) -> bytes:
    base = bytes((i * 7 + seed) & 0xFF for i in range(251))
    return (base * (n // 251 + 1))[:n]


def recv_exact(s, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise AssertionError(f"EOF after {got} of {n} bytes")
        got += k
    return bytes(buf)


def echo_server(addr: str, port: int) -> None:
    srv = rsock.create_server((addr, port), protocol="rsocket")
    print("listening", flush=True)
    c, _ = srv.accept()
    srv.close()
    total = 0
    while True:
        data = c.recv(1 << 20)
        if not data:
            break
        c.sendall(data)
        total += len(data)
    c.close()
    print(f"OK echo-server {total} bytes", flush=True)


def sizes(addr: str, port: int) -> None:
    s = rsock.create_connection((addr, port), protocol="rsocket")
    t0 = time.monotonic()
    total = 0
    for i, n in enumerate(SIZES):
        data = pattern(n, i)
        # send from a thread: a message larger than the rings needs the echo read
        # concurrently (the echo server sends back as it receives)
        th = threading.Thread(target=s.sendall, args=(data,))
        th.start()
        back = recv_exact(s, n)
        th.join()
        assert back == data, f"size {n}: data differs"
        total += n
    s.close()
    dt = time.monotonic() - t0
    print(f"OK sizes {len(SIZES)} transfers {total} bytes echoed in {dt:.2f}s "
          f"({2 * total / dt / 1e6:.1f} MB/s)", flush=True)


def _pair(addr: str, port: int, opts: RSOptions | None = None,
          client_opts: RSOptions | None = None):
    srv = rsock.create_server((addr, port), protocol="rsocket", options=opts)
    got: dict = {}
    th = threading.Thread(target=lambda: got.setdefault("c", srv.accept()[0]))
    th.start()
    cli = rsock.create_connection((addr, port), protocol="rsocket",
                                  options=client_opts or opts)
    th.join()
    srv.close()
    return cli, got["c"]


def _fill(s, chunk: bytes) -> int:
    """Send non-blocking until the peer's ring or credits are exhausted."""
    s.setblocking(False)
    total = 0
    try:
        while True:
            total += s.send(chunk)
    except BlockingIOError:
        pass
    s.setblocking(True)
    return total


def backpressure(addr: str, port: int) -> None:
    rbuf = 1 << 17  # rsocket's default receive buffer (two halves of 64 KiB)
    # 1. bytes: the ring bounds what a sender may put in flight
    cli, srv = _pair(addr, port)
    time.sleep(0.3)
    sent = _fill(cli, pattern(65536, 1))
    assert sent == rbuf, f"{sent} bytes accepted with the peer not reading; {rbuf} expected"
    # still blocked a while later: nothing was granted while the reader sleeps
    time.sleep(0.5)
    cli.settimeout(0.3)
    try:
        cli.send(b"x")
        raise AssertionError("a send went through with no room at the reader")
    except TimeoutError:
        pass
    cli.settimeout(None)
    # the reader drains: grants come back and the rest flows
    rest = pattern(3 * 65536, 2)
    th = threading.Thread(target=cli.sendall, args=(rest,))
    th.start()
    got = recv_exact(srv, sent + len(rest))
    th.join()
    assert got == (pattern(65536, 1) * 2)[:sent] + rest
    # 2. messages: the credits (rq_size = 384 receives) bound the writes in flight
    sent2 = _fill(cli, b"0123456789")
    assert sent2 == 3840, f"{sent2} bytes in 10-byte sends; 384 credits expected"
    got2 = recv_exact(srv, sent2)
    assert got2 == b"0123456789" * 384
    cli.sendall(b"after")
    assert recv_exact(srv, 5) == b"after"
    cli.close()
    assert srv.recv(10) == b""
    srv.close()
    # 3. a small ring (4 KiB, 16 credits) under a stream of 1 MiB, read slowly
    small = RSOptions(rbuf_size=4096, sbuf_size=4096, rq_size=16, sq_size=16)
    cli, srv = _pair(addr, port + 1, small)
    data = pattern(1 << 20, 3)
    th = threading.Thread(target=cli.sendall, args=(data,))
    th.start()
    buf = bytearray()
    while len(buf) < len(data):
        buf += srv.recv(1000)
    th.join()
    assert bytes(buf) == data
    cli.close()
    srv.close()
    print(f"OK backpressure ring {sent} bytes, credits {sent2 // 10} writes", flush=True)


def close(addr: str, port: int) -> None:
    # 1. the client closes after sending: the server reads everything, then EOF
    cli, srv = _pair(addr, port)
    data = pattern(300000, 4)
    th = threading.Thread(target=lambda: (cli.sendall(data), cli.close()))
    th.start()
    got = bytearray()
    while True:
        b = srv.recv(65536)
        if not b:
            break
        got += b
    th.join()
    assert bytes(got) == data, f"{len(got)} of {len(data)} bytes before EOF"
    assert srv.recv(10) == b""  # EOF stays
    try:
        srv.send(b"late")
        raise AssertionError("send after the peer's close succeeded")
    except (BrokenPipeError, ConnectionResetError):
        pass
    srv.close()
    # 2. the server closes after sending: the client reads everything, then EOF
    cli, srv = _pair(addr, port + 1)
    th = threading.Thread(target=lambda: (srv.sendall(data), srv.close()))
    th.start()
    got = bytearray()
    while True:
        b = cli.recv(65536)
        if not b:
            break
        got += b
    th.join()
    assert bytes(got) == data
    cli.close()
    # 3. shutdown(SHUT_WR): the peer sees EOF and may still answer
    cli, srv = _pair(addr, port + 2)
    cli.sendall(b"request")
    cli.shutdown(1)
    assert recv_exact(srv, 7) == b"request"
    assert srv.recv(10) == b""
    srv.sendall(b"response")
    assert recv_exact(cli, 8) == b"response"
    srv.close()
    assert cli.recv(10) == b""
    cli.close()
    # 4. the passive closer's ACK of the DISCONNECT is lost: it must stay up (TIME_WAIT)
    # and re-ACK the retransmission, or the active closer's DISCONNECT never completes
    # (rxe's requester then retransmits for ever; softrdma's gives up: RETRY_EXC)
    _lost_close_ack(addr, port + 3)
    # 4b. ... and the first retransmission lost as well: it comes a period later
    _lost_close_ack(addr, port + 4, lost_retransmissions=1)
    # 5. close released every QP, MR, CQ and PD on both sides
    from softrdma.verbs_api.device import get_soft_device
    left = {k: v for k, v in get_soft_device().in_use.items() if v}
    assert not left, f"left on the device after close: {left}"
    print("OK close both ways, shutdown(WR); nothing left on the device", flush=True)


def _lost_close_ack(addr: str, port: int, lost_retransmissions: int = 0) -> None:
    """The active closer (the client) retransmits on rdma_cm's default ACK timeout (19,
    2.1 s) as rxe does; the passive one's own QP uses 16 (268 ms): TIME_WAIT must follow
    the peer's period, not its own. ``lost_retransmissions``: that many of the active
    closer's retransmitted DISCONNECTs are lost too, each a period more of silence that
    TIME_WAIT must outlast."""
    from softrdma.verbs_api.device import get_soft_device
    from softrdma.wire.opcodes import Opcode
    cli, srv = _pair(addr, port, RSOptions(ack_timeout=16), RSOptions(ack_timeout=None))
    assert cli._conn.qp.query(0x200)[0].timeout == 19
    cli.sendall(b"ping")
    assert recv_exact(srv, 4) == b"ping"
    dev = get_soft_device()
    active, passive = cli._conn, srv._conn
    disconnect_psn = active.qp.engine.req.psn  # the next request: the DISCONNECT
    dropped = []
    sent_disconnects = []
    send_packet = dev.send_packet

    def lossy(qp, pkt, dst_ip, *tos):
        if (qp is passive.qp.engine and not dropped and pkt[0] == Opcode.RC_ACKNOWLEDGE
                and int.from_bytes(pkt[9:12], "big") == disconnect_psn):
            dropped.append(bytes(pkt))
            return
        if qp is active.qp.engine and int.from_bytes(pkt[9:12], "big") == disconnect_psn:
            sent_disconnects.append(bytes(pkt))
            if 1 < len(sent_disconnects) <= 1 + lost_retransmissions:
                return  # a retransmission lost on the way
        send_packet(qp, pkt, dst_ip, *tos)

    dev.send_packet = lossy
    try:
        th = threading.Thread(target=cli.close)
        th.start()
        assert srv.recv(10) == b""  # the DISCONNECT arrived (its ACK did not)
        srv.close()
        th.join()
    finally:
        dev.send_packet = send_packet
    assert dropped, "the DISCONNECT's ACK was never sent"
    assert active.error is None, f"the active close failed: {active.error!r}"
    assert passive.qp.engine.resp.duplicates >= 1, "no retransmitted DISCONNECT was answered"
    assert len(sent_disconnects) >= 2 + lost_retransmissions


def main() -> int:
    what, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"echo-server": echo_server, "sizes": sizes, "backpressure": backpressure,
     "close": close}[what](addr, port)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SOFTRDMA_IP", "127.0.11.1")
    sys.exit(main())
