"""Replay a capture of real RoCE traffic against softrdma's engines.

Given a capture of two endpoints talking (one QP each side), :func:`replay_side` stands up
a softrdma QP in place of one endpoint, with the capture's address, QP numbers, PSNs and
memory keys; posts the work requests that endpoint must have posted (reconstructed from its
request packets); feeds it, in capture order, every packet the peer sent; and returns what
softrdma transmitted beside what the real endpoint transmitted. A conforming
implementation sends the same packets, byte for byte, ICRC included once computed with the
capture's IP ID (rxe numbers its IPv4 packets; softrdma's own sockets send ID 0).

Memory the peer reads or updates atomically is seeded from the capture (the first read
response and the first atomic ACK of each address say what the real memory held); data
the endpoint sends is taken from its captured payloads. Everything else (segmentation,
PSNs, AckReq, ACK coalescing, MSNs, syndromes, RETH lengths, atomic results, UDP source
ports) is computed by softrdma and compared.
"""

from __future__ import annotations

import ipaddress
import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

from ..enums import (
    IBV_ACCESS_FLUSH_GLOBAL, IBV_ACCESS_FLUSH_PERSISTENT, IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE,
    IBV_FLUSH_PERSISTENT, IBV_WR_FLUSH, IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD, IBV_SEND_INLINE,
    IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WC_RECV,
    IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, bytes_to_mtu,
)
from ..wire.headers import feth_plt
from ..wire.opcodes import Opcode as O, Transport
from ..wire.packet import RocePacket, parse
from ..qp.params import udp_sport_for_path
from ..qp.psn import psn_add, psn_diff
from ..soft.device import RXE_MAX_HDR_LENGTH, SoftDevice
from ..verbs_api import (
    AH, CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SendWR,
)
from ..verbs_api.device import register_device, unregister_device
from ..errors import PyverbsError
from .replayjudge import judge
from .replayloss import Evidence, LossEvent, infer, rnr_frames
from .replaymsgs import Message, fill_holes, messages, wr_of_message
from .replayresult import (
    CapturedPacket, ExtraPacket, FrameVerdict, ReplayError, ReplayResult, captured_packet,
    iter_capture, load_capture,
)

__all__ = ["CapturedPacket", "ExtraPacket", "FrameVerdict", "ReplayError", "ReplayResult",
           "captured_packet", "iter_capture", "judge", "load_capture", "replay_side"]

_ALL = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
    IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_FLUSH_GLOBAL
# the QP allows whatever a captured peer asked (a persistent FLUSH, too: the target MRs
# that one reaches are registered over an mmap, as softrdma requires; docs/verbs.md)
_QP_ACCESS = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC | \
    IBV_ACCESS_FLUSH_GLOBAL | IBV_ACCESS_FLUSH_PERSISTENT
_U64 = struct.Struct("<Q")
ETH_MTU = 1500  # the netdev MTU of the captures' hosts (and of rxe's usual Ethernet)


@dataclass
class _Roles:
    """Who is who in a capture, seen from the endpoint softrdma stands in for."""

    me: bytes  # its address
    peer_ip: bytes
    transport: Transport
    my_qpn: int
    peer_qpn: int | None
    mine_out: list[CapturedPacket]  # what it sent
    reqs_in: list[CapturedPacket]  # the peer's requests to it
    reqs_out: list[CapturedPacket]  # its requests
    path_mtu: int  # bytes


