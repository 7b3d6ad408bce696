"""perftest's out-of-band exchange (TCP, default port 18515), as perftest 4.5 speaks it.

Read from linux-rdma/perftest (src/perftest_communication.c, perftest_communication.h,
perftest_parameters.c, and each test's main in write_bw.c, read_bw.c, atomic_bw.c,
send_bw.c, write_lat.c, read_lat.c, send_lat.c) and checked against real captures of
Debian 12's perftest 4.5-0.20 on rxe (pcaps/linux-rxe/with-oob).

Every exchange is ``ctx_xchg_data``/``ctx_hand_shake``: **the client writes its record, then
reads the server's; the server reads first, then writes** (perftest_communication.c,
``ctx_xchg_data_ethernet`` and ``ctx_hand_shake``). The records, in order:

1. ``exchange_versions``: ``user_param->version``, 16 bytes (``MAX_VERSION``): "6.06" and
   NULs. ``check_version_compatibility`` then refuses a peer below 5.70.
2. ``check_sys_data`` (peer >= 5.32): ``cycle_buffer`` (the page size, 4096) then
   ``cache_line_size`` (64), each a 4-byte big-endian int. Each side keeps the larger.
3. ``check_mtu`` (peer >= 5.1): ``sprintf("%d", curr_mtu)`` of the ``enum ibv_mtu`` (3 for
   1024), 2 bytes (peer >= 5.31, else 4); each side uses the smaller valid one.
4. Handshakes (``ctx_hand_shake``): the ``pingpong_dest`` of QP ``i`` (or of QP 0) as text,
   ``KEY_PRINT_FMT_GID`` = ``"%04x:%04x:%06x:%06x:%08x:%016llx:" + 16 x "%02x:" + "%08x:"``
   (lid, out_reads, qpn, psn, rkey, vaddr, GID bytes, srqn), NUL-terminated: 108 bytes
   (``KEY_MSG_SIZE_GID``; RoCE always has a GID index, ``check_link`` makes -1 into 0). Every
   handshake after the first resends the same record: they are barriers.
5. ``xchg_bw_reports`` (BW tests where only the client measures): ``size`` (8 bytes),
   ``iters`` (8 bytes for a peer >= 5.33, else 4), ``bw_peak``, ``bw_avg``, ``msgRate_avg``
   (IEEE doubles), all big-endian. The server's side is its never-filled ``my_bw_rep``
   (stack garbage in the captures); the server prints the client's numbers.
6. ``ctx_close_connection``: one more handshake, then ``write("done", 5)`` and ``close``:
   neither side reads the other's "done".

Which handshakes each test makes (``per QP`` = one handshake per QP, else one for QP 0):

=================  =========================================================================
write/read/atomic   keys (per QP), connect the QPs, again with the remote printed (per QP),
BW                  "after moving qp to RTR"; the client runs and prints; then one more (the
                    server waits in it for the end), the reports, close + done. 3 before the
                    traffic, 1 after, 8 x 10 bytes of reports, then 108 + "done" each way.
send BW             keys (per QP), connect, one, again with the remote printed (per QP), the
                    server posts its receives, one more (the sync that keeps the first send
                    from finding no receive); both run and print; close + done. 4 before, no
                    reports (each side measures what it sees), 1 + "done" after. That is
                    why send_bw shows 10 key records to write_bw's 8 before the reports.
                    With -a: per size, receives, a handshake, the run, a handshake.
write lat           one, keys (per QP), connect, again with the remote printed (per QP),
                    after RTR: 4; both ping-pong and print; write_lat.c returns without
                    ctx_close_connection: no closing handshake and no "done".
read/atomic lat     as write lat, then the server goes straight to close + done (it waits in
                    that handshake while the client reads); the client runs, prints, closes.
send lat            as write lat with the receives posted before the 4th; both ping-pong and
                    print; close + done.
=================  =========================================================================
"""

from __future__ import annotations

import math
import select
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable

from ...readiness import readable
from ..common import ToolError

__all__ = ["VERSION", "Dest", "PerftestComm", "HANDSHAKES", "KEY_MSG_SIZE_GID",
           "version_value"]

VERSION = "6.06"  # perftest 4.5-0.20's VERSION (perftest_parameters.h), as the captures show
MAX_VERSION = 16
KEY_MSG_SIZE_GID = 108
DONE = b"done\0"


