"""Inject faults into real captures: the helper behind tests/test_check.py's mutation tests.

A capture is a list of :class:`PcapRecord`. ``edit`` rewrites the RoCE packet of one record
(its fields through the wire layer's parse/build, or its raw bytes) and re-frames it with
the same addresses, ports, IP ID and flags, fixing the IP and UDP lengths and, unless the
fault is the ICRC itself, the ICRC (``softrdma.wire.icrc`` through ``encode_frame``), so
that the one thing wrong is the fault injected. ``drop``, ``insert``, ``copy`` and ``swap``
change the order; frame numbers are renumbered 1.. as in a real file.

The recovery mutations (tests/test_check_recovery_mutations.py) also need to tell a packet
the responder sent twice from one the network duplicated: ``copy`` and ``edit`` take
``ip_id``, because a sender's new packet has its own IPv4 ID (rxe numbers them) while a
network copy repeats it.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any, Callable

from softrdma.wire.frames import decode_frame, encode_frame
from softrdma.wire.packet import RocePacket, build, parse
from softrdma.wire.pcap import PcapRecord, PcapWriter, read_pcap

__all__ = ["load", "to_bytes", "renumber", "packet", "rebuild", "edit", "drop", "insert",
           "copy", "swap"]


def load(path: str | Path) -> list[PcapRecord]:
    return list(read_pcap(path))


def renumber(records: list[PcapRecord]) -> list[PcapRecord]:
    return [dataclasses.replace(r, index=i) for i, r in enumerate(records, 1)]


def to_bytes(records: list[PcapRecord]) -> bytes:
    f = io.BytesIO()
    with PcapWriter(f, close=False, nanosecond=True) as w:
        for r in records:
            w.write(r.data, ts_ns=r.ts_ns)
    return f.getvalue()


def packet(rec: PcapRecord) -> RocePacket:
    """The parsed RoCE packet of a record."""
    f = decode_frame(rec.data, rec.linktype)
    return parse(bytes(f.payload))


def rebuild(roce: bytes | bytearray, opcode: int | None = None, **changes: Any) -> bytearray:
    """The packet ``roce`` with some fields changed (``payload`` included), rebuilt by the
    wire layer. The pad follows the payload unless ``pad`` is given."""
    p = parse(bytes(roce))
    fields = p.fields()
    op = fields.pop("opcode")
    fields.pop("pad")
    fields["payload"] = bytes(p.payload)
    fields.update(changes)
    return build(op if opcode is None else opcode, **fields)


def edit(records: list[PcapRecord], index: int, change: Callable[[bytearray], Any] | None = None,
         *, fix_icrc: bool = True, sport: int | None = None, dport: int | None = None,
         ts_ns: int | None = None, ip_id: int | None = None,
         **fields: Any) -> list[PcapRecord]:
    """A copy of ``records`` where frame ``index`` (1-based) is changed: ``fields`` rebuild
    its RoCE packet (see :func:`rebuild`), then ``change`` may edit the bytes in place or
    return new ones; ``sport``/``dport``/``ts_ns``/``ip_id`` change the UDP ports, the
    time or the IPv4 ID (IPv6 has none: ignored there)."""
    out = list(records)
    rec = out[index - 1]
    f = decode_frame(rec.data, rec.linktype)
    if f is None:
        raise ValueError(f"frame {index} is not IP/UDP")
    roce = bytearray(f.payload)
    if fields:
        roce = rebuild(roce, **fields)
    if change is not None:
        new = change(roce)
        if new is not None:
            roce = bytearray(new)
    data = encode_frame(roce, src=f.ip_src, dst=f.ip_dst,
                        sport=f.sport if sport is None else sport,
                        dport=f.dport if dport is None else dport,
                        ip_id=f.ip_id if ip_id is None else ip_id, ttl=f.ttl,
                        tos=f.tos, frag=f.ip_frag, flow_label=f.flow_label,
                        fill_icrc=fix_icrc, linktype=rec.linktype,
                        **({"eth_src": f.eth_src, "eth_dst": f.eth_dst} if f.eth_src else {}))
    out[index - 1] = dataclasses.replace(rec, data=data, orig_len=len(data),
                                         ts_ns=rec.ts_ns if ts_ns is None else ts_ns)
    return out


def drop(records: list[PcapRecord], index: int) -> list[PcapRecord]:
    return renumber(records[:index - 1] + records[index:])


def insert(records: list[PcapRecord], after: int, rec: PcapRecord,
           ts_ns: int | None = None) -> list[PcapRecord]:
    """``rec`` placed after frame ``after`` (0: first), stamped ``ts_ns`` or 1 us after
    that frame; frames renumbered."""
    if ts_ns is None:
        ts_ns = records[after - 1].ts_ns + 1000 if after else rec.ts_ns
    rec = dataclasses.replace(rec, ts_ns=ts_ns)
    return renumber(records[:after] + [rec] + records[after:])


def copy(records: list[PcapRecord], index: int, after: int, *, ts_ns: int | None = None,
         change: Callable[[bytearray], Any] | None = None, **edits: Any) -> list[PcapRecord]:
    """A copy of frame ``index`` placed after frame ``after`` (see :func:`insert` for the
    time stamp), then changed as :func:`edit` would (``change``, fields, ``ip_id``...).
    The copy is frame ``after + 1``."""
    out = insert(records, after, records[index - 1], ts_ns=ts_ns)
    if change is not None or edits:
        out = edit(out, after + 1, change, **edits)
    return out


def swap(records: list[PcapRecord], i: int, j: int) -> list[PcapRecord]:
    out = list(records)
    out[i - 1], out[j - 1] = out[j - 1], out[i - 1]
    return renumber(out)
