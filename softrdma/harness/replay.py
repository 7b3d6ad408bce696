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
import struct
from dataclasses import dataclass, field
from typing import Any

from ..enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE, IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD, IBV_SEND_INLINE,
    IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM,
    IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_SEND_WITH_INV, bytes_to_mtu,
)
from ..wire.frames import decode_frame
from ..wire.icrc import icrc_ipv4, icrc_ipv6
from ..wire.opcodes import Opcode as O, Transport
from ..wire.packet import RocePacket, parse
from ..wire.pcap import read_pcap
from ..qp.psn import psn_add, psn_diff
from ..soft.device import RXE_MAX_HDR_LENGTH, SoftDevice
from ..verbs_api import (
    AH, CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SendWR,
)
from ..verbs_api.device import register_device, unregister_device

__all__ = ["CapturedPacket", "ReplayResult", "load_capture", "replay_side"]

_ALL = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
    IBV_ACCESS_REMOTE_ATOMIC
_U64 = struct.Struct("<Q")
ETH_MTU = 1500  # the netdev MTU of the captures' hosts (and of rxe's usual Ethernet)


@dataclass
class CapturedPacket:
    index: int
    src: bytes
    dst: bytes
    sport: int
    ip_id: int
    roce: bytes
    pkt: RocePacket


@dataclass
class ReplayResult:
    sent: list[bytes] = field(default_factory=list)  # what softrdma transmitted
    expected: list[CapturedPacket] = field(default_factory=list)  # what the real side sent
    sports: list[int] = field(default_factory=list)
    completions: list[Any] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    # what softrdma sent after the capture's last packet from the real endpoint: answers
    # the capture may have ended too early to show (reported, not compared)
    after_capture: list[bytes] = field(default_factory=list)


def load_capture(path: str) -> list[CapturedPacket]:
    out = []
    for r in read_pcap(path):
        f = decode_frame(r.data, r.linktype)
        if f is None or not f.is_roce:
            continue
        roce = bytes(f.payload)
        out.append(CapturedPacket(r.index, f.ip_src, f.ip_dst, f.sport, f.ip_id, roce, parse(roce)))
    return out


def _wr_of_message(pkts: list[CapturedPacket]) -> tuple[int, dict[str, Any], bytes]:
    """(WR opcode, WR fields, data) of one message the endpoint sent."""
    first, last = pkts[0].pkt, pkts[-1].pkt
    op = first.opcode & 0x1F if first.info.transport != Transport.UD else O.RC_SEND_ONLY
    data = b"".join(bytes(p.pkt.payload) for p in pkts)
    f: dict[str, Any] = {"se": last.se}
    base = {0x00: "send", 0x04: "send", 0x05: "send_imm", 0x01: "send", 0x02: "send",
            0x03: "send_imm", 0x06: "write", 0x0A: "write", 0x0B: "write_imm",
            0x0C: "read", 0x13: "cas", 0x14: "faa", 0x17: "send_inv"}
    kind = base.get(op)
    if kind == "send" and last.info.with_imm:
        kind = "send_imm"
    if kind == "send" and last.info.with_inv:
        kind = "send_inv"
    if kind == "write" and last.info.with_imm:
        kind = "write_imm"
    if kind in ("send_imm", "write_imm"):
        f["imm"] = last.imm
    if kind == "send_inv":
        f["imm"] = last.ieth_rkey
    if kind in ("write", "write_imm", "read"):
        f["remote_addr"], f["rkey"], f["len"] = first.va, first.rkey, first.dma_len
    if kind in ("cas", "faa"):
        f["remote_addr"], f["rkey"] = first.va, first.rkey
        f["compare_add"] = first.compare if kind == "cas" else first.swap_add
        f["swap"] = first.swap_add if kind == "cas" else 0
    if first.info.transport == Transport.UD:
        f["remote_qpn"], f["qkey"] = first.dest_qp, first.qkey
    opc = {"send": IBV_WR_SEND, "send_imm": IBV_WR_SEND_WITH_IMM, "send_inv": IBV_WR_SEND_WITH_INV,
           "write": IBV_WR_RDMA_WRITE, "write_imm": IBV_WR_RDMA_WRITE_WITH_IMM,
           "read": IBV_WR_RDMA_READ, "cas": IBV_WR_ATOMIC_CMP_AND_SWP,
           "faa": IBV_WR_ATOMIC_FETCH_AND_ADD}[kind]
    return opc, f, data


