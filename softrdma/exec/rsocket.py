"""librdmacm's rsocket calls (``rsocket``, ``rbind``, ..., ``rpoll``, ``riomap``), answered by
softrdma's rsocket protocol (:class:`softrdma.socket.rsocket.RSocket`, wire-compatible with
librdmacm's rsocket.c), with rsocket(7)'s semantics.

Descriptors. librdmacm numbers rsockets in an index space of its own; here each rsocket
holds a real descriptor (``/dev/null``, close-on-exec) and its number is the rsocket's: no
rsocket number is ever a live descriptor of something else, so a program that mixes
rsockets and ordinary descriptors in one ``rpoll``/``rselect`` never confuses them, and an
unknown number is EBADF as the man page says.

Blocking. A blocking call waits in poll(2) with the GIL released (the RSocket's own
waits), so the program's other threads and softrdma's progress thread run. A
non-blocking socket (``rfcntl(F_SETFL, O_NONBLOCK)``, or ``MSG_DONTWAIT`` on one call)
answers EAGAIN instead; its ``rconnect`` answers EINPROGRESS and connects on a thread of
its own, ``rpoll`` says POLLOUT when it is done and ``rgetsockopt(SO_ERROR)`` how.

``rpoll`` (rsocket.c's rpoll): each rsocket's readiness is looked at after handling what
completed (``RSocket.poll``); ordinary descriptors are asked with poll(2) at once. When
nothing is ready it waits, in one poll(2), on the ordinary descriptors and on every
rsocket's completion and CM channels, at most :data:`WAKE_INTERVAL` at a time (keepalive
and handshake timers run in between), and looks again. POLLHUP comes once the data that
arrived before the peer's close has been read (rsocket.c says it at once, and rstream -T a
then loses the tail).

Threads, as librdmacm has them: a listener has a service thread that answers connection
requests while the program is busy elsewhere (a peer's rconnect completes before raccept
is called); ``rclose`` returns once every send completed (rsocket.c's rshutdown) and
leaves softrdma's TIME_WAIT (re-acknowledging a lost last ACK; rsocket.c has none) and
the freeing to a thread, so a program that closes both ends at once waits for nothing.

Not here: SOCK_DGRAM rsockets (librdmacm's UDP over UD QPs; EOPNOTSUPP), AF_IB addresses,
``RDMA_ROUTE``.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import select
import struct
import sys
import threading
import time
from typing import Any, Callable

from ..readiness import readable
from . import shim

__all__ = ["IMPLEMENTS", "TYPES", "install", "lookup", "WAKE_INTERVAL"]

log = logging.getLogger("softrdma.exec")

IMPLEMENTS = ("rsocket", "rbind", "rlisten", "raccept", "rconnect", "rshutdown", "rclose",
              "rrecv", "rrecvfrom", "rrecvmsg", "rread", "rreadv", "rsend", "rsendto",
              "rsendmsg", "rwrite", "rwritev", "rpoll", "rselect", "rgetpeername",
              "rgetsockname", "rsetsockopt", "rgetsockopt", "rfcntl", "riomap", "riounmap",
              "riowrite")

# the socket structures only rsocket calls read (sockaddrs are read as bytes: other parts
# may declare them)
TYPES = """
    struct pollfd { int fd; short events; short revents; };
    struct iovec { void *iov_base; size_t iov_len; };
    struct msghdr { void *msg_name; socklen_t msg_namelen; struct iovec *msg_iov;
                    size_t msg_iovlen; void *msg_control; size_t msg_controllen;
                    int msg_flags; };
    struct timeval { long tv_sec; long tv_usec; };