@dataclass
class Dest:
    """perftest's ``struct pingpong_dest`` (the fields that travel)."""

    lid: int = 0
    out_reads: int = 1
    qpn: int = 0
    psn: int = 0
    rkey: int = 0
    vaddr: int = 0
    gid: bytes = bytes(16)
    srqn: int = 0

    def encode(self) -> bytes:
        """``sprintf(msg, KEY_PRINT_FMT_GID, ...)`` into ``char msg[108]``: the text, its NUL,
        and (the array being uninitialised in C) zeros after it."""
        text = (f"{self.lid & 0xFFFF:04x}:{self.out_reads & 0xFFFF:04x}:{self.qpn:06x}:"
                f"{self.psn:06x}:{self.rkey & 0xFFFFFFFF:08x}:{self.vaddr:016x}:"
                + "".join(f"{b:02x}:" for b in self.gid) + f"{self.srqn:08x}:").encode()
        return text + bytes(KEY_MSG_SIZE_GID - len(text))

    @classmethod
    def parse(cls, msg: bytes) -> "Dest":
        """``ethernet_read_keys``: strtol on each ':'-separated field."""
        text = msg.split(b"\0", 1)[0].decode("ascii", "replace")
        f = text.split(":")
        try:
            if len(f) < 23:
                raise ValueError
            lid, outs, qpn, psn, rkey, vaddr = (int(x, 16) for x in f[:6])
            gid = bytes(int(x, 16) & 0xFF for x in f[6:22])
            srqn = int(f[22], 16)
        except ValueError:
            raise ToolError(f"Couldn't parse the peer's key record {text[:60]!r}: not perftest's "
                            f"108-byte GID format (a perftest 4.x ib_*_bw/lat or softrdma perf "
                            f"peer with a GID index?)") from None
        return cls(lid, outs, qpn, psn, rkey, vaddr, gid, srqn)


def version_value(v: bytes) -> float:
    """C's ``atof`` of the version record: the leading number, 0.0 if none."""
    text = v.split(b"\0", 1)[0].decode("ascii", "replace")
    num = ""
    for ch in text:
        if ch.isdigit() or (ch == "." and "." not in num):
            num += ch
        else:
            break
    try:
        return float(num) if num.strip(".") else 0.0
    except ValueError:
        return 0.0


# (test kind) -> handshakes before the traffic, whether the reports are exchanged, whether
# the run ends with ctx_close_connection. For the docs and the tests; the code below follows
# the per-test order in softrdma.tools.perf.main.
HANDSHAKES = {
    "write_bw": (3, True, True), "read_bw": (3, True, True), "atomic_bw": (3, True, True),
    "send_bw": (4, False, True), "write_lat": (4, False, False),
    "read_lat": (4, False, True), "atomic_lat": (4, False, True), "send_lat": (4, False, True),
}


