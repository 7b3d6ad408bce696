"""rsocket(7)'s calls as a C program makes them, run under ``softrdma exec`` (the calls
reach the preload library through ctypes, exactly as a compiled program's references do).

    softrdma exec --addr IP -- python3 rsocket_exec_checks.py IP PORT

One process, one soft device: a listener and the connections to it on IP. Each check
prints ``OK <name>`` or raises (non-zero exit). What they check: rsocket(7)'s errnos
(EBADF, EOPNOTSUPP, ECONNREFUSED, EAGAIN, EINPROGRESS, EISCONN, EINVAL), rfcntl's
O_NONBLOCK, a non-blocking rconnect finished through rpoll and SO_ERROR, rpoll and
rselect mixing rsockets with a pipe (and on the pipe alone, as poll), MSG_PEEK and
MSG_WAITALL, rreadv/rwritev/rsendmsg/rrecvmsg/rrecvfrom, the names, the options, a
blocking raccept/rrecv in one thread while another connects and sends.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys
import threading
import time

lib = ctypes.CDLL(None, use_errno=True)
for name in ("rsend", "rrecv", "rwrite", "rread", "rsendto", "rrecvfrom", "rsendmsg",
             "rrecvmsg", "rreadv", "rwritev"):
    getattr(lib, name).restype = ctypes.c_ssize_t
lib.rsend.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
lib.rrecv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
lib.rfcntl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
lib.riowrite.restype = ctypes.c_size_t

IP, PORT = sys.argv[1], int(sys.argv[2])
AF_INET, SOCK_STREAM, SOCK_DGRAM = 2, 1, 2
F_GETFL, F_SETFL = 3, 4
MSG_PEEK, MSG_DONTWAIT, MSG_WAITALL = 0x2, 0x40, 0x100
SOL_SOCKET, SO_ERROR, SO_SNDBUF, SO_KEEPALIVE = 1, 4, 7, 9
IPPROTO_TCP, TCP_NODELAY = 6, 1
SOL_RDMA, RDMA_INLINE = 0x10000, 2
POLLIN, POLLOUT, POLLHUP = 1, 4, 16


class PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class MsgHdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint),
                ("msg_iov", ctypes.POINTER(IoVec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class TimeVal(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


def sockaddr(ip: str, port: int) -> bytes:
    return struct.pack("=H", AF_INET) + struct.pack("!H", port) + socket.inet_aton(ip) + bytes(8)


def addr_of(buf: bytes) -> tuple[str, int]:
    return socket.inet_ntoa(buf[4:8]), struct.unpack("!H", buf[2:4])[0]


def fails(ret: int, code: int, what: str) -> None:
    err = ctypes.get_errno()
    assert ret == -1 and err == code, f"{what}: {ret}, errno {errno.errorcode.get(err, err)}" \
        f" (want {errno.errorcode[code]})"


def ok(ret: int, what: str) -> int:
    assert ret >= 0, f"{what}: {ret}, errno {errno.errorcode.get(ctypes.get_errno())}"
    return ret


def say(name: str) -> None:
    print("OK", name, flush=True)


def rpoll(pairs: list[tuple[int, int]], timeout: int) -> tuple[int, list[int]]:
    arr = (PollFd * len(pairs))(*[PollFd(fd, ev, 0) for fd, ev in pairs])
    n = lib.rpoll(arr, len(pairs), timeout)
    return n, [p.revents for p in arr]


def listener(port: int) -> int:
    fd = ok(lib.rsocket(AF_INET, SOCK_STREAM, 0), "rsocket")
    a = sockaddr(IP, port)
    ok(lib.rbind(fd, a, len(a)), "rbind")
    ok(lib.rlisten(fd, 4), "rlisten")
    return fd


def connect(port: int) -> int:
    fd = ok(lib.rsocket(AF_INET, SOCK_STREAM, 0), "rsocket")
    a = sockaddr(IP, port)
    ok(lib.rconnect(fd, a, len(a)), "rconnect")
    return fd


def pair(lfd: int, port: int) -> tuple[int, int]:
    """A connected (client, server) pair through the listener ``lfd``."""
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(lib.raccept(lfd, None, None)))
    t.start()
    c = connect(port)
    t.join(60)
    assert got and got[0] >= 0, f"raccept: {got}"
    return c, got[0]


def send_all(fd: int, data: bytes) -> None:
    pos = 0
    while pos < len(data):
        pos += ok(lib.rsend(fd, data[pos:], len(data) - pos, 0), "rsend")


def recv_exact(fd: int, n: int) -> bytes:
    buf = ctypes.create_string_buffer(n)
    got = ok(lib.rrecv(fd, buf, n, MSG_WAITALL), "rrecv")
    assert got == n, (got, n)
    return buf.raw


def main() -> int:
    # ---- descriptors and errnos --------------------------------------------------------
    b = ctypes.create_string_buffer(8)
    fails(lib.rsend(12345, b, 8, 0), errno.EBADF, "rsend on no rsocket")
    fails(lib.rclose(12345), errno.EBADF, "rclose on no rsocket")
    fails(lib.rfcntl(12345, F_GETFL, 0), errno.EBADF, "rfcntl on no rsocket")
    fails(lib.rsocket(AF_INET, 5, 0), errno.EOPNOTSUPP, "rsocket(SOCK_SEQPACKET)")
    s = ok(lib.rsocket(AF_INET, SOCK_STREAM, 0), "rsocket")
    assert os.fstat(s)  # a real descriptor holds the number: it is nobody else's
    fails(lib.rsend(s, b, 8, 0), errno.ENOTCONN, "rsend unconnected")
    fails(lib.rbind(s, None, 16), errno.EINVAL, "rbind without an address")
    a = sockaddr(IP, PORT + 9)  # nobody listens there
    fails(lib.rconnect(s, a, len(a)), errno.ECONNREFUSED, "rconnect to no listener")
    fails(lib.rsend(s, b, 8, 0), errno.ECONNREFUSED, "rsend after the refusal")
    ok(lib.rclose(s), "rclose")
    fails(lib.rclose(s), errno.EBADF, "rclose twice")
    say("errnos")

    # ---- rfcntl and a non-blocking rconnect ----------------------------------------------
    s = ok(lib.rsocket(AF_INET, SOCK_STREAM, 0), "rsocket")
    assert lib.rfcntl(s, F_GETFL, 0) & os.O_NONBLOCK == 0
    ok(lib.rfcntl(s, F_SETFL, os.O_NONBLOCK), "rfcntl F_SETFL")
    assert lib.rfcntl(s, F_GETFL, 0) & os.O_NONBLOCK
    fails(lib.rconnect(s, a, len(a)), errno.EINPROGRESS, "non-blocking rconnect")
    n, rev = rpoll([(s, POLLOUT)], 30000)
    assert n == 1 and rev[0] & POLLOUT, rev
    err, ln = ctypes.c_int(-1), ctypes.c_uint(4)
    ok(lib.rgetsockopt(s, SOL_SOCKET, SO_ERROR, ctypes.byref(err), ctypes.byref(ln)), "SO_ERROR")
    assert err.value == errno.ECONNREFUSED, err.value
    n, rev = rpoll([(s, POLLIN)], 0)  # still an error, not a closed descriptor
    assert rev == [POLLIN | 8], rev  # POLLERR
    lib.rclose(s)
    say("nonblocking-connect-refused")

    lfd = listener(PORT)
    ok(lib.rfcntl(lfd, F_SETFL, os.O_NONBLOCK), "rfcntl listener")
    fails(lib.raccept(lfd, None, None), errno.EAGAIN, "raccept with nobody")
    s = ok(lib.rsocket(AF_INET, SOCK_STREAM, 0), "rsocket")
    ok(lib.rfcntl(s, F_SETFL, os.O_NONBLOCK), "rfcntl")
    a = sockaddr(IP, PORT)
    fails(lib.rconnect(s, a, len(a)), errno.EINPROGRESS, "non-blocking rconnect")
    n, rev = rpoll([(lfd, POLLIN)], 30000)  # the request, answered by rpoll's progress
    assert n == 1 and rev[0] & POLLIN, rev
    peer = ctypes.create_string_buffer(16)
    plen = ctypes.c_uint(16)
    srv = ok(lib.raccept(lfd, peer, ctypes.byref(plen)), "raccept")
    n, rev = rpoll([(s, POLLOUT)], 30000)
    assert n == 1 and rev[0] & POLLOUT, rev
    ok(lib.rgetsockopt(s, SOL_SOCKET, SO_ERROR, ctypes.byref(err), ctypes.byref(ln)), "SO_ERROR")
    assert err.value == 0, err.value
    mine = ctypes.create_string_buffer(16)
    mlen = ctypes.c_uint(16)
    ok(lib.rgetsockname(s, mine, ctypes.byref(mlen)), "rgetsockname")
    assert plen.value == 16 and addr_of(peer.raw) == addr_of(mine.raw), (peer.raw, mine.raw)
    ok(lib.rgetpeername(s, mine, ctypes.byref(mlen)), "rgetpeername")
    assert addr_of(mine.raw) == (IP, PORT), addr_of(mine.raw)
    say("nonblocking-connect-accept-names")

    # ---- data: EAGAIN, rpoll, MSG_PEEK, vectors -------------------------------------------
    fails(lib.rrecv(s, b, 8, 0), errno.EAGAIN, "non-blocking rrecv, nothing there")
    fails(lib.rrecv(srv, b, 8, MSG_DONTWAIT), errno.EAGAIN, "rrecv MSG_DONTWAIT")
    n, rev = rpoll([(srv, POLLIN)], 0)
    assert n == 0 and rev == [0], rev
    r, w = os.pipe()
    t0 = time.monotonic()
    n, rev = rpoll([(srv, POLLIN), (r, POLLIN)], 300)  # nothing comes: the timeout
    assert n == 0 and time.monotonic() - t0 >= 0.25, (n, rev)
    os.write(w, b"x")
    n, rev = rpoll([(r, POLLIN)], 5000)  # descriptors only: as poll(2)
    assert n == 1 and rev == [POLLIN], rev
    n, rev = rpoll([(srv, POLLIN), (r, POLLIN)], 5000)
    assert n == 1 and rev == [0, POLLIN], rev
    os.read(r, 1)
    threading.Timer(0.3, lambda: lib.rsend(s, b"hello world", 11, 0)).start()
    n, rev = rpoll([(r, POLLIN), (srv, POLLIN | POLLOUT)], 30000)
    assert rev[0] == 0 and rev[1] & POLLOUT, rev
    n, rev = rpoll([(r, POLLIN), (srv, POLLIN)], 30000)  # wakes when the data comes
    assert n == 1 and rev == [0, POLLIN], rev
    got = ctypes.create_string_buffer(32)
    assert lib.rrecv(srv, got, 5, MSG_PEEK) == 5 and got.raw[:5] == b"hello"
    assert lib.rrecv(srv, got, 32, MSG_WAITALL | MSG_DONTWAIT) == 11  # all there is
    assert got.raw[:11] == b"hello world"
    say("rpoll-peek")

    # rselect: the rsocket and the pipe, readable and writable sets
    fdset = ctypes.c_ubyte * 128
    rset, wset = fdset(), fdset()
    for fd, st in ((srv, rset), (r, rset), (s, wset)):
        st[fd // 8] |= 1 << (fd % 8)
    tv = TimeVal(5, 0)
    nfds = max(srv, r, s) + 1
    n = lib.rselect(nfds, rset, wset, None, ctypes.byref(tv))
    assert n == 1 and not any(rset) and wset[s // 8] == 1 << (s % 8), (n, list(wset))
    os.write(w, b"y")
    rset2 = fdset()
    rset2[r // 8] |= 1 << (r % 8)
    rset2[srv // 8] |= 1 << (srv % 8)
    n = lib.rselect(nfds, rset2, None, None, ctypes.byref(TimeVal(5, 0)))
    assert n == 1 and rset2[r // 8] == 1 << (r % 8) and not rset2[srv // 8] & (1 << srv % 8)
    os.read(r, 1)
    say("rselect")

    # vectors: rwritev / rsendmsg out, rreadv / rrecvmsg / rrecvfrom in
    p1, p2 = ctypes.create_string_buffer(b"abc", 3), ctypes.create_string_buffer(b"defg", 4)
    iov = (IoVec * 2)(IoVec(ctypes.cast(p1, ctypes.c_void_p), 3),
                      IoVec(ctypes.cast(p2, ctypes.c_void_p), 4))
    assert lib.rwritev(s, iov, 2) == 7
    msg = MsgHdr(None, 0, iov, 2, None, 0, 0)
    assert lib.rsendmsg(s, ctypes.byref(msg), 0) == 7
    assert recv_exact(srv, 3) == b"abc"
    inbuf = ctypes.create_string_buffer(4)
    iin = (IoVec * 1)(IoVec(ctypes.cast(inbuf, ctypes.c_void_p), 4))
    assert lib.rreadv(srv, iin, 1) == 4 and inbuf.raw == b"defg"
    mi = MsgHdr(None, 0, iin, 1, None, 0, 0)
    lib.rfcntl(srv, F_SETFL, 0)
    assert lib.rrecvmsg(srv, ctypes.byref(mi), 0) == 4 and inbuf.raw == b"abcd"
    frm, flen = ctypes.create_string_buffer(16), ctypes.c_uint(16)
    assert lib.rrecvfrom(srv, got, 3, 0, frm, ctypes.byref(flen)) == 3
    assert got.raw[:3] == b"efg" and flen.value == 16 and addr_of(frm.raw)[0] == IP
    fails(lib.rsendto(s, b"z", 1, 0, a, len(a)), errno.EISCONN, "rsendto with an address")
    fails(lib.rsend(s, None, 8, 0), errno.EFAULT, "rsend from NULL")  # never a crash
    fails(lib.rrecv(srv, None, 8, 0), errno.EFAULT, "rrecv into NULL")
    fails(lib.rpoll(None, 1, 0), errno.EFAULT, "rpoll without pollfds")
    say("vectors")

    # options: what was set reads back; SOL_RDMA is for before the connection
    one = ctypes.c_int(1)
    ok(lib.rsetsockopt(s, IPPROTO_TCP, TCP_NODELAY, ctypes.byref(one), 4), "TCP_NODELAY")
    v, vl = ctypes.c_int(0), ctypes.c_uint(4)
    ok(lib.rgetsockopt(s, IPPROTO_TCP, TCP_NODELAY, ctypes.byref(v), ctypes.byref(vl)), "get")
    assert v.value == 1
    fails(lib.rsetsockopt(s, SOL_RDMA, RDMA_INLINE, ctypes.byref(one), 4), errno.EINVAL,
          "SOL_RDMA once connected")
    fresh = ok(lib.rsocket(AF_INET, SOCK_STREAM, 0), "rsocket")
    big = ctypes.c_int(1 << 18)
    ok(lib.rsetsockopt(fresh, SOL_SOCKET, SO_SNDBUF, ctypes.byref(big), 4), "SO_SNDBUF")
    ok(lib.rgetsockopt(fresh, SOL_SOCKET, SO_SNDBUF, ctypes.byref(v), ctypes.byref(vl)), "get")
    assert v.value == 1 << 19, v.value  # rsocket.c doubles it, as Linux does
    ok(lib.rsetsockopt(fresh, SOL_RDMA, RDMA_INLINE, ctypes.byref(one), 4), "RDMA_INLINE")
    fails(lib.rgetsockopt(fresh, SOL_SOCKET, 999, ctypes.byref(v), ctypes.byref(vl)),
          errno.EOPNOTSUPP, "an unknown option")
    lib.rclose(fresh)
    say("options")

    # ---- blocking calls in two threads -------------------------------------------------
    # the server thread blocks in rrecv while the main thread sends: a blocking call that
    # kept the interpreter would never let the send happen
    lib.rfcntl(s, F_SETFL, 0)
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.append(recv_exact(srv, 100000)))
    t.start()
    time.sleep(0.5)
    data = bytes(range(256)) * 390 + bytes(160)
    send_all(s, data)
    t.join(60)
    assert out and out[0] == data
    lib.rfcntl(lfd, F_SETFL, 0)
    c2, s2 = pair(lfd, PORT)  # raccept blocking in a thread while this one connects
    send_all(c2, b"ping")
    assert recv_exact(s2, 4) == b"ping"
    say("threads")

    # a connection completes before raccept is asked for it (librdmacm's listen
    # service; TCP's backlog): rconnect returns, raccept then has it at once
    c3 = connect(PORT)
    lib.rfcntl(lfd, F_SETFL, os.O_NONBLOCK)
    s3 = ok(lib.raccept(lfd, None, None), "raccept of a completed connection")
    send_all(s3, b"pong")
    assert recv_exact(c3, 4) == b"pong"
    lib.rclose(c3)
    lib.rclose(s3)
    say("backlog")

    # ---- the end: EOF, POLLHUP, EPIPE ----------------------------------------------------
    send_all(s, b"tail")
    ok(lib.rshutdown(s, 2), "rshutdown")
    assert recv_exact(srv, 4) == b"tail"  # what came before the close is read first
    assert lib.rrecv(srv, got, 8, 0) == 0  # then EOF
    n, rev = rpoll([(srv, POLLIN)], 5000)
    assert rev[0] & POLLHUP, rev
    fails(lib.rsend(srv, b"x", 1, 0), errno.EPIPE, "rsend after the peer's close")
    for fd in (s, srv, c2, s2, lfd):
        ok(lib.rclose(fd), "rclose")
    say("close")
    return 0


if __name__ == "__main__":
    sys.exit(main())
