"""The test loops (perftest's run_iter_bw, run_iter_bw_server, run_iter_lat_write,
run_iter_lat_send, run_iter_lat): post, poll, time. Each returns what the report needs."""

from __future__ import annotations

import time

from ...readiness import readable
from ...enums import IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ, \
    IBV_WR_RDMA_WRITE, IBV_WR_SEND
from ...verbs_api import SGE, RecvWR, SendWR
from ..common import ToolError
from .communication import BwReport
from .report import bw_report
from .resources import INLINE, OPCODES, SIGNALED, Perf, pattern

__all__ = ["run_bw_client", "run_bw_server_send", "run_lat_write", "run_lat_send",
           "run_lat_read"]


def run_bw_client(perf: Perf, size: int, iters: int, duration: float | None) -> BwReport:
    a = perf.a
    perf.watch_tcp = True
    nq = len(perf.qps)
    buff = perf.buff
    mr = perf.mr
    lkey = mr.lkey
    base = mr.buf
    tx_depth = a.tx_depth
    cq_mod = a.cq_mod
    step, nslots = perf.slots(size)
    verb = perf.verb
    check = a.check
    flags_base = INLINE if (size <= a.inline_size and verb in ("send", "write")) else 0
    wrs = []
    for q in range(nq):
        sge = SGE(base + q * buff, size, lkey)
        if verb == "atomic":
            op = int(IBV_WR_ATOMIC_FETCH_AND_ADD) if a.atomic_type == "FETCH_AND_ADD" \
                else int(IBV_WR_ATOMIC_CMP_AND_SWP)
            wr = SendWR(wr_id=q, opcode=op, sg=[sge], send_flags=0)
            wr.set_wr_atomic(perf.rem[q].rkey, perf.rem[q].vaddr,
                             1 if op == IBV_WR_ATOMIC_FETCH_AND_ADD else 0, 0)
        else:
            wr = SendWR(wr_id=q, opcode=OPCODES[verb], sg=[sge], send_flags=0)
            if verb != "send":
                wr.set_wr_rdma(perf.rem[q].rkey, perf.rem[q].vaddr)
        wrs.append(wr)
    cas_check = verb == "atomic" and a.atomic_type == "CMP_AND_SWAP" and check
    scnt = [0] * nq
    ccnt = [0] * nq
    total = iters * nq
    timed = duration is None
    tposted = [0.0] * total if timed else []
    tcompleted = [0.0] * total if timed else []
    tot_s = tot_c = 0
    clock = time.perf_counter
    end = 0.0 if timed else clock() + duration
    start = clock()
    qps = perf.qps
    scq = perf.scq
    rems = [(perf.rem[q].vaddr, base + q * buff) for q in range(nq)]
    limit = iters if timed else 1 << 62
    mask = (1 << 40) - 1
    while True:
        posted = False
        for q in range(nq):
            wr = wrs[q]
            qp = qps[q]
            sge = wr.sg_list[0]
            rem_base, loc_base = rems[q]
            k = scnt[q]
            while k < limit and k - ccnt[q] < tx_depth:
                sig = (k % cq_mod == cq_mod - 1) or k == iters - 1
                wr.send_flags = flags_base | SIGNALED if sig else flags_base
                wr.wr_id = (q << 40) | k
                off = (k % nslots) * step
                sge.addr = loc_base + off
                if verb != "send":
                    wr.remote_addr = rem_base + off
                if cas_check:
                    wr.compare_add = k // nslots
                    wr.swap = k // nslots + 1
                if timed:
                    tposted[tot_s] = clock()
                qp.post_send(wr)
                k += 1
                tot_s += 1
                posted = True
            scnt[q] = k
        n, wcs = scq.poll(64)
        if n:
            now = clock()
            for wc in wcs:
                if wc.status:
                    raise perf.bad_completion(wc, "client")
                q = wc.wr_id >> 40
                k = (wc.wr_id & mask) + 1
                tot_c += k - ccnt[q]
                ccnt[q] = k
                if timed:
                    tcompleted[tot_c - 1] = now
        if timed:
            if tot_c >= total:
                break
        elif clock() >= end:
            # -D: stop posting; wait until every WR is acked (the unsignaled tail too)
            perf.drain()
            tot_c = tot_s
            break
        if not n and not posted:
            perf.idle(0.05)
    t_end = clock()
    perf.last_loc = (step, nslots, min(max(scnt), nslots))
    if timed:
        return bw_report(perf, size, total, tposted, tcompleted, cq_mod, a.noPeak)
    return bw_report(perf, size, tot_c, [], [], cq_mod, True, t_end - start)


def run_bw_server_send(perf: Perf, size: int, iters: int, duration: bool) -> BwReport:
    perf.watch_tcp = True
    nq = len(perf.qps)
    total = iters * nq
    rcnt = 0
    per_q = [0] * nq
    t_first = t_last = 0.0
    clock = time.perf_counter
    rcq = perf.rcq
    bad_len = 0
    while duration or rcnt < total:
        n, wcs = rcq.poll(64)
        if n:
            now = clock()
            for wc in wcs:
                if wc.status:
                    raise perf.bad_completion(wc, "server")
                q = wc.wr_id
                if wc.byte_len != size:
                    bad_len += 1
                if rcnt == 0:
                    t_first = now
                rcnt += 1
                per_q[q] += 1
                if duration or perf.rposted[q] < iters:
                    perf.post_one_recv(q, size)
            t_last = now
            continue
        if duration:
            # the client's closing handshake is the end of the run
            if readable([perf.tcp], 0):
                break
        perf.idle(0.05)
    if bad_len:
        raise ToolError(f"data check failed: {bad_len} messages were not {size} bytes")
    perf.received = per_q
    t = t_last - t_first if rcnt > 1 else 0.0
    return bw_report(perf, size, rcnt, [], [], 1, True, t)


