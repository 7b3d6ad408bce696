"""The ``cm`` target's run: mutated CM MADs fired at QP1 of two live devices that hold a
listening rdma_cm id and an established connection, then the survival checks.

Device A listens (RC and UD on one port); device B keeps an established RC connection
to it, and every :data:`CHURN_EVERY` frames makes another one and tears it down, so CM
ids in every state (REQ_SENT, REP_SENT, ESTABLISHED, DREQ_SENT, TIMEWAIT) exist while
the frames arrive. Frames (:class:`~.cm.MadMaker`) go to either device, aimed at its
live CM ids, from a socket bound to the other device's address (75 %: the source the CM
answers to is a real CM) or to a stranger's. A forged MAD may legitimately end the
established connection (a DREQ or REJ with its comm IDs is what an off-path attacker who
guessed them can do: docs/security.md); the run then makes a new one and counts it.

Checks at the end: the progress threads are alive and no exception escaped any thread,
the MAD handler (``gsi_handler_errors``), the progress loop (``progress_errors``) or a
QP (``qp_fatal``); the CM ids each device holds after a settle are back within
:data:`CM_IDS_SLACK` of the baseline (the forged requests left nothing behind); no
rdma_cm event waits unread; threads, descriptors, memory blocks and RSS flat as in the
data path; the established connection still moves data (or was ended by a forged MAD
and its successor does); a fresh legitimate connection is made within
:data:`~.rdmacm_live.CONNECT_TIMEOUT` and moves data.
"""

from __future__ import annotations

import random
import socket
import sys
import time
from typing import Any

from ...wire.headers import ROCE_V2_UDP_DPORT
from ..common import ToolError
from . import mutators as M
from .checks import check_flat, measure
from .cm import LiveCm, LiveId, MadMaker, cm_service_ids, load_cm_seeds
from .fuzzer import Check, FuzzConfig, next_ip, ip_int, raw_allowed
from .rdmacm_live import CONNECT_TIMEOUT, CmSides, ExceptHook, RcConn, close_devices, open_devices, send_socket
from .report import print_summary
from .seeds import default_pcap_dir
from .stats import Stats

__all__ = ["CmFuzz", "run_cm", "CM_PORT", "CHURN_EVERY", "CM_IDS_SLACK", "COUNTERS"]

CM_PORT = 7471  # the listeners' port (rdma_cm's ucmatose default)
CHURN_EVERY = 512  # frames between a connection made and torn down alongside
LEGIT_EVERY = 128  # frames between a SEND each way on the established connection
#: CM ids a device may hold above its baseline after the settle: the churned
#: connections' ids in TIMEWAIT (2 x 2.1 s on rxe paths: the settle waits that out) and
#: a connection being replaced; anything a forged MAD makes the CM keep grows with the
#: number of frames (thousands), far above this
CM_IDS_SLACK = 8
#: device counters that count an exception caught where it would otherwise have ended
#: the device's work: each must be unchanged by a run
COUNTERS = ("gsi_handler_errors", "progress_errors", "qp_fatal")
FROM_PEER = 0.75
#: seconds to let TIMEWAIT play out before counting CM ids: it lasts conv(av timeout),
#: 2,048 ms for the ACK timeout 19 of rxe paths (softrdma.cm.state), plus a margin
SETTLE = 2.5


