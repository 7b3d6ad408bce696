"""The ``records`` target's run: forged hellos and records sent over real rdma_cm
connections to a ``softrdma.socket`` :class:`~softrdma.socket.Receiver`, while a
legitimate sender uses it; then the survival checks.

Device A runs a Receiver (in a thread of its own, as a server does: ``recv`` in a loop)
configured with small limits (:data:`RX_OPTIONS`: 16 slots, 1 KiB inline, 1 MiB
messages, 4 MiB of memory) so that what a record can make it allocate is reached in a
short run. Device B runs:

* a legitimate sender (``create_connection``) that sends a numbered message every
  :data:`LEGIT_EVERY` records;
* every :data:`REP_HELLO_EVERY` forgers, a socket-layer client (``create_connection``)
  of a forged server on device B whose REP carries a hello from
  :data:`~.records.HELLO`: it must connect, or fail with a ConnectionError, in time;
* *forgers*, one after another: each an RC connection made with rdma_cm whose REQ
  carries a hello from :data:`~.records.HELLO` (a correct one 70 % of the time), then up
  to :data:`FORGER_RECORDS` SENDs made by :class:`~.records.RecordMaker` (a correct next
  record, then damaged), each waited for; the NORMAL records name a remote-readable MR of
  the forger, so the Receiver's READs succeed. A forger whose connection the Receiver
  ends (or that gets no completion within :data:`STEP_TIMEOUT`) is closed and replaced.

Checks at the end: the progress threads are alive, no exception escaped a thread or was
caught by a device (``gsi_handler_errors``, ``progress_errors``, ``qp_fatal``); the
Receiver's ``recv`` raised nothing but TimeoutError; every forged connection the
Receiver dropped had ended with a clear error (None after a CLOSE, or a ConnectionError
such as ProtocolError or ConnectionResetError); the Receiver holds no connection but the
legitimate sender's after a settle; memory, threads and descriptors flat; every
legitimate message arrived, in order, intact; a fresh sender connects and is heard
within :data:`~.rdmacm_live.CONNECT_TIMEOUT`.
"""

from __future__ import annotations

import collections
import random
import sys
import threading
import time
import traceback
from typing import Any

from ...errors import PyverbsRDMAError
from ...rdmacm import RAI_PASSIVE, AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam
from ...rdmacm import enums as ce
from ...socket import Options, Receiver, create_connection
from ...socket.record import RECORD, RECORD_SIZE, RecordType
from ...verbs_api import SGE, QPCap, QPInitAttr, RecvWR, SendWR
from ...verbs_api.enums import ibv_qp_type, ibv_send_flags, ibv_wr_opcode
from ..common import ToolError
from .checks import check_flat, measure
from .fuzzer import Check, FuzzConfig, raw_allowed
from .rdmacm_live import CONNECT_TIMEOUT, ExceptHook, close_devices, open_devices, poll_cq
from .records import Due, RecordMaker, hello_bytes
from .report import print_summary
from .stats import Stats

__all__ = ["RecordFuzz", "run_records", "RX_OPTIONS", "RX_PORT", "FORGER_RECORDS",
           "LEGIT_EVERY", "STEP_TIMEOUT"]

E = ce.rdma_cm_event_type
RX_PORT = 7500
#: the Receiver's limits: small, so a short run reaches them (the defaults are 64 slots,
#: 4 KiB inline, 1 GiB messages and 64 MiB)
RX_OPTIONS = Options(slots=16, inline_max=1024, max_message=1 << 20, mem_limit=4 << 20)
RX_MEM_LIMIT = 4 << 20
FORGER_RECORDS = 32  # records a forger sends before it closes (if it lasts that long)
LEGIT_EVERY = 16  # records between two messages of the legitimate sender
REP_HELLO_EVERY = 8  # forgers between two clients that meet a forged server's REP hello
#: a SEND on loopback completes in milliseconds; one the Receiver does not take (RNR
#: retried for ever, or a connection it stopped serving) is given up after this
STEP_TIMEOUT = 2.0
ACK_TIMEOUT = 12  # the forgers' QP ACK timeout: 4.096 us x 2^12 = 16 ms
READ_MR = 64 << 10  # the forger's remote-readable MR that NORMAL records name
#: how a dropped forged connection may end: no error (it closed), or a ConnectionError
CLEAR_ERRORS = (ConnectionError,)