"""

#: the longest one wait of rpoll/rselect blocks before it looks again (rsocket.c's
#: wake_up_interval is 5 s; timers of softrdma's connections want less)
WAKE_INTERVAL = 0.25

# Linux's numbers (<sys/socket.h>, <fcntl.h>, <netinet/in.h>, <rdma/rsocket.h>)
AF_INET, AF_INET6, AF_IB = 2, 10, 27
SOCK_STREAM, SOCK_DGRAM = 1, 2
IPPROTO_IP, IPPROTO_TCP, IPPROTO_IPV6 = 0, 6, 41
SOL_SOCKET, SOL_RDMA = 1, 0x10000
SO_REUSEADDR, SO_ERROR, SO_BROADCAST, SO_SNDBUF, SO_RCVBUF = 2, 4, 6, 7, 8
SO_KEEPALIVE, SO_OOBINLINE, SO_LINGER = 9, 10, 13
TCP_NODELAY, TCP_MAXSEG, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT = 1, 2, 4, 5, 6
TCP_CONGESTION = 13
IP_TOS, IPV6_V6ONLY = 1, 26
RDMA_SQSIZE, RDMA_RQSIZE, RDMA_INLINE, RDMA_IOMAPSIZE, RDMA_ROUTE = range(5)
MSG_PEEK, MSG_DONTWAIT, MSG_WAITALL = 0x2, 0x40, 0x100
F_GETFD, F_SETFD, F_GETFL, F_SETFL = 1, 2, 3, 4
O_NONBLOCK = os.O_NONBLOCK
PROT_NONE, PROT_WRITE = 0, 2
RS_QP_MAX_SIZE = 0xFFFE  # rsocket.c: the most RDMA_SQSIZE/RQSIZE give
RS_SNDLOWAT = 2048
POLLIN, POLLOUT, POLLERR, POLLHUP, POLLNVAL = (select.POLLIN, select.POLLOUT,
                                               select.POLLERR, select.POLLHUP,
                                               select.POLLNVAL)
SIZE_MAX = (1 << 64) - 1  # riowrite's (size_t)-1

_IN = struct.Struct("!2xH4s8x")        # sockaddr_in after sin_family: port, address
_IN6 = struct.Struct("!2xHI16sI")      # sockaddr_in6: port, flowinfo, address, scope
_FAMILY = struct.Struct("=H")          # sa_family_t, host order


class _Entry:
    """One rsocket: its RSocket, the descriptor that reserves its number, and what
    rsocket.c keeps beside the connection (flags, options, the error for SO_ERROR)."""

    __slots__ = ("sock", "fd", "family", "fs_flags", "fd_flags", "err", "connecting",
                 "maps", "so_opts", "tcp_opts", "ipv6_opts", "keepalive_time", "tos",
                 "closed", "lock", "failed")

    def __init__(self, sock: Any, fd: int, family: int) -> None:
        self.sock, self.fd, self.family = sock, fd, family
        self.fs_flags = 0          # F_GETFL/F_SETFL (O_NONBLOCK)
        self.fd_flags = 0          # F_GETFD/F_SETFD
        self.err = 0               # SO_ERROR: a non-blocking connect's outcome
        self.failed = 0            # why the connect failed, for every call after it
        self.connecting: threading.Thread | None = None
        self.maps: dict[tuple[int, int], Any] = {}  # (address, length) -> MR or None
        self.so_opts = 0           # option bits as rsocket.c keeps them (1 << optname)
        self.tcp_opts = 0
        self.ipv6_opts = 0
        self.keepalive_time = 0
        self.tos = 0
        self.closed = False
        # a listener's: its service thread and the program's calls take turns
        self.lock = threading.RLock()

    @property
    def nonblocking(self) -> bool:
        return bool(self.fs_flags & O_NONBLOCK)


_socks: dict[int, _Entry] = {}
_wake: list[int] = []  # an eventfd written when a background connect ends (rpoll wakes)


def lookup(fd: int) -> _Entry:
    """The rsocket numbered ``fd`` (Errno EBADF if there is none)."""
    e = _socks.get(fd)
    if e is None:
        raise shim.Errno(errno.EBADF, f"{fd} is not an rsocket")
    return e


#: ``SOFTRDMA_EXEC_CM_TRACE=1`` (rdma_cm's trace, :mod:`.cma`) also prints one line per
#: rsocket call that sets a socket up (rsocket, rbind, rlisten, raccept, rconnect,
#: rsetsockopt, rfcntl, riomap, riounmap, rshutdown, rclose) and its outcome. A call that
#: would block (EAGAIN) is not traced: programs spin on it.
TRACE = bool(os.environ.get("SOFTRDMA_EXEC_CM_TRACE"))

_LEVELS = {SOL_SOCKET: "SOL_SOCKET", SOL_RDMA: "SOL_RDMA", IPPROTO_TCP: "IPPROTO_TCP",
           IPPROTO_IP: "IPPROTO_IP", IPPROTO_IPV6: "IPPROTO_IPV6"}
_OPTIONS = {
    SOL_SOCKET: {SO_REUSEADDR: "SO_REUSEADDR", SO_ERROR: "SO_ERROR", SO_SNDBUF: "SO_SNDBUF",
                 SO_RCVBUF: "SO_RCVBUF", SO_KEEPALIVE: "SO_KEEPALIVE",
                 SO_OOBINLINE: "SO_OOBINLINE", SO_LINGER: "SO_LINGER"},
    SOL_RDMA: {RDMA_SQSIZE: "RDMA_SQSIZE", RDMA_RQSIZE: "RDMA_RQSIZE",
               RDMA_INLINE: "RDMA_INLINE", RDMA_IOMAPSIZE: "RDMA_IOMAPSIZE",
               RDMA_ROUTE: "RDMA_ROUTE"},
    IPPROTO_TCP: {TCP_NODELAY: "TCP_NODELAY", TCP_MAXSEG: "TCP_MAXSEG",
                  TCP_KEEPIDLE: "TCP_KEEPIDLE", TCP_KEEPINTVL: "TCP_KEEPINTVL",
                  TCP_KEEPCNT: "TCP_KEEPCNT", TCP_CONGESTION: "TCP_CONGESTION"},
    IPPROTO_IP: {IP_TOS: "IP_TOS"}, IPPROTO_IPV6: {IPV6_V6ONLY: "IPV6_V6ONLY"},
}
_FCNTL = {F_GETFD: "F_GETFD", F_SETFD: "F_SETFD", F_GETFL: "F_GETFL", F_SETFL: "F_SETFL"}


def option_name(level: int, name: int) -> str:
    """``SOL_RDMA, RDMA_IOMAPSIZE`` for the trace (numbers where Linux's name is unknown)."""
    return f"{_LEVELS.get(level, level)}, {_OPTIONS.get(level, {}).get(name, name)}"


def _trace(call: str, outcome: str) -> None:
    print(f"softrdma exec: {time.monotonic():.3f} {call} -> {outcome}", file=sys.stderr,
          flush=True)


def _rguard(fail: Any, show: Callable[..., str] | None = None
            ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """:func:`shim.guard` where any OSError with an errno is the socket's answer (EAGAIN,
    ECONNREFUSED, EPIPE...), not softrdma's failure: errno set, nothing logged. With
    ``show`` (the call's arguments as text) the call is traced under :data:`TRACE`."""
    guarded = shim.guard(fail, answers=(OSError,))
    if show is None or not TRACE:
        return guarded

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def traced(*args: Any) -> Any:
            try:
                r = fn(*args)
            except OSError as exc:
                code = getattr(exc, "error_code", None) or exc.errno
                if code not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    _trace(show(*args), f"-1 {errno.errorcode.get(code, code)}")
                raise
            _trace(show(*args), str(r))
            return r
        return guarded(traced)
    return wrap


# ---- addresses --------------------------------------------------------------------------

def _read_addr(ffi: Any, addr: Any, addrlen: int, family: int) -> tuple[str, int]:
    """A sockaddr from the program as (host, port): IPv4, or IPv6's wildcard, loopback and
    v4-mapped addresses (softrdma's devices are IPv4)."""
    if addr == ffi.NULL or addrlen < 2:
        raise shim.Errno(errno.EINVAL, "no address")
    raw = ffi.buffer(ffi.cast("char *", addr), min(addrlen, 28))[:]
    fam = _FAMILY.unpack_from(raw)[0]
    if fam == AF_INET and len(raw) >= 8:
        port, a = _IN.unpack_from(raw.ljust(16, b"\0"))
        return ".".join(map(str, a)), port
    if fam == AF_INET6 and len(raw) >= 24:
        port, _, a, _ = _IN6.unpack_from(raw.ljust(28, b"\0"))
        if a == bytes(16):
            return "0.0.0.0", port
        if a == bytes(15) + b"\1":
            return "127.0.0.1", port
        if a[:12] == bytes(10) + b"\xff\xff":
            return ".".join(map(str, a[12:])), port
        raise shim.Errno(errno.EADDRNOTAVAIL, "softrdma's devices have IPv4 addresses only")
    raise shim.Errno(errno.EAFNOSUPPORT if fam != family else errno.EINVAL,
                     f"address family {fam}")


def _write_addr(ffi: Any, out: Any, outlen: Any, family: int, host: str, port: int) -> None:
    """rs_copy_addr: the address as a sockaddr of the socket's family, cut to *outlen,
    *outlen set to the whole size."""
    a = bytes(int(x) for x in host.split("."))
    if family == AF_INET6:
        raw = _FAMILY.pack(AF_INET6) + _IN6.pack(port, 0, bytes(10) + b"\xff\xff" + a, 0)[2:]
        if host == "0.0.0.0":
            raw = raw[:8] + bytes(16) + raw[24:]
    else:
        raw = _FAMILY.pack(AF_INET) + _IN.pack(port, a)[2:]
    if out == ffi.NULL or outlen == ffi.NULL:
        raise shim.Errno(errno.EFAULT, "no room for the address")
    n = min(int(outlen[0]), len(raw))
    ffi.memmove(out, raw[:n], n)
    outlen[0] = len(raw)


# ---- blocking -----------------------------------------------------------------------------

class _Mode:
    """The socket non-blocking for one call (MSG_DONTWAIT), as it was after."""

    __slots__ = ("sock", "saved")

    def __init__(self, e: _Entry, flags: int) -> None:
        self.sock = e.sock
        self.saved = -1.0
        if flags & MSG_DONTWAIT and not e.nonblocking:
            self.saved = None
            e.sock.settimeout(0.0)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        if self.saved != -1.0:
            self.sock.settimeout(self.saved)


def _ready(e: _Entry) -> Any:
    """The connected RSocket of ``e``: a non-blocking connect still under way is EAGAIN
    (rsocket.c turns its EINPROGRESS into EAGAIN), one that failed its error."""
    if e.connecting is not None:
        if e.connecting.is_alive():
            raise shim.Errno(errno.EAGAIN, "connecting")
        e.connecting = None
    if e.failed:  # (softrdma's socket is closed by its failed connect: not EBADF)
        raise shim.Errno(e.failed, "the connect failed")
    return e.sock


def _connect_in_background(e: _Entry, host: str, port: int) -> None:
    """A non-blocking rconnect: connect on a thread; SO_ERROR says how it went."""
    sock = e.sock

    def run() -> None:
        try:
            sock.settimeout(None)
            sock.connect((host, port))
        except OSError as exc:
            e.err = e.failed = exc.errno or errno.ECONNREFUSED
        except Exception as exc:  # softrdma's failure: said once, the program sees EIO
            log.error("softrdma exec: rconnect failed: %r", exc, exc_info=exc)
            e.err = e.failed = errno.EIO
        finally:
            if e.closed:
                sock.close()
            else:
                sock.settimeout(0.0 if e.nonblocking else None)
            if _wake:
                try:
                    os.eventfd_write(_wake[0], 1)
                except OSError:
                    pass

    t = threading.Thread(target=run, name=f"rconnect-{e.fd}", daemon=True)
    e.connecting = t
    t.start()


def _listen_service(e: _Entry) -> None:
    """librdmacm's listen service: a listener answers connection requests and completes
    handshakes while the program is busy elsewhere (a peer's rconnect returns before
    raccept is called, as TCP's connect does), up to its backlog."""
    sock = e.sock

    def run() -> None:
        try:
            while not e.closed:
                with e.lock:
                    if e.closed:
                        return
                    fds = sock.wait_fds()
                ready = set(readable(fds, WAKE_INTERVAL))
                with e.lock:
                    if e.closed:
                        return
                    sock.took(ready)
                    sock.accept_ready()
        except Exception as exc:  # (closed under it: nothing to say)
            if not e.closed:
                log.error("softrdma exec: rsocket listen service: %r", exc, exc_info=exc)

    threading.Thread(target=run, name=f"rlisten-{e.fd}", daemon=True).start()


# ---- rpoll ------------------------------------------------------------------------------

def _revents(e: _Entry, events: int) -> int:
    """rs_poll_rs for one rsocket."""
    t = e.connecting
    if t is not None:
        if t.is_alive():
            return 0
    if e.failed:  # rs_connect_error: what was asked, and POLLERR
        return (events & (POLLIN | POLLOUT)) | POLLERR
    with e.lock:
        return e.sock.poll(events)


def _poll(fds: list[tuple[int, int]], timeout_ms: int) -> list[int]:
    """poll(2) over (fd, events) pairs mixing rsockets and descriptors; the revents of
    each, after at most ``timeout_ms`` (< 0: no limit)."""
    n = len(fds)
    ours = [_socks.get(fd) if fd >= 0 else None for fd, _ in fds]
    if not any(ours):  # only descriptors: poll(2) itself, the GIL released
        p = select.poll()
        for fd, ev in fds:
            if fd >= 0:
                p.register(fd, ev)
        got = dict(p.poll(timeout_ms))
        return [got.get(fd, 0) if fd >= 0 else 0 for fd, _ in fds]
    deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
    others = select.poll()
    plain = False
    for (fd, ev), e in zip(fds, ours):
        if fd >= 0 and e is None:
            others.register(fd, ev)
            plain = True
    while True:
        out = [0] * n
        for i, e in enumerate(ours):
            if e is not None:
                out[i] = POLLNVAL if e.closed else _revents(e, fds[i][1])
        if plain:
            got = dict(others.poll(0))
            for i, (fd, _) in enumerate(fds):
                if ours[i] is None and fd >= 0:
                    out[i] = got.get(fd, 0)
        if any(out):
            return out
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return out
        # wait on everything at once: the descriptors, every rsocket's channels
        waiter = select.poll()
        for (fd, ev), e in zip(fds, ours):
            if fd >= 0 and e is None:
                waiter.register(fd, ev)
        wake: dict[int, list[_Entry]] = {}
        for e in ours:
            if e is not None and e.connecting is None:
                with e.lock:
                    fds_e = e.sock.wait_fds()
                for fd in fds_e:
                    wake.setdefault(fd, []).append(e)
        for fd in wake:
            waiter.register(fd, select.POLLIN)
        if _wake:
            waiter.register(_wake[0], select.POLLIN)
        slice_s = WAKE_INTERVAL if left is None else min(WAKE_INTERVAL, left)
        ready = {fd for fd, _ in waiter.poll(max(0, int(slice_s * 1000 + 0.999)))}
        if _wake and _wake[0] in ready:
            try:
                os.eventfd_read(_wake[0])
            except OSError:
                pass
        taken = set()
        for fd in ready & wake.keys():
            for e in wake[fd]:
                if id(e) not in taken:
                    taken.add(id(e))
                    with e.lock:
                        e.sock.took(ready)


# ---- the calls ----------------------------------------------------------------------------

def install(ffi: Any, lib: Any) -> None:
    """Define the rsocket calls."""
    # imported here, not above: softrdma's verbs must not load before shim.install has
    # chosen the soft backend (the real libibverbs, in this process, is us)
    from ..socket.rsconn import RSOptions
    from ..socket.rsocket import RSocket
    from ..socket.rswire import scale_to_value, value_to_scale

    NULL = ffi.NULL
    buffer = ffi.buffer
    cast = ffi.cast
    try:
        _wake.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
    except (AttributeError, OSError):
        pass  # (no eventfd: rpoll still looks again every WAKE_INTERVAL)

    said: set[str] = set()

    def unsupported(what: str) -> None:
        if what not in said:
            said.add(what)
            print(f"softrdma exec: {what} is not supported by softrdma yet (EOPNOTSUPP)",
                  file=sys.stderr)
        raise shim.Errno(errno.EOPNOTSUPP, what)

    @ffi.def_extern(name="rsocket")
    @_rguard(-1, lambda d, t, p: f"rsocket({d}, {t}, {p})")
    def rsocket(domain: int, type_: int, protocol: int) -> int:
        if domain not in (AF_INET, AF_INET6, AF_IB) or type_ not in (SOCK_STREAM, SOCK_DGRAM) \
                or (type_ == SOCK_STREAM and protocol not in (0, IPPROTO_TCP)):
            raise shim.Errno(errno.EOPNOTSUPP, "rsocket: not a stream or datagram socket")
        if type_ == SOCK_DGRAM:
            unsupported("rsocket(SOCK_DGRAM)")
        if domain == AF_IB:
            unsupported("rsocket(AF_IB)")
        sock = RSocket(options=RSOptions())
        fd = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        _socks[fd] = _Entry(sock, fd, domain)
        return fd

    @ffi.def_extern(name="rbind")
    @_rguard(-1, lambda fd, a, n: f"rbind({fd})")
    def rbind(fd: int, addr: Any, addrlen: int) -> int:
        e = lookup(fd)
        e.sock.bind(_read_addr(ffi, addr, addrlen, e.family))
        return 0

    @ffi.def_extern(name="rlisten")
    @_rguard(-1, lambda fd, backlog: f"rlisten({fd}, {backlog})")
    def rlisten(fd: int, backlog: int) -> int:
        e = lookup(fd)
        with e.lock:
            listening = e.sock.listening
            e.sock.listen(backlog)
        if not listening:
            _listen_service(e)
        return 0

    @ffi.def_extern(name="raccept")
    @_rguard(-1, lambda fd, a, n: f"raccept({fd})")
    def raccept(fd: int, addr: Any, addrlen: Any) -> int:
        e = lookup(fd)
        if not e.sock.listening:
            raise shim.Errno(errno.EBADF, "raccept: not listening")  # rsocket.c's answer
        with e.lock:
            new, (host, port) = e.sock.accept()
        new.settimeout(None)  # a new rsocket is blocking, whatever its listener is
        nfd = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        ne = _Entry(new, nfd, e.family)
        ne.so_opts, ne.tcp_opts, ne.keepalive_time = e.so_opts, e.tcp_opts, e.keepalive_time
        _socks[nfd] = ne
        if addr != NULL and addrlen != NULL:
            _write_addr(ffi, addr, addrlen, e.family, host, port)
        return nfd

    @ffi.def_extern(name="rconnect")
    @_rguard(-1, lambda fd, a, n: f"rconnect({fd})")
    def rconnect(fd: int, addr: Any, addrlen: int) -> int:
        e = lookup(fd)
        if e.connecting is not None and e.connecting.is_alive():
            raise shim.Errno(errno.EALREADY, "rconnect: under way")
        if e.failed:
            e.err = 0
            raise shim.Errno(e.failed, "rconnect failed")
        if e.connecting is not None or e.sock.connected:
            raise shim.Errno(errno.EISCONN, "rconnect: connected")
        host, port = _read_addr(ffi, addr, addrlen, e.family)
        if e.nonblocking:
            e.err = 0
            _connect_in_background(e, host, port)
            raise shim.Errno(errno.EINPROGRESS, "rconnect: under way")
        try:
            e.sock.connect((host, port))
        except OSError as exc:
            e.failed = exc.errno or errno.ECONNREFUSED
            raise
        return 0

    @ffi.def_extern(name="rshutdown")
    @_rguard(-1, lambda fd, how: f"rshutdown({fd}, {how})")
    def rshutdown(fd: int, how: int) -> int:
        e = lookup(fd)
        if how not in (0, 1, 2):
            raise shim.Errno(errno.EINVAL, "rshutdown: how")
        sock = _ready(e)
        if not sock.connected:  # rsocket.c: nothing to do unless connected
            return 0
        saved = sock.gettimeout()
        sock.settimeout(None)  # (rsocket.c waits for the sends, blocking)
        try:
            # the TIME_WAIT softrdma adds (rsocket.c has none) is rclose's, in the
            # background: a program that shuts down both ends at once waits for nothing
            sock.shutdown(how, linger=False)
        finally:
            sock.settimeout(saved)
        return 0

    @ffi.def_extern(name="rclose")
    @_rguard(-1, lambda fd: f"rclose({fd})")
    def rclose(fd: int) -> int:
        e = lookup(fd)
        del _socks[fd]
        try:
            with e.lock:
                e.closed = True
                sock = e.sock
                if e.connecting is not None and e.connecting.is_alive():
                    return 0  # the connect's thread closes it when it ends
                sock.settimeout(None)
                if not sock.connected:
                    sock.close()
                    return 0
                # rsocket.c's rclose: rshutdown(SHUT_RDWR), which returns once every
                # send completed (what was sent has arrived), then free. The free waits
                # out softrdma's TIME_WAIT (the peer's last ACK), so it runs on a thread
                # of its own: the program goes on (or exits) at once.
                try:
                    sock.shutdown(2, linger=False)
                except OSError:
                    pass
                threading.Thread(target=sock.close, name=f"rclose-{fd}", daemon=True).start()
        finally:
            os.close(fd)
        return 0

    # ---- data ---------------------------------------------------------------------------

    def recv(fd: int, buf: Any, length: int, flags: int) -> int:
        e = lookup(fd)
        sock = _ready(e)
        if not length:
            return 0
        if buf == NULL:
            raise shim.Errno(errno.EFAULT, "rrecv: no buffer")
        view = buffer(buf, length)
        with _Mode(e, flags):
            if not flags & MSG_WAITALL or flags & MSG_PEEK:
                return sock.recv_into(view, 0, flags & MSG_PEEK)
            mv = memoryview(view)
            got = 0
            while got < length:  # rrecv's MSG_WAITALL loop: until full, EOF or error
                try:
                    n = sock.recv_into(mv[got:])
                except OSError:
                    if got:
                        break
                    raise
                if not n:
                    break
                got += n
            return got

    def send(fd: int, buf: Any, length: int, flags: int) -> int:
        e = lookup(fd)
        sock = _ready(e)
        if not length:
            return 0
        if buf == NULL:
            raise shim.Errno(errno.EFAULT, "rsend: no buffer")
        with _Mode(e, flags):
            return sock.send(buffer(buf, length))

    def iov_bytes(iov: Any, cnt: int) -> bytes:
        if cnt < 0 or (cnt and iov == NULL):
            raise shim.Errno(errno.EINVAL, "iovec")
        if any(iov[i].iov_base == NULL and iov[i].iov_len for i in range(cnt)):
            raise shim.Errno(errno.EFAULT, "iovec: no buffer")
        return b"".join(buffer(iov[i].iov_base, iov[i].iov_len)[:] for i in range(cnt)
                        if iov[i].iov_len)

    def sendv(fd: int, iov: Any, cnt: int, flags: int) -> int:
        e = lookup(fd)
        sock = _ready(e)
        data = iov_bytes(iov, cnt)  # (rsendv gathers too: into its send ring)
        if not data:
            return 0
        with _Mode(e, flags):
            return sock.send(data)

    def recvv(fd: int, iov: Any, cnt: int, flags: int) -> int:
        # rsocket.c's rrecvv fills the first vector only
        if cnt < 1 or iov == NULL:
            lookup(fd)
            raise shim.Errno(errno.EINVAL, "iovec")
        return recv(fd, iov[0].iov_base, iov[0].iov_len, flags)

    @ffi.def_extern(name="rrecv")
    @_rguard(-1)
    def rrecv(fd: int, buf: Any, length: int, flags: int) -> int:
        return recv(fd, buf, length, flags)

    @ffi.def_extern(name="rread")
    @_rguard(-1)
    def rread(fd: int, buf: Any, length: int) -> int:
        return recv(fd, buf, length, 0)

    @ffi.def_extern(name="rrecvfrom")
    @_rguard(-1)
    def rrecvfrom(fd: int, buf: Any, length: int, flags: int, src: Any, srclen: Any) -> int:
        n = recv(fd, buf, length, flags)
        if n > 0 and src != NULL and srclen != NULL:
            e = lookup(fd)
            _write_addr(ffi, src, srclen, e.family, *e.sock.getpeername())
        return n

    @ffi.def_extern(name="rreadv")
    @_rguard(-1)
    def rreadv(fd: int, iov: Any, cnt: int) -> int:
        return recvv(fd, iov, cnt, 0)

    @ffi.def_extern(name="rrecvmsg")
    @_rguard(-1)
    def rrecvmsg(fd: int, msg: Any, flags: int) -> int:
        lookup(fd)
        if msg == NULL:
            raise shim.Errno(errno.EINVAL, "rrecvmsg: no msghdr")
        if msg.msg_control != NULL and msg.msg_controllen:
            raise shim.Errno(errno.EOPNOTSUPP, "rrecvmsg: control data")
        return recvv(fd, msg.msg_iov, int(msg.msg_iovlen), flags)

    @ffi.def_extern(name="rsend")
    @_rguard(-1)
    def rsend(fd: int, buf: Any, length: int, flags: int) -> int:
        return send(fd, buf, length, flags)

    @ffi.def_extern(name="rwrite")
    @_rguard(-1)
    def rwrite(fd: int, buf: Any, length: int) -> int:
        return send(fd, buf, length, 0)

    @ffi.def_extern(name="rsendto")
    @_rguard(-1)
    def rsendto(fd: int, buf: Any, length: int, flags: int, dst: Any, dstlen: int) -> int:
        lookup(fd)
        if dst != NULL or dstlen:
            raise shim.Errno(errno.EISCONN, "rsendto: a stream has its peer")
        return send(fd, buf, length, flags)

    @ffi.def_extern(name="rwritev")
    @_rguard(-1)
    def rwritev(fd: int, iov: Any, cnt: int) -> int:
        return sendv(fd, iov, cnt, 0)

    @ffi.def_extern(name="rsendmsg")
    @_rguard(-1)
    def rsendmsg(fd: int, msg: Any, flags: int) -> int:
        lookup(fd)
        if msg == NULL:
            raise shim.Errno(errno.EINVAL, "rsendmsg: no msghdr")
        if msg.msg_control != NULL and msg.msg_controllen:
            raise shim.Errno(errno.EOPNOTSUPP, "rsendmsg: control data")
        return sendv(fd, msg.msg_iov, int(msg.msg_iovlen), flags)

    # ---- rpoll / rselect --------------------------------------------------------------

    @ffi.def_extern(name="rpoll")
    @_rguard(-1)
    def rpoll(fds: Any, nfds: int, timeout: int) -> int:
        if nfds and fds == NULL:
            raise shim.Errno(errno.EFAULT, "rpoll: no pollfds")
        pairs = [(fds[i].fd, fds[i].events) for i in range(nfds)]
        if not pairs:
            select.poll().poll(timeout)  # poll(NULL, 0, timeout): a sleep
            return 0
        out = _poll(pairs, timeout)
        for i, r in enumerate(out):
            fds[i].revents = r
        return sum(1 for r in out if r)

    @ffi.def_extern(name="rselect")
    @_rguard(-1)
    def rselect(nfds: int, rset: Any, wset: Any, xset: Any, tv: Any) -> int:
        if nfds < 0 or nfds > 1024:
            raise shim.Errno(errno.EINVAL, "rselect: nfds")
        nbytes = (nfds + 7) // 8
        sets = []
        for s in (rset, wset, xset):
            sets.append(int.from_bytes(buffer(cast("char *", s), nbytes)[:], "little")
                        if s != NULL else 0)
        r, w, x = sets
        pairs = []
        for fd in range(nfds):
            bit = 1 << fd
            if (r | w | x) & bit:
                pairs.append((fd, (POLLIN if r & bit else 0) | (POLLOUT if w & bit else 0)))
        if tv == NULL:
            ms = -1
        else:
            ms = int(tv.tv_sec) * 1000 + int(tv.tv_usec) // 1000
            if tv.tv_sec < 0 or tv.tv_usec < 0:
                raise shim.Errno(errno.EINVAL, "rselect: timeout")
        out = _poll(pairs, ms) if pairs else (select.poll().poll(ms), [])[1]
        r2 = w2 = x2 = 0
        cnt = 0
        for (fd, _), rev in zip(pairs, out):
            bit = 1 << fd
            if rev & POLLNVAL:
                raise shim.Errno(errno.EBADF, f"rselect: {fd} is not open")
            if r & bit and rev & (POLLIN | POLLHUP | POLLERR):
                r2 |= bit
                cnt += 1
            if w & bit and rev & (POLLOUT | POLLERR):
                w2 |= bit
                cnt += 1
            if x & bit and rev & select.POLLPRI:
                x2 |= bit
                cnt += 1
        for s, v in zip((rset, wset, xset), (r2, w2, x2)):
            if s != NULL:
                ffi.memmove(cast("char *", s), v.to_bytes(nbytes, "little"), nbytes)
        return cnt

    # ---- names --------------------------------------------------------------------------

    @ffi.def_extern(name="rgetpeername")
    @_rguard(-1)
    def rgetpeername(fd: int, addr: Any, addrlen: Any) -> int:
        e = lookup(fd)
        _write_addr(ffi, addr, addrlen, e.family, *_ready(e).getpeername())
        return 0

    @ffi.def_extern(name="rgetsockname")
    @_rguard(-1)
    def rgetsockname(fd: int, addr: Any, addrlen: Any) -> int:
        e = lookup(fd)
        _write_addr(ffi, addr, addrlen, e.family, *_ready(e).getsockname())
        return 0

    # ---- options --------------------------------------------------------------------------

    def int_at(p: Any, n: int) -> int:
        if p == NULL or n < 4:
            raise shim.Errno(errno.EINVAL, "option value")
        return cast("int *", p)[0]

    def uint_at(p: Any, n: int) -> int:
        return int_at(p, n) & 0xFFFFFFFF

    def opening(e: _Entry) -> bool:
        # rsocket.c's rs_opening and later; a listener's settings are its connections'
        return e.connecting is not None or e.sock.connected

    @ffi.def_extern(name="rsetsockopt")
    @_rguard(-1, lambda fd, level, name, val, vlen:
             f"rsetsockopt({fd}, {option_name(level, name)}"
             + (f", {int_at(val, vlen)})" if val != NULL and vlen == 4 else ")"))
    def rsetsockopt(fd: int, level: int, name: int, val: Any, vlen: int) -> int:
        e = lookup(fd)
        o = e.sock.options
        on = None  # the option's bit, for those rgetsockopt reports from the bits
        if level == SOL_SOCKET:
            if name in (SO_REUSEADDR, SO_OOBINLINE):
                on = int_at(val, vlen)
            elif name == SO_RCVBUF:
                if not e.sock.connected:
                    o.rbuf_size = uint_at(val, vlen) << 1
            elif name == SO_SNDBUF:
                if not e.sock.connected:
                    o.sbuf_size = max(uint_at(val, vlen) << 1, RS_SNDLOWAT << 1)
            elif name == SO_LINGER:
                if val == NULL or vlen < 8:
                    raise shim.Errno(errno.EINVAL, "SO_LINGER")
                on = not cast("int *", val)[0]  # inverted: the default (0) is on
            elif name == SO_KEEPALIVE:
                on = int_at(val, vlen)
                o.keepalive = (e.keepalive_time or 7200) if on else None
            else:
                raise shim.Errno(errno.EOPNOTSUPP, f"SOL_SOCKET option {name}")
            if on is not None:
                e.so_opts = e.so_opts | (1 << name) if on else e.so_opts & ~(1 << name)
            return 0
        if level == IPPROTO_TCP:
            if name == TCP_NODELAY:
                on = int_at(val, vlen)
                e.tcp_opts = e.tcp_opts | (1 << name) if on else e.tcp_opts & ~(1 << name)
            elif name == TCP_KEEPIDLE:
                t = int_at(val, vlen)
                if t <= 0:
                    raise shim.Errno(errno.EINVAL, "TCP_KEEPIDLE")
                e.keepalive_time = t
                if o.keepalive is not None:
                    o.keepalive = t
            elif name not in (TCP_KEEPCNT, TCP_KEEPINTVL, TCP_MAXSEG, TCP_CONGESTION):
                raise shim.Errno(errno.EOPNOTSUPP, f"IPPROTO_TCP option {name}")
            return 0
        if level == IPPROTO_IP and name == IP_TOS:
            e.tos = int_at(val, vlen)
            return 0
        if level == IPPROTO_IPV6 and name == IPV6_V6ONLY:
            on = int_at(val, vlen)
            e.ipv6_opts = e.ipv6_opts | (1 << name) if on else e.ipv6_opts & ~(1 << name)
            return 0
        if level == SOL_RDMA:
            if opening(e):  # the sizes are the connection's: set before it
                raise shim.Errno(errno.EINVAL, "SOL_RDMA options are set before connecting")
            if name == RDMA_SQSIZE:
                o.sq_size = min(uint_at(val, vlen), RS_QP_MAX_SIZE)
            elif name == RDMA_RQSIZE:
                o.rq_size = min(uint_at(val, vlen), RS_QP_MAX_SIZE)
            elif name == RDMA_INLINE:
                o.sq_inline = min(uint_at(val, vlen), RS_QP_MAX_SIZE)
            elif name == RDMA_IOMAPSIZE:
                o.iomap_size = scale_to_value(value_to_scale(int_at(val, vlen)))
            elif name == RDMA_ROUTE:
                unsupported("rsetsockopt(RDMA_ROUTE)")
            else:
                raise shim.Errno(errno.EOPNOTSUPP, f"SOL_RDMA option {name}")
            return 0
        raise shim.Errno(errno.EOPNOTSUPP, f"option {level}/{name}")

    @ffi.def_extern(name="rgetsockopt")
    @_rguard(-1)
    def rgetsockopt(fd: int, level: int, name: int, val: Any, vlen: Any) -> int:
        e = lookup(fd)
        if val == NULL or vlen == NULL:
            raise shim.Errno(errno.EFAULT, "rgetsockopt: no room")
        o = e.sock.options
        v: int | None = None
        if level == SOL_SOCKET:
            if name in (SO_REUSEADDR, SO_KEEPALIVE, SO_OOBINLINE):
                v = int(bool(e.so_opts & (1 << name)))
            elif name == SO_RCVBUF:
                v = o.rbuf_size
            elif name == SO_SNDBUF:
                v = o.sbuf_size
            elif name == SO_ERROR:
                if e.connecting is None or not e.connecting.is_alive():
                    v, e.err = e.err, 0
                else:
                    v = 0
            elif name == SO_LINGER:
                if vlen[0] < 8:
                    raise shim.Errno(errno.EINVAL, "SO_LINGER")
                p = cast("int *", val)
                p[0], p[1] = int(not e.so_opts & (1 << SO_LINGER)), 0
                vlen[0] = 8
                return 0
            elif name == SO_BROADCAST:
                return 0
        elif level == IPPROTO_TCP:
            if name == TCP_NODELAY:
                v = int(bool(e.tcp_opts & (1 << name)))
            elif name == TCP_KEEPIDLE:
                v = e.keepalive_time
            elif name == TCP_MAXSEG:
                v = 1024 if e.sock.connected else 2048  # the path's MTU (softrdma's: 1024)
            elif name in (TCP_CONGESTION, TCP_KEEPCNT, TCP_KEEPINTVL):
                v = 1
        elif level == IPPROTO_IP and name == IP_TOS:
            v = e.tos
        elif level == IPPROTO_IPV6 and name == IPV6_V6ONLY:
            v = int(bool(e.ipv6_opts & (1 << name)))
        elif level == SOL_RDMA:
            v = {RDMA_SQSIZE: o.sq_size, RDMA_RQSIZE: o.rq_size, RDMA_INLINE: o.sq_inline,
                 RDMA_IOMAPSIZE: o.iomap_size}.get(name)
        if v is None:
            raise shim.Errno(errno.EOPNOTSUPP, f"option {level}/{name}")
        if vlen[0] < 4:
            raise shim.Errno(errno.EINVAL, "option length")
        cast("int *", val)[0] = v
        vlen[0] = 4
        return 0

    @ffi.def_extern(name="softrdma_rfcntl")
    @_rguard(-1, lambda fd, cmd, arg: f"rfcntl({fd}, {_FCNTL.get(cmd, cmd)}, {arg:#x})")
    def rfcntl(fd: int, cmd: int, arg: int) -> int:
        e = lookup(fd)
        if cmd == F_GETFL:
            return e.fs_flags
        if cmd == F_SETFL:
            arg &= 0xFFFFFFFF  # an int, passed as a long
            if e.connecting is None or not e.connecting.is_alive():
                e.sock.settimeout(0.0 if arg & O_NONBLOCK else None)
            e.fs_flags = arg
            return 0
        if cmd == F_GETFD:
            return e.fd_flags
        if cmd == F_SETFD:
            e.fd_flags = arg & 0xFFFFFFFF
            return 0
        raise shim.Errno(errno.EOPNOTSUPP, f"rfcntl command {cmd}")

    # ---- riomap / riowrite ------------------------------------------------------------

    @ffi.def_extern(name="riomap")
    @_rguard(-1, lambda fd, buf, n, prot, flags, off: f"riomap({fd}, {n}, {prot}, {off})")
    def riomap(fd: int, buf: Any, length: int, prot: int, flags: int, offset: int) -> int:
        e = lookup(fd)
        sock = _ready(e)
        if not sock.connected or prot & ~PROT_WRITE:  # rsocket.c: no PD yet is EINVAL
            raise shim.Errno(errno.EINVAL, "riomap: not connected, or prot")
        if buf == NULL or length <= 0:
            raise shim.Errno(errno.EINVAL, "riomap: no buffer")
        addr = shim.address(buf)
        if offset == -1:
            offset = addr
        if prot & PROT_WRITE:
            offset, mr = sock.riomap(buffer(cast("char *", buf), length), offset)
        else:
            mr = None  # a local mapping: riowrite copies through the send ring anyway
        e.maps[(addr, length)] = mr
        return offset

    @ffi.def_extern(name="riounmap")
    @_rguard(-1, lambda fd, buf, n: f"riounmap({fd}, {n})")
    def riounmap(fd: int, buf: Any, length: int) -> int:
        e = lookup(fd)
        key = (shim.address(buf), length)
        if key not in e.maps:
            raise shim.Errno(errno.EINVAL, "riounmap: not mapped")
        mr = e.maps.pop(key)
        if mr is not None:
            e.sock.riounmap(mr)
        return 0

    @ffi.def_extern(name="riowrite")
    @_rguard(SIZE_MAX)
    def riowrite(fd: int, buf: Any, count: int, offset: int, flags: int) -> int:
        e = lookup(fd)
        sock = _ready(e)
        if not count:
            return 0
        if buf == NULL:
            raise shim.Errno(errno.EFAULT, "riowrite: no buffer")
        with _Mode(e, flags):
            return sock.riowrite(buffer(buf, count), offset)