class CmFuzz:
    """One run of the ``cm`` target (:func:`run_cm` drives it)."""

    def __init__(self, cfg: FuzzConfig, out: Any) -> None:
        self.cfg = cfg
        self.out = out
        self.rng = random.Random(cfg.seed)
        self.stats = Stats()
        self.checks: list[Check] = []
        self.thread_errors: list[str] = []
        self.devs: list[Any] = []
        self.socks: list[tuple[socket.socket, bytes, bool, int]] = []
        self.sides: CmSides | None = None
        self.conn: RcConn | None = None
        self.broken: dict[str, int] = {}
        self.raw = False
        self._hook: ExceptHook | None = None

    # -- setup ------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if cfg.icrc == "raw" and not raw_allowed():
            raise ToolError("--icrc raw needs a raw socket (root or CAP_NET_RAW)")
        self.raw = cfg.icrc == "raw" or (cfg.icrc == "auto" and raw_allowed())
        self._hook = ExceptHook(self.thread_errors)
        self.devs = open_devices(cfg.addrs, self.rng.randrange(1 << 30), self.raw)
        self.sides = CmSides(self.devs, CM_PORT, b"fuzz-legit" + self.rng.randbytes(6))
        stranger = cfg.stranger or next_ip(max(cfg.addrs, key=ip_int))
        for i, ip in enumerate(cfg.addrs):  # from device i's address to the other device
            self.socks.append((send_socket(ip), socket.inet_aton(ip), True, 1 - i))
        for ip in (stranger, "127.0.0.1"):
            for t in (0, 1):
                self.socks.append((send_socket(ip), socket.inet_aton(ip), False, t))
        self.conn, err = self.sides.connect()
        if err:
            raise ToolError(f"rdma_cm does not work before any fuzzing: {err}")
        err = self.conn.exchange(b"before")
        if err:
            raise ToolError(f"the connection does not move data before any fuzzing: {err}")

    def live(self, t: int) -> LiveCm:
        dev, peer = self.devs[t], self.devs[1 - t]
        cdev = self.sides.cdevs[t]  # type: ignore[union-attr]

        def ids() -> list[LiveId]:
            return [LiveId(c.local_id, c.remote_id, c.local_qpn, c.remote_qpn, c.state.name)
                    for c in list(cdev.service.agent.ids.values())]
        rc, ud = cm_service_ids(CM_PORT)
        return LiveCm(ids, rc, ud, dev.ip, peer.ip,
                      int.from_bytes(bytes(peer.node_guid), "big"))

    # -- the run ------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        return {f"{d.name} {k}": getattr(d.counters, k) for d in self.devs for k in COUNTERS}

    def _upkeep(self, i: int) -> None:
        sides = self.sides
        assert sides is not None
        sides.pump()
        conn = self.conn
        if conn is None:  # the last attempt was broken by forged MADs: again
            self.conn, cerr = sides.connect()
            if cerr:
                self.stats.wc_errors[cerr] = self.stats.wc_errors.get(cerr, 0) + 1
        elif conn.ended or i % LEGIT_EVERY == 0:
            err = conn.ended or conn.exchange(self.rng.randbytes(64))
            if err:  # ended by a forged MAD (or its data path broken): a new one
                k = err.split(":")[0]
                self.broken[k] = self.broken.get(k, 0) + 1
                sides.drop(conn)
                self.conn, cerr = sides.connect()
                if cerr:
                    self.stats.wc_errors[cerr] = self.stats.wc_errors.get(cerr, 0) + 1
            else:
                self.stats.legit_ops += 1
        if i % CHURN_EVERY == 0:
            extra, cerr = sides.connect()
            if extra is not None:
                sides.drop(extra)
                self.stats.recoveries["churn"] = self.stats.recoveries.get("churn", 0) + 1

    def fuzz(self, maker: MadMaker, seconds: float | None, count: int | None) -> float:
        t0 = time.monotonic()
        end = t0 + seconds if seconds is not None else None
        i = 0
        limit = count if count is not None else 1 << 62
        while i < limit and (end is None or time.monotonic() < end):
            i += 1
            t = self.rng.randrange(2)
            data, _name = maker.make(t)
            peer = [k for k, s in enumerate(self.socks) if s[3] == t and s[2]]
            other = [k for k, s in enumerate(self.socks) if s[3] == t and not s[2]]
            k = self.rng.choice(peer if self.rng.random() < FROM_PEER else other)
            sock, src, from_peer, _ = self.socks[k]
            buf = bytearray(data)
            m = M.ICRC.choose(self.rng)
            if len(buf) >= M.ICRC_MIN and m is not None and m.apply is not None:
                if m.attack:
                    self.stats.m(m.name)
                else:
                    self.stats.good_icrc += 1
                m.apply(self.rng, buf, src, socket.inet_aton(self.cfg.addrs[t]),
                        sock.getsockname()[1])
            try:
                sock.sendto(bytes(buf), (self.cfg.addrs[t], ROCE_V2_UDP_DPORT))
                self.stats.sent += 1
                self.stats.from_peer += from_peer
            except OSError:
                self.stats.send_errors += 1
            if i % 16 == 0:
                self._upkeep(i)
                # a MAD costs the device far more than a datagram costs us: a short pause
                # keeps the kernel from dropping what we send (measured: ~3,000 MADs/s)
                time.sleep(0.004)
        return time.monotonic() - t0

    def settle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sides.pump()  # type: ignore[union-attr]
            time.sleep(0.02)

    def close(self) -> None:
        if self.sides is not None:
            self.sides.close()
        for s, *_ in self.socks:
            s.close()
        close_devices(self.devs)
        if self._hook is not None:
            self._hook.close()