class Forger:
    """One forged connection: an rdma_cm RC connection from device B with a damaged or
    correct hello, then forged records."""

    def __init__(self, src: str, dst: str, port: int, hello: bytes) -> None:
        self.ch = CMEventChannel()
        self.cmid = CMID(self.ch)
        self.ok = False
        self.err = ""
        deadline = time.monotonic() + CONNECT_TIMEOUT
        try:
            self.cmid.resolve_addr(AddrInfo(src=src, dst=dst, dst_service=str(port)))
            self._expect(E.RDMA_CM_EVENT_ADDR_RESOLVED, deadline)
            # a connection the Receiver dropped is noticed by its RC retries: 7 x 16 ms
            self.cmid.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT, ACK_TIMEOUT)
            self.cmid.resolve_route()
            self._expect(E.RDMA_CM_EVENT_ROUTE_RESOLVED, deadline)
            self.cmid.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC,
                                         cap=QPCap(max_send_wr=8, max_recv_wr=32,
                                                   max_send_sge=1, max_recv_sge=1)))
            cp = ConnParam(resources=4, depth=4, retry=6, rnr_retry=7, data_len=len(hello))
            cp.set_private_data(hello)
            self.cmid.connect(cp)
            self._expect(E.RDMA_CM_EVENT_ESTABLISHED, deadline)
        except PyverbsRDMAError as e:
            self.err = str(e)
            return
        self.slot = RECORD_SIZE + RX_OPTIONS.inline_max
        self.smr = self.cmid.reg_msgs(2 * self.slot)
        self.rmr = self.cmid.reg_msgs(32 * self.slot)
        self.read_mr = self.cmid.reg_read(READ_MR)
        self.read_mr.write(bytes(range(256)) * (READ_MR // 256), READ_MR)
        for i in range(32):
            self._post_recv(i)
        self.due = Due(seq=0, inline_max=RX_OPTIONS.inline_max,
                       max_message=RX_OPTIONS.max_message, rkey=self.read_mr.rkey,
                       addr=self.read_mr.buf, mr_len=READ_MR, out=[])
        self.ok = True

    def _expect(self, want: int, deadline: float) -> None:
        while not self.ch.pending():
            if time.monotonic() > deadline:
                raise PyverbsRDMAError(f"no {ce.event_str(want)}", 110)
            self.ch.wait(0.05)
        ev = CMEvent(self.ch, 0)
        if ev.event_type != want:
            raise PyverbsRDMAError(f"{ev.event_str()} (status {ev.status})", 111)

    def _post_recv(self, i: int) -> None:
        self.cmid.qp.post_recv(RecvWR(i, 1, [SGE(self.rmr.buf + i * self.slot, self.slot,
                                              self.rmr.lkey)]))

    def send(self, data: bytes) -> str | None:
        """One SEND of ``data``; None when it completed, else why not."""
        n = len(data)
        if n:
            self.smr.write(data, n)
        sge = [SGE(self.smr.buf, n, self.smr.lkey)] if n else []
        try:
            self.cmid.qp.post_send(SendWR(1, ibv_wr_opcode.IBV_WR_SEND, len(sge), sg=sge,
                                        send_flags=ibv_send_flags.IBV_SEND_SIGNALED))
        except PyverbsRDMAError as e:
            return f"post_send: {e}"
        wc = poll_cq(self.cmid.qp.send_cq, STEP_TIMEOUT)
        self._reap()
        if wc is None:
            return "no send completion"
        if wc.status:
            return f"send completion status {wc.status}"
        return None

    def _reap(self) -> None:
        """Take the Receiver's records (CREDIT, ACK...) and repost their receives."""
        while True:
            n, wcs = self.cmid.qp.recv_cq.poll(8)
            if not n:
                return
            for wc in wcs:
                if wc.status == 0:
                    raw = self.rmr.read(RECORD_SIZE, wc.wr_id * self.slot)
                    if raw[0] == RecordType.ACK:
                        self.due.out.append(RECORD.unpack(raw)[3])
                    try:
                        self._post_recv(wc.wr_id)
                    except PyverbsRDMAError:
                        return

    def ended(self) -> bool:
        """The Receiver ended the connection (an event on our channel)."""
        return self.ch.pending()

    def close(self) -> None:
        try:
            self.cmid.disconnect()
        except PyverbsRDMAError:
            pass
        for mr in ("smr", "rmr", "read_mr"):
            if hasattr(self, mr):
                getattr(self, mr).close()
        self.cmid.close()
        self.ch.close()


class ForgedServer(threading.Thread):
    """An rdma_cm listener on device B that accepts every request with a REP carrying
    the hello it is given (damaged or not), then says nothing: what a client of the socket
    layer does with the REP's hello is tested."""

    def __init__(self, ip: str, port: int) -> None:
        super().__init__(name="fuzz-forged-server", daemon=True)
        self.ch = CMEventChannel()
        self.lid = CMID(self.ch)
        self.lid.bind_addr(AddrInfo(src=ip, src_service=str(port), flags=RAI_PASSIVE))
        self.lid.listen(16)
        self.hello = b""
        self.stop = threading.Event()
        self.children: list[CMID] = []
        self.mrs: list[Any] = []
        self.lock = threading.Lock()  # children and mrs: this thread adds, the run drops
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            self.ch.wait(0.05)
            while self.ch.pending():
                ev = CMEvent(self.ch, 0)
                if ev.event_type != E.RDMA_CM_EVENT_CONNECT_REQUEST:
                    continue
                child = CMID(ev, listen_id=self.lid)
                try:
                    child.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC,
                                               cap=QPCap(max_send_wr=4, max_recv_wr=4,
                                                         max_send_sge=1, max_recv_sge=1)))
                    # receives for the client's first records (its CLOSE), so it is not
                    # held by RNR when it leaves
                    mr = child.reg_msgs(4 * 8192)
                    with self.lock:
                        self.mrs.append(mr)
                    for k in range(4):
                        child.qp.post_recv(RecvWR(k, 1, [SGE(mr.buf + k * 8192, 8192,
                                                             mr.lkey)]))
                    cp = ConnParam(resources=4, depth=4, retry=6, rnr_retry=7,
                                   data_len=len(self.hello))
                    cp.set_private_data(self.hello)
                    child.accept(cp)
                except PyverbsRDMAError:
                    pass
                except Exception:
                    self.errors.append(traceback.format_exc().strip())
                with self.lock:
                    self.children.append(child)
        self.drop_children()
        self.lid.close()
        self.ch.close()

    def drop_children(self) -> None:
        with self.lock:
            children, self.children = self.children, []
            mrs, self.mrs = self.mrs, []
        for c in children:
            try:
                c.disconnect()
            except PyverbsRDMAError:
                pass
            c.close()
        for mr in mrs:
            mr.close()


