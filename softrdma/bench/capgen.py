"""Long RoCEv2 captures made from short real ones, for ``softrdma bench capture``.

A real rxe capture of one RC connection (``pcaps/linux-rxe/write_bw.pcap`` and its
siblings: perftest runs that start at the connection's first packet) is a *tile*. Copy
``k`` of a tile is the same frames with everything that advances along a connection
advanced consistently, so that copy ``k`` continues where copy ``k - 1`` ended:

- the PSN of every packet by ``k`` times the PSNs the tile spans (requests and responses
  share the requester's PSN space), modulo 2**24 as on the wire;
- the MSN of every AETH by ``k`` times the tile's last MSN (the tile starts at MSN 0, so
  its last MSN is the number of messages it completes);
- the IPv4 ID by ``k`` times the tile's frames (a new ID per packet, as Linux gives them),
  with the IP header checksum and the ICRC (which covers the ID and the PSN) recomputed;
- the time by ``k`` times the tile's duration plus one mean inter-packet gap.

Several tiles (one per template, each on its own QP) are interleaved by time, so the
result has several flows the way a busy host's capture has. Optionally, SEND and WRITE
flows lose packets after the capture point and repair them as rxe does
(:mod:`.caploss`: a NAK, a go-back). Everything else (addresses,
ports, RETH addresses and keys, payloads) is the template's, byte for byte.
:func:`long_capture` yields frames one at a time; :func:`write_long_capture` writes them.

    >>> from softrdma.bench.capgen import DEFAULT_TEMPLATES, write_long_capture
    >>> import io
    >>> n = write_long_capture(io.BytesIO(), 1000, DEFAULT_TEMPLATES)
    >>> n
    1000
"""

from __future__ import annotations

import heapq
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from ..data import reference_pcap_dir
from ..wire.frames import decode_frame, ip_checksum
from ..wire.headers import Hdr
from ..wire.icrc import icrc_ipv4
from ..wire.packet import parse
from ..wire.opcodes import Opcode
from ..wire.pcap import PcapWriter, read_pcap
from .caploss import LossStats, with_losses

__all__ = ["Tile", "load_tile", "tile_copies", "long_capture", "write_long_capture",
           "lossy_template",
           "DEFAULT_TEMPLATES", "PCAP_DIR"]

#: the real captures installed with softrdma (a copy of pcaps/linux-rxe: softrdma.data)
PCAP_DIR = reference_pcap_dir() / "linux-rxe"
#: RDMA WRITE, READ and SEND streams of perftest between two kernel rxe hosts
DEFAULT_TEMPLATES = tuple(PCAP_DIR / f"{n}.pcap" for n in ("write_bw", "read_bw", "send_bw"))

_PSN_MOD = 1 << 24
_NOT_LOSSY = {Opcode.RC_RDMA_READ_REQUEST, Opcode.RC_COMPARE_SWAP, Opcode.RC_FETCH_ADD}
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_ICRC = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class _Frame:
    """One template frame and where its advancing fields are."""

    data: bytes
    ts_ns: int  # relative to the tile's first frame
    ip: int  # offset of the IPv4 header
    roce: int  # offset of the BTH
    psn: int
    msn: int | None  # the AETH's MSN, if the opcode carries an AETH
    aeth: int | None  # offset of the AETH
    ip_id: int
    src: bytes
    dst: bytes
    sport: int
    dport: int
    frag: int


@dataclass(frozen=True, slots=True)
class Tile:
    """A template capture ready to be copied: its frames, and how far one copy advances
    the PSN, the MSN, the IP ID and the clock."""

    name: str
    frames: tuple[_Frame, ...]
    psn_span: int
    msn_span: int
    period_ns: int