def _roles(capture: list[CapturedPacket], me: bytes) -> _Roles:
    """Phase 1: read the endpoints, QP numbers, transport and path MTU off the capture."""
    mine_out = [c for c in capture if c.src == me]
    to_me = [c for c in capture if c.dst == me]
    if not mine_out and not to_me:
        raise ReplayError("no packet of the conversation is from or to this address")
    peer_ip = to_me[0].src if to_me else mine_out[0].dst
    transport = (to_me or mine_out)[0].pkt.info.transport
    my_qpn = to_me[0].pkt.dest_qp if to_me else None
    if my_qpn is None:
        # nothing was sent to us: for UD the DETH of our packets names us
        my_qpn = mine_out[0].pkt.src_qp
    if my_qpn is None:
        raise ReplayError("nothing in the capture was sent to this endpoint: its QP number "
                          "is unknown")
    return _Roles(me, peer_ip, transport, my_qpn,
                  mine_out[0].pkt.dest_qp if mine_out else None, mine_out,
                  [c for c in to_me if c.pkt.info.is_request],
                  [c for c in mine_out if c.pkt.info.is_request], _path_mtu(capture))


_IB_MTUS = (256, 512, 1024, 2048, 4096)


def _path_mtu(capture: list[CapturedPacket]) -> int:
    """The path MTU the endpoints used, in bytes. Segmentation cuts a message at exactly
    the path MTU, so any FIRST or MIDDLE packet's payload is it. A capture with no
    segmented message does not pin it (any MTU that carries its largest payload replays
    the same bytes): then 1024, what rxe on a 1500-byte Ethernet netdev offers and what
    the tools that made the captures ask for, or the smallest IB MTU above that carries
    the largest payload. (A FIRST or MIDDLE packet cut short by the capture's snap length
    pins nothing.)"""
    for c in capture:
        info = c.pkt.info
        if (info.first or info.middle) and not info.last and c.pkt.payload_len in _IB_MTUS:
            return c.pkt.payload_len
    largest = max((c.pkt.payload_len for c in capture), default=0)
    mtu = 1024
    while mtu < largest and mtu < 4096:
        mtu *= 2
    return mtu


def _netdev_mtu(path_mtu: int) -> int:
    """The netdev MTU of the replaying device: Ethernet's 1500 when its active MTU (1024)
    carries the path MTU, else just enough (rxe_set_mtu keeps 80 bytes for headers)."""
    return max(ETH_MTU, path_mtu + RXE_MAX_HDR_LENGTH)


#: the largest memory region a replay makes for the peer's targets (a garbled RETH must
#: not make it allocate gigabytes); requests outside it are answered as rxe would
_MAX_TARGET = 64 << 20


def _target_memory(pd: Any, dev: SoftDevice, roles: _Roles) -> dict[int, Any]:
    """Phase 2: the memory the peer targets, as MRs with the captured rkeys and addresses
    (one per rkey, covering every range the peer's requests touch)."""
    remote: dict[int, tuple[int, int]] = {}
    persistent: set[int] = set()  # rkeys a persistent FLUSH names
    for c in roles.reqs_in:
        p = c.pkt
        if p.info.flush and feth_plt(p.feth or 0) & IBV_FLUSH_PERSISTENT:
            persistent.add(p.rkey)
        if p.rkey is not None and p.va is not None and (p.dma_len or p.info.atomic):
            n = 8 if p.info.atomic else p.dma_len
            lo, hi = remote.get(p.rkey, (p.va, p.va + n))
            lo, hi = min(lo, p.va), max(hi, p.va + n)
            if hi - lo <= _MAX_TARGET and hi < 1 << 64:
                remote[p.rkey] = (lo, hi)
    target_mrs = {}
    for rkey, (lo, hi) in remote.items():
        if rkey in persistent:
            mr = MR(pd, hi - lo, _ALL | IBV_ACCESS_FLUSH_PERSISTENT, address=lo,
                    buffer=mmap.mmap(-1, hi - lo))
        else:
            mr = MR(pd, hi - lo, _ALL, address=lo)
        entry = dev.keys.get(mr.rkey)  # the device's key table, not the MR's insides
        assert entry is not None
        if rkey != mr.rkey and dev.keys.get(rkey) is not None:
            continue  # the key is one of the replay's own MRs: the peer's requests miss
        try:
            dev.keys.rekey(entry, rkey)
        except ValueError:  # its index is taken (a garbled key): the requests miss
            continue
        target_mrs[rkey] = mr
    return target_mrs