class Server(threading.Thread):
    """The Receiver's application: ``recv`` in a loop, as a server runs it."""

    def __init__(self, rx: Receiver) -> None:
        super().__init__(name="fuzz-receiver", daemon=True)
        self.rx = rx
        self.stop = threading.Event()
        self.legit: list[bytes] = []  # the legitimate sender's messages, as received
        self.received = 0  # messages received, forged ones included (not kept)
        self.errors: list[str] = []  # what recv raised besides TimeoutError
        self.ends: collections.Counter[str] = collections.Counter()  # how conns ended
        self.unclear: list[str] = []
        self._seen: dict[int, Any] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                m = self.rx.recv(timeout=0.05)
                self.received += 1
                if m.data.startswith(b"legit "):
                    self.legit.append(bytes(m.data))
            except TimeoutError:
                pass
            except Exception:
                self.errors.append(traceback.format_exc().strip())
                if len(self.errors) > 100:
                    return
            self._watch()

    def _watch(self) -> None:
        """How each connection the Receiver dropped had ended (its ``error``)."""
        now = {k: conn for k, (conn, _) in list(self.rx.conns.items())}
        for k, conn in self._seen.items():
            if k not in now:
                err = conn.error
                name = "closed" if err is None else type(err).__name__
                self.ends[name] += 1
                if err is not None and not isinstance(err, CLEAR_ERRORS):
                    self.unclear.append(f"{type(err).__name__}: {err}")
        self._seen = now