def run_cm(cfg: FuzzConfig, out: Any = None) -> int:
    """``softrdma fuzz --target cm``."""
    out = out or sys.stdout
    root = cfg.pcaps or default_pcap_dir()
    seeds, nfiles = load_cm_seeds(root)
    fz = CmFuzz(cfg, out)
    try:
        fz.setup()
        return _run(fz, seeds, nfiles, out)
    finally:
        fz.close()


def _run(fz: CmFuzz, seeds: list[Any], nfiles: int, out: Any) -> int:
    cfg = fz.cfg
    sides = fz.sides
    assert sides is not None
    print(f"softrdma fuzz --target cm: seed {cfg.seed}, devices {fz.devs[0].ip} (listening "
          f"on port {CM_PORT}) and {fz.devs[1].ip}, "
          + ("ICRC verified (raw receive)" if fz.raw else "ICRC NOT verified"), file=out)
    print(f"seeds: {len(seeds)} CM MADs ({nfiles} captures, the rest built), "
          f"{len({s.name for s in seeds})} messages: "
          + ", ".join(sorted({s.name for s in seeds})), file=out, flush=True)
    maker = MadMaker(fz.rng, fz.stats, seeds, [fz.live(0), fz.live(1)])
    c0 = fz.counters()
    if cfg.seconds is not None:
        w_sec: float | None = cfg.seconds * cfg.warmup
        m_sec: float | None = cfg.seconds - w_sec
        w_cnt = m_cnt = None
    else:
        w_sec = m_sec = None
        w_cnt = int(cfg.count * cfg.warmup)  # type: ignore[operator]
    t = fz.fuzz(maker, w_sec, w_cnt) if (w_sec or w_cnt) else 0.0
    fz.settle(SETTLE)
    base = measure()
    qps0 = sides.qps_made
    ids0 = sides.cm_ids()
    if cfg.count is not None:
        m_cnt = cfg.count - fz.stats.sent
    t += fz.fuzz(maker, m_sec, m_cnt) if m_cnt is None or m_cnt > 0 else 0.0
    fz.settle(SETTLE)
    if cfg.self_test == "leak":
        fz._leak = [[bytes(200)] for _ in range(50_000)]  # type: ignore[attr-defined]
    now = measure()
    c = fz.checks
    check_flat(fz, base, now, new_qps=sides.qps_made - qps0)  # type: ignore[arg-type]
    c1 = fz.counters()
    moved = {k: c1[k] - c0[k] for k in c1 if c1[k] != c0[k]}
    c.append(Check("no exception caught by a device", not moved,
                   ", ".join(f"{k} +{v}" for k, v in moved.items()) or
                   "gsi_handler_errors, progress_errors, qp_fatal unchanged"))
    ids1 = sides.cm_ids()
    grown = [b - a for a, b in zip(ids0, ids1)]
    c.append(Check("CM ids bounded", all(g <= CM_IDS_SLACK for g in grown),
                   f"{ids0} -> {ids1} after {fz.stats.sent} frames "
                   f"(slack {CM_IDS_SLACK})"))
    waiting = int(sides.ch_a.pending()) + int(sides.ch_b.pending())
    c.append(Check("no rdma_cm event left unread", waiting == 0,
                   f"{sides.forged_requests} forged connection requests rejected"))
    c.append(Check("rdma_cm calls fail only with PyverbsRDMAError", not sides.app_errors,
                   sides.app_errors[0].splitlines()[-1] + f" (in {sides.app_errors[0].split(':')[0]}"
                   f", {len(sides.app_errors)} times)" if sides.app_errors else
                   "rdma_reject and rdma_destroy_id of every forged request"))
    # the established connection: still moving data, or ended by a forged MAD (what an
    # off-path forger who knows its comm IDs may do) and replaced by one that does
    conn = fz.conn
    if conn is None or conn.ended:
        if conn is not None:
            fz.broken[conn.ended] = fz.broken.get(conn.ended, 0) + 1
            sides.drop(conn)
        conn, _err = sides.connect()
        fz.conn = conn
    err = "no connection" if conn is None else conn.exchange(b"after" * 20)
    how = ", ".join(f"{k} {v}" for k, v in sorted(fz.broken.items())) or "none"
    c.append(Check("established connection moves data", err is None,
                   f"ended by forged MADs and replaced: {how}" + (f"; {err}" if err else "")))
    fresh, cerr = sides.connect()
    if fresh is not None:
        cerr = fresh.exchange(b"fresh" * 30)
        sides.drop(fresh)
    c.append(Check("a fresh connection works", cerr is None,
                   cerr or f"connected and moved data within {CONNECT_TIMEOUT:.0f} s"))
    return print_summary(fz, t, out, unit="CM MADs")  # type: ignore[arg-type]

