"""``softrdma bench wire``: the wire layer beside its baseline, measured in the same run.

:func:`run_wire_bench`: parse + ICRC check and build + ICRC of a RoCE packet, against bare
``zlib.crc32`` over the same bytes. The wire layer's own cost is the difference; the goal
is for parse + check and build + ICRC each to cost less than 1.5x the bare CRC. softrdma's
own CRC (softrdma.wire.crc: ISA-L's where installed) has a row of its own, for scale.

Each row is timed in alternating batches with the bare CRC (so both see the same load on a
shared machine), in several rounds; the ratio of each round is reported as the median and
the range over the rounds. The rows do what the device does per packet: the receive row is
``parse`` then ``icrc_ok_ipv4`` as in softrdma/soft/rx.py, the send row the requester's
``build_request`` (its per-opcode ``REQUEST_BUILDERS`` entry) then ``icrc_ipv4`` and the store as in ``SoftDevice.send_packet``;
a last row shows the same packet through ``build``'s keywords (the responder's and the
tools' way).
"""

from __future__ import annotations

import statistics
import time
import zlib
from typing import Callable

from ..wire.crc import CRC_IMPL, crc32
from ..wire.headers import ROCE_V2_UDP_DPORT
from ..wire.icrc import icrc_ipv4, icrc_ipv4_iov, icrc_ok_ipv4
from ..wire.iov import ZERO_COPY_MIN, zero_copy_enabled
from ..wire.opcodes import Opcode
from ..wire.packet import REQUEST_BUILDERS, REQUEST_IOV_BUILDERS, build, build_request, parse

__all__ = ["rate", "paired_rates", "run_wire_bench", "MAX_PAYLOAD", "TARGET_RATIO"]

#: the largest RDMA WRITE payload one UDP datagram can carry: 65507 bytes of UDP payload
#: (IPv4) less BTH (12), RETH (16) and ICRC (4)
MAX_PAYLOAD = 65507 - 12 - 16 - 4
#: the per-packet goal: parse + ICRC check, and build + ICRC, each below 1.5x the bare
#: ``zlib.crc32`` of the packet (the stdlib's CRC: what a bare Python program has)
TARGET_RATIO = 1.5