def load_tile(path: str | os.PathLike[str]) -> Tile:
    """Read a template: IPv4 RoCEv2 frames of one RC connection from its first packet
    (ValueError otherwise, naming what does not fit)."""
    frames: list[_Frame] = []
    t0 = None
    qpns: set[int] = set()
    for rec in read_pcap(path):
        f = decode_frame(rec.data, rec.linktype)
        if f is None or not f.is_roce or f.ip_version != 4:
            raise ValueError(f"{path}: frame {rec.index} is not IPv4 RoCEv2")
        n_ip = len(f.ip_packet)
        ip = next(o for o in range(len(rec.data) - n_ip + 1)
                  if rec.data[o:o + n_ip] == f.ip_packet)
        if rec.data[ip] != 0x45:
            raise ValueError(f"{path}: frame {rec.index} has IPv4 options")
        pkt = parse(f.payload)
        if pkt.info.transport.name != "RC":
            raise ValueError(f"{path}: frame {rec.index} is not RC")
        qpns.add(pkt.dest_qp)
        t0 = rec.ts_ns if t0 is None else t0
        aeth = dict(pkt.info.headers).get(Hdr.AETH)
        frames.append(_Frame(bytes(rec.data), rec.ts_ns - t0, ip, ip + 28, pkt.psn, pkt.msn,
                             None if aeth is None else ip + 28 + aeth, f.ip_id, f.ip_src, f.ip_dst, f.sport, f.dport, f.ip_frag))
    if len(frames) < 2:
        raise ValueError(f"{path}: a template needs at least two frames")
    if len(qpns) > 2:
        raise ValueError(f"{path}: more than one RC connection ({len(qpns)} QPNs)")
    psns = [fr.psn for fr in frames]
    lo, hi = min(psns), max(psns)
    if hi - lo > _PSN_MOD // 2:
        raise ValueError(f"{path}: the PSNs wrap inside the template")
    msn_span = max((fr.msn for fr in frames if fr.msn is not None), default=0)
    duration = frames[-1].ts_ns
    return Tile(Path(path).stem, tuple(frames), hi - lo + 1, msn_span,
                duration + duration // (len(frames) - 1))


def _copy(fr: _Frame, k: int, tile: Tile, ids: int) -> bytearray:
    """Frame ``fr`` of copy ``k``: PSN, MSN and IP ID advanced, checksums recomputed."""
    buf = bytearray(fr.data)
    r = fr.roce
    psn = (fr.psn + k * tile.psn_span) % _PSN_MOD
    buf[r + 9:r + 12] = psn.to_bytes(3, "big")
    if fr.aeth is not None:
        buf[fr.aeth + 1:fr.aeth + 4] = ((fr.msn + k * tile.msn_span) % _PSN_MOD).to_bytes(3, "big")
    ip_id = (fr.ip_id + k * ids) & 0xFFFF
    ip = fr.ip
    _U16.pack_into(buf, ip + 4, ip_id)
    buf[ip + 10:ip + 12] = b"\0\0"
    _U16.pack_into(buf, ip + 10, ip_checksum(memoryview(buf)[ip:ip + 20]))
    roce = memoryview(buf)[r:ip + _U16.unpack_from(buf, ip + 2)[0]]
    _ICRC.pack_into(roce, len(roce) - 4,
                    icrc_ipv4(roce, fr.src, fr.dst, fr.sport, fr.dport, ip_id, fr.frag))
    return buf


def tile_copies(tile: Tile, start_ns: int = 0) -> Iterator[tuple[int, bytearray]]:
    """``(ts_ns, frame)`` of copies 0, 1, 2... of ``tile``, without end."""
    ids = len(tile.frames)
    k = 0
    while True:
        base = start_ns + k * tile.period_ns
        for fr in tile.frames:
            yield base + fr.ts_ns, _copy(fr, k, tile, ids)
        k += 1


def long_capture(packets: int, templates: Sequence[str | os.PathLike[str]] = DEFAULT_TEMPLATES,
                 start_ns: int = 1_700_000_000 * 10**9, loss_every: int = 0,
                 losses: LossStats | None = None) -> Iterator[tuple[int, bytearray]]:
    """The first ``packets`` frames of the templates' tiles interleaved by time, as
    ``(ts_ns, frame)``: streamed, in memory the templates' size. ``loss_every``: lose
    one request packet in that many of each SEND or RDMA WRITE flow after the capture
    point, repaired by NAK and go-back as rxe does (:mod:`.caploss`, counted in
    ``losses``); the other flows stay clean."""
    if not templates:
        raise ValueError("no template capture")
    tiles = [load_tile(t) for t in templates]
    # start each flow a little later than the previous one, as separate runs would
    streams = [tile_copies(t, start_ns + i * 1_000_003) for i, t in enumerate(tiles)]
    if loss_every:
        losses = losses if losses is not None else LossStats()
        streams = [with_losses(s, loss_every, losses) if lossy_template(t) else s
                   for s, t in zip(streams, tiles)]
    merged = heapq.merge(*streams, key=lambda x: x[0])
    for n, item in enumerate(merged):
        if n >= packets:
            return
        yield item


def lossy_template(tile: Tile) -> bool:
    """Whether :mod:`.caploss` models losses in this tile's flow: SENDs and RDMA WRITEs."""
    return all(parse(memoryview(fr.data)[fr.roce:]).opcode not in _NOT_LOSSY
               for fr in tile.frames)


def write_long_capture(target: str | os.PathLike[str] | BinaryIO, packets: int,
                       templates: Sequence[str | os.PathLike[str]] = DEFAULT_TEMPLATES,
                       loss_every: int = 0, losses: LossStats | None = None) -> int:
    """Write :func:`long_capture` as a nanosecond pcap; returns the frames written."""
    with PcapWriter(target, nanosecond=True, close=not hasattr(target, "write")) as w:
        for ts_ns, frame in long_capture(packets, templates, loss_every=loss_every,
                                         losses=losses):
            w.write(frame, ts_ns=ts_ns)
        return w.count
