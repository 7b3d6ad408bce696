"""``softrdma bench scale``: issue 18's scale and idle goals, each beside a baseline measured
in the same run, in several rounds (median and spread):

- **stream**: N (1,000) RC QPs streaming RDMA WRITEs at once between two processes on
  loopback, against one QP doing the same (the same total window of outstanding messages:
  ``window`` for the one QP, ``max(1, window // N)`` each for the N). Goal: the N QPs'
  aggregate throughput >= 0.8 of the one QP's, and no QP starved (the slowest and fastest
  QPs' rates are reported, and their ratio). The two runs of a round take turns going
  first;
- **qps**: 65,536 RC QPs (rxe's ``max_qp``) created in one process (a fresh child): RSS
  growth and time. Goal: under 500 MB;
- **timers**: the cost of one progress step (``next_deadline`` + ``fire_timers``, nothing
  due) and of moving one QP's timer later (what every ACK does), with 65,536 QPs holding
  armed timers, against one QP holding one; and the cost of one 64-byte WRITE through the
  engines (receive dispatch, ACK, timers) with 65,536 idle QPs on the device, against
  none. Goal: ratios near 1 (costs that do not grow with the number of QPs);
- **idle**: the CPU time of a process holding two live devices with N (1,000) connected,
  idle QP pairs, against the same process with no QPs. Goal: under 1 % of one core.

Child processes start with ``python -c`` and talk JSON lines over pipes. Absolute numbers
on a shared machine are noise: compare the ratios.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

__all__ = ["run_scale_bench", "STREAM_TARGET", "QPS_TARGET_BYTES", "IDLE_TARGET",
           "MAX_QP"]

STREAM_TARGET = 0.8  # N QPs' aggregate throughput / one QP's
QPS_TARGET_BYTES = 500 * 1000 * 1000  # for MAX_QP QPs
IDLE_TARGET = 0.01  # fraction of one core
MAX_QP = 0x10000  # rxe's max_qp


# -- helpers ---------------------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _spread(xs: list[float]) -> str:
    """``median [min .. max]`` of a list of numbers."""
    return f"{statistics.median(xs):.3g} [{min(xs):.3g} .. {max(xs):.3g}]"


def _child(role: str, **kw: Any) -> subprocess.Popen[str]:
    code = ("import sys, json; from softrdma.bench import scale; "
            f"scale._{role}(**json.loads(sys.argv[1]))")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(kw)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _read(p: subprocess.Popen[str]) -> Any:
    line = p.stdout.readline() if p.stdout else ""
    if not line:
        p.wait(10)
        raise RuntimeError(f"a benchmark process ended early (exit status {p.returncode})")
    return json.loads(line)


def _run_child(role: str, timeout: float, **kw: Any) -> Any:
    """Start a child in ``role``, read its one answer, close its stdin (its signal to
    exit) and wait for it."""
    p = _child(role, **kw)
    try:
        return _read(p)
    finally:
        if p.stdin:
            p.stdin.close()
        p.wait(timeout)


def _send(p: subprocess.Popen[str], obj: Any) -> None:
    assert p.stdin is not None
    p.stdin.write(json.dumps(obj) + "\n")
    p.stdin.flush()


def _say(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _listen() -> Any:
    line = sys.stdin.readline()
    return json.loads(line) if line else None


# -- one side of the streaming pairs (a child process each) ------------------------------------

class _Side:
    """A live device on ``ip`` with ``n`` RC QPs, one PD, CQ and MR."""

    def __init__(self, ip: str, n: int, size: int, depth: int) -> None:
        from ..verbs_api import CQ, MR, PD, QP, Context, QPCap, QPInitAttr, add_device
        from ..verbs_api.enums import IBV_QPT_RC
        from ..harness.testing import ALL_ACCESS
        self.name = f"softrdma-scale-{os.getpid()}"
        self.dev = add_device(ip, name=self.name)
        self.ctx = Context(name=self.name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, min(n * depth + 16, 32767))
        self.mr = MR(self.pd, max(size, 64), ALL_ACCESS)
        cap = QPCap(max_send_wr=max(depth, 1), max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qps = [QP(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                           cap=cap, sq_sig_all=0)) for _ in range(n)]

    def info(self) -> dict[str, Any]:
        return {"gid": self.ctx.query_gid(1, 1).raw.hex(), "qpns": [q.qp_num for q in self.qps],
                "rkey": self.mr.rkey, "addr": self.mr.buf}

    def connect(self, peer: dict[str, Any]) -> None:
        from ..verbs_api import GID, AHAttr, GlobalRoute, QPAttr
        from ..verbs_api.enums import (IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE,
                                       IBV_MTU_4096)
        gid = GID(bytes.fromhex(peer["gid"]))
        for i, q in enumerate(self.qps):
            a = QPAttr(port_num=1)
            a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
            a.path_mtu = IBV_MTU_4096
            a.max_dest_rd_atomic = a.max_rd_atomic = 1
            a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
            a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=gid, sgid_index=1, hop_limit=64))
            a.dest_qp_num, a.rq_psn, a.sq_psn = peer["qpns"][i], 1000 + i, 1000 + i
            q.to_rts(a)

    def close(self) -> dict[str, Any]:
        from ..verbs_api.device import remove_device
        c = self.dev.counters
        out = {k: getattr(c, k, 0) for k in ("sent_pkts", "rcvd_pkts", "sport_evicted",
                                              "sport_fallback", "send_err")}
        self.ctx.close()
        remove_device(self.name)
        return out


def _stream_server(ip: str, n: int, size: int) -> None:
    """The passive side: n QPs and an MR that the client WRITEs into; answers ACKs from its
    progress thread until its stdin closes."""
    side = _Side(ip, n, size, 1)
    _say(side.info())
    side.connect(_listen())
    _say("ready")
    _listen()  # until the orchestrator closes our stdin
    _say(side.close())


def _stream_client(ip: str, n: int, size: int, depth: int, seconds: float, warmup: float,
                   peer: dict[str, Any]) -> None:
    """The active side: keep ``depth`` signalled WRITEs of ``size`` bytes outstanding on each
    of ``n`` QPs for ``warmup + seconds``; report the completions of each QP in the last
    ``seconds``."""
    from ..verbs_api import SGE, SendWR
    from ..verbs_api.enums import IBV_SEND_SIGNALED, IBV_WR_RDMA_WRITE
    side = _Side(ip, n, size, depth)
    _say(side.info())
    side.connect(peer)
    _listen()  # "go": the server's QPs are in RTS
    by_qpn = {q.qp_num: i for i, q in enumerate(side.qps)}
    sge = SGE(side.mr.buf, size, side.mr.lkey)

    def wr(i: int) -> SendWR:
        w = SendWR(i, opcode=IBV_WR_RDMA_WRITE, sg=[sge], send_flags=IBV_SEND_SIGNALED)
        w.remote_addr, w.rkey = peer["addr"], peer["rkey"]
        return w

    for i, q in enumerate(side.qps):
        q.post_send([wr(i) for _ in range(depth)])
    counts = [0] * n
    errors = 0
    cq = side.cq
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + seconds
    measuring = False
    cpu0 = 0.0
    while True:
        now = time.perf_counter()
        if not measuring and now >= t_measure:
            measuring = True
            counts = [0] * n
            cpu0 = _cpu()
            t_measure = now
        if now >= t_end:
            break
        k, wcs = cq.poll(256)
        for wc in wcs:
            i = by_qpn[wc.qp_num]
            if wc.status:
                errors += 1
                continue
            counts[i] += 1
            side.qps[i].post_send(wr(i))
    dt = time.perf_counter() - t_measure
    cpu = _cpu() - cpu0
    out = {"counts": counts, "seconds": dt, "errors": errors, "cpu": cpu}
    out.update(side.close())
    _say(out)


def _stream_once(n: int, size: int, window: int, seconds: float, warmup: float,
                 ips: tuple[str, str]) -> dict[str, Any]:
    depth = max(1, window // n)
    srv = _child("stream_server", ip=ips[1], n=n, size=size)
    try:
        sinfo = _read(srv)
        cli = _child("stream_client", ip=ips[0], n=n, size=size, depth=depth, seconds=seconds,
                     warmup=warmup, peer=sinfo)
        try:
            cinfo = _read(cli)
            _send(srv, cinfo)
            _read(srv)  # ready
            _send(cli, "go")
            res = _read(cli)
        finally:
            if cli.stdin:
                cli.stdin.close()
            cli.wait(30)
        if srv.stdin:
            srv.stdin.close()
        res["server"] = _read(srv)
    finally:
        if srv.poll() is None:
            try:
                srv.wait(30)
            except subprocess.TimeoutExpired:
                srv.kill()
    counts = res["counts"]
    dt = res["seconds"]
    res["mbps"] = sum(counts) * size / dt / 1e6
    res["min_rate"] = min(counts) / dt
    res["max_rate"] = max(counts) / dt
    res["depth"] = depth
    return res


# -- 65,536 QPs in one process (a child) -------------------------------------------------------

def _many_qps(n: int, depth: int) -> None:
    from ..verbs_api import CQ, PD, QP, Context, QPCap, QPInitAttr, add_device
    from ..verbs_api.device import remove_device
    from ..verbs_api.enums import IBV_QPT_RC
    name = f"softrdma-scale-qps-{os.getpid()}"
    add_device("127.18.0.253", name=name, live=False)
    with Context(name=name) as ctx:
        pd = PD(ctx)
        cq = CQ(ctx, 4096)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        QP(pd, init).close()  # warm up
        gc.collect()
        rss0 = _rss()
        t0 = time.perf_counter()
        qps = [QP(pd, init) for _ in range(n)]
        dt = time.perf_counter() - t0
        gc.collect()
        rss1 = _rss()
        _say({"n": len(qps), "seconds": dt, "rss_growth": rss1 - rss0, "rss": rss1})
        for q in qps:
            q.close()
    remove_device(name)


# -- timer and dispatch costs (in this process, manual devices) --------------------------------

def _interleaved(fns: list[Callable[[], Any]], reps: int, batches: int = 7) -> list[float]:
    """Seconds per call of each of ``fns``: batches of ``reps`` calls, taking turns (so load
    on the machine hits them alike), the best batch of each."""
    best = [float("inf")] * len(fns)
    for _ in range(batches):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / reps)
    return best


class _Owner:
    """The timer interface of a QP engine: deadline, closed, on_timer."""

    __slots__ = ("deadline", "closed")

    def __init__(self, d: float) -> None:
        self.deadline: float | None = d
        self.closed = False

    def on_timer(self, now: float) -> None:
        self.deadline = None


def _timer_costs(ks: list[int]) -> dict[str, list[float]]:
    """For each k of ``ks``, a device whose k owners hold armed (far-off) timers: the cost of
    one idle progress step (next_deadline + fire_timers, nothing due), and of moving one
    owner's timer later (what every ACK does to a retransmit timer) and asking for the next
    deadline again."""
    from ..soft.device import SoftDevice

    steps, moves = [], []
    for k in ks:
        dev = SoftDevice(f"timers-{k}", "127.18.0.252")
        owners = [_Owner(1e6 + i) for i in range(k)]
        for o in owners:
            dev.timer_changed(o)

        def move(dev: SoftDevice = dev, o: _Owner = owners[0], t: list[float] = [1e6]) -> None:
            t[0] += 1e-3
            o.deadline = t[0]
            dev.timer_changed(o)
            dev.next_deadline()

        steps.append(lambda dev=dev: (dev.next_deadline(), dev.fire_timers(1.0)))
        moves.append(move)
    return {"step": _interleaved(steps, 2000), "move": _interleaved(moves, 2000)}


def _dispatch_costs(idles: list[int], msgs: int) -> list[float]:
    """For each n of ``idles``, a manual device with a connected RC pair and n more (idle)
    QPs: seconds per 64-byte RDMA WRITE through the engines (loopback: the request, its
    dispatch to the QP by QPN, the ACK, the retransmit timer armed and stopped)."""
    from ..enums import IBV_WR_RDMA_WRITE
    from ..harness.testing import Endpoint, connect
    from ..verbs_api import CQ, PD, QP, Context, QPCap, QPInitAttr, add_device
    from ..verbs_api.device import remove_device
    from ..verbs_api.enums import IBV_QPT_RC
    names, ctxs, fns = [], [], []
    try:
        for j, idle in enumerate(idles):
            name = f"softrdma-scale-dispatch-{os.getpid()}-{j}"
            dev = add_device(f"127.18.1.{j + 1}", name=name, live=False)
            names.append(name)
            ctx = Context(name=name)
            ctxs.append(ctx)
            cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
            a = Endpoint(ctx, "RC", 4096, cap, 64)
            b = Endpoint(ctx, "RC", 4096, cap, 64)
            connect(a, b, 1, 2)
            connect(b, a, 2, 1)
            pd = PD(ctx)
            cq = CQ(ctx, 16)
            init = QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq,
                              cap=QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1,
                                        max_recv_sge=1))
            for _ in range(idle):
                QP(pd, init)  # kept by the context until it closes

            def one(a: Endpoint = a, dev: Any = dev, sge: Any = a.sge(0, 64)) -> None:
                a.post_send(IBV_WR_RDMA_WRITE, sge, 1, remote_offset=64)
                while dev.progress():
                    pass
                a.cq.poll(1)

            for _ in range(50):
                one()
            fns.append(one)
        return _interleaved(fns, msgs)
    finally:
        for ctx in ctxs:
            ctx.close()
        for name in names:
            remove_device(name)


# -- idle CPU (a child) --------------------------------------------------------------------------

def _idle(n: int, seconds: float, ips: list[str]) -> None:
    """Two live devices with ``n`` connected RC QP pairs, each pair having moved one WRITE;
    then the process's CPU time over ``seconds`` of idleness."""
    from ..enums import IBV_WR_RDMA_WRITE
    from ..harness.testing import Endpoint, connect
    from ..verbs_api import Context, QPCap
    from ..verbs_api.device import add_device, remove_device
    names = [f"softrdma-scale-idle-{os.getpid()}-{i}" for i in range(2)]
    for ip, nm in zip(ips, names):
        add_device(ip, name=nm)
    ca, cb = Context(name=names[0]), Context(name=names[1])
    cap = QPCap(max_send_wr=2, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    pairs = []
    for i in range(n):
        a, b = Endpoint(ca, "RC", 4096, cap, 4), Endpoint(cb, "RC", 4096, cap, 4)
        connect(a, b, 10, 20)
        connect(b, a, 20, 10)
        pairs.append((a, b))
    for a, _ in pairs:
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 64), 1, remote_offset=0)
    deadline = time.monotonic() + 60
    pending = [a for a, _ in pairs]
    while pending and time.monotonic() < deadline:
        pending = [a for a in pending if not a.cq.poll(1)[0]]
    time.sleep(0.5)  # let the last ACKs and timer cancellations settle
    c0, t0 = _cpu(), time.perf_counter()
    time.sleep(seconds)
    c1, t1 = _cpu(), time.perf_counter()
    armed = len(ca.device.timer_qps) + len(cb.device.timer_qps)
    _say({"cpu": c1 - c0, "wall": t1 - t0, "unfinished": len(pending), "armed": armed})
    ca.close()
    cb.close()
    for nm in names:
        remove_device(nm)