def _write(mr: Any, va: int, data: bytes | memoryview) -> None:
    """``data`` into ``mr`` at address ``va``, the part that falls inside it."""
    off = va - mr.buf
    if 0 <= off < mr.length:
        data = bytes(data[:mr.length - off])
        mr.mem[off:off + len(data)] = data


def _seed_atomics(target_mrs: dict[int, Any], roles: _Roles,
                  by_psn: dict[int, RocePacket]) -> None:
    """Phase 2 too: what each atomic target held before the first atomic on it, from the
    original value in the endpoint's atomic ACK."""
    seeded = set()
    for c in roles.reqs_in:
        p = c.pkt
        if p.info.atomic and (p.rkey, p.va) not in seeded and p.rkey in target_mrs:
            ack = by_psn.get(p.psn)
            if ack is not None and ack.orig is not None:
                _write(target_mrs[p.rkey], p.va, _U64.pack(ack.orig))
                seeded.add((p.rkey, p.va))


def _seed_read(mr: Any, p: RocePacket, by_psn: dict[int, RocePacket], mtu: int) -> None:
    """What the memory held when the READ request ``p`` was served: its captured responses
    (set again before each READ: the application may have changed the buffer between two
    reads of it, as rping does). A response never captured leaves the memory as it was."""
    for k in range(min(-(-p.dma_len // mtu), mr.length // mtu + 1)):
        r = by_psn.get(psn_add(p.psn, k))
        if r is not None and r.info.read:
            _write(mr, p.va + k * mtu, r.payload)


def _first_whole(reqs: list[CapturedPacket], copies: Any) -> CapturedPacket | None:
    """The peer's first request that starts a message (a capture may start inside one)."""
    return next((c for c in reqs if c.pkt.info.first and c.index not in copies), None)


def _flow_label_from_port(roles: _Roles) -> int:
    """A flow label that gives the UDP source port the endpoint's packets carry (rxe folds
    the label into the port's low 14 bits: a label below 2**14 is the port's bits), or 0
    when the QP numbers alone give that port (no label was set)."""
    if roles.transport == Transport.UD or not roles.mine_out or roles.peer_qpn is None:
        return 0
    sport = roles.mine_out[0].sport
    if udp_sport_for_path(0, roles.my_qpn, roles.peer_qpn) == sport:
        return 0
    fl = sport & 0x3FFF
    return fl if fl and udp_sport_for_path(fl, roles.my_qpn, roles.peer_qpn) == sport else 0


def _first_expected(capture: list[CapturedPacket], me: bytes) -> int | None:
    """The PSN the endpoint's responder expected first, if its first answer says so (a
    PSN sequence NAK, before any acknowledgement, of a PSN before any the capture shows the
    peer sending it), else None."""
    start = None
    for c in capture:
        p = c.pkt
        if c.dst == me and p.info.is_request and start is None:
            start = p.psn
        if c.src == me and p.info.is_response:
            if p.syndrome == 0x60 and start is not None and psn_diff(p.psn, start) < 0:
                return p.psn
            return None
    return None


def _connect(qp: Any, dev: SoftDevice, roles: _Roles, *, rq_psn: int, sq_psn: int,
             max_dest_rd_atomic: int, max_rd_atomic: int, flow_label: int) -> bytes:
    """Phase 3: bring the QP to RTS with the captured PSNs, QPNs and path; returns the
    peer's GID."""
    a = QPAttr(port_num=1)
    a.qp_access_flags = _QP_ACCESS
    a.path_mtu = bytes_to_mtu(roles.path_mtu)
    a.max_dest_rd_atomic, a.max_rd_atomic = max_dest_rd_atomic, max_rd_atomic
    # a retransmit timer that is armed (timeout 14, 67 ms) but fires only when the replay
    # moves the device's virtual clock to it, where the capture shows a retransmission
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
    peer_gid = dev.gid_for_ip(str(ipaddress.ip_address(roles.peer_ip)))
    a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=peer_gid, sgid_index=1, hop_limit=64,
                                                    flow_label=flow_label))
    a.dest_qp_num = roles.peer_qpn if roles.peer_qpn is not None else 0
    a.rq_psn, a.sq_psn = rq_psn, sq_psn
    a.qkey = (roles.reqs_in or roles.reqs_out)[0].pkt.qkey or 0 \
        if roles.transport == Transport.UD and (roles.reqs_in or roles.reqs_out) else 0
    qp.to_rts(a)
    return peer_gid


class _Receives:
    """Phase 4: the endpoint's receive queue, posted as the capture shows it was. Before a
    packet of the peer's that consumes a receive is delivered, one is posted if none is
    left, unless the endpoint answered that packet with an RNR NAK (it had none)."""

    SLOT = 8192

    def __init__(self, pd: Any, qp: Any, cq: Any, capture: list[CapturedPacket],
                 me: bytes, rq_psn: int | None, mtu: int) -> None:
        self.mr = MR(pd, 1 << 20, _ALL)
        self.epsn, self.mtu = rq_psn, mtu  # None: UD (no sequence)
        self.qp, self.cq = qp, cq
        self.posted = self.done = 0
        self.completions: list[Any] = []
        self.rnr = rnr_frames(capture, me)

    def before(self, c: CapturedPacket) -> None:
        """``c`` (a request of the peer's) is about to be delivered."""
        p = c.pkt
        if self.epsn is not None:
            # only a request the responder takes in sequence may consume a receive (the
            # rest are duplicates, or dropped out of sequence)
            if p.psn != self.epsn or c.index in self.rnr:
                return
            self.epsn = (p.psn + (max(1, -(-(p.dma_len or 0) // self.mtu))
                                  if p.info.read else 1)) & 0xFFFFFF
        if not p.info.consumes_rwqe or c.index in self.rnr:
            return
        self.poll()
        if self.posted - self.done <= 0:
            i = self.posted
            self.qp.post_recv(RecvWR(i, sg=[SGE(self.mr.buf + (i % 128) * self.SLOT,
                                                self.SLOT, self.mr.lkey)]))
            self.posted += 1

    def poll(self) -> None:
        for wc in self.cq.poll_all():
            self.completions.append(wc)
            if wc.opcode & IBV_WC_RECV:
                self.done += 1


#: the most memory the endpoint's send buffers take in a replay: their data is laid out
#: one message after the other and written when the message is posted, so a ring this
#: large wraps only over messages long completed
_MAX_SEND_RING = 64 << 20


def _work_requests(pd: Any, roles: _Roles, msgs: list[Message], peer_gid: bytes,
                   inline: bool) -> list[tuple[int, Any, bytes, Any, int]]:
    """Phase 5: the work requests the endpoint posted, rebuilt from its request packets,
    each with the first PSN of its message (where the replay posts it), in PSN order, and
    the data to write into its buffer when it is posted: (PSN, WR, data, MR, offset)."""
    ah = None
    ud = roles.transport == Transport.UD
    built = []
    total = 0
    for msg in msgs:
        opc, f, data = wr_of_message(msg, roles.path_mtu, ud)
        length = len(data) if opc not in (IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
                                          IBV_WR_ATOMIC_FETCH_AND_ADD) else (
            8 if opc != IBV_WR_RDMA_READ else f["len"])
        length = min(length, _MAX_SEND_RING)
        built.append((msg, opc, f, data[:length], length))
        total += (length + 63) // 64 * 64
    send_mr = MR(pd, min(max(total, 1 << 20), _MAX_SEND_RING), _ALL)
    out: list[tuple[int, Any, bytes, Any, int]] = []
    off = 0
    for msg, opc, f, data, length in built:
        if ud and (ah is None or "remote_qpn" not in f):
            f.setdefault("remote_qpn", roles.peer_qpn or 0)
            f.setdefault("qkey", 0)
        if off + length > send_mr.length:
            off = 0
        flags = IBV_SEND_SIGNALED | (IBV_SEND_SOLICITED if f["se"] else 0) | (
            IBV_SEND_INLINE if inline and opc in (IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
                                                  IBV_WR_RDMA_WRITE) and length <= 256 else 0)
        wr = SendWR(len(out), opcode=opc,
                    sg=[SGE(send_mr.buf + off, length, send_mr.lkey)],
                    imm_data=f.get("imm", 0), send_flags=flags)
        if "remote_addr" in f:
            wr.remote_addr, wr.rkey = f["remote_addr"], f["rkey"]
            wr.compare_add, wr.swap = f.get("compare_add", 0), f.get("swap", 0)
        if opc == IBV_WR_FLUSH:  # no data: what to flush is in the WR
            wr.set_wr_flush(f["rkey"], f["remote_addr"], f["len"], f["flush_type"],
                            f["flush_level"])
        if ud:
            if ah is None:
                ah = AH(pd, attr=AHAttr(is_global=1, gr=GlobalRoute(dgid=peer_gid, sgid_index=1,
                                                                    hop_limit=64)))
            wr.set_wr_ud(ah, f["remote_qpn"], f["qkey"])
        out.append((msg.psn, wr, data if opc != IBV_WR_RDMA_READ else b"", send_mr, off))
        off += (length + 63) // 64 * 64
    return out


def _time_out(dev: SoftDevice) -> None:
    """The real requester timed out here: move the device's virtual clock to its next
    timer (this QP's retransmit timer, or its RNR timer if that comes first) and let the
    device fire it, as the progress machinery would once the time had passed."""
    with dev.lock:
        deadline = dev.next_deadline()
        if deadline is not None:
            dev.now = max(dev.now, deadline)
            dev.progress()


@dataclass
class _Clock:
    """Where the replay is: the capture frame being played, and how many times softrdma
    has sent each request PSN."""

    frame: int = 0
    ours: dict[int, int] = field(default_factory=dict)


def _play(capture: list[CapturedPacket], roles: _Roles, dev: SoftDevice, qp: Any,
          pending: list[tuple[int, Any, bytes, Any, int]], base: int,
          target_mrs: dict[int, Any],
          by_psn: dict[int, RocePacket], res: ReplayResult, ev: Evidence,
          clock: _Clock, rq: _Receives) -> int | None:
    """Phase 6: in capture order, the endpoint posts each WR when the capture shows a
    packet of its message (or of a later one), its retransmit timer fires where the capture
    shows it resend a PSN more times than softrdma has, and every packet the peer sent is
    delivered, but those the endpoint evidently never received (``ev.undelivered``).
    Returns how many packets softrdma had sent when the capture's last packet from the
    real endpoint had gone by (None: no such)."""
    me = roles.me
    last_mine = max((i for i, c in enumerate(capture) if c.src == me), default=-1)
    cut = None
    shown: dict[int, int] = {}  # request PSN -> transmissions of it the capture showed
    k = 0  # the next WR of ``pending`` to post
    for i, c in enumerate(capture):
        clock.frame = c.index
        if i > last_mine and cut is None:
            cut = len(res.sent)
        p = c.pkt
        if c.src == me:
            if not p.info.is_request or c.index in ev.copies:
                continue
            off = psn_diff(p.psn, base)
            while k < len(pending) and psn_diff(pending[k][0], base) <= off:
                _, wr, data, mr, at = pending[k]
                mr.mem[at:at + len(data)] = data  # the application's buffer, as sent
                try:
                    qp.post_send(wr)
                except PyverbsError as e:  # a garbled request no verb could post
                    res.notes.append(f"frame {c.index}: the work request at PSN "
                                     f"{pending[k][0]} cannot be posted: {e}")
                k += 1
            n = shown[p.psn] = shown.get(p.psn, 0) + 1
            if 0 < clock.ours.get(p.psn, 0) < n:
                _time_out(dev)  # the real requester resent it: its timer fired
            continue
        if c.dst == me and c.index not in ev.undelivered:
            if p.opcode == O.RC_RDMA_READ_REQUEST and p.dma_len and p.rkey in target_mrs:
                _seed_read(target_mrs[p.rkey], p, by_psn, roles.path_mtu)
            rq.before(c)
            dev.receive(c.roce, c.src, c.dst, ip_id=c.ip_id, sport=c.sport, verify_icrc=True)
            while dev.run_responders():  # a long READ's response, whole before the next packet
                pass
    return cut if last_mine >= 0 else None


def _set_aside_late_answers(res: ReplayResult, cut: int | None) -> None:
    """Answers softrdma sent after the capture's last packet from the real endpoint go to
    ``after_capture``: the capture may have ended before showing them (requests stay:
    they were posted, so they are all compared)."""
    if cut is None:
        return
    late = [i for i in range(cut, len(res.sent)) if not parse(res.sent[i]).info.is_request]
    res.after_capture = [res.sent[i] for i in late]
    for i in reversed(late):
        del res.sent[i], res.sports[i], res.sent_at[i]


def replay_side(capture: list[CapturedPacket], ip: str, *, device_name: str,
                inline: bool = False, max_dest_rd_atomic: int = 128,
                max_rd_atomic: int = 128, rx_depth: int = 512,
                flow_label: int | None = 0) -> ReplayResult:
    """Stand up softrdma as the endpoint at ``ip`` of ``capture`` and replay (see module doc).
    Supports captures of one QP per side (RC, UC or UD); for several, see
    :mod:`softrdma.harness.conversations`. ``flow_label`` is the connection's GRH flow
    label (rdma_cm puts it in the CM REQ; it picks an RC QP's UDP source port); None:
    the connection was made by rdma_cm but the capture lacks its REQ, so take one that
    gives the captured port. ``max_dest_rd_atomic`` and ``max_rd_atomic`` are rxe's largest (128,
    what perftest asks for): the responder resources a duplicate READ or atomic is
    answered from, and the READs and atomics in flight, which the wire does not show (the
    replay posts each WR when the capture shows it, so a limit above the endpoint's
    changes nothing). Raises :class:`ReplayError` when the side cannot be replayed at all."""
    me = ipaddress.ip_address(ip).packed
    roles = _roles(capture, me)
    notes: list[str] = []
    if flow_label is None:
        flow_label = _flow_label_from_port(roles)
        if flow_label:
            notes.append("the connection's flow label is not in the capture (no CM REQ): "
                         "taken from its UDP source port, which is then not judged")
    # packets of another transport (a CNP, a garbled opcode) are nobody's in this QP pair
    foreign = {c.index for c in capture if c.pkt.info.transport != roles.transport}
    mine_all = roles.mine_out
    if foreign:
        capture = [c for c in capture if c.index not in foreign]
        roles = _roles(capture, me) if capture else roles
    qpt = {Transport.RC: IBV_QPT_RC, Transport.UC: IBV_QPT_UC,
           Transport.UD: IBV_QPT_UD}.get(roles.transport)
    if qpt is None:
        raise ReplayError(f"transport {roles.transport.name} is not replayed")
    ev = infer(capture, me, roles.path_mtu)
    ud = roles.transport == Transport.UD
    res = ReplayResult(expected=mine_all, evidence=ev, notes=notes)
    first = _first_whole(roles.reqs_in, ev.copies)
    rq_psn = first.pkt.psn if first is not None else 0
    expected = _first_expected(capture, me)
    if expected is not None:
        # the endpoint's first answer is a sequence NAK: it expected that PSN (the first
        # packets were lost before the capture point), whatever the capture starts with
        rq_psn = expected
        ev.events.append(LossEvent(roles.reqs_in[0].index if roles.reqs_in else 0,
                                   "lost-before", expected, 1,
                                   f"the endpoint's first answer NAKs PSN {expected}: the "
                                   "packets before it in the capture were lost before the "
                                   "capture point"))
    elif first is not None and first is not roles.reqs_in[0]:
        for c in roles.reqs_in:
            if c is first:
                break
            ev.undelivered.setdefault(c.index, "the capture starts inside this message")
            ev.input_events.append((c.index, "the capture starts inside this message"))
        ev.events.append(LossEvent(roles.reqs_in[0].index, "unresolved", roles.reqs_in[0].pkt.psn,
                                   1, "the capture starts inside one of the peer's messages"))
    peer_resps = {c.pkt.psn: c.pkt for c in capture
                  if c.dst == me and c.pkt.info.is_response and c.index not in ev.copies}
    msgs = fill_holes(messages(roles.reqs_out, roles.path_mtu, ud, set(ev.copies)),
                       peer_resps, roles.path_mtu)
    skipped: dict[int, str] = {}
    if msgs and msgs[0].head is None and msgs[0].slots and msgs[0].slots[0] is not None:
        # the capture starts inside one of the endpoint's messages: where it began, and
        # so what its first packet was, is not known; it is not replayed
        m0 = msgs.pop(0)
        inside = {psn_add(m0.psn, k) for k in range(len(m0.slots))}
        for c in roles.reqs_out:
            if c.pkt.psn in inside:
                skipped[c.index] = "the capture starts inside this message of the endpoint's"
        ev.events.append(LossEvent(roles.reqs_out[0].index, "unresolved", m0.psn,
                                   len(m0.slots), "the capture starts inside one of the "
                                   "endpoint's messages"))
    for m in msgs:
        if m.head is None:
            res.notes.append(f"PSN {m.psn}: a message whose first packet was never captured "
                             "(rebuilt with what the capture shows)")
    dev = SoftDevice(device_name, ip, mtu=_netdev_mtu(roles.path_mtu), seed=1)
    register_device(dev)
    clock = _Clock()

    def transmit(data: bytes, dst: bytes, sport: int, tos: int = 0) -> None:
        res.sent.append(data)
        res.sports.append(sport)
        res.sent_at.append(clock.frame)
        p = parse(data)
        if p.info.is_request:
            clock.ours[p.psn] = clock.ours.get(p.psn, 0) + 1

    dev.transmit = transmit
    ctx = Context(name=device_name)
    try:
        pd = PD(ctx)
        cq = CQ(ctx, 4096)
        dev.pin_next_qpn(roles.my_qpn)  # the captured QPN: the next one allocated is it
        cap = QPCap(max_send_wr=max(1024, len(msgs) + 1), max_recv_wr=rx_depth, max_send_sge=1,
                    max_recv_sge=1, max_inline_data=256 if inline else 0)
        qp = QP(pd, QPInitAttr(qp_type=qpt, scq=cq, rcq=cq, cap=cap, sq_sig_all=0))
        if qp.qp_num != roles.my_qpn:
            raise ReplayError(f"QP number {roles.my_qpn:#x} cannot be given to the replay")
        target_mrs = _target_memory(pd, dev, roles)
        by_psn = {c.pkt.psn: c.pkt for c in roles.mine_out if c.pkt.info.is_response}
        _seed_atomics(target_mrs, roles, by_psn)
        sq_psn = msgs[0].psn if msgs else 0
        peer_gid = _connect(qp, dev, roles, rq_psn=rq_psn,
                            sq_psn=sq_psn, max_dest_rd_atomic=max_dest_rd_atomic,
                            max_rd_atomic=max_rd_atomic, flow_label=flow_label)
        rq = _Receives(pd, qp, cq, capture, me, None if ud else rq_psn, roles.path_mtu)
        pending = _work_requests(pd, roles, msgs, peer_gid, inline)
        cut = _play(capture, roles, dev, qp, pending, sq_psn, target_mrs, by_psn, res, ev,
                    clock, rq)
        rq.poll()
        res.completions = rq.completions
        _set_aside_late_answers(res, cut)
        judge(res, ev, foreign, skipped)
        res.drops = dict(dev.counters.drops)
        return res
    finally:
        ctx.close()
        unregister_device(device_name)
