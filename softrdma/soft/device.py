"""The soft RoCE device: what rxe keeps per ``rxe_dev``, minus the I/O.

A :class:`SoftDevice` is made for one IP address. It owns the GID table, the port and
device attributes (rxe's limits), QP numbers, the memory key table, and the packets
looped back to itself. The protocol decisions are the engines' (``softrdma.qp``); the
device only moves packets and time between them and a driver:

* **live** (the default for devices opened through the verbs API): the first
  :meth:`open` binds UDP 4791 (:meth:`attach_udp`) and starts a progress thread, like a
  NIC that is simply there; the last :meth:`release` stops it again.
* **manual** (``live=False``): nothing moves unless the program says so, with
  :meth:`progress` (in-memory loopback, virtual time) or ``attach_udp(thread=False)`` and
  :meth:`poll`; the simulated network and capture replay drive devices this way.

Every driver makes progress the same way: deliver what arrived, fire the due timers
(:meth:`fire_timers`), deliver what looped back (:meth:`run_local`). :meth:`fire_timers`
also gives every QP whose responder asked for it (:meth:`schedule_responder`: a long
READ's response) one pass, and :meth:`next_deadline` is "now" while one waits, so a
driver that sleeps until the next timer (the progress thread, :meth:`poll`, :meth:`step`,
the simulated network) comes straight back.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..completion import AsyncEvent
from .. import trace as _trace
from ..counters import Counters, Drop
from ..enums import bytes_to_mtu, ibv_event_type, ibv_mtu
from ..qp.engine import QpEngine
from ..qp.memory import KeyTable
from ..wire.icrc import (
    RC_FLUSH_OPCODE, icrc_ipv4, icrc_ipv4_iov, icrc_ipv6, icrc_ipv6_iov, rxe_flush_icrc,
)
from ..wire.iov import packet_bytes, zero_copy_enabled
from ..wire.opcodes import BTH_SIZE
from .capture import PacketCapture
from .faults import Direction, Faults, with_icrc
from .gsi import GsiEndpoint
from .lock import DeviceLock
from .mcast import McastTable
from .netdev import NetdevInfo, eui64_link_local, ipv4_mapped_gid, netdev_for_ip
from .progress import Progress, poll_once
from .rx import receive_packet, receive_train, synth_ip_header, trace_packet
from .timers import DeviceTimers
from .udp import TransportError, UdpTransport

__all__ = ["SoftDevice", "DeviceLimits", "DeviceFailed", "RXE_MAX_HDR_LENGTH",
           "active_mtu_for", "LOOPBACK_TRIES"]

log = logging.getLogger("softrdma")
LOOPBACK_TRIES = 64  # an auto-addressed device tries 127.0.0.1, .2, ... this many addresses
POOLS = ("pd", "cq", "srq", "qp", "mr", "mw", "ah")  # counted against DeviceLimits.max_<kind>


class DeviceFailed(OSError):
    """The device's progress machinery stopped; nothing on it can complete any more."""


RXE_MAX_HDR_LENGTH = 80  # rxe subtracts this from the netdev MTU before picking an IB MTU
RXE_MIN_QP_INDEX = 16  # first QPN handed to users; 0 (SMI) and 1 (GSI) are reserved
RXE_MAX_QPN = 0xFFFFFE  # 0xFFFFFF is the multicast QPN


def active_mtu_for(netdev_mtu: int) -> ibv_mtu:
    """rxe_set_mtu: the IB MTU below ``netdev_mtu - 80``, clamped to 256..4096 (1500 -> 1024)."""
    return bytes_to_mtu(max(256, min(4096, netdev_mtu - RXE_MAX_HDR_LENGTH)))