def run_lat_write(perf: Perf, size: int, iters: int) -> list[float]:
    """run_iter_lat_write: the server writes first; each side waits for the last byte of
    its buffer to hold the count of writes received, then writes its own count."""
    perf.watch_tcp = True
    a = perf.a
    mem = perf.mr.mem
    qp = perf.qps[0]
    base = perf.mr.buf
    post_off = size - 1
    poll_off = perf.buff + size - 1
    flags = SIGNALED | (INLINE if size <= a.inline_size else 0)
    wr = SendWR(wr_id=0, opcode=int(IBV_WR_RDMA_WRITE), sg=[SGE(base, size, perf.mr.lkey)],
                send_flags=flags)
    wr.set_wr_rdma(perf.rem[0].rkey, perf.rem[0].vaddr)
    tposted = [0.0] * iters
    scnt = ccnt = rcnt = 0
    clock = time.perf_counter
    server = perf.server
    while scnt < iters or ccnt < iters or rcnt < iters:
        if rcnt < iters and not (scnt < 1 and server):
            rcnt += 1
            want = rcnt & 0xFF
            while mem[poll_off] != want:
                perf.idle(0.05)
        if scnt < iters:
            tposted[scnt] = clock()
            scnt += 1
            mem[post_off] = scnt & 0xFF
            qp.post_send(wr)
        if ccnt < iters:
            perf.wait_send()
            ccnt += 1
    if a.check:
        got = bytes(mem[perf.buff:perf.buff + size - 1])
        if got != pattern(size - 1):
            raise ToolError(f"data check failed: the {size}-byte writes received differ from "
                            f"the pattern")
        perf.check_msgs.append(f"{iters} x {size} B writes received intact")
    return tposted


def run_lat_send(perf: Perf, size: int, iters: int) -> list[float]:
    """run_iter_lat_send: the client sends first; each side answers every receive."""
    perf.watch_tcp = True
    a = perf.a
    qp = perf.qps[0]
    flags = SIGNALED | (INLINE if size <= a.inline_size else 0)
    wr = SendWR(wr_id=0, opcode=int(IBV_WR_SEND), sg=[SGE(perf.mr.buf, size, perf.mr.lkey)],
                send_flags=flags)
    tposted = [0.0] * iters
    scnt = rcnt = 0
    clock = time.perf_counter
    client = not perf.server
    rsge = SGE(perf.mr.buf + perf.buff, perf.buff, perf.mr.lkey)
    bad = 0
    while scnt < iters or rcnt < iters:
        if rcnt < iters and not (scnt < 1 and client):
            wc = perf.wait_recv()
            rcnt += 1
            if wc.byte_len != size:
                bad += 1
            repost = perf.recv_left > 0
        else:
            repost = False
        posted = scnt < iters
        if posted:
            tposted[scnt] = clock()
            scnt += 1
            qp.post_send(wr)
        if repost:  # after the send: off the critical path (rx_depth are posted anyway)
            qp.post_recv(RecvWR(1, sg=[rsge]))
            perf.recv_left -= 1
        if posted:
            perf.wait_send()
    if bad:
        raise ToolError(f"data check failed: {bad} messages were not {size} bytes")
    if a.check:
        got = bytes(perf.mr.mem[perf.buff:perf.buff + size])
        if got != pattern(size):
            raise ToolError("data check failed: the messages received differ from the pattern")
        perf.check_msgs.append(f"{iters} x {size} B messages received intact")
    return tposted


def run_lat_read(perf: Perf, size: int, iters: int) -> list[float]:
    """run_iter_lat (read/atomic): post one, wait for its completion, again."""
    perf.watch_tcp = True
    a = perf.a
    qp = perf.qps[0]
    if perf.verb == "atomic":
        fa = a.atomic_type == "FETCH_AND_ADD"
        wr = SendWR(wr_id=0, opcode=int(IBV_WR_ATOMIC_FETCH_AND_ADD if fa
                                         else IBV_WR_ATOMIC_CMP_AND_SWP),
                    sg=[SGE(perf.mr.buf, 8, perf.mr.lkey)], send_flags=SIGNALED)
        wr.set_wr_atomic(perf.rem[0].rkey, perf.rem[0].vaddr, 1 if fa else 0, 0)
    else:
        wr = SendWR(wr_id=0, opcode=int(IBV_WR_RDMA_READ),
                    sg=[SGE(perf.mr.buf, size, perf.mr.lkey)], send_flags=SIGNALED)
        wr.set_wr_rdma(perf.rem[0].rkey, perf.rem[0].vaddr)
    tposted = [0.0] * iters
    clock = time.perf_counter
    cas = perf.verb == "atomic" and a.atomic_type == "CMP_AND_SWAP" and a.check
    for k in range(iters):
        if cas:
            wr.compare_add, wr.swap = k, k + 1
        tposted[k] = clock()
        qp.post_send(wr)
        perf.wait_send()
    if a.check and perf.verb == "read":
        if bytes(perf.mr.mem[0:size]) != pattern(size):
            raise ToolError("data check failed: the data read differs from the server's "
                            "pattern")
        perf.check_msgs.append(f"{iters} x {size} B reads returned the server's data")
    return tposted
