"""Binding a soft device to real UDP sockets on port 4791.

Sending: rxe gives every QP its own UDP source port (0xC000 + a hash) and the ICRC covers
that port, so softrdma sends each packet from a socket bound to ``(address, source port)``.
Those sockets form a bounded pool (:data:`TX_POOL` per device, and no more than an eighth of
the process's descriptor limit; the least recently used is closed first and counted in
``counters.sport_evicted``), so thousands of QPs cost a bounded number of descriptors. IPv4 sockets are
unconnected with ``IP_PMTUDISC_DO``, which makes Linux send DF with IP ID 0, the value our
ICRC assumes. If a source port cannot be had (another program holds it, or the process is
out of descriptors), the packet is rebuilt for the main socket's port 4791 and sent from
it, and ``counters.sport_fallback`` counts it: rxe does not check source ports, so peers
still accept it.

Packets leave in trains: the transport queues what the engines send and, when the device
lock's outermost holder lets go (softrdma.soft.lock), sends each run of equal-size packets
for one destination and source port with one ``sendmsg`` and a ``UDP_SEGMENT`` control
message (Linux UDP GSO; softrdma.wire.trains has the rules and the IPv4 ICRC fix-up). The
receive socket sets ``UDP_GRO``, so a train that arrives whole is read with one
``recvmsg`` and cut into its packets. Each is optional: ``SOFTRDMA_GSO=0`` and
``SOFTRDMA_GRO=0`` switch them off, a kernel without them is detected (the option is
refused, or a train's ``sendmsg`` fails with EIO/EINVAL and the train goes packet by
packet), and ``counters.gso_trains``/``gro_trains`` say how often they were used.

Packets addressed to the device itself never touch a socket: they go to the device's
loopback queue (rxe's ``rxe_loopback``), handled on the same thread right after the call
that sent them.

Receiving: one socket bound to ``(address, 4791)``. Over IPv6 every field the ICRC covers is
known (addresses, ports, length), so the ICRC is verified. Over IPv4 the IP identification
field is covered too, and an ordinary UDP socket cannot see it; so IPv4 ICRCs are only
verified in raw mode (``raw_rx=True``, needs CAP_NET_RAW), where packets are read with
their IP header from a raw socket. Otherwise they are counted in ``counters.icrc_unchecked``.
"""

from __future__ import annotations

import errno
import ipaddress
import mmap
import os
import resource
import select
import selectors
import socket
import struct
from collections import OrderedDict
from typing import Any

from ..wire.headers import ROCE_V2_UDP_DPORT
from ..wire.icrc import RC_FLUSH_OPCODE, icrc_ipv4, icrc_ipv6, icrc_ok_ipv4
from ..wire.iov import packet_bytes
from ..wire.trains import coalesce, split, split_unsized, train_iov
from ..counters import Drop
from .rx import synth_ip_header

__all__ = ["UdpTransport", "TransportError", "TX_POOL"]

IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2
UDP_NO_CHECK6_RX = 102
IP_MULTICAST_ALL = 49  # linux/in.h: a socket reads only its own groups when off
MCAST_TTL = 64  # IPV6_DEFAULT_HOPLIMIT: the hop limit cma_iboe_join_multicast sets
SOCKBUF = 4 << 20
TX_POOL = 4096  # source-port sockets kept open per device (descriptors are finite) ...
TX_POOL_SHARE = 8  # ... and at most 1/8 of the process's descriptor limit
# errors that say "no descriptor or buffer right now", not "this port is someone else's"
_TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
SOL_UDP = 17
UDP_SEGMENT = 103  # linux/udp.h: send a train (GSO), the segment size as a u16 cmsg
UDP_GRO = 104  # receive trains whole, the segment size as an int cmsg
# what sendmsg says when this kernel, device or route cannot take a train
_NO_GSO = (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP)
_GSO_SIZE = struct.Struct("=H")
_GRO_SIZE = struct.Struct("=i")
IP_RECVTOS = 13  # linux/in.h: the TOS of each datagram as an IP_TOS control message
_IPPROTO_IP, _IP_TOS = socket.IPPROTO_IP, socket.IP_TOS
_IPPROTO_IPV6, _IPV6_TCLASS = socket.IPPROTO_IPV6, socket.IPV6_TCLASS
_INT = struct.Struct("=i")  # IPV6_TCLASS takes an int
RX_OFFSET = 2032  # where a datagram lands in the receive buffer's first page (see __init__)
_BYTE = struct.Struct("=B")  # IP_TOS as a control message: one byte (ip_cmsg_send accepts it)