def _messages(pkts: list[CapturedPacket]) -> list[list[CapturedPacket]]:
    """Group request packets into messages (first..last), skipping retransmissions."""
    msgs: list[list[CapturedPacket]] = []
    cur: list[CapturedPacket] = []
    seen: set[int] = set()
    for cp in pkts:
        if cp.pkt.psn in seen:
            continue
        seen.add(cp.pkt.psn)
        if cp.pkt.info.first:
            cur = [cp]
        else:
            cur.append(cp)
        if cp.pkt.info.last:
            msgs.append(cur)
            cur = []
    return msgs


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
    peer_ip = to_me[0].src if to_me else mine_out[0].dst
    my_qpn = to_me[0].pkt.dest_qp if to_me else None
    if my_qpn is None:
        # nothing was sent to us: for UD the DETH of our packets names us
        my_qpn = mine_out[0].pkt.src_qp
    return _Roles(me, peer_ip, capture[0].pkt.info.transport, my_qpn,
                  mine_out[0].pkt.dest_qp if mine_out else None, mine_out,
                  [c for c in to_me if c.pkt.info.is_request],
                  [c for c in mine_out if c.pkt.info.is_request], _path_mtu(capture))


def _path_mtu(capture: list[CapturedPacket]) -> int:
    """The path MTU the endpoints used, in bytes. Segmentation cuts a message at exactly
    the path MTU, so any FIRST or MIDDLE packet's payload is it. A capture with no
    segmented message does not pin it (any MTU that carries its largest payload replays
    the same bytes): then 1024, what rxe on a 1500-byte Ethernet netdev offers and what
    the tools that made the captures ask for, or the smallest IB MTU above that carries
    the largest payload."""
    for c in capture:
        info = c.pkt.info
        if (info.first or info.middle) and not info.last:
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


def _target_memory(pd: Any, dev: SoftDevice, roles: _Roles) -> dict[int, Any]:
    """Phase 2: the memory the peer targets, as MRs with the captured rkeys and addresses
    (one per rkey, covering every range the peer's requests touch)."""
    remote: dict[int, tuple[int, int]] = {}
    for c in roles.reqs_in:
        p = c.pkt
        if p.rkey is not None and (p.dma_len or p.info.atomic):
            n = 8 if p.info.atomic else p.dma_len
            lo, hi = remote.get(p.rkey, (p.va, p.va + n))
            remote[p.rkey] = (min(lo, p.va), max(hi, p.va + n))
    target_mrs = {}
    for rkey, (lo, hi) in remote.items():
        mr = MR(pd, hi - lo, _ALL, address=lo)
        entry = dev.keys.get(mr.rkey)  # the device's key table, not the MR's insides
        assert entry is not None
        dev.keys.rekey(entry, rkey)
        target_mrs[rkey] = mr
    return target_mrs


def _seed_atomics(target_mrs: dict[int, Any], roles: _Roles,
                  by_psn: dict[int, RocePacket]) -> None:
    """Phase 2 too: what each atomic target held before the first atomic on it, from the
    original value in the endpoint's atomic ACK."""
    seeded = set()
    for c in roles.reqs_in:
        p = c.pkt
        if p.info.atomic and (p.rkey, p.va) not in seeded:
            ack = by_psn.get(p.psn)
            if ack is not None and ack.orig is not None:
                mr = target_mrs[p.rkey]
                mr.mem[p.va - mr.buf:p.va - mr.buf + 8] = _U64.pack(ack.orig)
                seeded.add((p.rkey, p.va))


def _seed_read(mr: Any, p: RocePacket, by_psn: dict[int, RocePacket], mtu: int) -> None:
    """What the memory held when the READ request ``p`` was served: its captured responses
    (set again before each READ: the application may have changed the buffer between two
    reads of it, as rping does)."""
    for k in range(-(-p.dma_len // mtu)):
        r = by_psn.get(psn_add(p.psn, k))
        if r is not None and r.info.read:
            off = p.va - mr.buf + k * mtu
            mr.mem[off:off + r.payload_len] = r.payload


def _connect(qp: Any, dev: SoftDevice, roles: _Roles, *, max_dest_rd_atomic: int,
             max_rd_atomic: int, flow_label: int) -> bytes:
    """Phase 3: bring the QP to RTS with the captured PSNs, QPNs and path; returns the
    peer's GID."""
    a = QPAttr(port_num=1)
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC
    a.path_mtu = bytes_to_mtu(roles.path_mtu)
    a.max_dest_rd_atomic, a.max_rd_atomic = max_dest_rd_atomic, max_rd_atomic
    # a retransmit timer that is armed (timeout 14, 67 ms) but fires only when the replay
    # moves the device's virtual clock to it, where the capture shows a retransmission
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
    peer_gid = dev.gid_for_ip(str(ipaddress.ip_address(roles.peer_ip)))
    a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=peer_gid, sgid_index=1, hop_limit=64,
                                                    flow_label=flow_label))
    a.dest_qp_num = roles.peer_qpn if roles.peer_qpn is not None else 0
    a.rq_psn = roles.reqs_in[0].pkt.psn if roles.reqs_in else 0
    a.sq_psn = roles.reqs_out[0].pkt.psn if roles.reqs_out else 0
    a.qkey = (roles.reqs_in or roles.reqs_out)[0].pkt.qkey or 0 \
        if roles.transport == Transport.UD else 0
    qp.to_rts(a)
    return peer_gid


