"""Benchmarks that print numbers with their baseline beside them, measured in the same run.

``softrdma bench`` runs :func:`run_wire_bench`: parse + ICRC check and build + ICRC of a
RoCE packet, against bare ``zlib.crc32`` over the same bytes. The wire layer's own cost is
the difference; the aim is for it to be below the CRC's.

``softrdma bench --what qps [--qps N]`` runs :func:`run_qp_bench`: the Python memory of an
idle RC QP with 128-entry send and receive queues, and the time and memory to create N
(10,000) of them in one process, against the targets (10,000 QPs in under 200 MB and 10 s).
"""

from __future__ import annotations

import time
import zlib
from typing import Callable

__all__ = ["rate", "run_wire_bench", "run_qp_bench"]


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
    from .wire.icrc import icrc_ipv4
    from .wire.opcodes import Opcode
    from .wire.packet import build, parse

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


# -- QPs: memory and creation time ---------------------------------------------------------

QP_TARGET_BYTES = 200 * 1000 * 1000  # for 10,000 QPs
QP_TARGET_SECONDS = 10.0  # for 10,000 QPs
QP_TARGET_COUNT = 10_000


def _rss() -> int | None:
    """Resident set size now, in bytes (Linux /proc), or None."""
    import os
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def run_qp_bench(n: int = QP_TARGET_COUNT, depth: int = 128, sample: int = 1000,
                 top: int = 8, quiet: bool = False) -> dict[str, float]:
    """Create ``n`` idle RC QPs (``depth``-entry send and receive queues) on a device of
    their own; report time, RSS and tracemalloc memory, per QP and in total, beside the
    targets scaled to ``n``; then where a QP's memory goes (tracemalloc, by source line)
    and the cost of a QP brought to RTS. Returns the numbers."""
    import gc
    import itertools
    import os
    import tracemalloc

    from .verbs_api import (
        CQ, PD, QP, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, add_device,
        remove_device,
    )
    from .verbs_api.enums import IBV_MTU_1024, IBV_QPT_RC

    out = print if not quiet else (lambda *a, **k: None)
    name = f"softrdma-qpbench-{os.getpid()}"
    add_device("127.0.0.254", name=name, live=False)  # no traffic: no socket
    res: dict[str, float] = {}
    scale = n / QP_TARGET_COUNT
    target_bytes, target_s = QP_TARGET_BYTES * scale, QP_TARGET_SECONDS * scale
    try:
        with Context(name=name) as ctx:
            pd = PD(ctx)
            cq = CQ(ctx, 4096)

            def make() -> QP:
                cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
                return QP(pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))

            make().close()  # warm up (imports, first-use caches)
            reported = make()
            cap = reported.query()[1].cap
            reported.close()
            out(f"softrdma QP benchmark: {n:,} idle RC QPs, max_send_wr = max_recv_wr = {depth} "
                f"(reported {cap.max_send_wr}/{cap.max_recv_wr}), one PD and CQ")
            out(f"{'measurement':<48}{'value':>14}   target")

            # 1. time and RSS, without tracemalloc (it slows allocation down)
            gc.collect()
            rss0 = _rss()
            t0 = time.perf_counter()
            qps = [make() for _ in range(n)]
            dt = time.perf_counter() - t0
            gc.collect()
            rss1 = _rss()
            res["create_seconds"] = dt
            out(f"{f'create {n:,} QPs: time':<48}{dt:>12.2f} s   < {target_s:.1f} s "
                f"({'met' if dt < target_s else 'MISSED'})")
            out(f"{'  per QP':<48}{dt / n * 1e6:>11.1f} us")
            if rss0 is not None and rss1 is not None:
                res["rss_bytes"] = rss1 - rss0
                out(f"{f'create {n:,} QPs: RSS growth':<48}{(rss1 - rss0) / 1e6:>11.1f} MB   "
                    f"< {target_bytes / 1e6:.0f} MB "
                    f"({'met' if rss1 - rss0 < target_bytes else 'MISSED'})")
            t0 = time.perf_counter()
            for q in qps:
                q.close()
            res["destroy_seconds"] = time.perf_counter() - t0
            out(f"{f'destroy {n:,} QPs: time':<48}{res['destroy_seconds']:>12.2f} s")
            del qps, q
            gc.collect()

            # 2. the same under tracemalloc: Python memory, exactly
            tracemalloc.start(1)
            try:
                gc.collect()
                snap0 = tracemalloc.take_snapshot()
                before = tracemalloc.get_traced_memory()[0]
                qps = [make() for _ in range(n)]
                gc.collect()
                traced = tracemalloc.get_traced_memory()[0] - before
                snap1 = tracemalloc.take_snapshot()
                res["traced_bytes"] = traced
                res["bytes_per_qp"] = traced / n
                out(f"{f'create {n:,} QPs: Python memory (tracemalloc)':<48}"
                    f"{traced / 1e6:>11.1f} MB   < {target_bytes / 1e6:.0f} MB "
                    f"({'met' if traced < target_bytes else 'MISSED'})")
                out(f"{'  per idle QP':<48}{traced / n:>12,.0f} B   "
                    f"< {QP_TARGET_BYTES / QP_TARGET_COUNT:,.0f} B")
                for q in qps:
                    q.close()
                del qps, q
                gc.collect()

                # 3. a QP brought to RTS holds its attributes and address too
                attr = QPAttr(qp_state=1, port_num=1)
                attr.path_mtu, attr.max_dest_rd_atomic, attr.max_rd_atomic = IBV_MTU_1024, 1, 1
                attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
                attr.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=ctx.query_gid(1, 1),
                                                                  sgid_index=1))
                psn = itertools.count(1)
                k = min(sample, n)
                before = tracemalloc.get_traced_memory()[0]
                qps = [make() for _ in range(k)]
                for q in qps:
                    attr.dest_qp_num, attr.rq_psn, attr.sq_psn = 0xFFFFF0, next(psn), next(psn)
                    q.to_rts(attr)
                gc.collect()
                per_rts = (tracemalloc.get_traced_memory()[0] - before) / k
                res["bytes_per_rts_qp"] = per_rts
                out(f"{'  per QP in RTS (sample of ' + format(k, ',') + ')':<48}"
                    f"{per_rts:>12,.0f} B")
                for q in qps:
                    q.close()
                del qps
            finally:
                tracemalloc.stop()

            out(f"where an idle QP's memory goes (tracemalloc, top {top} source lines):")
            stats = snap1.compare_to(snap0, "lineno")
            for st in stats[:top]:
                frame = st.traceback[0]
                fname = frame.filename
                i = fname.rfind("softrdma/")
                fname = fname[i:] if i >= 0 else os.path.basename(fname)
                out(f"  {st.size_diff / n:>8,.0f} B  {fname}:{frame.lineno}")
    finally:
        remove_device(name)
    return res