class RecordFuzz:
    def __init__(self, cfg: FuzzConfig, out: Any) -> None:
        self.cfg = cfg
        self.out = out
        self.rng = random.Random(cfg.seed)
        self.stats = Stats()
        self.checks: list[Check] = []
        self.thread_errors: list[str] = []
        self.devs: list[Any] = []
        self.rx: Receiver | None = None
        self.server: Server | None = None
        self.legit: Any = None
        self.legit_sent: list[bytes] = []
        self.legit_error = ""
        self.forgers_made = 0
        self.hello_refused = 0
        self.qps_made = 0  # QPs with new numbers (forgers, the Receiver's side, REP clients)
        self.forged_server: ForgedServer | None = None
        self.rep_hellos: collections.Counter[str] = collections.Counter()  # client outcomes
        self.rep_unclear: list[str] = []  # outcomes that are not a ConnectionError
        self.raw = False
        self._hook: ExceptHook | None = None

    def setup(self) -> None:
        cfg = self.cfg
        self.raw = cfg.icrc == "raw" or (cfg.icrc == "auto" and raw_allowed())
        self._hook = ExceptHook(self.thread_errors)
        self.devs = open_devices(cfg.addrs, self.rng.randrange(1 << 30), self.raw)
        self.rx = Receiver((cfg.addrs[0], RX_PORT), mem_limit=RX_MEM_LIMIT,
                           options=RX_OPTIONS)
        self.server = Server(self.rx)
        self.server.start()
        try:
            self.legit = create_connection((cfg.addrs[0], RX_PORT), timeout=CONNECT_TIMEOUT)
        except OSError as e:
            raise ToolError(f"the Receiver does not take a sender before any fuzzing: {e}")
        self.legit_send()
        self.forged_server = ForgedServer(cfg.addrs[1], RX_PORT + 1)
        self.forged_server.start()

    def rep_hello(self) -> None:
        """A socket-layer client connects to the forged server, whose REP carries a hello
        from HELLO: it connects (a correct hello) or fails with a ConnectionError, within
        its timeout."""
        fs = self.forged_server
        assert fs is not None
        fs.hello = hello_bytes(self.rng, self.stats)
        self.stats.sent += 1
        self.qps_made += 2
        t0 = time.monotonic()
        try:
            s = create_connection((self.cfg.addrs[1], RX_PORT + 1), timeout=CONNECT_TIMEOUT)
            s.close()
            self.rep_hellos["connected"] += 1
        except ConnectionError as e:
            self.rep_hellos[type(e).__name__] += 1
        except Exception as e:  # TimeoutError included: the forged server did answer
            self.rep_hellos[type(e).__name__] += 1
            self.rep_unclear.append(f"{type(e).__name__}: {e} after "
                                    f"{time.monotonic() - t0:.1f} s")
        fs.drop_children()

    def legit_send(self) -> None:
        """The legitimate sender's next message (after its connection broke: nothing; the
        check reports why it broke)."""
        if self.legit_error:
            return
        data = b"legit %d " % len(self.legit_sent) + self.rng.randbytes(
            self.rng.choice((10, 500, 3000)))
        try:
            self.legit.send(data)
        except OSError as e:
            self.legit_error = f"the legitimate sender's send: {type(e).__name__}: {e}"
            return
        self.legit_sent.append(data)
        self.stats.legit_ops += 1

    def fuzz(self, seconds: float | None, count: int | None) -> float:
        t0 = time.monotonic()
        end = t0 + seconds if seconds is not None else None
        limit = count if count is not None else 1 << 62
        maker = RecordMaker(self.rng, self.stats)
        i = 0
        f: Forger | None = None
        sent_on_f = 0
        while i < limit and (end is None or time.monotonic() < end):
            if f is None:
                if self.forgers_made % REP_HELLO_EVERY == REP_HELLO_EVERY - 1:
                    self.rep_hello()
                    i += 1
                hello = hello_bytes(self.rng, self.stats)
                self.forgers_made += 1
                self.qps_made += 2
                f = Forger(self.devs[1].ip, self.devs[0].ip, RX_PORT, hello)
                self.stats.sent += 1  # the REQ with the hello
                i += 1
                sent_on_f = 0
                if not f.ok:
                    self.hello_refused += 1
                    f.close()
                    f = None
                    continue
            if f.ended():  # the Receiver dropped it after the last record
                f.close()
                f = None
                continue
            data, _t, correct = maker.make(f.due, f.slot)
            rtype = data[0] if data else 0
            err = f.send(data)
            self.stats.sent += 1
            i += 1
            sent_on_f += 1
            if correct or (rtype in (RecordType.NORMAL, RecordType.INLINE) and len(data) >= 8
                           and int.from_bytes(data[4:8], "big") == f.due.seq):
                if rtype in (RecordType.NORMAL, RecordType.INLINE):
                    f.due.seq = (f.due.seq + 1) & 0xFFFFFFFF
            if err or f.ended() or sent_on_f >= FORGER_RECORDS:
                if err:
                    k = err.split(":")[0]
                    self.stats.wc_errors[k] = self.stats.wc_errors.get(k, 0) + 1
                f.close()
                f = None
            if i % LEGIT_EVERY == 0:
                self.legit_send()
        if f is not None:
            f.close()
        return time.monotonic() - t0

    def settle(self, seconds: float) -> None:
        """Until the Receiver serves only the legitimate sender (or ``seconds``)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(self.rx.conns) > 1:  # type: ignore[union-attr]
            time.sleep(0.05)
        time.sleep(0.2)  # the last drop's disconnect on its way

    def counters(self) -> dict[str, int]:
        return {f"{d.name} {k}": getattr(d.counters, k) for d in self.devs
                for k in ("gsi_handler_errors", "progress_errors", "qp_fatal")}

    def close(self) -> None:
        for t in (self.server, self.forged_server):
            if t is not None:
                t.stop.set()
                t.join(5)
        if self.legit is not None:
            self.legit.close()
        if self.rx is not None:
            self.rx.close()
        close_devices(self.devs)
        if self._hook is not None:
            self._hook.close()


def run_records(cfg: FuzzConfig, out: Any = None) -> int:
    """``softrdma fuzz --target records``."""
    out = out or sys.stdout
    fz = RecordFuzz(cfg, out)
    try:
        fz.setup()
        return _run(fz, out)
    finally:
        fz.close()


def _legit_heard(fz: RecordFuzz, deadline: float) -> str | None:
    """Every legitimate message arrived, in order and intact (waits until ``deadline``)."""
    srv = fz.server
    assert srv is not None
    if not srv.is_alive():
        return "the Receiver's thread is gone"
    while True:
        got = list(srv.legit)
        if got == fz.legit_sent:
            return None
        if len(got) > len(fz.legit_sent) or got != fz.legit_sent[:len(got)]:
            return f"{len(got)} legitimate messages, not as sent"
        if time.monotonic() > deadline:
            return f"{len(got)} of {len(fz.legit_sent)} legitimate messages arrived"
        time.sleep(0.02)


def _run(fz: RecordFuzz, out: Any) -> int:
    cfg = fz.cfg
    srv, rx = fz.server, fz.rx
    assert srv is not None and rx is not None
    print(f"softrdma fuzz --target records: seed {cfg.seed}, a Receiver on {cfg.addrs[0]}:"
          f"{RX_PORT} (slots {RX_OPTIONS.slots}, inline {RX_OPTIONS.inline_max}, messages up "
          f"to {RX_OPTIONS.max_message}, memory {RX_MEM_LIMIT}), senders on {cfg.addrs[1]}",
          file=out, flush=True)
    c0 = fz.counters()
    if cfg.seconds is not None:
        w_sec: float | None = cfg.seconds * cfg.warmup
        m_sec: float | None = cfg.seconds - w_sec
        w_cnt = m_cnt = None
    else:
        w_sec = m_sec = None
        w_cnt = int(cfg.count * cfg.warmup)  # type: ignore[operator]
    t = fz.fuzz(w_sec, w_cnt) if (w_sec or w_cnt) else 0.0
    fz.settle(CONNECT_TIMEOUT)
    base = measure()
    qps0 = fz.qps_made
    if cfg.count is not None:
        m_cnt = cfg.count - fz.stats.sent
    t += fz.fuzz(m_sec, m_cnt) if m_cnt is None or m_cnt > 0 else 0.0
    fz.settle(CONNECT_TIMEOUT)
    heard = fz.legit_error or _legit_heard(fz, time.monotonic() + CONNECT_TIMEOUT)
    if cfg.self_test == "leak":
        fz._leak = [[bytes(200)] for _ in range(50_000)]  # type: ignore[attr-defined]
    now = measure()
    c = fz.checks
    check_flat(fz, base, now, new_qps=fz.qps_made - qps0)  # type: ignore[arg-type]
    c1 = fz.counters()
    moved = {k: c1[k] - c0[k] for k in c1 if c1[k] != c0[k]}
    c.append(Check("no exception caught by a device", not moved,
                   ", ".join(f"{k} +{v}" for k, v in moved.items()) or
                   "gsi_handler_errors, progress_errors, qp_fatal unchanged"))
    c.append(Check("Receiver.recv raised only TimeoutError", not srv.errors,
                   srv.errors[0].splitlines()[-1] if srv.errors else
                   f"{srv.received} messages received"))
    ends = ", ".join(f"{k} {v}" for k, v in srv.ends.most_common()) or "none"
    c.append(Check("broken connections end with a clear error", not srv.unclear,
                   (f"{srv.unclear[0]}; " if srv.unclear else "") + f"ended: {ends}; "
                   f"{fz.hello_refused} of {fz.forgers_made} hellos refused"))
    outcomes = ", ".join(f"{k} {v}" for k, v in fz.rep_hellos.most_common()) or "none"
    c.append(Check("a client refuses a bad REP hello clearly", not fz.rep_unclear,
                   (f"{fz.rep_unclear[0]}; " if fz.rep_unclear else "")
                   + f"clients of a forged server: {outcomes}"))
    # what the Receiver serves, and what its hubs (one CQ per device) still hold: a
    # connection it refused must be gone from both
    left, held = len(rx.conns), sum(len(h.conns) for h in rx.hubs.values())
    c.append(Check("Receiver connections bounded", left <= 1 and held <= 1,
                   f"{left} served and {held} held by its hubs after the settle (the "
                   f"legitimate sender's: 1)"))
    c.append(Check("the legitimate sender is heard", heard is None,
                   heard or f"{len(fz.legit_sent)} messages, in order and intact"))
    # a fresh sender, after all that
    err = None
    try:
        s = create_connection((cfg.addrs[0], RX_PORT), timeout=CONNECT_TIMEOUT)
        try:
            data = b"legit %d fresh" % len(fz.legit_sent)
            s.send(data)
            fz.legit_sent.append(data)
            err = _legit_heard(fz, time.monotonic() + CONNECT_TIMEOUT)
        finally:
            s.close()
    except OSError as e:
        err = f"{type(e).__name__}: {e}"
    c.append(Check("a fresh sender is heard", err is None,
                   err or f"within {CONNECT_TIMEOUT:.0f} s"))
    return print_summary(fz, t, out, unit="records")  # type: ignore[arg-type]