def _tos_of(anc: Any) -> int:
    """The TOS (IPv4 IP_TOS, one byte) or traffic class (IPv6 IPV6_TCLASS, an int) among a
    datagram's control messages; 0 if none came."""
    for level, kind, data in anc:
        if level == socket.IPPROTO_IP and kind == socket.IP_TOS and data:
            return data[0]
        if level == socket.IPPROTO_IPV6 and kind == socket.IPV6_TCLASS and len(data) >= 4:
            return _INT.unpack_from(data)[0] & 0xFF
    return 0


def _env_on(name: str) -> bool:
    """A feature switch: on unless the variable is set to 0, no, off or false."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "no", "off", "false")


def _train_ip_id(packet: memoryview, src: bytes, dst: bytes, sport: int, k: int) -> int:
    """The IPv4 ID packet ``k`` of a received train had: ``k`` if its ICRC says so (a
    softrdma GSO train, cut by the kernel), else 0 (a DF sender such as rxe)."""
    return k if icrc_ok_ipv4(packet, src, dst, sport, ip_id=k) else 0


DEFAULT_NOFILE = 1024  # the kernel's and systemd's default soft RLIMIT_NOFILE


def _descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE, for sizing the source-port pool. A soft limit at the default
    1,024 (kept that low only for ``select()``; systemd asks programs that do not use it
    to raise their own soft limit, as Go and the JVM do at start-up) is first raised
    towards the hard limit, as far as the pool wants (TX_POOL * TX_POOL_SHARE): at 1,024
    the pool would hold 128 sockets, and 1,000 streaming QPs would close and open a socket
    for nearly every packet. Any other soft limit was chosen by someone and is respected."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    if soft == DEFAULT_NOFILE:
        want = TX_POOL * TX_POOL_SHARE
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
    return soft


class TransportError(OSError):
    """The device could not be bound (address not local, port in use...)."""


class UdpTransport:
    def __init__(self, device: Any, port: int = ROCE_V2_UDP_DPORT, raw_rx: bool = False) -> None:
        self.device = device
        self.port = port
        self.ip = device.ip
        self.v6 = device.ip_version == 6
        self.family = socket.AF_INET6 if self.v6 else socket.AF_INET
        self.sock = self._bind(port)
        self._recv_tos(self.sock)
        self.tx: OrderedDict[int, socket.socket] = OrderedDict()  # the LRU pool
        self.tx_pool = max(4, min(TX_POOL, _descriptor_limit() // TX_POOL_SHARE))
        self.busy_ports: set[int] = set()  # bound by another program: always fall back
        self.raw: socket.socket | None = None
        if raw_rx and not self.v6:
            self.raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
            self.raw.setblocking(False)
            self.raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)
        device.transmit = self.send
        device.verify_icrc = self.v6 or self.raw is not None
        # trains (module docstring): queue and flush on the lock's last release, GRO reads
        self.gso = _env_on("SOFTRDMA_GSO")
        self.gro = False
        if _env_on("SOFTRDMA_GRO"):
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:  # a kernel before 5.0: one datagram per packet
                pass
        self._pending: list[tuple[bytes, bytes, int]] = []
        self.pending_peak = 0  # the most packets one flush has sent (see ``pending``)
        device.lock.on_release = self.flush
        # The receive buffer: page-aligned memory, each datagram read RX_OFFSET bytes in.
        # With zero copy the responder copies a payload straight from here into the MR,
        # and a copy whose source lies a few bytes below its destination modulo the page
        # size runs about six times slower on x86 (4K aliasing; 1.3 against 0.21 us for
        # 4 KiB, measured): at RX_OFFSET a payload starts mid-page, far from where a
        # page-aligned or malloc'ed (page offset 16) MR's chunks start.
        self._rxmem = mmap.mmap(-1, RX_OFFSET + 65536)
        self._buf = memoryview(self._rxmem)[RX_OFFSET:]
        self.zero_copy = device.zero_copy  # views of _buf for received packets
        self._addr: dict[bytes, tuple[str, int]] = {}
        self._sel: selectors.BaseSelector | None = None
        self._last_sport, self._last_sock = -1, None  # the pool entry used last
        # multicast groups joined (soft/mcast.py): a socket bound to each group's address,
        # read with the receive socket; one epoll descriptor stands for all of them, so the
        # progress thread's selector, made once, sees a group joined later
        self.groups: dict[bytes, socket.socket] = {}
        self._ep = select.epoll()
        self._ep.register((self.raw or self.sock).fileno(), select.EPOLLIN)
        self.closed = False

    def _recv_tos(self, s: socket.socket) -> None:
        """Ask for each datagram's TOS / traffic class (a control message), which a UD
        receive's GRH area shows as rxe's does (the real IP header's)."""
        try:
            if s.family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
            else:
                s.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
        except OSError:
            pass

    def _bind(self, port: int) -> socket.socket:
        try:
            s = socket.socket(self.family, socket.SOCK_DGRAM)
        except OSError as e:
            raise TransportError(e.errno, f"cannot open a UDP socket for {self.ip}:{port}: "
                                          f"{e.strerror}") from None
        try:
            if self.v6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    s.setsockopt(socket.IPPROTO_UDP, UDP_NO_CHECK6_RX, 1)  # rxe sends checksum 0
                except OSError:
                    pass
                # multicast leaves by the device's interface, 64 hops (rdma_cm's join)
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, MCAST_TTL)
                if self._ifindex():
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, self._ifindex())
            else:
                s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
                # multicast: TTL 64 (the hop limit rdma_cm's join gives the AH, which rxe
                # writes as the TTL; a socket's default would be 1), out by the device's
                # address; looped back to this host's members, as rxe's QP sockets do
                s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, MCAST_TTL)
                s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                             socket.inet_aton(self.ip))
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, SOCKBUF)
            s.bind((self.ip, port))
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                raise TransportError(e.errno, f"UDP port {port} on {self.ip} is in use (another "
                                              f"softrdma device or a kernel rxe?)") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise TransportError(e.errno, f"{self.ip} is not an address of this host") from None
            raise TransportError(e.errno, f"cannot bind {self.ip}:{port}: {e.strerror}") from None
        s.setblocking(False)
        return s

    def fileno(self) -> int:
        """The receive socket's descriptor (the epoll of it and the group sockets once
        made: what the progress thread waits on)."""
        ep = getattr(self, "_ep", None)
        return ep.fileno() if ep is not None else (self.raw or self.sock).fileno()

    # -- multicast groups ---------------------------------------------------------------
    def _ifindex(self) -> int:
        name = getattr(self.device.netdev, "ifname", None)
        try:
            return socket.if_nametoindex(name) if name else 0
        except OSError:
            return 0

    def join_group(self, group: bytes) -> None:
        """Receive what is sent to the IP multicast ``group`` (4 or 16 bytes) on the
        device's interface: a socket bound to ``(group, 4791)`` that joined it there
        (IP_ADD_MEMBERSHIP / IPV6_JOIN_GROUP, as rxe's ``ip_mc_join_group``), reading only
        its own memberships (IP_MULTICAST_ALL off). OSError if the kernel refuses."""
        if group in self.groups:
            return
        v6 = len(group) == 16
        s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # several devices (and processes) of one host may join one group
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)
            if v6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    s.setsockopt(socket.IPPROTO_UDP, UDP_NO_CHECK6_RX, 1)
                except OSError:
                    pass
                s.bind((socket.inet_ntop(socket.AF_INET6, group), self.port, 0,
                        self._ifindex()))
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP,
                             group + struct.pack("@I", self._ifindex()))
            else:
                s.bind((socket.inet_ntoa(group), self.port))
                try:
                    s.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
                except OSError:
                    pass
                # ip_mreq: the group, and the interface by the device's own address
                s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                             group + self.device.ip_packed)
            self._recv_tos(s)
        except OSError:
            s.close()
            raise
        s.setblocking(False)
        self.groups[group] = s
        self._ep.register(s.fileno(), select.EPOLLIN)

    def leave_group(self, group: bytes) -> None:
        """The last QP left ``group``: its socket is closed, which leaves the IP group."""
        s = self.groups.pop(group, None)
        if s is not None:
            try:
                self._ep.unregister(s.fileno())
            except OSError:
                pass
            s.close()

    def _receive_groups(self, budget: int) -> int:
        """Read what the group sockets have (no trains: one datagram, one packet). The
        destination is the group; over IPv4 the ICRC cannot be checked, as for unicast."""
        dev = self.device
        n = 0
        buf = self._buf
        for group, s in list(self.groups.items()):
            while n < budget:
                try:
                    nbytes, anc, _flags, addr = s.recvmsg_into([buf], 64)
                except (BlockingIOError, OSError):
                    break
                n += 1
                src = socket.inet_pton(s.family, addr[0].split("%")[0])
                verify = len(group) == 16
                if not verify:
                    dev.counters.icrc_unchecked += 1
                tos = _tos_of(anc)
                # zero copy: a view, used before the next recvmsg_into (what keeps a
                # packet copies it); else a copy, as before
                dev.receive(memoryview(buf)[:nbytes] if self.zero_copy else bytes(buf[:nbytes]),
                            src, group, sport=addr[1], verify_icrc=verify,
                            ip_header=synth_ip_header(src, group, nbytes, 0, tos) if tos
                            else None)
                if self._pending:
                    self.flush()
        return n

    def selector(self) -> selectors.BaseSelector:
        """A selector (epoll: no 1,024-descriptor limit) watching the receive socket."""
        if self._sel is None:
            self._sel = selectors.DefaultSelector()
            self._sel.register(self.fileno(), selectors.EVENT_READ)
        return self._sel

    # -- send ---------------------------------------------------------------------------------
    def release_sport(self, sport: int) -> None:
        """No QP sends from ``sport`` any more: its pooled socket is closed (the pool
        holds the ports of live QPs; a server's ended connections leave no descriptor
        behind). A packet still queued for it binds the port again."""
        s = self.tx.pop(sport, None)
        if s is not None:
            if sport == self._last_sport:
                self._last_sport, self._last_sock = -1, None
            s.close()

    def _tx_socket(self, sport: int) -> socket.socket | None:
        """The pooled socket bound to ``sport``, or None to fall back to port 4791."""
        if sport == self.port:
            return self.sock
        s = self.tx.get(sport)
        if s is not None:
            self.tx.move_to_end(sport)
            return s
        if sport in self.busy_ports:
            return None
        if len(self.tx) >= self.tx_pool:
            # the least recently used port's socket goes; the port stays right on the wire
            old_port, old = self.tx.popitem(last=False)
            old.close()
            if old_port == self._last_sport:
                self._last_sport, self._last_sock = -1, None
            self.device.counters.sport_evicted += 1
        try:
            s = self._bind(sport)
        except TransportError as e:
            if e.errno not in _TRANSIENT:
                self.busy_ports.add(sport)
            return None
        self.tx[sport] = s
        return s

    def send(self, data: Any, dst_ip: bytes, sport: int, tos: int = 0) -> None:
        """The device's ``transmit``: loopback at once, anything else queued for the flush
        when the device lock is let go (or sent now, without trains). ``data`` is one
        buffer or a list of buffers (softrdma.wire.iov), kept as it is until ``sendmsg``
        gathers it; the loopback queue, read after this call, gets a copy.

        ``tos`` (the path's traffic class) goes into the IP header as rxe puts it there,
        through an IP_TOS / IPV6_TCLASS control message of that ``sendmsg`` (the sockets
        are shared by every path of a source port). Queued, it rides in the upper bits of
        the port key, so a train never mixes two classes."""
        dev = self.device
        if dst_ip == dev.ip_packed:  # loopback: no socket, handled right after this call
            if type(data) is list:  # received later: the bytes of now, not a view
                data = packet_bytes(data)
            dev._rxq.append((data, dst_ip, dst_ip, sport,
                             synth_ip_header(dst_ip, dst_ip, len(data), 0, tos) if tos
                             else None))
            return
        key = sport | (tos & 0xFF) << 16 if tos else sport
        if self.gso:
            self._pending.append((data, dst_ip, key))
            if type(data) is list:
                self.views_pending = True
            if dev.lock.depth == 0:  # sent by someone not holding the lock: no flush coming
                self.flush()
            return
        self._send_one(data, dst_ip, key)

    send.takes_iov = True  # type: ignore[attr-defined]  # SoftDevice.wire_send reads it

    #: a queued packet holds a view of an MR (zero copy): it must leave within the device
    #: lock's hold that computed its ICRC, so a post does not defer it (doorbell batching)
    views_pending = False

    @property
    def pending(self) -> int:
        """Packets queued for the next :meth:`flush`. What one hold of the device lock
        queues: :attr:`pending_peak` is the most a flush has sent since the transport was
        made (a long READ's response leaves in batches, softrdma.qp.responder)."""
        return len(self._pending)

    def flush(self) -> None:
        """Send what is queued: each run of equal-size packets for one destination and
        port as one train. Called with the device lock held, as it is let go."""
        pending = self._pending
        if not pending or self.closed:
            return
        if len(pending) > self.pending_peak:
            self.pending_peak = len(pending)
        self._pending = []
        self.views_pending = False
        for dst_ip, key, size, packets in coalesce(pending):
            if len(packets) == 1:
                self._send_one(packets[0], dst_ip, key)
            else:
                self._send_train(packets, dst_ip, key, size)

    def _socket_for(self, sport: int) -> socket.socket | None:
        if sport == self._last_sport:  # a message's packets share a port: skip the pool
            return self._last_sock
        s = self._tx_socket(sport)
        if s is not None:
            self._last_sport, self._last_sock = sport, s
        return s

    def _address(self, dst_ip: bytes) -> tuple[str, int]:
        addr = self._addr.get(dst_ip)
        if addr is None:  # converting with ipaddress costs ~2 us: once per destination
            addr = self._addr[dst_ip] = (str(ipaddress.ip_address(dst_ip)), ROCE_V2_UDP_DPORT)
        return addr

    def _tos_cmsg(self, tos: int) -> tuple[int, int, bytes]:
        if self.v6:
            return (socket.IPPROTO_IPV6, socket.IPV6_TCLASS, _INT.pack(tos))
        return (socket.IPPROTO_IP, socket.IP_TOS, _BYTE.pack(tos))

    def _send_train(self, packets: list, dst_ip: bytes, key: int, size: int) -> None:
        """``key``: the source port, with the TOS above bit 16 (:meth:`send`)."""
        sport = key & 0xFFFF
        s = self._socket_for(sport)
        if s is None:  # no socket on the QP's port: the fallback rebuilds each packet
            for p in packets:
                self._send_one(p, dst_ip, key)
            return
        c = self.device.counters
        cmsgs = [(SOL_UDP, UDP_SEGMENT, _GSO_SIZE.pack(size))]
        if key >> 16:
            cmsgs.append(self._tos_cmsg(key >> 16))
        try:
            s.sendmsg(train_iov(packets, not self.v6), cmsgs, 0, self._address(dst_ip))
        except BlockingIOError:
            c.drop(Drop.TX_QUEUE_FULL, len(packets))
            return
        except OSError as e:
            if e.errno not in _NO_GSO:
                c.send_err += 1
                c.drop(Drop.TX_ERROR, len(packets))
                return
            # this kernel or route takes no trains: from now on, packet by packet
            self.gso = False
            c.gso_fallback += 1
            for p in packets:
                self._send_one(p, dst_ip, key)
            return
        c.gso_trains += 1
        c.gso_packets += len(packets)

    def _send_one(self, data: bytes, dst_ip: bytes, key: int) -> None:
        """``key``: the source port, with the TOS above bit 16 (:meth:`send`)."""
        sport = key & 0xFFFF
        s = self._socket_for(sport)
        if s is None:
            # rebuild the ICRC for the main socket's port, which the packet will carry
            self.device.counters.sport_fallback += 1
            b = bytearray(packet_bytes(data))
            src = self.device.ip_packed
            c = (icrc_ipv6 if self.v6 else icrc_ipv4)(b, src, dst_ip, self.port)
            b[-4:] = c.to_bytes(4, "little")
            data = bytes(b)
            s = self.sock
        try:
            if type(data) is list:  # zero copy: the kernel gathers the buffers
                s.sendmsg(data, [self._tos_cmsg(key >> 16)] if key >> 16 else [], 0,
                          self._address(dst_ip))
            elif key >> 16:
                s.sendmsg([data], [self._tos_cmsg(key >> 16)], 0, self._address(dst_ip))
            else:
                s.sendto(data, self._address(dst_ip))
        except BlockingIOError:
            self.device.counters.drop(Drop.TX_QUEUE_FULL)
        except OSError:
            self.device.counters.send_err += 1
            self.device.counters.drop(Drop.TX_ERROR)

    # -- receive -------------------------------------------------------------------------------
    def receive_ready(self, budget: int = 256) -> int:
        """Read and deliver what is waiting (up to ``budget`` datagrams); return how many."""
        n = self._receive_groups(budget) if self.groups else 0
        return n + self._receive_unicast(budget)

    def _receive_unicast(self, budget: int) -> int:
        if self.raw is not None:
            return self._receive_raw(budget)
        dev = self.device
        n = 0
        own = dev.ip_packed
        verify = self.v6
        buf = self._buf
        mv = memoryview(buf)
        sock = self.sock
        gro = self.gro
        # zero copy: each packet a view of the receive buffer, read before the next
        # recvmsg_into (the responder's placement is the payload's one copy; whatever keeps
        # a packet past the call copies it); off: a copy first, as before
        zc = self.zero_copy
        while n < budget:
            try:  # the control messages: a train's segment size (UDP_GRO), the TOS
                nbytes, anc, _flags, addr = sock.recvmsg_into([buf], 64)
            except BlockingIOError:
                break
            except OSError:
                break
            n += 1
            src = socket.inet_pton(self.family, addr[0].split("%")[0])
            sport = addr[1]
            size = tos = 0
            for level, kind, data in anc:
                if level == SOL_UDP:
                    if kind == UDP_GRO and gro:
                        size = _GRO_SIZE.unpack_from(data)[0]
                elif kind == _IP_TOS and level == _IPPROTO_IP:
                    tos = data[0]
                elif kind == _IPV6_TCLASS and level == _IPPROTO_IPV6:
                    tos = _INT.unpack_from(data)[0] & 0xFF
            if tos:  # a path's traffic class: each packet with its IP header (UD's GRH)
                parts = split(mv, nbytes, size) if 0 < size < nbytes else [mv[:nbytes]]
                if not verify:
                    dev.counters.icrc_unchecked += len(parts)
                for k, part in enumerate(parts):
                    ip_id = _train_ip_id(part, src, own, sport, k) if k and not verify and \
                        dev.capture is not None else 0
                    dev.receive(part if zc else bytes(part), src, own, sport=sport,
                                verify_icrc=verify,
                                ip_id=ip_id,
                                ip_header=synth_ip_header(src, own, len(part), ip_id, tos))
            elif 0 < size < nbytes:
                dev.counters.gro_trains += 1
                parts = split(mv, nbytes, size)
                if not verify:
                    dev.counters.icrc_unchecked += len(parts)
                ip_ids = None
                if dev.capture is not None and not verify:
                    # the capture wants the IP ID each packet had (its ICRC covers it)
                    ip_ids = [_train_ip_id(part, src, own, sport, k) if k else 0
                              for k, part in enumerate(parts)]
                dev.receive_train(parts, src, own, sport=sport, verify_icrc=verify,
                                  ip_ids=ip_ids)
            else:
                if not verify:
                    dev.counters.icrc_unchecked += 1
                dev.receive(mv[:nbytes] if zc else bytes(mv[:nbytes]), src, own, sport=sport,
                            verify_icrc=verify)
            if self._pending:
                # what this datagram (or train) provoked leaves now, not after the whole
                # budget: an ACK held back stalls a sender whose window it would open
                self.flush()
        return n

    def _receive_raw(self, budget: int) -> int:
        """Read from the raw socket: every packet with its IP header, so its ICRC checked.
        With zero copy, each packet is a view of the receive buffer (read before the next
        datagram: what keeps a packet copies it), else a copy, as before."""
        dev = self.device
        own = dev.ip_packed
        n = 0
        while True:  # the UDP socket gets its own copy of everything: discard it
            try:
                self.sock.recv(65536)
            except (BlockingIOError, OSError):
                break
        buf = self._buf
        zc = self.zero_copy
        while n < budget:
            try:
                nbytes = self.raw.recv_into(buf)
            except (BlockingIOError, OSError):
                break
            # the headers as bytes (addresses are cache keys), the RoCE part a view or copy
            pkt = memoryview(buf)[:nbytes]
            if nbytes < 28 or pkt[16:20] != own:
                continue
            ihl = (pkt[0] & 0xF) * 4
            sport, dport, ulen = struct.unpack_from("!HHH", pkt, ihl)
            if dport != ROCE_V2_UDP_DPORT:
                continue
            n += 1
            ip_id = struct.unpack_from("!H", pkt, 4)[0]
            src, ip_header = bytes(pkt[12:16]), bytes(pkt[:20])
            roce = pkt[ihl + 8:ihl + ulen] if zc else bytes(pkt[ihl + 8:ihl + ulen])
            parts = [roce]
            if len(roce) >= 32 and roce[0] != RC_FLUSH_OPCODE and \
                    not icrc_ok_ipv4(roce, src, own, sport, ip_id=ip_id):
                # not one good packet: maybe a train that crossed loopback whole, which a
                # raw socket sees uncut and without its segment size
                parts = split_unsized(roce)
            for k, part in enumerate(parts):  # segment k of a train has IP ID id + k
                dev.receive(part, src, own, ip_id=(ip_id + k) & 0xFFFF, sport=sport,
                            ip_header=ip_header, verify_icrc=True)
            if self._pending:  # what it provoked leaves now (as for the UDP socket)
                self.flush()
        return n

    def close(self) -> None:
        if self.closed:
            return
        self.flush()
        if self.device.lock.on_release == self.flush:
            self.device.lock.on_release = None
        self.closed = True
        if self._sel is not None:
            self._sel.close()
        for g in list(self.groups):
            self.leave_group(g)
        self._ep.close()
        for s in self.tx.values():
            s.close()
        self.tx.clear()
        self._last_sport, self._last_sock = -1, None
        self.sock.close()
        if self.raw is not None:
            self.raw.close()