@dataclass(frozen=True)
class DeviceLimits:
    """rxe_param.h limits (the values of the 5.x/6.1 kernels Debian 12 ships)."""

    max_qp: int = 0x10000
    max_qp_wr: int = 0x4000
    max_sge: int = 32
    max_sge_rd: int = 32
    max_cq: int = 16384
    max_cqe: int = (1 << 15) - 1
    max_mr: int = 256 * 1024
    max_mw: int = 256 * 1024
    max_pd: int = 0x7FFC
    max_qp_rd_atom: int = 128
    max_qp_init_rd_atom: int = 128
    max_res_rd_atom: int = 0x3F000
    max_srq: int = 0x10000
    max_srq_wr: int = 0x4000
    max_srq_sge: int = 27
    max_ah: int = 0x7FFF
    max_pkeys: int = 64
    max_inline_data: int = 400
    max_msg_sz: int = 0x800000
    max_mr_size: int = 0xFFFFFFFFFFFFFFFF
    page_size_cap: int = 0xFFFFF000
    local_ca_ack_delay: int = 15
    vendor_id: int = 0xFFFFFF
    gid_tbl_len: int = 1024
    max_mcast_grp: int = 8192  # RXE_MAX_MCAST_GRP
    max_mcast_qp_attach: int = 56  # RXE_MAX_MCAST_QP_ATTACH
    max_total_mcast_qp_attach: int = 0x70000  # RXE_MAX_TOT_MCAST_QP_ATTACH