class PerftestComm:
    """The TCP side channel of one test, in either role.

    ``pump(timeout)`` is called while waiting for the peer, so the (manual-mode) soft device
    keeps answering RDMA traffic: a server waiting in a handshake is the responder of the
    client's writes, reads and atomics."""

    def __init__(self, sock: socket.socket, client: bool,
                 pump: Callable[[float], Any] | None = None) -> None:
        self.sock = sock
        self.client = client
        self.pump = pump
        self.rem_version = b""
        self.rem_vers = 0.0
        self.sock.setblocking(False)

    # -- raw records --------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view)
                view = view[n:]
            except BlockingIOError:
                select.select([], [self.sock], [], 0.05)
            except OSError as e:
                raise ToolError(f"Couldn't send to the peer: {e.strerror or e} (did it exit?)") \
                    from None

    def _recv(self, n: int, what: str, timeout: float | None = None) -> bytes:
        buf = bytearray()
        waited = 0.0
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except BlockingIOError:
                chunk = None
            except OSError as e:
                raise ToolError(f"Couldn't read the {what} from the peer: {e.strerror or e}") \
                    from None
            if chunk == b"":
                got = f" after {len(buf)} of {n} bytes" if buf else ""
                raise ToolError(f"the peer closed the connection while we waited for its {what}"
                                f"{got} (is it perftest 4.x or softrdma perf, running the same "
                                f"test?)")
            if chunk:
                buf += chunk
                continue
            step = 0.01
            if self.pump is not None:
                # wait for the socket or the device, whichever speaks first
                r = readable([self.sock], 0)
                if not r:
                    self.pump(step)
            else:
                readable([self.sock], step)
            waited += step
            if timeout is not None and waited > timeout:
                raise ToolError(f"no {what} from the peer in {timeout:.0f} s: it does not speak "
                                f"perftest's exchange (ibv_*_pingpong waits for a 52-byte "
                                f"record instead)")
        return bytes(buf)

    def xchg(self, mine: bytes, what: str, timeout: float | None = None) -> bytes:
        """``ctx_xchg_data``: the client writes first, the server reads first."""
        if self.client:
            self._send(mine)
            return self._recv(len(mine), what, timeout)
        rem = self._recv(len(mine), what, timeout)
        self._send(mine)
        return rem

    # -- the steps ----------------------------------------------------------------------------
    def exchange_versions(self, timeout: float = 30.0) -> str:
        mine = VERSION.encode().ljust(MAX_VERSION, b"\0")
        rem = self.xchg(mine, "perftest version record", timeout)
        text = rem.split(b"\0", 1)[0]
        ok = bool(text) and all(c in b"0123456789." for c in text) and text[:1].isdigit()
        if not ok:
            raise ToolError(f"the peer sent {rem!r} where perftest sends its version string: it "
                            f"does not speak perftest's exchange (an ibv_*_pingpong or another "
                            f"tool on port?)")
        self.rem_version = rem
        self.rem_vers = version_value(rem)
        if self.rem_vers < 5.70:  # check_version_compatibility
            raise ToolError(f"Current implementation is not compatible with versions older than "
                            f"5.70 (the peer is perftest version {text.decode()})")
        return text.decode()

    def check_sys_data(self, cycle_buffer: int, cache_line: int) -> tuple[int, int]:
        if self.rem_vers < 5.32:
            return cycle_buffer, cache_line
        rc = struct.unpack("!i", self.xchg(struct.pack("!i", cycle_buffer), "page size"))[0]
        rl = struct.unpack("!i", self.xchg(struct.pack("!i", cache_line), "cache line size"))[0]
        return max(rc, cycle_buffer), max(rl, cache_line)

    def check_mtu(self, curr_mtu: int) -> int:
        """Our ``enum ibv_mtu``; returns the one to use (the smaller valid of the two)."""
        if self.rem_vers < 5.1:
            return curr_mtu
        size = 2 if self.rem_vers >= 5.31 else 4
        mine = str(curr_mtu).encode()[:size].ljust(size, b"\0")
        rem = self.xchg(mine, "MTU record")
        try:
            rem_mtu = int(rem.split(b"\0", 1)[0].decode("ascii") or "0")
        except (ValueError, UnicodeDecodeError):
            rem_mtu = 0
        return rem_mtu if 1 <= rem_mtu <= 5 and curr_mtu > rem_mtu else curr_mtu

    def hand_shake(self, my: Dest, timeout: float | None = None) -> Dest:
        return Dest.parse(self.xchg(my.encode(), "key record", timeout))

    def xchg_bw_reports(self, rep: "BwReport") -> "BwReport":
        long_iters = self.rem_vers >= 5.33
        size = struct.unpack("!Q", self.xchg(struct.pack("!Q", rep.size), "report"))[0]
        if long_iters:
            iters = struct.unpack("!Q", self.xchg(struct.pack("!Q", rep.iters), "report"))[0]
        else:
            iters = struct.unpack("!I", self.xchg(struct.pack("!I", rep.iters & 0xFFFFFFFF),
                                                  "report"))[0]
        vals = [struct.unpack("!d", self.xchg(struct.pack("!d", v), "report"))[0]
                for v in (rep.bw_peak, rep.bw_avg, rep.msg_rate)]
        return BwReport(size, iters, *(v if math.isfinite(v) else 0.0 for v in vals))

    def close_connection(self, my: Dest) -> None:
        """``ctx_close_connection``: a handshake, then "done" and close (nothing is read)."""
        self.hand_shake(my)
        self._send(DONE)
        self.close()

    def close(self) -> None:
        """Close; first read what the peer sent and we did not (its "done"), so the kernel
        closes with a FIN rather than a reset the peer might still be reading into."""
        try:
            for _ in range(64):
                if not self.sock.recv(65536):
                    break
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


@dataclass
class BwReport:
    """perftest's ``struct bw_report_data`` as exchanged (MB/s or Gb/s, Mpps)."""

    size: int = 0
    iters: int = 0
    bw_peak: float = 0.0
    bw_avg: float = 0.0
    msg_rate: float = 0.0
