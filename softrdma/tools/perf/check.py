"""``--check``: after a BW run, the server verifies what the client wrote, sent or added,
and the client what it read (softrdma on both sides; perftest has no such option)."""

from __future__ import annotations

import struct

from ..common import ToolError
from .resources import Perf, pattern

__all__ = ["check_remote_region", "check_read_data"]


def check_remote_region(perf: Perf, size: int, iters: int) -> None:
    """The server's check of what the client wrote, sent or added (sizes from the report)."""
    nq = len(perf.qps)
    mem = perf.mr.mem
    step, nslots = perf.slots(size)
    if perf.verb == "atomic":
        total = 0
        for q in range(nq):
            base = (nq + q) * perf.buff
            for k in range(nslots if step else 1):
                off = base + k * step
                total += struct.unpack_from("<Q", mem, off)[0]
        if total != iters:
            raise ToolError(f"data check failed: the {iters} atomics left a total of {total} "
                            f"in the target slots, not {iters}")
        perf.check_msgs.append(f"{iters} atomics: the counters add up to {total}")
        return
    used = min(iters // max(nq, 1), nslots) if step else 1
    if perf.verb == "send":
        used = min(max(perf.received) if getattr(perf, "received", None) else 0, nslots) \
            if step else 1
    for q in range(nq):
        base = (nq + q) * perf.buff
        for k in range(used):
            off = k * step
            if bytes(mem[base + off:base + off + size]) != pattern(size, off):
                raise ToolError(f"data check failed: QP {q}, message slot {k} (offset {off}) "
                                f"does not hold the {size} bytes sent")
    what = "written" if perf.verb == "write" else "received"
    perf.check_msgs.append(f"{iters} x {size} B {what}, every byte as sent")


def check_read_data(perf: Perf, size: int) -> None:
    step, nslots = perf.slots(size)
    used = perf.last_loc[2] if step else 1
    mem = perf.mr.mem
    for q in range(len(perf.qps)):
        base = q * perf.buff
        for k in range(used):
            off = k * step
            if bytes(mem[base + off:base + off + size]) != pattern(size, off):
                raise ToolError(f"data check failed: QP {q}, read slot {k} (offset {off}) "
                                f"does not hold the server's data")
    perf.check_msgs.append(f"{size} B reads returned the server's data")