class SoftDevice:
    """A software RoCE device bound (logically) to one IP address.

    ``transmit`` is called with ``(packet_bytes, dst_ip, src_port)`` for every packet the
    engines send, and a fourth argument, the path's traffic class (IP TOS), when it is not
    0; drivers replace it. ``lock`` serialises verbs calls and the progress
    engine, like rxe's per-object spinlocks but coarser.
    """

    def __init__(self, name: str, ip: str, *, mtu: int | None = None, mac: bytes | None = None,
                 netdev: NetdevInfo | None = None, seed: int | None = None, live: bool = False,
                 auto_address: bool = False, sequential_qpn: bool = False,
                 strict: bool | None = None) -> None:
        self.name = name
        self._mtu_override = mtu
        self._mac_override = mac
        self.set_address(ip, netdev)
        self.max_mtu = ibv_mtu.IBV_MTU_4096
        self.limits = DeviceLimits()
        self.rng = random.Random(seed)
        # live: open() attaches UDP and a progress thread; auto_address: if UDP 4791 on a
        # loopback address is taken (another softrdma process), move to the next address
        self.live = live
        self.auto_address = auto_address
        self._auto_attached = False
        self.fatal: BaseException | None = None
        self.fatal_listeners: list[Callable[[BaseException], None]] = []
        # what peers must not be able to guess (memory keys, iovas, QP numbers): from the OS's
        # random source, or from the seed when one is given (reproducible captures and tests)
        self.secret_rng: random.Random = random.SystemRandom() if seed is None else \
            random.Random(f"softrdma-secrets-{seed}")
        self.keys = KeyTable(self.secret_rng)
        self.qps: dict[int, QpEngine] = {}  # QPN -> the QP's engine (rxe's QP pool)
        # QP1, the GSI: 256-byte MADs in and out, handed to a MAD handler (the CM)
        self.gsi = GsiEndpoint(self)
        self.mcast = McastTable(self)  # UD multicast groups (soft/mcast.py)
        # rxe hands out QPNs in order from 16; softrdma draws them at random unless told to
        # be sequential (replays of captures pin QPNs through ``_next_qpn``)
        self.sequential_qpn = sequential_qpn
        self._next_qpn = RXE_MIN_QP_INDEX
        # strict receive checks (docs/security.md): None -> the SOFTRDMA_STRICT variable
        if strict is None:
            strict = os.environ.get("SOFTRDMA_STRICT", "") not in ("", "0")
        self.strict = strict
        # packets as lists of buffers, received packets as views (softrdma.wire.iov);
        # SOFTRDMA_ZEROCOPY=0: one buffer each, copied, as before
        self.zero_copy = zero_copy_enabled()
        self.counters = Counters()
        self.trace: Any = None  # a softrdma.trace.Tracer while tracing: every hook tests it
        _trace.attach(self)
        self.lock = DeviceLock()  # an RLock whose last release sends what was queued
        self.contexts: int = 0
        # objects in use per kind, against the limits (rxe's rxe_pool counts)
        self.in_use: dict[str, int] = dict.fromkeys(POOLS, 0)
        self.transmit: Callable[..., None] = self._loopback
        # whether ``transmit`` takes a packet as a list of buffers (wire_send asks it once
        # per transport: its ``takes_iov``)
        self._iov_transmit: Any = None
        self._iov_ok = False
        self.async_listeners: list[Callable[[Any], None]] = []
        self.port_active = True
        # time, injected by whoever drives the device: a virtual clock sets ``_now``; a real
        # transport sets ``clock`` (time.monotonic) and ``now`` then reads it
        self._now = 0.0
        self.clock: Callable[[], float] | None = None
        self.udp: Any = None  # UdpTransport when bound to sockets
        self.progress_thread: Any = None
        self.polled_at = float("-inf")  # when an application last polled a CQ (progress.py)
        self.timers = DeviceTimers()  # every QP's (and the CM's...) armed timers
        # loopback deliveries: (packet, src, dst, sport, IP header or None: a path's TOS)
        self._rxq: deque[tuple[bytes, bytes, bytes, int, bytes | None]] = deque()
        # QPs whose responder has more to send (schedule_responder), in the order they asked
        self._resp_ready: deque[QpEngine] = deque()
        self._resp_queued: set[QpEngine] = set()
        # told when the first of them asks (the progress thread wakes up for it)
        self.on_schedule: Callable[[], None] | None = None
        #: the progress thread's wake-up, for :meth:`blocking`
        self.on_blocking: Callable[[], None] | None = None
        self.capture: Any = None  # a PacketCapture, when capturing
        self.verify_icrc = True  # transports that cannot see the IPv4 ID switch this off
        # fault injection (soft/faults.py, docs/faults.md): ``faults.tx`` / ``faults.rx``;
        # the data path tests fault_tx / fault_rx, set only while a direction has work
        self.fault_tx: Direction | None = None
        self.fault_rx: Direction | None = None
        self.faults = Faults(self, None if seed is None else f"softrdma-faults-{seed}")

    # -- addressing ------------------------------------------------------------------
    def set_address(self, ip: str, netdev: NetdevInfo | None = None) -> None:
        """(Re)bind the device to ``ip``: MAC, MTU and the GID table follow, as an rxe
        device follows its netdev. Only while no QP exists (an address change moves the
        GIDs peers would use)."""
        if getattr(self, "qps", None):
            raise RuntimeError("cannot change the address of a device with QPs")
        addr = ipaddress.ip_address(ip)
        self.ip = str(addr)
        self.ip_packed = addr.packed
        self.ip_version = addr.version
        self.netdev = netdev or netdev_for_ip(self.ip)
        self.mac = self._mac_override or self.netdev.mac
        self.netdev_mtu = self._mtu_override or self.netdev.mtu
        self.active_mtu = active_mtu_for(self.netdev_mtu)
        self.gid_table: list[bytes] = [eui64_link_local(self.mac)]
        if self.ip_version == 4:
            self.gid_table.append(ipv4_mapped_gid(self.ip))
        else:
            self.gid_table.append(ipaddress.IPv6Address(self.ip).packed)
        self.node_guid = self.gid_table[0][8:]

    def gid_for_ip(self, ip: str) -> bytes:
        a = ipaddress.ip_address(ip)
        return ipv4_mapped_gid(str(a)) if a.version == 4 else a.packed

    def ip_of_gid(self, gid: bytes) -> bytes:
        """The IP address a GID stands for. A GID of this device's own table is the device's
        address, whichever index names it (rxe sends from its netdev's address: the
        link-local GID of index 0 too, which for softrdma's loopback addresses has no IPv6
        link-local address of its own); otherwise rdma_gid2ip: IPv4-mapped GIDs give 4
        bytes, anything else the 16 bytes."""
        gid = bytes(gid)
        if gid in self.gid_table:
            return self.ip_packed
        # the link-local GID of another softrdma device whose MAC was derived from its IPv4
        # address (02:00:a.b.c.d: loopback and interface-less addresses, soft/netdev.py):
        # that address, as neighbour resolution finds an rxe peer's link-local address
        if gid[:8] == b"\xfe\x80" + bytes(6) and gid[8:10] == b"\x00\x00" \
                and gid[11:13] == b"\xff\xfe" and self.ip_version == 4:
            return bytes([gid[10]]) + gid[13:16]
        if gid[:12] == bytes(10) + b"\xff\xff":
            return gid[12:]
        return bytes(gid)

    # -- resource pools ---------------------------------------------------------------------
    def pool_take(self, kind: str) -> bool:
        """Count one more object of ``kind`` ("pd", "qp", ...); False at the device's limit."""
        with self.lock:
            if self.in_use[kind] >= getattr(self.limits, f"max_{kind}"):
                return False
            self.in_use[kind] += 1
            return True

    def pool_give(self, kind: str) -> None:
        with self.lock:
            self.in_use[kind] -= 1

    # -- QP numbers --------------------------------------------------------------------
    def alloc_qpn(self) -> int:
        """A free QPN in [16, 2^24 - 1) (0xFFFFFF is the multicast QPN). By default drawn at
        random, so an off-path sender cannot guess it (rxe counts up from 16); with
        ``sequential_qpn`` like rxe's pool: from ``_next_qpn`` upward, skipping numbers in
        use, wrapping at 2^24."""
        if not self.sequential_qpn:
            rng = self.secret_rng
            for _ in range(64):
                qpn = rng.randrange(RXE_MIN_QP_INDEX, RXE_MAX_QPN + 1)
                if qpn not in self.qps:
                    return qpn
            # a pathologically full table: fall through to a scan from a random point
            self._next_qpn = rng.randrange(RXE_MIN_QP_INDEX, RXE_MAX_QPN + 1)
        for _ in range(RXE_MAX_QPN - RXE_MIN_QP_INDEX + 1):
            qpn = self._next_qpn
            self._next_qpn = qpn + 1 if qpn < RXE_MAX_QPN else RXE_MIN_QP_INDEX
            if qpn not in self.qps:
                return qpn
        raise MemoryError("no free QP number")

    # -- data path ---------------------------------------------------------------------
    def qp_destroyed(self, engine: Any) -> None:
        """A QP's engine left :attr:`qps` (device lock held): the socket of its UDP source
        port goes unless another QP sends from that port."""
        if self.udp is None:
            return
        sport = engine.src_port
        if not any(e.src_port == sport for e in self.qps.values()):
            self.udp.release_sport(sport)

    def send_packet(self, qp: Any, pkt: Any, dst_ip: bytes | None, tos: int = 0) -> None:
        """Called by the engines: fill the ICRC for our addresses and transmit.

        ``pkt`` is one ``bytearray`` (its ICRC slot is written) or a list of buffers
        (softrdma.wire.iov: headers, a view of the MR, pad + ICRC slot), whose last buffer
        is replaced by the pad and the ICRC, continued over the headers and the view: the
        payload is not copied here, and leaves by the transport's ``sendmsg`` before the
        device lock is let go. ``tos`` is the path's traffic class (the AH's, or the QP's
        primary path's), which rxe puts in the IPv4 TOS / IPv6 traffic class of every
        packet; the ICRC masks it."""
        if dst_ip is None:
            self.counters.drop(Drop.NO_PATH)
            return
        sport = qp.src_port
        if type(pkt) is list:
            if len(dst_ip) == 4:
                c = icrc_ipv4_iov(pkt, self.ip_packed, dst_ip, sport)
            else:
                c = icrc_ipv6_iov(pkt, self.ip_packed, dst_ip, sport)
            tail = pkt[2]
            t = len(tail)
            pkt[2] = tail[:t - 4] + c.to_bytes(4, "little") if t > 4 else c.to_bytes(4, "little")
            data = pkt
        else:
            n = len(pkt)
            if len(dst_ip) == 4:
                c = icrc_ipv4(pkt, self.ip_packed, dst_ip, sport)
            else:
                c = icrc_ipv6(pkt, self.ip_packed, dst_ip, sport)
            if pkt[0] == RC_FLUSH_OPCODE:  # rxe's ICRC of a FLUSH, which rxe requires
                c = rxe_flush_icrc(c, pkt)
            pkt[n - 4:] = c.to_bytes(4, "little")
            data = bytes(pkt)
        if self.trace is not None:  # what the QP sent (the faults' doings are traced apart)
            trace_packet(self, "tx", packet_bytes(data), qpn=getattr(qp, "qp_num", None),
                         peer=dst_ip)
        if self.fault_tx is not None:  # it may hold the packet back: the bytes of now
            self.faults.send(packet_bytes(data), dst_ip, sport, tos)
            return
        self.wire_send(data, dst_ip, sport, tos)

    def wire_send(self, data: Any, dst_ip: bytes, sport: int, tos: int = 0) -> None:
        """Put one finished packet on the wire (counted and captured): the tail of
        :meth:`send_packet`, which the fault injector calls for each copy it lets out.
        A transport is called with ``tos`` only when it is not 0 (``transmit(data, dst_ip,
        sport[, tos])``), so the simplest transport takes three arguments. ``data`` may be
        a list of buffers (softrdma.wire.iov); a transport gets it as such only if its
        ``transmit`` says it takes them (a ``takes_iov`` attribute, as
        ``UdpTransport.send`` has), else joined into ``bytes``."""
        self.counters.sent_pkts += 1
        if type(data) is list:
            if self.capture is not None:
                self.capture.record(packet_bytes(data), self.ip_packed, dst_ip, sport, tos=tos)
            t = self.transmit
            if t is not self._iov_transmit:  # replaced since last asked: ask once
                self._iov_transmit = t
                self._iov_ok = bool(getattr(t, "takes_iov", False))
            if not self._iov_ok:
                data = packet_bytes(data)
        elif self.capture is not None:
            self.capture.record(data, self.ip_packed, dst_ip, sport, tos=tos)
        if tos:
            self.transmit(data, dst_ip, sport, tos)
        else:
            self.transmit(data, dst_ip, sport)

    def flush_tx(self) -> None:
        """Send what the transport has queued now, rather than when the device lock is let
        go (softrdma.soft.lock): between two QPs' batches in :meth:`run_responders`."""
        flush = self.lock.on_release
        if flush is not None:
            flush()

    def defer_until_sent(self, qp: Any, fn: Callable[[], None]) -> bool:
        """A responder offers to hold back an ACK and merge it with later ones (coalesced
        ACKs, softrdma.soft.lock): True if ``fn`` will be called before the packets of the
        datagram being handled leave (``lock.before_flush``), False to send it now. Only
        over real sockets to another address (a looped-back ACK costs no system call, and
        simulated networks count one ACK per AckReq), while SOFTRDMA_ACK_COALESCE allows."""
        if not self.lock.coalesce_acks or self.udp is None or qp.dst_ip == self.ip_packed:
            return False
        self.lock.before_flush(fn)
        return True

    def schedule_responder(self, qp: QpEngine) -> None:
        """``qp``'s responder has more to send than one pass may (a READ longer than
        ``softrdma.qp.responder.READ_RESPONSE_BATCH`` packets): give it another pass
        (``qp.run_responder()``) in :meth:`run_responders`, after the QPs that asked
        before it. Asking again before that pass counts once. rxe reschedules the QP's
        responder task the same way."""
        if qp in self._resp_queued:
            return
        self._resp_queued.add(qp)
        self._resp_ready.append(qp)
        if len(self._resp_ready) == 1 and self.on_schedule is not None:
            self.on_schedule()

    @property
    def responders_waiting(self) -> int:
        """How many QPs wait for a pass of :meth:`run_responders`."""
        return len(self._resp_ready)

    def run_responders(self) -> int:
        """One pass over the QPs that asked for one (:meth:`schedule_responder`), in the
        order they asked: each sends its next batch, which leaves (:meth:`flush_tx`)
        before the next QP's is built. A QP with still more to send asks again and comes
        after the others: round robin, so two long READs share the device and neither
        keeps it from received packets and timers, which drivers handle between passes.
        Returns how many QPs had a pass."""
        q = self._resp_ready
        if not q:
            return 0
        n = 0
        with self.lock:
            for _ in range(len(q)):
                qp = q.popleft()
                self._resp_queued.discard(qp)
                if qp.closed:
                    continue
                self.flush_tx()
                qp.run_responder()
                n += 1
            self.flush_tx()
        return n

    def set_mad_handler(self, handler: Callable[..., Any] | None) -> None:
        """QP1: hand every MAD that passes rxe's checks to ``handler(mad, source)``
        (``self.gsi.set_handler``; docs/device.md, "QP1")."""
        self.gsi.set_handler(handler)

    def send_mad(self, mad: bytes | bytearray, dst_ip: str | bytes, dst_qpn: int = 1,
                 **kw: int) -> None:
        """QP1: send one 256-byte MAD to ``dst_ip`` as rxe does (``self.gsi.send``)."""
        self.gsi.send(mad, dst_ip, dst_qpn, **kw)

    def _loopback(self, data: bytes, dst_ip: bytes, sport: int, tos: int = 0) -> None:
        """Default transport: deliver to ourselves (rxe's loopback), drop anything else."""
        if dst_ip == self.ip_packed or self.mcast.group(dst_ip) is not None:
            # a group this device is in: the copy IP_MULTICAST_LOOP would bring back
            self._rxq.append((data, self.ip_packed, dst_ip, sport,
                              synth_ip_header(dst_ip, dst_ip, len(data), 0, tos) if tos
                              else None))
        else:
            self.counters.drop(Drop.NO_TRANSPORT)

    def receive(self, data: bytes | bytearray | memoryview, src_ip: bytes, dst_ip: bytes, *,
                ip_id: int = 0, ip_header: bytes | None = None, sport: int = 0,
                verify_icrc: bool | None = None) -> None:
        """A RoCE packet (BTH .. ICRC) arrived from ``src_ip`` for ``dst_ip``."""
        verify = self.verify_icrc if verify_icrc is None else verify_icrc
        with self.lock:
            if self.fault_rx is not None:
                self.faults.receive(data, src_ip, dst_ip, ip_id, ip_header, sport, verify,
                                    self._deliver_received)
            else:
                receive_packet(self, data, src_ip, dst_ip, ip_id, ip_header, sport, verify)

    def receive_train(self, parts: list, src_ip: bytes, dst_ip: bytes, *, sport: int = 0,
                      verify_icrc: bool | None = None, ip_ids: list[int] | None = None) -> None:
        """The packets of a train received whole (UDP GRO; ``parts`` may be views of the
        receive buffer, used before this returns; ``ip_ids`` their IPv4 IDs, if known).
        Runs of MIDDLE packets take the train path (softrdma.soft.rx.receive_train) unless
        something wants every packet on its own: receive faults, a capture or a trace."""
        verify = self.verify_icrc if verify_icrc is None else verify_icrc
        with self.lock:
            if self.fault_rx is not None or self.capture is not None or self.trace is not None:
                # each on its own: what keeps a packet (the capture, a held or delayed
                # fault) copies it; with zero copy off, a copy each, as before
                zc = self.zero_copy
                for k, p in enumerate(parts):
                    self.receive(p if zc else bytes(p), src_ip, dst_ip, sport=sport,
                                 verify_icrc=verify, ip_id=ip_ids[k] if ip_ids else 0)
            else:
                receive_train(self, parts, src_ip, dst_ip, sport, verify, ip_ids)

    def _deliver_received(self, data: bytes, src_ip: bytes, dst_ip: bytes, ip_id: int,
                          ip_header: bytes | None, sport: int, verify: bool) -> None:
        receive_packet(self, data, src_ip, dst_ip, ip_id, ip_header, sport, verify)

    def inject(self, data: bytes | bytearray | memoryview, *, src: str | bytes | None = None,
               sport: int | None = None, fix_icrc: bool = True) -> None:
        """Feed a crafted packet to the receive path as if it had arrived from the network.

        ``data`` is the RoCE part (BTH .. ICRC). ``src`` (an address, or its packed bytes)
        and ``sport`` default to this device's own address and 0xC000. ``fix_icrc`` writes
        the ICRC the receive check expects for them (False: the packet's own, right or
        wrong, as a peer sent it). The packet meets the rx faults and every receive check,
        like any arrival, and is counted in ``counters.faults["rx_injected"]``; whatever it
        provokes is sent at once (the answers of a device with no transport wait for
        :meth:`progress`). A scapy packet goes through
        :func:`softrdma.harness.inject.inject_packet`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            # bytes(scapy_packet) would be IP/UDP/BTH, read as a BTH: refuse rather than guess
            raise TypeError(f"inject takes the RoCE bytes (BTH .. ICRC), not "
                            f"{type(data).__name__}; for a scapy packet use "
                            f"softrdma.harness.inject.inject_packet")
        data = bytes(data)
        if src is None:
            src_ip = self.ip_packed
        elif isinstance(src, (bytes, bytearray)):
            src_ip = bytes(src)
        else:
            src_ip = ipaddress.ip_address(src).packed
        sport = 0xC000 if sport is None else sport
        if fix_icrc and len(data) >= BTH_SIZE + 4:
            data = with_icrc(data, src_ip, self.ip_packed, sport)
        with self.lock:
            self.faults.count("rx", "injected")
            self.receive(data, src_ip, self.ip_packed, sport=sport)
            self.after_post()

    def progress(self) -> int:
        """Deliver looped-back packets and fire due timers at ``self.now``; return how many
        events were handled. The manual-mode driver: call until it returns 0."""
        with self.lock:
            n = self.run_local()
            n += self.fire_timers(self.now)
            n += self.run_local()
        return n

    def run_local(self) -> int:
        """Deliver the packets this device sent to itself (rxe's loopback), including the
        answers they provoke; return how many. Called with the lock held, after a verbs
        call or a progress step has finished, never from inside an engine: engines only
        queue, so none is re-entered while it is mid-way through a state machine."""
        q = self._rxq
        n = 0
        while q:
            data, src, dst, sport, ip_header = q.popleft()
            receive_packet(self, data, src, dst, 0, ip_header, sport, True)
            n += 1
        return n

    def after_post(self) -> None:
        """A verbs call queued work: with a transport attached, loopback traffic is handled
        at once on the caller's thread (no hand-off to the progress thread, which a
        busy-polling caller would starve of the GIL). Manual devices without a transport
        keep their packets until :meth:`progress`, so tests and lessons can step."""
        if self._rxq and self.udp is not None:
            self.run_local()

    def blocking(self) -> None:
        """The application stops polling and is about to block (``get_cq_event``): the
        progress thread takes receiving back now, not when its grace after the last poll
        runs out (softrdma.soft.progress)."""
        if self.polled_at != float("-inf"):
            self.polled_at = float("-inf")
            if self.on_blocking is not None:
                self.on_blocking()

    def poll_nowait(self) -> int:
        """Progress driven by a caller polling a CQ: read what arrived, handle loopback.
        Skips (returns 0) if another thread is already making progress."""
        if self.fatal is not None:
            raise DeviceFailed(errno.EIO, f"device {self.name} stopped: {self.fatal!r}")
        self.polled_at = time.monotonic()  # the progress thread leaves rx to us for a while
        if not self.lock.acquire(blocking=False):
            return 0
        try:
            n = self.udp.receive_ready(64) if self.udp is not None else 0
            if self._resp_ready:
                n += self.run_responders()
            return n + self.run_local()
        finally:
            self.lock.release()

    # -- opening (live devices) -------------------------------------------------------------
    def open(self) -> None:
        """A context opened the device: a live device starts moving packets by itself (UDP
        4791 and a progress thread). Raises :class:`TransportError` if it cannot bind."""
        with self.lock:
            if self.live and self.udp is None:
                self._go_live()
            self.contexts += 1

    def release(self) -> None:
        """A context closed; the last one stops what :meth:`open` started."""
        with self.lock:
            self.contexts = max(0, self.contexts - 1)
            last = self.contexts == 0 and self._auto_attached
        if last:
            self.detach()

    def _go_live(self) -> None:
        start = ipaddress.ip_address(self.ip)
        tries = LOOPBACK_TRIES if self.auto_address and start.is_loopback and \
            start.version == 4 else 1
        for i in range(tries):
            if i:
                self.set_address(str(start + i))
            try:
                self.attach_udp()
            except TransportError as e:
                if e.errno != errno.EADDRINUSE or i == tries - 1:
                    if i:
                        self.set_address(str(start))
                    raise
                continue
            self._auto_attached = True
            return

    def fail(self, exc: BaseException) -> None:
        """The progress machinery stopped for good: tell every waiter (contexts wake their
        completion channels and raise DEVICE_FATAL) instead of leaving them hanging."""
        if self.fatal is not None:
            return
        self.fatal = exc
        log.error("softrdma device %s stopped: %r", self.name, exc)
        self.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_DEVICE_FATAL, 1))
        for fn in list(self.fatal_listeners):
            try:
                fn(exc)
            except Exception:  # a listener must not keep the others from learning it
                log.exception("fatal listener of %s failed", self.name)

    @property
    def now(self) -> float:
        return self.clock() if self.clock is not None else self._now

    @now.setter
    def now(self, t: float) -> None:
        self._now = t

    # -- sockets -----------------------------------------------------------------------------
    def attach_udp(self, *, thread: bool = True, raw_rx: bool = False,
                   capture: str | None = None) -> Any:
        """Bind the device to UDP port 4791 on its address and, by default, start the
        progress thread. ``capture`` (or the SOFTRDMA_PCAP environment variable) names a pcap
        file that gets every packet sent and received."""
        if self.udp is not None:
            return self.udp
        # SOFTRDMA_FAULTS and the old SOFTRDMA_TX_LOSS[_KIND], once per device; a bad spec
        # (FaultError) fails the attach before anything is bound
        self.faults.load_env(os.environ)
        self.udp = UdpTransport(self, raw_rx=raw_rx)
        self.mcast.rejoin()
        self.clock = time.monotonic
        path = capture or os.environ.get("SOFTRDMA_PCAP")
        if path:
            self.capture = PacketCapture(path.replace("{name}", self.name))
        if thread:
            self.progress_thread = Progress(self, self.udp)
            self.progress_thread.start()
        self.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_PORT_ACTIVE, 1))
        return self.udp

    def poll(self, timeout: float = 0.0) -> int:
        """Manual mode: wait up to ``timeout`` seconds for packets or a timer and handle them."""
        if self.udp is None:
            return self.progress()
        return poll_once(self, self.udp, timeout)

    def step(self, jump_to_timer: bool = True) -> bool:
        """One step for a caller waiting on a manual device (rdma_cm's event channel):
        with sockets, up to 1 ms of packets and timers (:meth:`poll`); without, the
        queued work, and when there was none and ``jump_to_timer`` allows it, the
        virtual clock skips to the next timer, which fires. False when nothing happened."""
        if self.udp is not None:
            return bool(self.poll(0.001))
        with self.lock:
            if self.progress():
                return True
            nxt = self.next_deadline()
            if nxt is None or not jump_to_timer:
                return False
            self.now = max(self.now, nxt)  # virtual time: nothing to wait for in between
            self.fire_timers(self.now)
            self.progress()
            return True

    def detach(self) -> None:
        """Stop the progress thread and close the sockets and the capture (idempotent)."""
        if self.progress_thread is not None:
            self.progress_thread.stop()
            self.progress_thread = None
        with self.lock:
            if self.udp is not None:
                self.udp.close()
                self.udp = None
            if self.capture is not None and hasattr(self.capture, "close"):
                self.capture.close()
                self.capture = None
            self.clock = None
            self._auto_attached = False
            self.transmit = self._loopback

    # -- timers (soft/timers.py; the driver and the engines' DeviceServices use these) ------
    def timer_changed(self, owner: Any) -> None:
        """``owner``'s deadline changed (armed, moved, cancelled): refile it."""
        self.timers.changed(owner)

    @property
    def timer_qps(self) -> Any:
        """The owners with a timer armed (a read-only view)."""
        return self.timers.owners

    def next_deadline(self) -> float | None:
        """The earliest armed timer's deadline, or None; :attr:`now` while a responder
        waits for a pass (:meth:`schedule_responder`). It tidies the heap on the way: call
        it with the device lock held (or from the one thread driving a manual device), as
        :meth:`fire_timers` and :meth:`timer_changed` are called."""
        if self._resp_ready:
            return self.now
        return self.timers.next_deadline()

    def fire_timers(self, now: float) -> int:
        """Fire every timer due at ``now``, then give the responders that asked for it a
        pass (:meth:`run_responders`); return how many owners were due or had a pass."""
        n = self.timers.fire(now)
        if self._resp_ready:
            n += self.run_responders()
        return n

    def emit_async(self, event: Any) -> None:
        if self.trace is not None:
            self.trace.emit(self, "event", getattr(getattr(event, "element", None), "qp_num",
                                                   None), f"async event {event}")
        for fn in list(self.async_listeners):
            fn(event)

    def __repr__(self) -> str:
        return f"<SoftDevice {self.name} {self.ip} mtu={self.netdev_mtu}>"

    def pin_next_qpn(self, qpn: int) -> None:
        """Allocate QPNs sequentially from now on (rxe's pool order), starting at ``qpn``: how
        a replay of a capture gives its QP the captured number."""
        self.sequential_qpn = True
        self._next_qpn = qpn
