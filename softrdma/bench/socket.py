"""``softrdma bench socket``: softrdma.socket beside Python TCP sockets, in one run.

For 64 B, 4 KiB and 1 MiB messages, a client streams messages for ``--seconds`` to a
server in another process, which counts them and answers once at the end; messages per
second and MB/s are what the server took divided by the time from the first send to
its answer. The TCP baseline uses the same framing a message API needs on a byte
stream (a 4-byte length, then the bytes; the server reads whole messages), on loopback,
between the same two processes' worth of Python. Both run in turn, size by size, so load
on the machine hits both.
"""

from __future__ import annotations

import socket as pysocket
import struct
import subprocess
import sys
import time
from typing import Any

__all__ = ["run_socket_bench", "SIZES"]

SIZES = (64, 4096, 1 << 20)
_LEN = struct.Struct("!I")
END = b"END"  # a message that ends a run (all benchmark messages are larger or zeros)


def _recv_exact(s: pysocket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _serve_tcp(port: int) -> None:
    srv = pysocket.create_server(("127.0.0.1", port))
    print("READY", flush=True)
    conn, _ = srv.accept()
    with conn:
        while True:
            count = nbytes = 0
            try:
                while True:
                    (n,) = _LEN.unpack(_recv_exact(conn, 4))
                    msg = _recv_exact(conn, n)
                    if msg == END:
                        break
                    count += 1
                    nbytes += n
            except EOFError:
                return
            conn.sendall(_LEN.pack(count))


def _serve_rdma(ip: str, port: int) -> None:
    from .. import socket as rsock
    from ..verbs_api import add_device
    add_device(ip, name="bench-srv")
    with rsock.create_server((ip, port)) as srv:
        print("READY", flush=True)
        conn, _ = srv.accept()
        with conn:
            while True:
                count = 0
                try:
                    while True:
                        msg = conn.recv()
                        if msg == END:
                            break
                        count += 1
                except EOFError:
                    return
                conn.send(_LEN.pack(count))


def _tcp_runs(port: int, sizes: tuple[int, ...], seconds: float) -> dict[int, tuple]:
    out = {}
    with pysocket.create_connection(("127.0.0.1", port)) as s:
        for size in sizes:
            payload = _LEN.pack(size) + bytes(size)
            t0 = time.perf_counter()
            end = t0 + seconds
            sent = 0
            while time.perf_counter() < end:
                s.sendall(payload)
                sent += 1
            s.sendall(_LEN.pack(len(END)) + END)
            (got,) = _LEN.unpack(_recv_exact(s, 4))
            dt = time.perf_counter() - t0
            out[size] = (got, dt)
    return out


def _rdma_runs(ip: str, my_ip: str, port: int, sizes: tuple[int, ...],
               seconds: float) -> dict[int, tuple]:
    from .. import socket as rsock
    from ..verbs_api import add_device
    add_device(my_ip, name="bench-cli")
    out = {}
    with rsock.socket() as s:
        s.bind((my_ip, 0))
        s.connect((ip, port))
        for size in sizes:
            payload = bytes(size)
            t0 = time.perf_counter()
            end = t0 + seconds
            sent = 0
            while time.perf_counter() < end:
                s.send(payload)
                sent += 1
            s.send(END)
            (got,) = _LEN.unpack(s.recv())
            dt = time.perf_counter() - t0
            out[size] = (got, dt)
    return out


def _spawn(args: list[str]) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "softrdma.bench.socket", *args],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "READY":
        p.kill()
        raise RuntimeError(f"benchmark server did not start: {line!r}")
    return p


def run_socket_bench(sizes: tuple[int, ...] = SIZES, seconds: float = 2.0,
                     port: int = 20700, ip: str = "127.0.20.1",
                     my_ip: str = "127.0.20.2", out: Any = None) -> dict[str, dict]:
    """Run both, print a table, return ``{"tcp": {size: (msgs/s, MB/s)}, "rdma": ...}``."""
    out = out or sys.stdout
    tcp_srv = _spawn(["--serve-tcp", str(port)])
    try:
        tcp = _tcp_runs(port, sizes, seconds)
    finally:
        tcp_srv.kill()
    rd_srv = _spawn(["--serve-rdma", ip, str(port + 1)])
    try:
        rdma = _rdma_runs(ip, my_ip, port + 1, sizes, seconds)
    finally:
        rd_srv.wait(30) if rd_srv.poll() is None else None
        rd_srv.kill()
    res: dict[str, dict] = {"tcp": {}, "rdma": {}}
    print(f"softrdma.socket vs Python TCP (length-prefixed messages), {seconds:g} s per size",
          file=out)
    print(f"{'size':>8} {'rdma msg/s':>12} {'rdma MB/s':>10} {'tcp msg/s':>12} {'tcp MB/s':>10}"
          f" {'ratio':>7}", file=out)
    for size in sizes:
        for kind, runs in (("rdma", rdma), ("tcp", tcp)):
            got, dt = runs[size]
            res[kind][size] = (got / dt, got * size / dt / 1e6)
        r, t = res["rdma"][size], res["tcp"][size]
        print(f"{size:>8} {r[0]:>12.0f} {r[1]:>10.2f} {t[0]:>12.0f} {t[1]:>10.2f}"
              f" {r[0] / t[0]:>7.3f}", file=out)
    return res


if __name__ == "__main__":
    if sys.argv[1] == "--serve-tcp":
        _serve_tcp(int(sys.argv[2]))
    elif sys.argv[1] == "--serve-rdma":
        _serve_rdma(sys.argv[2], int(sys.argv[3]))
