"""Long captures are read as streams: ``read_pcap`` holds one record at a time (classic
pcap and pcapng), and ``softrdma dissect`` decodes a capture in memory that does not grow
with its length (issue 28, "Long captures")."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import tracemalloc

from softrdma.bench.capgen import write_long_capture
from softrdma.tools.dissect import PAYLOAD
from softrdma.wire.dissect import DissectStats, dissect_records
from softrdma.wire.pcap import PcapWriter, read_pcap


class CountingReader(io.RawIOBase):
    """A file that remembers how far it has been read."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        b = self._f.read(n)
        self.pos += len(b)
        return b


def _frames(n: int) -> list[bytes]:
    return [bytes([i % 251]) * (60 + 7 * (i % 13)) for i in range(n)]


def _classic(frames: list[bytes]) -> tuple[bytes, list[int]]:
    """A classic pcap of ``frames`` and the offset where each record ends (24-byte file
    header, then a 16-byte header and the data per record: the libpcap file format)."""
    f = io.BytesIO()
    with PcapWriter(f, close=False) as w:
        for i, fr in enumerate(frames):
            w.write(fr, ts_ns=i * 1000)
    ends, off = [], 24
    for fr in frames:
        off += 16 + len(fr)
        ends.append(off)
    return f.getvalue(), ends


def _block(btype: int, body: bytes) -> bytes:
    n = 12 + len(body)
    return struct.pack("<II", btype, n) + body + struct.pack("<I", n)


def _pcapng(frames: list[bytes]) -> tuple[bytes, list[int]]:
    """A pcapng file written here from the format's description (section header,
    interface description, one enhanced packet block per frame) and each block's end."""
    out = _block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1))
    out += _block(1, struct.pack("<HHI", 1, 0, 65535))
    ends = []
    for i, fr in enumerate(frames):
        pad = b"\0" * (-len(fr) % 4)
        out += _block(6, struct.pack("<IIIII", 0, 0, i * 10, len(fr), len(fr)) + fr + pad)
        ends.append(len(out))
    return out, ends


def _assert_reads_one_record_ahead_at_most(data: bytes, ends: list[int], frames: list[bytes]):
    src = CountingReader(data)
    n = 0
    for rec, end, fr in zip(read_pcap(src), ends, frames, strict=True):
        # when record k is handed out, the reader has read exactly up to its end
        assert src.pos == end, (rec.index, src.pos, end)
        assert rec.data == fr
        n += 1
    assert n == len(frames)


def test_read_pcap_reads_a_classic_file_one_record_at_a_time():
    """read_pcap (classic pcap) has read no further than the record it yields: it never
    holds more than one record, however long the file."""
    frames = _frames(300)
    _assert_reads_one_record_ahead_at_most(*_classic(frames), frames)


def test_read_pcap_reads_a_pcapng_file_one_block_at_a_time():
    """The same for pcapng: each enhanced packet block is read when it is yielded."""
    frames = _frames(300)
    _assert_reads_one_record_ahead_at_most(*_pcapng(frames), frames)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _drain(it) -> None:
    for _ in it:
        pass


def test_read_pcap_and_dissect_records_peak_memory_does_not_grow(tmp_path):
    """Peak Python memory of read_pcap, and of the dissector's engine over it, is the same
    for a 20,000-frame capture as for a 2,000-frame one (within 64 KiB, where keeping 60
    bytes per frame would add 1 MiB)."""
    small, big = tmp_path / "small.pcap", tmp_path / "big.pcap"
    write_long_capture(small, 2_000)
    write_long_capture(big, 20_000)
    for run in (lambda p: _drain(read_pcap(p)),
                lambda p: _drain(dissect_records(read_pcap(p), DissectStats(), PAYLOAD))):
        grow = _peak(lambda: run(big)) - _peak(lambda: run(small))
        assert grow < 64 * 1024, grow


def _max_rss(argv: list[str]) -> int:
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == 0, p.stderr.read()
    p.stderr.close()
    return usage.ru_maxrss * 1024


def test_softrdma_dissect_streams_in_bounded_memory(tmp_path):
    """``softrdma dissect`` of 50,000 frames peaks within 4 MiB of its peak on 5,000
    frames (the kernel's ru_maxrss of each process); a list of the frames, or of their
    records, would add tens of MiB."""
    small, big = tmp_path / "small.pcap", tmp_path / "big.pcap"
    write_long_capture(small, 5_000)
    write_long_capture(big, 50_000)
    cmd = [sys.executable, "-m", "softrdma", "dissect", "-q"]
    grow = _max_rss(cmd + [str(big)]) - _max_rss(cmd + [str(small)])
    assert grow < 4 * 2**20, grow
