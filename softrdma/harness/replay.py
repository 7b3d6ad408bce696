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
    IBV_ACCESS_REMOTE_WRITE, IBV_MTU_1024, IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD, IBV_SEND_INLINE,
    IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM,
    IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_SEND_WITH_INV,
)
from ..wire.frames import decode_frame
from ..wire.icrc import icrc_ipv4, icrc_ipv6
from ..wire.opcodes import Opcode as O, Transport
from ..wire.packet import RocePacket, parse
from ..wire.pcap import read_pcap
from ..qp.psn import psn_diff
from ..soft.device import SoftDevice
from ..verbs_api import (
    AH, CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SendWR,
)
from ..verbs_api.device import register_device, unregister_device

__all__ = ["CapturedPacket", "ReplayResult", "load_capture", "replay_side"]

_ALL = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
    IBV_ACCESS_REMOTE_ATOMIC
_U64 = struct.Struct("<Q")


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


def _wr_of_message(pkts: list[CapturedPacket], mtu: int) -> tuple[int, dict[str, Any], bytes]:
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


def replay_side(capture: list[CapturedPacket], ip: str, *, device_name: str,
                inline: bool = False, max_dest_rd_atomic: int = 16,
                max_rd_atomic: int = 16, rx_depth: int = 512,
                flow_label: int = 0) -> ReplayResult:
    """Stand up softrdma as the endpoint at ``ip`` of ``capture`` and replay (see module doc).
    Supports captures of one QP per side (RC, UC or UD); for several, see
    :mod:`softrdma.harness.conversations`. ``flow_label`` is the connection's GRH flow
    label (rdma_cm puts it in the CM REQ; it picks an RC QP's UDP source port)."""
    me = ipaddress.ip_address(ip).packed
    mine_out = [c for c in capture if c.src == me]
    to_me = [c for c in capture if c.dst == me]
    peer_ip = (to_me or mine_out)[0].src if to_me else mine_out[0].dst
    transport = capture[0].pkt.info.transport
    qpt = {Transport.RC: IBV_QPT_RC, Transport.UC: IBV_QPT_UC, Transport.UD: IBV_QPT_UD}[transport]
    my_qpn = to_me[0].pkt.dest_qp if to_me else None
    peer_qpn = mine_out[0].pkt.dest_qp if mine_out else None
    if my_qpn is None:
        # nothing was sent to us: for UD the DETH of our packets names us
        my_qpn = mine_out[0].pkt.src_qp
    reqs_in = [c for c in to_me if c.pkt.info.is_request]
    reqs_out = [c for c in mine_out if c.pkt.info.is_request]
    mtu = 1024

    dev = SoftDevice(device_name, str(ipaddress.ip_address(me)), mtu=1500, seed=1)
    register_device(dev)
    res = ReplayResult(expected=mine_out)

    def transmit(data: bytes, dst: bytes, sport: int) -> None:
        res.sent.append(data)
        res.sports.append(sport)

    dev.transmit = transmit
    ctx = Context(name=device_name)
    try:
        pd = PD(ctx)
        cq = CQ(ctx, 4096)
        dev.pin_next_qpn(my_qpn)  # the captured QPN: the next one allocated is it
        cap = QPCap(max_send_wr=1024, max_recv_wr=rx_depth, max_send_sge=1, max_recv_sge=1,
                    max_inline_data=256 if inline else 0)
        qp = QP(pd, QPInitAttr(qp_type=qpt, scq=cq, rcq=cq, cap=cap, sq_sig_all=0))
        assert qp.qp_num == my_qpn

        # -- memory the peer targets, keyed and placed as in the capture -----------------------
        remote = {}
        for c in reqs_in:
            p = c.pkt
            if p.rkey is not None and (p.dma_len or p.info.atomic):
                n = 8 if p.info.atomic else p.dma_len
                lo, hi = remote.get(p.rkey, (p.va, p.va + n))
                remote[p.rkey] = (min(lo, p.va), max(hi, p.va + n))
        target_mrs = {}
        for rkey, (lo, hi) in remote.items():
            mr = MR(pd, hi - lo, _ALL, address=lo)
            dev.keys.rekey(mr._entry, rkey)
            target_mrs[rkey] = mr
        # reads: the responses say what the memory held when it was read (set again just
        # before each READ request is delivered: the application may have changed it
        # between two reads of the same buffer, as rping does)
        by_psn = {c.pkt.psn: c.pkt for c in mine_out if c.pkt.info.is_response}

        def seed_read(p: RocePacket) -> None:
            mr = target_mrs[p.rkey]
            for k in range(-(-p.dma_len // mtu)):
                r = by_psn.get((p.psn + k) & 0xFFFFFF)
                if r is not None and r.info.read:
                    off = p.va - mr.buf + k * mtu
                    mr.mem[off:off + r.payload_len] = r.payload
        seeded = set()
        for c in reqs_in:
            p = c.pkt
            if p.info.atomic and (p.rkey, p.va) not in seeded:
                ack = by_psn.get(p.psn)
                if ack is not None and ack.orig is not None:
                    mr = target_mrs[p.rkey]
                    mr.mem[p.va - mr.buf:p.va - mr.buf + 8] = _U64.pack(ack.orig)
                    seeded.add((p.rkey, p.va))

        # -- connect -------------------------------------------------------------------------
        a = QPAttr(port_num=1)
        a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC
        a.path_mtu = IBV_MTU_1024
        a.max_dest_rd_atomic, a.max_rd_atomic = max_dest_rd_atomic, max_rd_atomic
        a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 0, 7, 7
        peer_gid = dev.gid_for_ip(str(ipaddress.ip_address(peer_ip)))
        a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=peer_gid, sgid_index=1, hop_limit=64,
                                                        flow_label=flow_label))
        a.dest_qp_num = peer_qpn if peer_qpn is not None else 0
        a.rq_psn = reqs_in[0].pkt.psn if reqs_in else 0
        a.sq_psn = reqs_out[0].pkt.psn if reqs_out else 0
        a.qkey = (reqs_in or reqs_out)[0].pkt.qkey or 0 if transport == Transport.UD else 0
        qp.to_rts(a)

        # -- receives, for every message that will consume one ------------------------------
        recv_mr = MR(pd, 1 << 20, _ALL)
        n_recv = sum(1 for c in reqs_in if c.pkt.info.consumes_rwqe)
        slot = 8192
        for i in range(min(n_recv, rx_depth)):
            qp.post_recv(RecvWR(i, sg=[SGE(recv_mr.buf + (i % 128) * slot, slot, recv_mr.lkey)]))

        # -- the work requests this endpoint posted, from its request packets ------------------
        send_mr = MR(pd, 1 << 21, _ALL)
        ah = None
        wr_at_psn: dict[int, Any] = {}  # first PSN of a message -> its WR
        off = 0
        for msg in _messages(reqs_out):
            opc, f, data = _wr_of_message(msg, mtu)
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
            if transport == Transport.UD:
                if ah is None:
                    ah = AH(pd, attr=AHAttr(is_global=1, gr=GlobalRoute(dgid=peer_gid, sgid_index=1,
                                                                        hop_limit=64)))
                wr.set_wr_ud(ah, f["remote_qpn"], f["qkey"])
            wr_at_psn[msg[0].pkt.psn] = wr
            off += (length + 63) // 64 * 64

        # -- replay, in capture order: the endpoint posts each WR when the capture shows its
        # first packet, its retransmit timer fires where the capture shows a go-back-N burst,
        # and every packet the peer sent is delivered.
        highest = None
        in_burst = False
        last_mine = max((i for i, c in enumerate(capture) if c.src == me), default=-1)
        cut = None
        for i, c in enumerate(capture):
            if i > last_mine and cut is None:
                cut = len(res.sent)
            if c.src == me:
                p = c.pkt
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
                    with dev.lock:
                        qp.engine.comp.on_timeout()
                continue
            if c.dst == me:
                p = c.pkt
                if p.opcode == O.RC_RDMA_READ_REQUEST and p.dma_len and p.rkey in target_mrs:
                    seed_read(p)
                dev.receive(c.roce, c.src, c.dst, ip_id=c.ip_id, sport=c.sport, verify_icrc=True)
        res.completions = cq.poll_all()
        if cut is not None and last_mine >= 0:  # (requests were posted: compare them all)
            late = [i for i in range(cut, len(res.sent))
                    if not parse(res.sent[i]).info.is_request]  # answers, not requests
            res.after_capture = [res.sent[i] for i in late]
            for i in reversed(late):
                del res.sent[i], res.sports[i]
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
