"""``softrdma bench qps``: the Python memory of an idle RC QP with 128-entry send and
receive queues, and the time and memory to create N (10,000) of them in one process,
against the targets (10,000 QPs in under 200 MB and 10 s), scaled to N.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
import tracemalloc

from ..verbs_api import (
    CQ, PD, QP, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, add_device,
    remove_device,
)
from ..verbs_api.enums import IBV_MTU_1024, IBV_QPT_RC

__all__ = ["run_qp_bench", "QP_TARGET_BYTES", "QP_TARGET_SECONDS", "QP_TARGET_COUNT"]

# -- QPs: memory and creation time ---------------------------------------------------------

QP_TARGET_BYTES = 200 * 1000 * 1000  # for 10,000 QPs
QP_TARGET_SECONDS = 10.0  # for 10,000 QPs
QP_TARGET_COUNT = 10_000


def _rss() -> int | None:
    """Resident set size now, in bytes (Linux /proc), or None."""
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
