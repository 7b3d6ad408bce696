#!/usr/bin/env python3
"""The softrdma side of librdmacm's rstream and riostream (custom tests: -S size, -C count,
-I iterations), over softrdma.socket's rsocket protocol.

    rsocket_stream.py server ADDR PORT [-S size] [-C count] [-I iters] [--rio] [--verify]
    rsocket_stream.py client ADDR PORT [...]

rstream (librdmacm/examples/rstream.c): a 16-byte sync (client sends, server answers),
then per iteration the client sends count transfers of size bytes and the server sends
as many back. With -T v every byte sent is the next value of a byte counter that runs
across the whole connection (common.c format_buf), and every byte received is checked
against the receiver's own counter (verify_buf).

riostream (riostream.c): both sides riomap their size-byte buffer at offset 0; a 16-byte
rsend/rrecv sync; then the client riowrites count transfers (the last with its last byte
set to the next marker, its first size-1 bytes from the counter under --verify) and spins
on its own buffer's last byte until the server's answer marker arrives; the server does
the mirror image. The server, which sends last in both, closes only after the client
has (linger). Prints "rstream ok BYTES" / "riostream ok BYTES" and exits 0 on success.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from softrdma import socket as rsock  # noqa: E402
from softrdma.socket.rsconn import RS_CONNECTED, RSOptions  # noqa: E402

PAT = bytes(range(256)) * 2


class Counter:
    """common.c's static byte counter (format_buf / verify_buf)."""

    def __init__(self) -> None:
        self.n = 0

    def make(self, size: int) -> bytes:
        out = bytearray(size)
        pos = 0
        while pos < size:
            k = min(256, size - pos)
            s = self.n & 0xFF
            out[pos:pos + k] = PAT[s:s + k]
            pos += k
            self.n += k
        return bytes(out)

    def check(self, data: bytes | memoryview) -> None:
        want = self.make(len(data))
        if bytes(data) != want:
            bad = next(i for i in range(len(want)) if data[i] != want[i])
            raise SystemExit(f"data verification failed byte {self.n - len(want) + bad}")


def send_xfer(s, size: int, tx: Counter | None) -> None:
    s.sendall(tx.make(size) if tx else bytes(size))


def recv_xfer(s, size: int, rx: Counter | None) -> None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        try:
            n = s.recv_into(view[got:])
        except TimeoutError:  # --trace: say where a slow transfer stands
            c = s._conn
            print(f"{time.monotonic():.1f} recv {got}/{size} state {c.state:#x} rseq "
                  f"{c.rseq_no} rmsg {len(c.rmsg)} rbuf_avail {c.rbuf_bytes_avail} "
                  f"ctrl {c.ctrl_seqno}/{c.ctrl_max_seqno} sqe {c.sqe_avail}",
                  file=sys.stderr, flush=True)
            continue
        if n == 0:
            raise SystemExit(f"EOF after {got} of {size} bytes")
        got += n
    if rx:
        rx.check(buf)


def rstream(s, args, client: bool) -> int:
    tx, rx = (Counter(), Counter()) if args.verify else (None, None)
    if client:
        send_xfer(s, 16, tx)
        recv_xfer(s, 16, rx)
    else:
        recv_xfer(s, 16, rx)
        send_xfer(s, 16, tx)
    for _ in range(args.iters):
        for first in (True, False):
            for _ in range(args.count):
                if first == client:
                    send_xfer(s, args.size, tx)
                else:
                    recv_xfer(s, args.size, rx)
    return 2 * args.iters * args.count * args.size


