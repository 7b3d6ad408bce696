"""Helpers shared by the data-path tests (test_datapath_properties, test_datapath_errors).

- :func:`pair`: ``connected_pair`` as a context manager that closes both contexts and
  unregisters both devices afterwards (hypothesis runs many examples; 1 MiB MRs add up).
- :class:`Wire`: taps a device's ``transmit`` to record (and optionally drop or swallow)
  every packet it sends, parsed.
- :func:`inject`: hand a crafted packet to a device as if it came from ``src`` (ICRC filled).
- :func:`sge_place` / :func:`sge_take`: the sequential scatter/gather model of SGE lists.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any, Callable, Iterator

from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import Endpoint, connected_pair
from softrdma.verbs_api.device import remove_device
from softrdma.wire.icrc import set_icrc_ipv4
from softrdma.wire.packet import build, parse

U64 = struct.Struct("<Q")


@contextlib.contextmanager
def pair(net: SimNetwork, qp_type: str = "RC", **kw: Any) -> Iterator[tuple[Endpoint, Endpoint]]:
    a, b = connected_pair(net, qp_type, **kw)
    try:
        yield a, b
    finally:
        for e in (a, b):
            e.close()
            with contextlib.suppress(Exception):
                remove_device(e.device.name)


class Wire:
    """Record what ``dev`` transmits. ``drop(i, pkt) -> bool`` may swallow packet number
    ``i`` (0-based, counted on this device); ``deliver=False`` swallows everything (the
    packets are only recorded), which is how tests capture a responder's answers."""

    def __init__(self, dev: Any, deliver: bool = True,
                 drop: Callable[[int, Any], bool] | None = None) -> None:
        self.dev = dev
        self.inner = dev.transmit
        self.deliver = deliver
        self.drop = drop
        self.raw: list[bytes] = []
        self.times: list[float] = []  # dev.now (virtual time) of each packet
        self.dropped: list[Any] = []
        dev.transmit = self._tx

    def _tx(self, data: bytes, dst: bytes, sport: int) -> None:
        i = len(self.raw)
        self.raw.append(bytes(data))
        self.times.append(self.dev.now)
        p = parse(data)
        if self.drop is not None and self.drop(i, p):
            self.dropped.append(p)
            return
        if self.deliver:
            self.inner(data, dst, sport)

    @property
    def pkts(self) -> list[Any]:
        return [parse(r) for r in self.raw]

    def clear(self) -> None:
        self.raw.clear()
        self.times.clear()

    def restore(self) -> None:
        self.dev.transmit = self.inner


def inject(dev: Any, raw: bytes | bytearray, src_ip: bytes, *, sport: int = 0xC123,
           icrc: bool = True, dst_ip: bytes | None = None) -> None:
    """Deliver RoCE bytes (BTH .. ICRC) to ``dev`` as if sent by ``src_ip``; the ICRC is
    computed for those addresses unless ``icrc`` is False (then the bytes go as they are)."""
    b = bytearray(raw)
    dst = dev.ip_packed if dst_ip is None else dst_ip
    if icrc:
        set_icrc_ipv4(b, src_ip, dst, sport)
    dev.receive(bytes(b), src_ip, dst, sport=sport, verify_icrc=True)


def craft(opcode: int, **fields: Any) -> bytearray:
    return build(opcode, **fields)


def sge_place(mem: bytearray, sges: list[tuple[int, int]], data: bytes) -> None:
    """Scatter ``data`` over ``[(offset, length), ...]`` of ``mem`` in order."""
    pos = 0
    for off, ln in sges:
        take = min(ln, len(data) - pos)
        if take <= 0:
            break
        mem[off:off + take] = data[pos:pos + take]
        pos += take
    assert pos == len(data), "model error: data does not fit the SGE list"


def sge_take(mem: bytes | bytearray, sges: list[tuple[int, int]]) -> bytes:
    return b"".join(bytes(mem[off:off + ln]) for off, ln in sges)


def diff_ranges(before: bytes, after: bytes) -> list[tuple[int, int]]:
    """The [start, end) ranges where two equal-length byte strings differ (for messages)."""
    out: list[tuple[int, int]] = []
    i, n = 0, len(before)
    while i < n:
        if before[i] != after[i]:
            j = i
            while j < n and before[j] != after[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out
