"""Reading and writing packet captures: classic pcap (read and write) and pcapng (read).

The reader yields :class:`PcapRecord` objects and recognises the format by its magic
number; anything else raises :class:`PcapError` with one line saying why. The writer
produces classic pcap with microsecond or nanosecond timestamps, which tcpdump, tshark,
scapy and ``softrdma dissect`` all read.

    >>> import io
    >>> from softrdma.wire.pcap import PcapWriter, read_pcap
    >>> f = io.BytesIO()
    >>> with PcapWriter(f, close=False) as w:
    ...     w.write(b"\\x00" * 60, ts=1.5)
    >>> _ = f.seek(0)
    >>> [(r.index, r.timestamp, len(r.data)) for r in read_pcap(f)]
    [(1, 1.5, 60)]
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from .frames import LINKTYPE_ETHERNET

__all__ = ["PcapError", "PcapRecord", "PcapWriter", "read_pcap"]

_MAGIC_US = 0xA1B2C3D4
_MAGIC_NS = 0xA1B23C4D
_PCAPNG_SHB = 0x0A0D0D0A
_BYTE_ORDER_MAGIC = 0x1A2B3C4D
_MAX_RECORD = 256 * 1024 * 1024  # refuse absurd lengths instead of allocating them


class PcapError(ValueError):
    """The file is not a readable capture (bad magic, truncated header, corrupt record)."""


@dataclass(slots=True)
class PcapRecord:
    index: int  # 1-based, like tshark's frame.number
    ts_ns: int  # capture time in nanoseconds since the epoch
    linktype: int
    data: bytes
    orig_len: int

    @property
    def timestamp(self) -> float:
        return self.ts_ns / 1e9


def read_pcap(source: str | os.PathLike[str] | BinaryIO) -> Iterator[PcapRecord]:
    """Iterate over the records of a pcap or pcapng file (a path or a binary file object)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            yield from read_pcap(f)
        return
    head = source.read(4)
    if len(head) < 4:
        raise PcapError("file is too short to be a capture")
    (magic_le,) = struct.unpack("<I", head)
    (magic_be,) = struct.unpack(">I", head)
    if magic_le == _PCAPNG_SHB:
        yield from _read_pcapng(source, head)
        return
    for endian, magic in (("<", magic_le), (">", magic_be)):
        if magic in (_MAGIC_US, _MAGIC_NS):
            yield from _read_classic(source, endian, magic == _MAGIC_NS)
            return
    raise PcapError(f"not a pcap or pcapng file (magic 0x{magic_be:08x})")


def _read_classic(f: BinaryIO, e: str, nano: bool) -> Iterator[PcapRecord]:
    rest = f.read(20)
    if len(rest) < 20:
        raise PcapError("pcap global header truncated")
    _vmaj, _vmin, _zone, _sig, _snap, linktype = struct.unpack(e + "HHiIII", rest)
    linktype &= 0x0FFFFFFF  # upper bits carry FCS info
    rec = struct.Struct(e + "IIII")
    scale = 1 if nano else 1000
    index = 0
    while True:
        h = f.read(16)
        if not h:
            return
        if len(h) < 16:
            raise PcapError(f"record {index + 1}: header truncated")
        sec, frac, incl, orig = rec.unpack(h)
        if incl > _MAX_RECORD:
            raise PcapError(f"record {index + 1}: implausible length {incl}")
        data = f.read(incl)
        if len(data) < incl:
            raise PcapError(f"record {index + 1}: data truncated ({len(data)} of {incl} bytes)")
        index += 1
        yield PcapRecord(index, sec * 1_000_000_000 + frac * scale, linktype, data, orig)


