"""The messages a replayed endpoint sent, rebuilt from its captured request packets, and
the work request that sends each: a packet never captured is a hole filled with zeros (its
bytes are never compared), a message whose first packet was never captured targets
address 0, a run of PSNs never captured becomes the READ or atomic the peer's responses
show, else a SEND of that many packets, so that softrdma's PSNs stay the endpoint's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..enums import (
    IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_ATOMIC_WRITE, IBV_WR_FLUSH,
    IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND,
    IBV_WR_SEND_WITH_IMM, IBV_WR_SEND_WITH_INV,
)
from ..qp.psn import psn_add, psn_diff
from ..wire.headers import feth_plt, feth_sel
from ..wire.packet import RocePacket
from .replayresult import CapturedPacket

__all__ = ["Message", "fill_holes", "messages", "wr_of_message"]


#: the WR of each request opcode's message (low five bits; UD sends are all "send")
_KIND = {0x00: "send", 0x01: "send", 0x02: "send", 0x03: "send_imm", 0x04: "send",
         0x05: "send_imm", 0x06: "write", 0x07: "write", 0x08: "write", 0x09: "write_imm",
         0x0A: "write", 0x0B: "write_imm", 0x0C: "read", 0x13: "cas", 0x14: "faa",
         0x16: "send_inv", 0x17: "send_inv", 0x1C: "flush", 0x1D: "atomic_write"}
_OPC = {"send": IBV_WR_SEND, "send_imm": IBV_WR_SEND_WITH_IMM, "send_inv": IBV_WR_SEND_WITH_INV,
        "write": IBV_WR_RDMA_WRITE, "write_imm": IBV_WR_RDMA_WRITE_WITH_IMM,
        "read": IBV_WR_RDMA_READ, "cas": IBV_WR_ATOMIC_CMP_AND_SWP,
        "faa": IBV_WR_ATOMIC_FETCH_AND_ADD, "flush": IBV_WR_FLUSH,
        "atomic_write": IBV_WR_ATOMIC_WRITE}


@dataclass
class Message:
    """One message of the endpoint's, as far as the capture shows it: ``slots`` has one
    entry per PSN from ``psn``, the captured packet or None where none was captured;
    ``head`` is its first packet if captured."""

    psn: int
    head: CapturedPacket | None
    slots: list[CapturedPacket | None] = field(default_factory=list)
    span: int = 1  # PSNs it takes (a READ: one per response packet)
    read_len: int | None = None  # a READ never captured, its length from the responses
    atomic: bool = False  # an atomic never captured (its ACK was)


def wr_of_message(msg: Message, mtu: int, ud: bool) -> tuple[int, dict[str, Any], bytes]:
    """(WR opcode, WR fields, data) of one message the endpoint sent. What the capture
    lacks is filled in: a packet never captured carries zeros (its bytes are never
    compared: the capture has nothing to compare them with); a message whose first packet
    was never captured targets address 0 with key 0 (its RETH was never seen)."""
    captured = [c for c in msg.slots if c is not None]
    first = msg.head.pkt if msg.head is not None else None
    last = captured[-1].pkt if captured else None
    ref = first or last
    kind = "send" if ref is None or ud else _KIND.get(ref.opcode & 0x1F, "send")
    if msg.read_len is not None:
        kind = "read"
    elif msg.atomic:
        kind = "faa"
    if last is not None and last.info.last:
        if kind == "send" and last.info.with_imm:
            kind = "send_imm"
        elif kind == "send" and last.info.with_inv:
            kind = "send_inv"
        elif kind == "write" and last.info.with_imm:
            kind = "write_imm"
    data = b"".join(bytes(c.pkt.payload) if c is not None else bytes(mtu) for c in msg.slots)
    f: dict[str, Any] = {"se": bool(last is not None and last.info.last and last.se)}
    if kind in ("send_imm", "write_imm"):
        f["imm"] = (last.imm or 0) if last is not None and last.info.last else 0
    if kind == "send_inv":
        f["imm"] = (last.ieth_rkey or 0) if last is not None and last.info.last else 0
    if kind in ("write", "write_imm", "read"):
        if first is not None:
            f["remote_addr"], f["rkey"], f["len"] = first.va or 0, first.rkey or 0, \
                first.dma_len or 0
        else:
            f["remote_addr"], f["rkey"] = 0, 0
            f["len"] = msg.read_len if msg.read_len is not None else len(data)
        if kind != "read" and first is not None and first.dma_len is not None:
            data = data[:first.dma_len].ljust(first.dma_len, b"\0")
    if kind in ("atomic_write", "flush"):
        # ONLY packets: the RETH names the target; an ATOMIC WRITE's 8 bytes are its
        # payload, a FLUSH has none and its FETH says what to flush
        f["remote_addr"], f["rkey"] = (ref.va or 0, ref.rkey or 0) if ref else (0, 0)
        f["len"] = (ref.dma_len or 0) if ref else 0
        if kind == "atomic_write":
            data = data[:8].ljust(8, b"\0")
        else:
            data = b""
            feth = (ref.feth or 0) if ref else 0
            f["flush_type"], f["flush_level"] = feth_plt(feth), feth_sel(feth)
        return _OPC[kind], f, data
    if kind in ("cas", "faa"):
        ref = ref if ref is not None and ref.info.atomic else None
        f["remote_addr"], f["rkey"] = (ref.va or 0, ref.rkey or 0) if ref else (0, 0)
        if ref is None:
            f["compare_add"] = f["swap"] = 0
            return _OPC[kind], f, data
        f["compare_add"] = (ref.compare if kind == "cas" else ref.swap_add) or 0
        f["swap"] = (ref.swap_add or 0) if kind == "cas" else 0
    if ud and ref is not None:
        f["remote_qpn"], f["qkey"] = ref.dest_qp, ref.qkey or 0
    return _OPC[kind], f, data


def messages(pkts: list[CapturedPacket], mtu: int, ud: bool = False,
              copies: frozenset[int] | set[int] = frozenset()) -> list[Message]:
    """The endpoint's messages in PSN order, from its request packets (a retransmission
    gives nothing new, but may be the only capture of a packet). A PSN never captured is
    a hole in its message; a run of holes between two messages is a message of its own
    (see :func:`fill_holes`)."""
    at: dict[int, CapturedPacket] = {}
    for c in pkts:
        if c.index not in copies:
            at.setdefault(c.pkt.psn, c)
    if not at:
        return []
    base = pkts[0].pkt.psn
    offs = _cluster({psn_diff(psn, base): c for psn, c in at.items()})
    lo, hi = min(offs), max(offs)
    msgs: list[Message] = []
    cur: Message | None = None
    o = lo
    while o <= hi:
        c = offs.get(o)
        psn = psn_add(base, o)
        if c is None or ud:
            if ud and c is not None:  # every datagram is a message
                msgs.append(Message(psn, c, [c]))
            elif ud:
                msgs.append(Message(psn, None, [None]))
            else:
                if cur is None:
                    cur = Message(psn, None)
                    msgs.append(cur)
                cur.slots.append(None)
            o += 1
            continue
        info = c.pkt.info
        if info.first:
            cur = Message(psn, c, [c])
            msgs.append(cur)
            if info.last:
                cur.span = max(1, -(-(c.pkt.dma_len or 0) // mtu)) if info.read else 1
                o += cur.span
                cur = None
                continue
        else:
            if cur is None:
                cur = Message(psn, None)
                msgs.append(cur)
            cur.slots.append(c)
            if info.last:
                cur = None
        o += 1
    for m in msgs:
        if m.head is None or not m.head.pkt.info.read:
            m.span = len(m.slots)
    return msgs


#: the widest run of PSNs never captured that a replay bridges (more says the PSN itself
#: is wrong: a garbled packet, not a loss)
_MAX_HOLE = 4096


def _cluster(offs: dict[int, CapturedPacket]) -> dict[int, CapturedPacket]:
    """The packets whose PSNs (offsets from the first captured) form one run with the first
    one, no gap wider than ``_MAX_HOLE``; a packet far from the rest is judged as it is."""
    keys = sorted(offs)
    i = keys.index(0)
    lo = hi = i
    while lo > 0 and keys[lo] - keys[lo - 1] <= _MAX_HOLE:
        lo -= 1
    while hi < len(keys) - 1 and keys[hi + 1] - keys[hi] <= _MAX_HOLE:
        hi += 1
    return {k: offs[k] for k in keys[lo:hi + 1]}


def fill_holes(msgs: list[Message], peer_resps: dict[int, RocePacket], mtu: int) -> list[Message]:
    """Runs of PSNs of the endpoint's that were never captured become messages: a READ
    where the peer's READ responses show one (from the response at its first PSN to the
    LAST), an atomic where an atomic ACK does, else one SEND covering the rest of the run.
    Their packets are never compared; they keep softrdma's PSNs where the endpoint's were."""
    out: list[Message] = []
    for m in msgs:
        if m.head is not None or any(c is not None for c in m.slots):
            out.append(m)
            continue
        k, n = 0, len(m.slots)
        while k < n:
            psn = psn_add(m.psn, k)
            r = peer_resps.get(psn)
            if r is not None and r.info.read and r.info.first:
                end = k
                while end < n - 1:
                    e = peer_resps.get(psn_add(m.psn, end))
                    if e is not None and e.info.read and e.info.last:
                        break
                    end += 1
                e = peer_resps.get(psn_add(m.psn, end))
                tail = e.payload_len if e is not None and e.info.last else mtu
                out.append(Message(psn, None, [None], span=end - k + 1,
                                    read_len=(end - k) * mtu + tail))
                k = end + 1
            elif r is not None and r.info.atomic:
                out.append(Message(psn, None, [None], atomic=True))
                k += 1
            else:
                j = k + 1
                while j < n and peer_resps.get(psn_add(m.psn, j)) is None:
                    j += 1
                out.append(Message(psn, None, [None] * (j - k), span=j - k))
                k = j
    return out
