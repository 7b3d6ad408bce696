"""A hypothesis state machine: QPs (RC, UC, UD) created, modified, posted to, polled and
destroyed in random orders, each answer checked against a small model of the rules.

The model knows: the legal transitions (tests/verbs_helpers.TABLE, transcribed from the
seed inventory), what each state allows (post_recv from INIT on, post_send in RTS, SQD and
ERR), opcodes per QP type, queue capacities (rxe's ring rounding), that entering ERR
flushes every outstanding WR of both queues with IBV_WC_WR_FLUSH_ERR in post order (and
anything posted in ERR at once), that RESET empties the queues without completions, and
that EBUSY protects resources in use.

The data path is live, so the model allows what it may legitimately do with no peer:
UC and UD sends in RTS may complete (successfully) at once; RC sends go out and wait for
ACKs that never come (no progress, no clock), so an RC QP moved to SQD may still be
draining and refuse to leave SQD (EINVAL) except for ERR. Every QP has sq_sig_all=1, so
every completed WR produces exactly one completion.
"""

from __future__ import annotations

import errno
import itertools

from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from softrdma.errors import PyverbsRDMAError
from softrdma.verbs_api import (
    AH, CQ, PD, QP, Context, QPCap, QPInitAttr, RecvWR, SendWR, add_device, remove_device,
)

from .verbs_helpers import (
    ERR, INIT, MASK_BITS, NO_SUCH_QPN, PATHS, RC, RESET, RTR, RTS, SQD, STATE_NAMES, TABLE, UC,
    UD, full_attr,
    loopback_av,
)

SUCCESS, FLUSH = 0, 5  # ibv_wc_status values
STATE = MASK_BITS["STATE"]
SEND, WRITE, READ = 2, 0, 4  # ibv_wr_opcode values
OPS_ALLOWED = {RC: {SEND, WRITE, READ}, UC: {SEND, WRITE}, UD: {SEND}}  # seed §2.1
DEV_NAME = "softrdma-stateful"

# rxe starts no new WR in SQD (test_verbs_objects.test_sqd_starts_no_new_message_after_
# earlier_traffic checks it directly); the model says so too.
SQD_STARTS_NEW_WRS = False


def ring(n: int) -> int:
    slots = 1
    while slots < n + 1:
        slots *= 2
    return slots - 1


class Entry:
    __slots__ = ("wr_id", "live", "flushed", "may_succeed", "started")

    def __init__(self, wr_id: int) -> None:
        self.wr_id = wr_id
        self.live = True  # still occupying the real queue (as far as the model knows)
        self.flushed = False  # a FLUSH_ERR completion is guaranteed
        self.may_succeed = False  # a SUCCESS completion may appear (UC/UD send started)
        self.started = False  # the data path may have started it (it was in RTS)


class QPModel:
    def __init__(self, qp: QP, qpt: int, scq: int, rcq: int, sq_cap: int, rq_cap: int) -> None:
        self.qp, self.qpt, self.scq, self.rcq = qp, qpt, scq, rcq
        self.state = RESET
        self.sq: list[Entry] = []
        self.rq: list[Entry] = []
        self.sq_cap, self.rq_cap = sq_cap, rq_cap
        self.alive = True

    def bounds(self, queue: list[Entry]) -> tuple[int, int]:
        """(fewest, most) WRs the real queue can hold now."""
        live = [e for e in queue if e.live]
        return len([e for e in live if not e.may_succeed]), len(live)

    def maybe_draining(self) -> bool:
        return any(e.live and e.started for e in self.sq)

    def enter(self, new: int) -> None:
        old, self.state = self.state, new
        if new == ERR:
            for e in self.sq + self.rq:
                if e.live:
                    e.live, e.flushed = False, True
        elif new == RESET:
            self.drop_outstanding()
        elif new == RTS and old != RTS:
            for e in self.sq:
                if e.live:
                    e.started = True
                    e.may_succeed = self.qpt in (UC, UD)

    def drop_outstanding(self) -> None:
        """RESET or destroy: outstanding WRs vanish without completions; completions already
        made stay in the CQ (rxe does not purge the CQ)."""
        for q in (self.sq, self.rq):
            keep = []
            for e in q:
                if e.live:
                    e.live = False
                    if e.may_succeed:  # it may have completed before the reset
                        keep.append(e)
                else:
                    keep.append(e)
            q[:] = keep


class QPMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = Context(name=DEV_NAME)
        self.pd = PD(self.ctx)
        self.cqs = [CQ(self.ctx, 4095), CQ(self.ctx, 4095)]
        self.ah = AH(self.pd, attr=loopback_av(self.ctx))
        self.models: list[QPModel] = []
        self.by_qpn: dict[int, QPModel] = {}
        self.wr_ids = itertools.count(1)
        self.where: dict[int, tuple[QPModel, str]] = {}

    def teardown(self) -> None:
        self.ctx.close()

    def live(self) -> list[QPModel]:
        return [m for m in self.models if m.alive]

    # -- create / destroy -----------------------------------------------------------------
    @precondition(lambda self: len(self.live()) < 6)
    @rule(qpt=st.sampled_from([RC, UC, UD]), scq=st.integers(0, 1), rcq=st.integers(0, 1),
          swr=st.sampled_from([1, 2, 3, 4]), rwr=st.sampled_from([1, 2, 3, 4]),
          start=st.sampled_from([RESET, INIT, RTR, RTS, RTS, SQD, ERR]))
    def create(self, qpt, scq, rcq, swr, rwr, start):
        ia = QPInitAttr(qp_type=qpt, scq=self.cqs[scq], rcq=self.cqs[rcq],
                        cap=QPCap(max_send_wr=swr, max_recv_wr=rwr), sq_sig_all=1)
        qp = QP(self.pd, ia)
        assert qp.qp_state == RESET and qp.qp_num >= 16 and qp.qp_num not in self.by_qpn
        m = QPModel(qp, qpt, scq, rcq, ring(swr), ring(rwr))
        cap = qp.query()[1].cap
        assert (cap.max_send_wr, cap.max_recv_wr) == (m.sq_cap, m.rq_cap)
        self.models.append(m)
        self.by_qpn[qp.qp_num] = m
        for nxt in PATHS[start]:  # bring it up through legal transitions, required only
            req, _ = TABLE[qpt][(m.state, nxt)]
            qp.modify(full_attr(self.ctx, nxt, m.state), sum(MASK_BITS[n] for n in req) | STATE)
            m.enter(nxt)
            assert qp.qp_state == nxt

    @precondition(lambda self: self.live())
    @rule(i=st.integers(0, 63))
    def destroy(self, i):
        m = self.live()[i % len(self.live())]
        m.qp.close()
        assert m.qp.closed
        m.alive = False
        m.drop_outstanding()

    @precondition(lambda self: self.live())
    @rule(which=st.sampled_from(["pd", "cq0", "cq1"]))
    def destroy_busy_resource(self, which):
        if which == "pd":
            res, busy = self.pd, True
        else:
            k = int(which[-1])
            res = self.cqs[k]
            busy = any(k in (m.scq, m.rcq) for m in self.live())
        if busy:
            try:
                res.close()
            except PyverbsRDMAError as e:
                assert e.error_code == errno.EBUSY
            else:
                raise AssertionError(f"{which} closed while in use")
            assert not res.closed

    # -- modify ---------------------------------------------------------------------------
    @precondition(lambda self: self.live())
    @rule(i=st.integers(0, 63), bias=st.integers(0, 9),
          mode=st.sampled_from(["legal", "legal", "legal", "missing", "extra", "random"]),
          with_state=st.sampled_from([True, True, True, True, False]), data=st.data())
    def modify(self, i, bias, mode, with_state, data):
        m = self.live()[i % len(self.live())]
        cur = m.state
        # mostly a state the table allows next (so QPs get to RTS, SQD, ERR), else any state
        nexts = sorted({b for (a, b) in TABLE[m.qpt] if a == cur and b != cur})
        to = data.draw(st.sampled_from(nexts) if bias < 7 and nexts else st.integers(0, 6))
        new = to if with_state else cur
        entry = TABLE[m.qpt].get((cur, new))
        req, opt = entry if entry else (frozenset(), frozenset())
        names = sorted(MASK_BITS)
        if mode == "random" or entry is None:
            chosen = set(data.draw(st.sets(st.sampled_from(names), max_size=6)))
        else:
            chosen = set(req) | set(data.draw(st.sets(st.sampled_from(sorted(opt) or ["STATE"]))))
            if mode == "missing" and req - {"STATE"}:
                chosen.discard(data.draw(st.sampled_from(sorted(req - {"STATE"}))))
            elif mode == "extra":
                chosen.add(data.draw(st.sampled_from(names)))
        chosen.discard("STATE")
        mask = sum(MASK_BITS[n] for n in chosen) | (STATE if with_state else 0)
        legal = entry is not None and req - {"STATE"} <= chosen and \
            chosen <= (req | opt) - {"STATE"}
        may_drain = legal and cur == SQD and with_state and new != ERR and m.maybe_draining()
        before = m.qp.query()[0]
        try:
            m.qp.modify(full_attr(self.ctx, new, cur), mask)
        except PyverbsRDMAError as e:
            assert e.error_code == errno.EINVAL, str(e)
            assert not legal or may_drain, f"legal {cur}->{new} mask {mask:#x} refused: {e}"
            if legal:
                assert "draining" in str(e)
                event("modify refused: SQ draining")
            else:
                event("modify refused (illegal)")
            assert m.qp.qp_state == cur and m.qp.query()[0] == before
            return
        assert legal, f"illegal {cur}->{new} mask {mask:#x} accepted"
        assert m.qp.qp_state == new
        event(f"modify ok -> {STATE_NAMES[new]}")
        m.enter(new)

    @precondition(lambda self: self.live())
    @rule(i=st.integers(0, 63), data=st.data())
    def step(self, i, data):
        """A legal transition to a next state (required + some optional attributes)."""
        m = self.live()[i % len(self.live())]
        nexts = sorted(b for (a, b) in TABLE[m.qpt] if a == m.state and b != m.state)
        to = data.draw(st.sampled_from(nexts))
        req, opt = TABLE[m.qpt][(m.state, to)]
        chosen = set(req) | set(data.draw(st.sets(st.sampled_from(sorted(opt) or ["STATE"]))))
        mask = sum(MASK_BITS[n] for n in chosen) | STATE
        try:
            m.qp.modify(full_attr(self.ctx, to, m.state), mask)
        except PyverbsRDMAError as e:
            ok = m.state == SQD and to != ERR and m.maybe_draining() and "draining" in str(e)
            assert ok and e.error_code == errno.EINVAL, str(e)
            assert m.qp.qp_state == m.state
            event("step refused: SQ draining")
            return
        m.enter(to)
        event(f"step -> {STATE_NAMES[to]}")

    # -- posting --------------------------------------------------------------------------
    def _send_wr(self, m, opcode):
        wr_id = next(self.wr_ids)
        wr = SendWR(wr_id=wr_id, opcode=opcode, send_flags=0)  # sq_sig_all=1 signals anyway
        if opcode != SEND:
            wr.set_wr_rdma(0x1234, 0x10000)
        if m.qpt == UD:
            wr.set_wr_ud(self.ah, NO_SUCH_QPN, 0x11111111)
        return wr

    @precondition(lambda self: self.live())
    @rule(i=st.integers(0, 63), ops=st.lists(st.sampled_from([SEND, SEND, WRITE, READ]),
                                             min_size=1, max_size=3))
    def post_send(self, i, ops):
        self._post_send(self.live()[i % len(self.live())], ops)

    def _post_send(self, m, ops):
        wrs = [self._send_wr(m, op) for op in ops]
        # predict WR by WR: EINVAL (state, opcode) before ENOMEM (full), as rxe validates
        fail_at, fail_code, maybe_full_from = None, None, None
        extra = 0
        for k, w in enumerate(wrs):
            lo, hi = m.bounds(m.sq)
            if m.state not in (RTS, SQD, ERR) or w.opcode not in OPS_ALLOWED[m.qpt]:
                fail_at, fail_code = k, errno.EINVAL
                break
            # (in ERR the queue is empty between posts: each post is flushed when it ends)
            if lo + extra >= m.sq_cap:
                fail_at, fail_code = k, errno.ENOMEM
                break
            if hi + extra >= m.sq_cap and maybe_full_from is None:
                maybe_full_from = k
            extra += 1
        try:
            m.qp.post_send(wrs)
            posted = len(wrs)
            assert fail_at is None, f"expected errno {fail_code} at WR {fail_at}"
        except PyverbsRDMAError as e:
            posted = e.bad_wr_index
            assert e.bad_wr is wrs[posted]
            if fail_at is not None and posted == fail_at:
                assert e.error_code == fail_code, str(e)
            else:  # only a full queue the model could not rule out
                assert e.error_code == errno.ENOMEM, str(e)
                assert maybe_full_from is not None and posted >= maybe_full_from, str(e)
                assert fail_at is None or posted < fail_at
        for w in wrs[:posted]:
            self._add(m, "sq", w.wr_id)
        event(f"post_send in {STATE_NAMES[m.state]}: " + ("ok" if posted == len(wrs) else "error"))

    @precondition(lambda self: any(m.state in (RTS, SQD) for m in self.live()))
    @rule(i=st.integers(0, 63), n=st.integers(2, 3))
    def burst_of_sends(self, i, n):
        """Several SENDs to a QP that accepts them (so ERR and RESET find WRs queued)."""
        ready = [m for m in self.live() if m.state in (RTS, SQD)]
        self._post_send(ready[i % len(ready)], [SEND] * n)

    @precondition(lambda self: self.live())
    @rule(i=st.integers(0, 63), n=st.integers(1, 3))
    def post_recv(self, i, n):
        m = self.live()[i % len(self.live())]
        wrs = [RecvWR(wr_id=next(self.wr_ids)) for _ in range(n)]
        lo, _ = m.bounds(m.rq)
        if m.state == RESET:
            expect_ok, code = 0, errno.EINVAL
        else:  # in ERR too: a post's WRs are flushed when the post ends, not one by one
            expect_ok = min(n, max(0, m.rq_cap - lo))
            code = errno.ENOMEM if expect_ok < n else None
        try:
            m.qp.post_recv(wrs)
            posted = n
        except PyverbsRDMAError as e:
            posted = e.bad_wr_index
            assert e.error_code == code, str(e)
        assert posted == expect_ok
        for w in wrs[:posted]:
            self._add(m, "rq", w.wr_id)

    def _add(self, m, q, wr_id):
        e = Entry(wr_id)
        if m.state == ERR:
            e.live, e.flushed = False, True
        elif q == "sq" and (m.state == RTS or (m.state == SQD and SQD_STARTS_NEW_WRS)):
            e.started = True
            e.may_succeed = m.qpt in (UC, UD)
        getattr(m, q).append(e)
        self.where[wr_id] = (m, q)

    # -- polling --------------------------------------------------------------------------
    @rule(k=st.integers(0, 1))
    def poll(self, k):
        for wc in self.cqs[k].poll_all():
            m, q = self.where[wc.wr_id]
            assert wc.qp_num == m.qp.qp_num
            assert (m.scq if q == "sq" else m.rcq) == k, "completion on the wrong CQ"
            queue = getattr(m, q)
            pos = next(i for i, e in enumerate(queue) if e.wr_id == wc.wr_id)
            for skipped in queue[:pos]:  # only WRs that vanished without completing
                assert not skipped.live and not skipped.flushed, \
                    f"completion for {wc.wr_id} before earlier WR {skipped.wr_id}"
            e = queue[pos]
            if wc.status == SUCCESS:
                assert e.may_succeed, f"unexpected success {wc}"
            else:
                assert wc.status == FLUSH and e.flushed, f"unexpected {wc}"
            event(f"completion {'SUCCESS' if wc.status == SUCCESS else 'FLUSH'} ({q})")
            del queue[:pos + 1]
        for m in self.models:  # every guaranteed completion was there
            for q, cq in (("sq", m.scq), ("rq", m.rcq)):
                if cq == k:
                    assert not [e.wr_id for e in getattr(m, q) if e.flushed], \
                        "a flushed WR produced no completion"

    @invariant()
    def states_and_queues_agree(self):
        for m in self.live():
            assert m.qp.qp_state == m.state
            assert m.qp.query()[0].qp_state == m.state
            lo, hi = m.bounds(m.sq)
            assert lo <= len(m.qp.sq) <= hi, (len(m.qp.sq), lo, hi)
            assert len(m.qp.rq) == m.bounds(m.rq)[1]


TestQPStateMachine = QPMachine.TestCase


def setup_module(module):
    add_device("127.0.0.11", name=DEV_NAME, live=False)  # stepped with progress()


def teardown_module(module):
    remove_device(DEV_NAME)


TestQPStateMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow,
                                                              HealthCheck.filter_too_much])
