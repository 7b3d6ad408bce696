"""The survival checks after a fuzzing run: the devices alive and working, nothing leaked,
no byte outside the permitted ranges changed.

Each check appends a :class:`~.fuzzer.Check` (name, ok, detail) to ``fz.checks``; the
report prints them and the first failure is the tool's one-line error.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

from ...enums import IBV_QPS_RTS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_SEND
from ...errors import PyverbsRDMAError
from ...verbs_api import SendWR
from .fuzzer import Check, Fuzzer
from .live import KINDS, RECV_TARGET, SLOT, UD_QKEY, Pair

__all__ = ["measure", "check_flat", "check_memory", "exercise", "check_pairs",
           "BLOCKS_PER_NEW_QP"]

#: memory blocks a QP with a new number may leave behind, by design: the device's pooled
#: source-port socket for it (softrdma.soft.udp, up to TX_POOL sockets) and its entry.
#: Measured 3.5 to 4.6 per QP over 400 and 800 legitimate rdma_cm connections made and
#: torn down (no fuzzing); 6 leaves a margin. A leaked CM id costs ~36 blocks.
BLOCKS_PER_NEW_QP = 6


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


def _alive(dev: Any) -> bool:
    t = getattr(dev, "progress_thread", None)
    return t is not None and t.is_alive()


def measure() -> dict[str, int]:
    """What must stay flat: threads, descriptors, RSS, allocated memory blocks."""
    gc.collect()
    return {"threads": threading.active_count(), "fds": _fds(), "rss": _rss(),
            "blocks": sys.getallocatedblocks()}


def check_flat(fz: Fuzzer, base: dict[str, int], now: dict[str, int],
               new_qps: int = 0) -> None:
    """Threads, descriptors, memory blocks and RSS against the baseline. ``new_qps``: QPs
    with new numbers made since the baseline (each may open one source-port socket, which
    the device pools up to ``softrdma.soft.udp.TX_POOL``: a descriptor each)."""
    c = fz.checks
    alive = [_alive(d) for d in fz.devs]
    c.append(Check("progress threads alive", all(alive), ", ".join(
        f"{d.name}: {'alive' if a else 'DEAD'}" for d, a in zip(fz.devs, alive))))
    c.append(Check("no exception in any thread", not fz.thread_errors,
                   fz.thread_errors[0].splitlines()[-1] if fz.thread_errors else ""))
    # Threads and descriptors: exact. Every socket (one per QP source port, the sending
    # sockets) and every thread exists before the baseline (the warm-up ran traffic on
    # every QP), and recovering a QP reuses its QPN and so its source port.
    c.append(Check("threads flat", now["threads"] == base["threads"],
                   f"{base['threads']} -> {now['threads']}"))
    if new_qps:
        c.append(Check("descriptors bounded", now["fds"] - base["fds"] <= new_qps,
                       f"{base['fds']} -> {now['fds']}; {new_qps} new QPs, one source-port "
                       f"socket each at most"))
    else:
        c.append(Check("descriptors flat", now["fds"] == base["fds"],
                       f"{base['fds']} -> {now['fds']}"))
    # Allocated blocks (pymalloc objects): CPython's caches and freelists, the drop
    # counters' keys (one per reason) and the WQEs in flight at either moment (at most
    # QP_DEPTH per QP, a handful of objects each) move it by about a thousand (+600 to
    # +900 measured over 5 s runs); a leak of one object per frame grows it by the
    # number of frames, 3,000 to 4,500 a second.
    tol_blocks = 2000 + base["blocks"] // 100 + BLOCKS_PER_NEW_QP * new_qps
    c.append(Check("allocated memory blocks flat",
                   now["blocks"] - base["blocks"] <= tol_blocks,
                   f"{base['blocks']} -> {now['blocks']} ({now['blocks'] - base['blocks']:+d},"
                   f" tolerance {tol_blocks})"))
    # RSS: coarser. pymalloc takes 1 MiB arenas and glibc keeps freed chunks (64 KiB
    # receive buffers, 8 KiB payloads) for reuse, so fragmentation alone moves RSS by a
    # few MiB; 16 MiB plus 10 % is far below what a per-frame leak costs over a run.
    tol_rss = (16 << 20) + base["rss"] // 10
    c.append(Check("RSS flat", now["rss"] - base["rss"] <= tol_rss,
                   f"{base['rss'] >> 20} -> {now['rss'] >> 20} MiB "
                   f"(tolerance +{tol_rss >> 20} MiB)"))


def check_memory(fz: Fuzzer) -> None:
    bad = []
    total = 0
    for k, s in enumerate(fz.sides):
        for msg in s.arena.compare():
            bad.append(f"{s.dev.name} {msg}")
        total += sum(b - a for _, a, b in s.arena.forbidden())
        for j, (buf, ref) in enumerate(zip(s.loose, s.loose_copy)):
            total += len(buf)
            if buf != ref:
                bad.append(f"{s.dev.name} unregistered buffer {j} changed")
    fz.checks.append(Check("memory outside permitted ranges unchanged", not bad,
                             bad[0] if bad else f"{total} bytes in guards and sentinels"))


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def exercise(fz: Fuzzer, p: Pair) -> str | None:
    """WRITE, SEND and READ both ways (UC: WRITE, SEND; UD: SEND); None or what failed."""
    ops = {"UD": ("SEND",), "UC": ("WRITE", "SEND")}.get(p.kind, ("WRITE", "SEND", "READ"))
    for e, peer in ((p.a, p.b), (p.b, p.a)):
        for name in ops:
            for x in (e, peer):
                fz.drain(x)
                fz.top_up(x)
            n = 512 if p.kind == "UD" else 3000
            data = fz.rng.randbytes(n)
            e.side.arena.region("rw")[:n] = data
            prw = peer.side.mrs["rw"]
            off = 8192 * (1 + KINDS.index(p.kind)) + (0 if e is p.a else 4096)
            wrid = fz.next_wrid()
            if name == "SEND":
                wr = SendWR(wrid, opcode=IBV_WR_SEND, sg=[e.side.sge("rw", 0, n)])
                if p.kind == "UD":
                    wr.set_wr_ud(e.ah, peer.qpn, UD_QKEY)
            elif name == "WRITE":
                wr = SendWR(wrid, opcode=IBV_WR_RDMA_WRITE,
                            sg=[e.side.sge("rw", 0, n)])
                wr.set_wr_rdma(prw.rkey, prw.buf + off)
            else:
                peer.side.arena.region("rw")[off:off + n] = data
                wr = SendWR(wrid, opcode=IBV_WR_RDMA_READ,
                            sg=[e.side.sge("sink", 0, n)])
                wr.set_wr_rdma(prw.rkey, prw.buf + off)
            try:
                e.qp.post_send(wr)
            except PyverbsRDMAError as ex:
                return f"{name} post_send: {ex}"
            got: list[Any] = []
            if not _wait(lambda: bool(len(e.scq)), 2.0):
                return f"{name} {e.side.dev.ip}->{peer.side.dev.ip}: no completion"
            wcs = e.scq.poll_all()
            if any(w.status for w in wcs):
                return f"{name}: completion status {wcs[-1].status}"
            if name == "SEND":
                ok = _wait(lambda: bool(len(peer.rcq)), 2.0)
                got = peer.rcq.poll_all() if ok else []
                if peer.srq is not None:
                    k = fz.sides.index(peer.side)
                    fz.srq_posted[k] = max(0, fz.srq_posted[k] - len(got))
                else:
                    peer.posted = max(0, peer.posted - len(got))
                if not got or got[0].status:
                    return f"SEND {e.side.dev.ip}->{peer.side.dev.ip}: " + (
                        "nothing received" if not got else f"receive status {got[0].status}")
                base = peer.slot * SLOT + (40 if p.kind == "UD" else 0)
                if bytes(peer.side.arena.region("recv")[base:base + n]) != data:
                    return "SEND: received data differs"
            elif name == "WRITE":
                # UC completes a WRITE when it is sent, not when it arrived: wait for it
                rw = peer.side.arena.region("rw")
                if not _wait(lambda: bytes(rw[off:off + n]) == data, 2.0):
                    return "WRITE: data at the peer differs"
            else:
                if bytes(e.side.arena.region("sink")[:n]) != data:
                    return "READ: data read back differs"
    return None


def exercise_safe(fz: Fuzzer, p: Pair) -> str | None:
    try:
        return exercise(fz, p)
    except Exception as ex:  # the check reports it rather than dying with a traceback
        fz.thread_errors.append("main thread (final check): " + traceback.format_exc().strip())
        return f"{type(ex).__name__}: {ex}"


def check_pairs(fz: Fuzzer) -> None:
    for i, p in enumerate(fz.pairs):
        states = [int(e.qp.qp_state) for e in p.ends]
        how = "intact"
        err = None
        if all(s == IBV_QPS_RTS for s in states):
            err = exercise_safe(fz, p)
            if err is None:
                fz.checks.append(Check(f"{p.kind} pair works", True, how))
                continue
            how = f"re-created after: {err}"
        else:
            how = f"re-created: QP states {states}"
        for e in p.ends:
            e.close()
        if p.kind == "SRQ":
            fz.srq_posted = [min(x, RECV_TARGET) for x in fz.srq_posted]
        p2 = fz.make_pair(p.kind, i)
        fz.pairs[i] = p2
        err = exercise_safe(fz, p2)
        fz.checks.append(Check(f"{p.kind} pair works", err is None,
                                 how if err is None else f"{how}; new pair: {err}"))