def _post_receives(pd: Any, qp: Any, roles: _Roles, rx_depth: int) -> None:
    """Phase 4: a receive for every message of the peer's that consumes one."""
    recv_mr = MR(pd, 1 << 20, _ALL)
    n_recv = sum(1 for c in roles.reqs_in if c.pkt.info.consumes_rwqe)
    slot = 8192
    for i in range(min(n_recv, rx_depth)):
        qp.post_recv(RecvWR(i, sg=[SGE(recv_mr.buf + (i % 128) * slot, slot, recv_mr.lkey)]))


def _work_requests(pd: Any, roles: _Roles, peer_gid: bytes, inline: bool) -> dict[int, Any]:
    """Phase 5: the work requests the endpoint posted, rebuilt from its request packets;
    keyed by the first PSN of each message (where the replay posts it)."""
    send_mr = MR(pd, 1 << 21, _ALL)
    ah = None
    wr_at_psn: dict[int, Any] = {}
    off = 0
    for msg in _messages(roles.reqs_out):
        opc, f, data = _wr_of_message(msg)
        length = len(data) if opc not in (IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
                                          IBV_WR_ATOMIC_FETCH_AND_ADD) else (
            8 if opc != IBV_WR_RDMA_READ else f["len"])
        if off + length > send_mr.length:
            off = 0
        send_mr.mem[off:off + len(data)] = data
        flags = IBV_SEND_SIGNALED | (IBV_SEND_SOLICITED if f["se"] else 0) | (
            IBV_SEND_INLINE if inline and opc in (IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
                                                  IBV_WR_RDMA_WRITE) else 0)
        wr = SendWR(len(wr_at_psn), opcode=opc,
                    sg=[SGE(send_mr.buf + off, length, send_mr.lkey)],
                    imm_data=f.get("imm", 0), send_flags=flags)
        if "remote_addr" in f:
            wr.remote_addr, wr.rkey = f["remote_addr"], f["rkey"]
            wr.compare_add, wr.swap = f.get("compare_add", 0), f.get("swap", 0)
        if roles.transport == Transport.UD:
            if ah is None:
                ah = AH(pd, attr=AHAttr(is_global=1, gr=GlobalRoute(dgid=peer_gid, sgid_index=1,
                                                                    hop_limit=64)))
            wr.set_wr_ud(ah, f["remote_qpn"], f["qkey"])
        wr_at_psn[msg[0].pkt.psn] = wr
        off += (length + 63) // 64 * 64
    return wr_at_psn


def _time_out(dev: SoftDevice) -> None:
    """The real requester timed out here: move the device's virtual clock to its next
    timer (this QP's retransmit timer, or its RNR timer if that comes first) and let the
    device fire it, as the progress machinery would once the time had passed."""
    with dev.lock:
        deadline = dev.next_deadline()
        if deadline is not None:
            dev.now = max(dev.now, deadline)
            dev.progress()


def _play(capture: list[CapturedPacket], roles: _Roles, dev: SoftDevice, qp: Any,
          wr_at_psn: dict[int, Any], target_mrs: dict[int, Any],
          by_psn: dict[int, RocePacket], res: ReplayResult) -> int | None:
    """Phase 6: in capture order, the endpoint posts each WR when the capture shows its
    first packet, its retransmit timer fires where the capture shows a go-back-N burst, and
    every packet the peer sent is delivered. Returns how many packets softrdma had sent
    when the capture's last packet from the real endpoint had gone by (None: no such)."""
    me = roles.me
    highest = None
    in_burst = False
    last_mine = max((i for i, c in enumerate(capture) if c.src == me), default=-1)
    cut = None
    for i, c in enumerate(capture):
        if i > last_mine and cut is None:
            cut = len(res.sent)
        p = c.pkt
        if c.src == me:
            if not p.info.is_request:
                continue
            if highest is None or psn_diff(p.psn, highest) > 0:
                highest = p.psn
                in_burst = False
                wr = wr_at_psn.pop(p.psn, None)
                if wr is not None:
                    qp.post_send(wr)
            elif not in_burst:
                in_burst = True  # a retransmission: the real requester timed out here
                _time_out(dev)
            continue
        if c.dst == me:
            if p.opcode == O.RC_RDMA_READ_REQUEST and p.dma_len and p.rkey in target_mrs:
                _seed_read(target_mrs[p.rkey], p, by_psn, roles.path_mtu)
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
        del res.sent[i], res.sports[i]