def _idle_once(n: int, seconds: float, ips: list[str]) -> dict[str, float]:
    r = _run_child("idle", 60, n=n, seconds=seconds, ips=ips)
    r["share"] = r["cpu"] / r["wall"]
    return r


# -- the whole run -------------------------------------------------------------------------------

def run_scale_bench(qps: int = 1000, rounds: int = 3, seconds: float = 3.0, size: int = 4096,
                    window: int = 128, max_qp: int = MAX_QP, idle_seconds: float = 3.0,
                    quiet: bool = False, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the goals' measurements (``only``: a subset of stream, qps, timers, idle) and
    print each beside its baseline; return the numbers and whether each target is met."""
    out = print if not quiet else (lambda *a, **k: None)
    res: dict[str, Any] = {}
    met: dict[str, bool] = {}
    todo = only or ("stream", "qps", "timers", "idle")
    out(f"softrdma scale benchmark: {rounds} rounds; median [min .. max] of the rounds; "
        f"{os.cpu_count()} CPUs")

    if "stream" in todo:
        out(f"\n-- stream: {qps:,} RC QPs vs 1 QP, RDMA WRITE {size} B, window {window} "
            f"messages in all, {seconds:g} s per run, between two processes on loopback")
        one: list[float] = []
        many: list[float] = []
        ratio: list[float] = []
        fair: list[float] = []
        lo: list[float] = []
        hi: list[float] = []
        evicted: list[float] = []
        for r in range(rounds):
            runs = [(1, ("127.18.0.1", "127.18.0.2")), (qps, ("127.18.0.3", "127.18.0.4"))]
            if r % 2:  # every other round the N QPs go first: drifting load hits both alike
                runs.reverse()
            got = {k: _stream_once(k, size, window, seconds, 1.0, ips) for k, ips in runs}
            a, b = got[1], got[qps]
            one.append(a["mbps"])
            many.append(b["mbps"])
            ratio.append(b["mbps"] / a["mbps"] if a["mbps"] else 0.0)
            lo.append(b["min_rate"])
            hi.append(b["max_rate"])
            fair.append(b["min_rate"] / b["max_rate"] if b["max_rate"] else 0.0)
            evicted.append(b.get("sport_evicted", 0) + b["server"].get("sport_evicted", 0))
            out(f"  round {r + 1}: 1 QP {a['mbps']:.1f} MB/s, {qps:,} QPs {b['mbps']:.1f} MB/s "
                f"(ratio {ratio[-1]:.2f}); per-QP msgs/s min {b['min_rate']:.1f} max "
                f"{b['max_rate']:.1f}; errors {a['errors'] + b['errors']}; source-port "
                f"sockets evicted {evicted[-1]:.0f}")
        res["stream"] = {"one_mbps": one, "many_mbps": many, "ratio": ratio,
                         "min_rate": lo, "max_rate": hi, "fairness": fair, "evicted": evicted}
        met["stream"] = statistics.median(ratio) >= STREAM_TARGET and min(lo) > 0
        out(f"  {'1 QP aggregate (baseline)':<40}{_spread(one)} MB/s")
        out(f"  {f'{qps:,} QPs aggregate':<40}{_spread(many)} MB/s")
        out(f"  {'ratio':<40}{_spread(ratio)}   target >= {STREAM_TARGET} "
            f"({'met' if met['stream'] else 'MISSED'})")
        out(f"  {'per-QP rate, slowest QP':<40}{_spread(lo)} msgs/s   (0: starved)")
        out(f"  {'per-QP rate, fastest QP':<40}{_spread(hi)} msgs/s")
        out(f"  {'slowest / fastest':<40}{_spread(fair)}")

    if "qps" in todo:
        out(f"\n-- qps: {max_qp:,} RC QPs (128-entry queues) created in one fresh process")
        grow: list[float] = []
        secs: list[float] = []
        total: list[float] = []
        for r in range(rounds):
            m = _run_child("many_qps", 120, n=max_qp, depth=128)
            grow.append(m["rss_growth"] / 1e6)
            total.append(m["rss"] / 1e6)
            secs.append(m["seconds"])
        res["qps"] = {"rss_growth_mb": grow, "seconds": secs, "rss_mb": total}
        target = QPS_TARGET_BYTES * max_qp / MAX_QP
        met["qps"] = statistics.median(grow) * 1e6 < target
        out(f"  {'RSS growth':<40}{_spread(grow)} MB   target < "
            f"{target / 1e6:.0f} MB ({'met' if met['qps'] else 'MISSED'})")
        out(f"  {'process RSS after':<40}{_spread(total)} MB")
        out(f"  {'per QP':<40}{statistics.median(grow) * 1e6 / max_qp:,.0f} B")
        out(f"  {'creation time':<40}{_spread(secs)} s")

    if "timers" in todo:
        out(f"\n-- timers and dispatch: {max_qp:,} QPs vs 1 (interleaved batches, the best of "
            f"each, per round)")
        steps: list[float] = []
        moves: list[float] = []
        disp: list[float] = []
        base = {"step": [], "move": [], "disp": []}  # type: dict[str, list[float]]
        for r in range(rounds):
            t = _timer_costs([1, max_qp])
            base["step"].append(t["step"][0] * 1e6)
            base["move"].append(t["move"][0] * 1e6)
            steps.append(t["step"][1] / t["step"][0])
            moves.append(t["move"][1] / t["move"][0])
            d = _dispatch_costs([0, max_qp - 2], 200)  # with the pair: the device's max_qp
            base["disp"].append(d[0] * 1e6)
            disp.append(d[1] / d[0])
            gc.collect()
        res["timers"] = {"step_ratio": steps, "move_ratio": moves, "dispatch_ratio": disp,
                         "baseline_us": base}
        out(f"  {'idle progress step, 1 timer (baseline)':<40}{_spread(base['step'])} us")
        out(f"  {f'  ratio with {max_qp:,} timers armed':<40}{_spread(steps)}")
        out(f"  {'move a timer later, 1 timer (baseline)':<40}{_spread(base['move'])} us")
        out(f"  {f'  ratio with {max_qp:,} timers armed':<40}{_spread(moves)}")
        out(f"  {'64 B WRITE via engines, 0 idle QPs':<40}{_spread(base['disp'])} us")
        out(f"  {f'  ratio with {max_qp - 2:,} idle QPs more':<40}{_spread(disp)}")
        met["timers"] = max(statistics.median(steps), statistics.median(moves),
                            statistics.median(disp)) < 2.0

    if "idle" in todo:
        out(f"\n-- idle: a process with two live devices and {qps:,} connected idle QP pairs, "
            f"CPU over {idle_seconds:g} s, vs the same with none")
        zero: list[float] = []
        full: list[float] = []
        for r in range(rounds):
            zero.append(_idle_once(0, idle_seconds, ["127.18.0.5", "127.18.0.6"])["share"] * 100)
            full.append(_idle_once(qps, idle_seconds, ["127.18.0.7", "127.18.0.8"])["share"] * 100)
        res["idle"] = {"none_pct": zero, "qps_pct": full}
        met["idle"] = statistics.median(full) < IDLE_TARGET * 100
        out(f"  {'no QPs (baseline), both devices':<40}{_spread(zero)} % of a core")
        out(f"  {f'{qps:,} idle QP pairs, both devices':<40}{_spread(full)} % of a core   "
            f"target < {IDLE_TARGET * 100:g} % per device ({'met' if met['idle'] else 'MISSED'})")

    res["met"] = met
    out("\ntargets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()))
    return res