def _read_pcapng(f: BinaryIO, head: bytes) -> Iterator[PcapRecord]:
    e = "<"
    interfaces: list[tuple[int, int]] = []  # (linktype, ticks per second)
    index = 0
    first = True
    while True:
        h = head if first else f.read(4)
        first = False
        if not h:
            return
        h += f.read(4)
        if len(h) < 8:
            raise PcapError("pcapng block header truncated")
        btype = struct.unpack(e + "I", h[:4])[0]
        if btype == _PCAPNG_SHB:
            bom = f.read(4)
            if len(bom) < 4:
                raise PcapError("pcapng section header truncated")
            e = "<" if struct.unpack("<I", bom)[0] == _BYTE_ORDER_MAGIC else ">"
            if struct.unpack(e + "I", bom)[0] != _BYTE_ORDER_MAGIC:
                raise PcapError("pcapng section header has a bad byte-order magic")
            blen = struct.unpack(e + "I", h[4:8])[0]
            body = bom + f.read(blen - 12 - 4) if blen >= 16 else b""
            interfaces = []
        else:
            blen = struct.unpack(e + "I", h[4:8])[0]
            if blen < 12 or blen > _MAX_RECORD or blen % 4:
                raise PcapError(f"pcapng block of implausible length {blen}")
            body = f.read(blen - 12)
        trailer = f.read(4)
        if len(trailer) < 4 or len(body) < blen - 12:
            raise PcapError("pcapng block truncated")
        if btype == 1:  # interface description block
            linktype = struct.unpack_from(e + "H", body, 0)[0]
            interfaces.append((linktype, _pcapng_tsresol(body[8:], e)))
        elif btype == 6:  # enhanced packet block
            if len(body) < 20:
                raise PcapError("pcapng enhanced packet block truncated")
            iface, th, tl, cap, orig = struct.unpack_from(e + "IIIII", body, 0)
            if iface >= len(interfaces) or 20 + cap > len(body):
                raise PcapError("pcapng packet block refers to an unknown interface or overruns")
            lt, tps = interfaces[iface]
            ticks = (th << 32) | tl
            index += 1
            yield PcapRecord(index, ticks * 1_000_000_000 // tps, lt, bytes(body[20:20 + cap]), orig)
        elif btype == 3:  # simple packet block
            if not interfaces or len(body) < 4:
                raise PcapError("pcapng simple packet block without an interface")
            orig = struct.unpack_from(e + "I", body, 0)[0]
            index += 1
            yield PcapRecord(index, 0, interfaces[0][0], bytes(body[4:4 + orig]), orig)
        # other blocks (name resolution, statistics, custom) are skipped


def _pcapng_tsresol(opts: bytes, e: str) -> int:
    off = 0
    while off + 4 <= len(opts):
        code, ln = struct.unpack_from(e + "HH", opts, off)
        if code == 0:
            break
        if code == 9 and ln >= 1:
            v = opts[off + 4]
            return 2 ** (v & 0x7F) if v & 0x80 else 10 ** v
        off += 4 + ((ln + 3) & ~3)
    return 1_000_000


class PcapWriter:
    """Write a classic pcap file. Usable as a context manager; ``write`` takes raw frames.

    ``nanosecond=True`` writes the nanosecond-resolution variant. ``flush_each`` flushes
    after every record, so a capture is complete even if the process dies.
    """

    def __init__(self, target: str | os.PathLike[str] | BinaryIO, linktype: int = LINKTYPE_ETHERNET,
                 snaplen: int = 262144, nanosecond: bool = False, flush_each: bool = False,
                 close: bool = True) -> None:
        if isinstance(target, (str, os.PathLike)):
            self._f: BinaryIO = open(target, "wb")
            self._close = True
        else:
            self._f = target
            self._close = close
        self.linktype = linktype
        self.nanosecond = nanosecond
        self.snaplen = snaplen
        self.flush_each = flush_each
        self.count = 0
        self._f.write(struct.pack("<IHHiIII", _MAGIC_NS if nanosecond else _MAGIC_US, 2, 4, 0, 0,
                                  snaplen, linktype))

    def write(self, frame: bytes | bytearray | memoryview, ts: float | None = None,
              ts_ns: int | None = None) -> None:
        """Append one frame, stamped ``ts`` (seconds) or ``ts_ns`` (0 if neither: the wire
        layer reads no clock; a live capture passes the time, see softrdma.soft.capture)."""
        if ts_ns is None:
            ts_ns = 0 if ts is None else round(ts * 1e9)
        sec, ns = divmod(ts_ns, 1_000_000_000)
        frac = ns if self.nanosecond else ns // 1000
        n = len(frame)
        cap = min(n, self.snaplen)
        self._f.write(struct.pack("<IIII", sec, frac, cap, n))
        self._f.write(bytes(frame[:cap]) if cap < n else frame)
        self.count += 1
        if self.flush_each:
            self._f.flush()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if self._close:
            self._f.close()
        else:
            self._f.flush()

    def __enter__(self) -> "PcapWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


