"""``softrdma bench wire``: the wire layer beside its baseline, measured in the same run.

:func:`run_wire_bench`: parse + ICRC check and build + ICRC of a RoCE packet, against bare
``zlib.crc32`` over the same bytes. The wire layer's own cost is the difference; the aim is
for it to be below the CRC's.
"""

from __future__ import annotations

import time
import zlib
from typing import Callable

from ..wire.icrc import icrc_ipv4
from ..wire.opcodes import Opcode
from ..wire.packet import build, parse

__all__ = ["rate", "run_wire_bench", "MAX_PAYLOAD"]

#: the largest RDMA WRITE payload one UDP datagram can carry: 65507 bytes of UDP payload
#: (IPv4) less BTH (12), RETH (16) and ICRC (4)
MAX_PAYLOAD = 65507 - 12 - 16 - 4


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of ``fn``, timed in batches for about ``seconds``."""
    batch = 1
    while True:  # grow the batch until it takes >= 10 ms, so timer overhead is negligible
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        dt = time.perf_counter() - t0
        if dt >= 0.01:
            break
        batch *= 2
    total = 0
    t0 = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(batch):
            fn()
        total += batch
    return total / elapsed


def run_wire_bench(payload: int = 4096, seconds: float = 1.0) -> dict[str, float]:
    src, dst, sport = bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]), 0xC123
    data = bytes(range(256)) * (payload // 256) + bytes(payload % 256)
    pkt = build(Opcode.RC_RDMA_WRITE_ONLY, dest_qp=0x12, psn=5, ackreq=True, va=0x1000,
                rkey=0x77, dma_len=payload, payload=data)
    pkt[-4:] = icrc_ipv4(pkt, src, dst, sport).to_bytes(4, "little")
    frozen = bytes(pkt)

    def bare_crc() -> None:
        zlib.crc32(frozen)

    def parse_check() -> None:
        p = parse(frozen)
        if icrc_ipv4(frozen, src, dst, sport) != p.icrc:
            raise AssertionError("ICRC mismatch")

    def build_icrc() -> None:
        b = build(Opcode.RC_RDMA_WRITE_ONLY, dest_qp=0x12, psn=5, ackreq=True, va=0x1000,
                  rkey=0x77, dma_len=payload, payload=data)
        b[-4:] = icrc_ipv4(b, src, dst, sport).to_bytes(4, "little")

    def parse_only() -> None:
        parse(frozen)

    results = {}
    print(f"softrdma wire benchmark: RC_RDMA_WRITE_ONLY, {payload} B payload, "
          f"{len(frozen)} B packet, {seconds:.1f} s per row")
    print(f"{'measurement':<34}{'ops/s':>14}{'us/op':>10}{'x bare crc':>12}")
    base = rate(bare_crc, seconds)
    for name, fn in (("bare zlib.crc32 (baseline)", bare_crc), ("parse only", parse_only),
                     ("parse + ICRC check", parse_check), ("build + ICRC", build_icrc)):
        r = base if fn is bare_crc else rate(fn, seconds)
        results[name] = r
        print(f"{name:<34}{r:>14,.0f}{1e6 / r:>10.2f}{base / r:>12.2f}")
    overhead_parse = 1e6 / results["parse + ICRC check"] - 1e6 / base
    overhead_build = 1e6 / results["build + ICRC"] - 1e6 / base
    print(f"wire-layer cost beyond the CRC: parse {overhead_parse:.2f} us, build "
          f"{overhead_build:.2f} us, CRC itself {1e6 / base:.2f} us")
    return results