def riostream(s, args, client: bool) -> int:
    size = args.size
    _, mr = s.riomap(size, 0)
    mem = mr.mem
    mem[size - 1] = 0xFF
    counter_tx, counter_rx = Counter(), Counter()

    def send_msg() -> None:
        s.sendall(bytes(mem[:16]))

    def recv_msg() -> None:
        recv_xfer(s, 16, None)

    def send_xfer_rio() -> None:
        data = bytes(mem[:size])
        off = 0
        while off < size:
            n = s.riowrite(data[off:], off)
            if n == 0:
                s.progress()
                time.sleep(0.001)  # the peer's iomap has not arrived yet
            off += n

    def wait_marker(marker: int) -> None:
        t0 = time.monotonic()
        conn = s._conn
        while mem[size - 1] != marker:
            s.progress()
            # a peer that went away (DISCONNECT, DREQ, a failed send) never writes the
            # marker: say so at once. Its writes are placed before its DISCONNECT's
            # completion (RC order), so the marker is looked at once more first.
            if (not conn.state & RS_CONNECTED or conn.error) and mem[size - 1] != marker:
                raise SystemExit(f"the peer went away before marker {marker} (last byte "
                                 f"{mem[size - 1]}, state {conn.state:#x}, {conn.error})")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"marker {marker} never came (last byte {mem[size - 1]})")
        if args.verify:
            counter_rx.check(mem[:size - 1])

    if client:
        send_msg()
        recv_msg()
    else:
        recv_msg()
        send_msg()
    marker = 0
    for _ in range(args.iters):
        if not client:
            wait_marker(marker)
            marker = (marker + 1) & 0xFF
        for _ in range(args.count - 1):
            send_xfer_rio()
        mem[size - 1] = marker
        marker = (marker + 1) & 0xFF
        if args.verify:
            mem[:size - 1] = counter_tx.make(size - 1)
        send_xfer_rio()
        if client:
            wait_marker(marker)
            marker = (marker + 1) & 0xFF
    return 2 * args.iters * args.count * size


def linger(s) -> None:
    """The server sends last, in both tools; it closes only once the client has closed
    (EOF), so the client reads everything before it learns of any close. rstream -T a
    (rpoll) fails (exit 16) when the peer's DISCONNECT is processed before its last
    rpoll for data: rsocket's rpoll then reports POLLIN|POLLHUP and rstream's do_poll
    takes any POLLHUP as an error. rstream's own server closes right after its last send
    and so loses that race too (between two kernel rxe hosts, about half the runs of -T a
    -T v 10000 B x 100): it is rstream's, not the protocol's, and a counterpart that
    waits is what makes the outcome deterministic."""
    extra = s.recv(1)
    if extra:
        raise SystemExit("data from the client after the exchange")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("addr")
    ap.add_argument("port", type=int)
    ap.add_argument("-S", "--size", type=int, default=1000)
    ap.add_argument("-C", "--count", type=int, default=1000)
    ap.add_argument("-I", "--iters", type=int, default=1)
    ap.add_argument("-B", "--buffer", type=int, default=1 << 19, help="SO_SNDBUF/SO_RCVBUF")
    ap.add_argument("--rio", action="store_true", help="riostream instead of rstream")
    ap.add_argument("--verify", action="store_true", help="rstream/riostream -T v")
    ap.add_argument("--keepalive", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--trace", action="store_true", help="report a stalled recv every 5 s")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang shows where
    opts = RSOptions(sbuf_size=args.buffer, rbuf_size=args.buffer,
                     iomap_size=1 if args.rio else 0, keepalive=args.keepalive)
    client = args.role == "client"
    t0 = time.monotonic()
    if client:
        s = rsock.create_connection((args.addr, args.port), protocol="rsocket", options=opts)
    else:
        srv = rsock.create_server((args.addr, args.port), protocol="rsocket", options=opts)
        print("listening", flush=True)
        s, peer = srv.accept()
        srv.close()
    if args.trace:
        s.settimeout(5.0)
    try:
        t1 = time.monotonic()
        nbytes = (riostream if args.rio else rstream)(s, args, client)
        dt = time.monotonic() - t1
        if not client:
            linger(s)
    finally:
        s.close()
    name = "riostream" if args.rio else "rstream"
    print(f"{name} ok {nbytes} bytes in {dt:.2f}s ({nbytes / dt / 1e6:.2f} MB/s), "
          f"total {time.monotonic() - t0:.2f}s{' verified' if args.verify else ''}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
