"""Packet capture for soft devices: every packet sent and received, framed as
Ethernet/IP/UDP so tshark and ``softrdma dissect`` read it."""

from __future__ import annotations

import time
from typing import Callable

from ..wire.frames import encode_frame
from ..wire.pcap import PcapWriter

__all__ = ["PacketCapture"]


class PacketCapture:
    """Write frames to a pcap file. ``clock`` gives the timestamp in seconds (wall clock by
    default; the simulator passes its virtual clock)."""

    def __init__(self, path: str, clock: Callable[[], float] | None = None) -> None:
        self.writer = PcapWriter(path, nanosecond=True, flush_each=True)
        self.clock = clock or time.time
        self.count = 0

    def record(self, roce: bytes, src: bytes, dst: bytes, sport: int, ip_id: int = 0,
               tos: int = 0) -> None:
        frame = encode_frame(roce, src=src, dst=dst, sport=sport, ip_id=ip_id, ttl=64,
                             tos=tos, fill_icrc=False)
        self.writer.write(frame, ts=self.clock())
        self.count += 1

    def close(self) -> None:
        self.writer.close()