def replay_side(capture: list[CapturedPacket], ip: str, *, device_name: str,
                inline: bool = False, max_dest_rd_atomic: int = 16,
                max_rd_atomic: int = 16, rx_depth: int = 512,
                flow_label: int = 0) -> ReplayResult:
    """Stand up softrdma as the endpoint at ``ip`` of ``capture`` and replay (see module doc).
    Supports captures of one QP per side (RC, UC or UD); for several, see
    :mod:`softrdma.harness.conversations`. ``flow_label`` is the connection's GRH flow
    label (rdma_cm puts it in the CM REQ; it picks an RC QP's UDP source port)."""
    roles = _roles(capture, ipaddress.ip_address(ip).packed)
    qpt = {Transport.RC: IBV_QPT_RC, Transport.UC: IBV_QPT_UC,
           Transport.UD: IBV_QPT_UD}[roles.transport]
    dev = SoftDevice(device_name, ip, mtu=_netdev_mtu(roles.path_mtu), seed=1)
    register_device(dev)
    res = ReplayResult(expected=roles.mine_out)

    def transmit(data: bytes, dst: bytes, sport: int) -> None:
        res.sent.append(data)
        res.sports.append(sport)

    dev.transmit = transmit
    ctx = Context(name=device_name)
    try:
        pd = PD(ctx)
        cq = CQ(ctx, 4096)
        dev.pin_next_qpn(roles.my_qpn)  # the captured QPN: the next one allocated is it
        cap = QPCap(max_send_wr=1024, max_recv_wr=rx_depth, max_send_sge=1, max_recv_sge=1,
                    max_inline_data=256 if inline else 0)
        qp = QP(pd, QPInitAttr(qp_type=qpt, scq=cq, rcq=cq, cap=cap, sq_sig_all=0))
        assert qp.qp_num == roles.my_qpn
        target_mrs = _target_memory(pd, dev, roles)
        by_psn = {c.pkt.psn: c.pkt for c in roles.mine_out if c.pkt.info.is_response}
        _seed_atomics(target_mrs, roles, by_psn)
        peer_gid = _connect(qp, dev, roles, max_dest_rd_atomic=max_dest_rd_atomic,
                            max_rd_atomic=max_rd_atomic, flow_label=flow_label)
        _post_receives(pd, qp, roles, rx_depth)
        wr_at_psn = _work_requests(pd, roles, peer_gid, inline)
        cut = _play(capture, roles, dev, qp, wr_at_psn, target_mrs, by_psn, res)
        res.completions = cq.poll_all()
        _set_aside_late_answers(res, cut)
        _compare(res, dev)
        res.drops = dict(dev.counters.drops)  # type: ignore[attr-defined]
        return res
    finally:
        ctx.close()
        unregister_device(device_name)


def _compare(res: ReplayResult, dev: Any) -> None:
    """Requests and responses are compared separately (their interleaving is timing).
    :func:`softrdma.harness.replaydiff.diff_replay` shows the same field by field."""
    def split(items):
        reqs = [x for x in items if parse(x[0]).info.is_request]
        resps = [x for x in items if not parse(x[0]).info.is_request]
        return reqs, resps

    ours = list(zip(res.sent, res.sports))
    theirs = [(c.roce, c) for c in res.expected]
    for name, (o_list, t_list) in (("request", (split(ours)[0], split(theirs)[0])),
                                   ("response", (split(ours)[1], split(theirs)[1]))):
        if len(o_list) != len(t_list):
            res.mismatches.append(f"{name}s: softrdma sent {len(o_list)}, capture has {len(t_list)}")
        for i, ((ob, sport), (tb, c)) in enumerate(zip(o_list, t_list)):
            if ob[:-4] != tb[:-4]:
                res.mismatches.append(f"{name} {i} (frame {c.index}): {parse(ob)!r} != {c.pkt!r}")
                continue
            if sport != c.sport:
                res.mismatches.append(f"{name} {i} (frame {c.index}): UDP source port {sport} != "
                                      f"{c.sport}")
            if len(c.src) == 4:
                icrc = icrc_ipv4(ob, c.src, c.dst, sport, ip_id=c.ip_id)
            else:
                icrc = icrc_ipv6(ob, c.src, c.dst, sport)
            if icrc != c.pkt.icrc:
                res.mismatches.append(f"{name} {i} (frame {c.index}): ICRC with the captured IP ID "
                                      f"0x{icrc:08x} != 0x{c.pkt.icrc:08x}")