def _batch(fn: Callable[[], object]) -> int:
    """Calls of ``fn`` that take >= 10 ms, so the timer's own cost is negligible."""
    batch = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        if time.perf_counter() - t0 >= 0.01:
            return batch
        batch *= 2


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of ``fn``, timed in batches for about ``seconds``."""
    batch = _batch(fn)
    total = 0
    t0 = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(batch):
            fn()
        total += batch
    return total / elapsed


def paired_rates(fn: Callable[[], object], base: Callable[[], object],
                 seconds: float) -> tuple[float, float]:
    """Calls per second of ``fn`` and of ``base``, timed in alternating batches for about
    ``seconds`` in all: a burst of load from elsewhere slows both alike, not one row."""
    bf, bb = _batch(fn), _batch(base)
    tf = tb = 0.0
    nf = nb = 0
    perf = time.perf_counter
    end = perf() + seconds
    while True:
        t0 = perf()
        for _ in range(bb):
            base()
        t1 = perf()
        for _ in range(bf):
            fn()
        t2 = perf()
        tb += t1 - t0
        tf += t2 - t1
        nb += bb
        nf += bf
        if t2 >= end:
            return nf / tf, nb / tb


def run_wire_bench(payload: int = 4096, seconds: float = 0.5, rounds: int = 5
                   ) -> dict[str, dict[str, float]]:
    """Print and return, per row: ``us`` (median microseconds per packet), ``ratio``
    (median over the rounds of row time / bare CRC time in that round), ``lo``, ``hi``
    (the ratio's range over the rounds)."""
    src, dst, sport = bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]), 0xC123
    data = bytes(range(256)) * (payload // 256) + bytes(payload % 256)
    op = int(Opcode.RC_RDMA_WRITE_ONLY)
    pkt = build(op, dest_qp=0x12, psn=5, ackreq=True, va=0x1000, rkey=0x77, dma_len=payload,
                payload=data)
    pkt[-4:] = icrc_ipv4(pkt, src, dst, sport).to_bytes(4, "little")
    frozen = bytes(pkt)

    def bare_crc() -> None:
        zlib.crc32(frozen)

    def softrdma_crc() -> None:
        crc32(frozen)

    zero_copy = zero_copy_enabled() and payload >= ZERO_COPY_MIN
    rxbuf = bytearray(65536)  # the transport's reused receive buffer
    rxbuf[:len(frozen)] = frozen
    rxview = memoryview(rxbuf)[:len(frozen)]
    mr = memoryview(bytearray(payload + 64))  # the MR a WRITE's payload lands in
    mr_src = memoryview(bytearray(data))  # the MR a requester sends from

    def parse_only() -> None:
        parse(frozen)

    def parse_check() -> None:  # softrdma/soft/udp.py hands a view (a copy if zero copy off)
        p = parse(rxview if zero_copy else bytes(rxview))
        if not icrc_ok_ipv4(p.buf, src, dst, sport, ROCE_V2_UDP_DPORT, 0):
            raise AssertionError("ICRC mismatch")

    def parse_check_place() -> None:  # ... and the responder's one copy into the MR
        p = parse(rxview if zero_copy else bytes(rxview))
        if not icrc_ok_ipv4(p.buf, src, dst, sport, ROCE_V2_UDP_DPORT, 0):
            raise AssertionError("ICRC mismatch")
        mr[:payload] = p.payload

    def build_copy() -> None:  # the copying requester, then SoftDevice.send_packet's bytes()
        b = build_req(op, 5, 0x12, True, False, 0x1000, 0x77, payload, 0, 0, 0, 0, 0, 0x13,
                      mr_src)
        n = len(b)
        c = icrc_ipv4(b, src, dst, sport)
        b[n - 4:] = c.to_bytes(4, "little")
        bytes(b)

    def build_iov() -> None:  # zero copy: headers, a view of the MR, pad + ICRC
        b = build_req_iov(op, 5, 0x12, True, False, 0x1000, 0x77, payload, 0, 0, 0, 0, 0,
                          0x13, mr_src)
        c = icrc_ipv4_iov(b, src, dst, sport)
        tail = b[2]
        t = len(tail)
        b[2] = tail[:t - 4] + c.to_bytes(4, "little") if t > 4 else c.to_bytes(4, "little")

    build_icrc = build_iov if zero_copy else build_copy

    def build_kw_icrc() -> None:  # the same through build()'s keywords (responder, tools)
        b = build(op, psn=5, dest_qp=0x12, ackreq=True, se=False, va=0x1000, rkey=0x77,
                  dma_len=payload, swap_add=0, compare=0, imm=0, ieth_rkey=0, qkey=0,
                  src_qp=0x13, payload=data)
        n = len(b)
        c = icrc_ipv4(b, src, dst, sport)
        b[n - 4:] = c.to_bytes(4, "little")

    build_req = REQUEST_BUILDERS[op]  # what the requester calls
    build_req_iov = REQUEST_IOV_BUILDERS[op]
    parse_check()
    want = build(op, psn=5, dest_qp=0x12, ackreq=True, va=0x1000, rkey=0x77, dma_len=payload,
                 src_qp=0x13, payload=data)
    if build_request(op, 5, 0x12, True, False, 0x1000, 0x77, payload, 0, 0, 0, 0, 0, 0x13,
                     data) != want:
        raise AssertionError("build_request and build disagree")
    iov = build_req_iov(op, 5, 0x12, True, False, 0x1000, 0x77, payload, 0, 0, 0, 0, 0, 0x13,
                        mr_src)
    if b"".join(iov)[:-4] != bytes(want)[:-4]:
        raise AssertionError("the zero-copy builder and build disagree")
    mode = "zero copy" if zero_copy else "copying"
    rows = ((f"softrdma's crc32 ({CRC_IMPL})", softrdma_crc), ("parse only", parse_only),
            ("parse + ICRC check", parse_check), ("... + placement into the MR", parse_check_place),
            ("build + ICRC", build_icrc), ("build + ICRC, copying", build_copy),
            ("build() keywords + ICRC", build_kw_icrc))
    print(f"softrdma wire benchmark: RC_RDMA_WRITE_ONLY, {payload} B payload, "
          f"{len(frozen)} B packet ({mode}); {rounds} rounds, {seconds:g} s per row per round, "
          f"each row alternating with the bare CRC")
    crc_us: list[float] = []
    per_row: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in rows}
    for _ in range(rounds):
        for name, fn in rows:
            r_fn, r_base = paired_rates(fn, bare_crc, seconds)
            per_row[name].append((1e6 / r_fn, r_base / r_fn))
            crc_us.append(1e6 / r_base)
    results: dict[str, dict[str, float]] = {
        "bare zlib.crc32 (baseline)": {"us": statistics.median(crc_us), "ratio": 1.0,
                                       "lo": 1.0, "hi": 1.0}}
    for name, samples in per_row.items():
        ratios = [r for _, r in samples]
        results[name] = {"us": statistics.median(u for u, _ in samples),
                         "ratio": statistics.median(ratios), "lo": min(ratios),
                         "hi": max(ratios)}
    print(f"{'measurement':<32}{'us/op':>8}{'x bare crc':>12}{'range':>15}  target")
    for name, r in results.items():
        spread = f"{r['lo']:.2f}..{r['hi']:.2f}"
        mark = ""
        if name in ("parse + ICRC check", "build + ICRC"):
            mark = (f"< {TARGET_RATIO:g}x: " + ("met" if r["ratio"] < TARGET_RATIO
                                                else "missed"))
            if r["hi"] >= TARGET_RATIO > r["ratio"]:
                mark += " (not in every round)"
        print(f"{name:<32}{r['us']:>8.2f}{r['ratio']:>12.2f}{spread:>15}  {mark}")
    own = results[f"softrdma's crc32 ({CRC_IMPL})"]["us"]
    print(f"wire-layer cost beyond softrdma's CRC of the packet ({own:.2f} us): parse + check "
          f"{results['parse + ICRC check']['us'] - own:.2f} us, build + ICRC "
          f"{results['build + ICRC']['us'] - own:.2f} us")
    return results
