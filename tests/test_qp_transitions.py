"""The QP state machine, table-driven: every (from state, to state, QP type, mask).

The expected table is tests/verbs_helpers.TABLE, transcribed from the seed inventory §2.3
(with the two kernel differences spelled out there), never from softrdma's own table. Real
QPs are driven into each reachable state; SQE, which the API cannot reach (a QP enters it
only when an unreliable send fails in the data path), is tested at the level of
softrdma.qp.transitions.check_transition.
"""

from __future__ import annotations

import errno
import itertools

import pytest

from softrdma.errors import PyverbsRDMAError
from softrdma.qp.transitions import check_transition
from softrdma.verbs_api import (
    AHAttr, Context, GlobalRoute, QPCap, add_device, ibv_qp_attr_mask, remove_device,
)

from .verbs_helpers import (
    ERR, INIT, MASK_BITS, RC, RESET, RTR, RTS, SQD, SQE, STATE_NAMES, TABLE, TYPE_NAMES, UC, UD,
    Env, bits, drive, full_attr, loopback_av,
)

TYPES = [RC, UC, UD]
ALL_STATES = range(7)
REACHABLE = [RESET, INIT, RTR, RTS, SQD, ERR]
STATE = MASK_BITS["STATE"]

# attribute field each mask bit sets, to check a successful modify applied it
FIELD_OF = {"PKEY_INDEX": "pkey_index", "PORT": "port_num", "QKEY": "qkey",
            "ACCESS_FLAGS": "qp_access_flags", "PATH_MTU": "path_mtu", "TIMEOUT": "timeout",
            "RETRY_CNT": "retry_cnt", "RNR_RETRY": "rnr_retry", "RQ_PSN": "rq_psn",
            "SQ_PSN": "sq_psn", "MAX_QP_RD_ATOMIC": "max_rd_atomic",
            "MAX_DEST_RD_ATOMIC": "max_dest_rd_atomic", "MIN_RNR_TIMER": "min_rnr_timer",
            "PATH_MIG_STATE": "path_mig_state", "DEST_QPN": "dest_qp_num",
            "EN_SQD_ASYNC_NOTIFY": "en_sqd_async_notify"}


@pytest.fixture(scope="module")
def env():
    with Context() as ctx:
        e = Env(ctx)
        yield e
        e.close()


def test_mask_bit_values_match_the_seed():
    """The enum values the API exports are the ones the seed lists (verbs.h)."""
    for name, value in MASK_BITS.items():
        assert int(getattr(ibv_qp_attr_mask, "IBV_QP_" + name)) == value


def _legal_cases(qpt):
    return sorted(TABLE[qpt].items())


def _snapshot(qp):
    attr, init = qp.query()
    return qp.qp_state, attr, init.cap, init.qp_type, init.sq_sig_all


def _expect_fail(env, qp, frm, to, mask, *, names=(), contains=()):
    before = _snapshot(qp)
    with pytest.raises(PyverbsRDMAError) as ei:
        qp.modify(full_attr(env.ctx, to, frm), mask)
    e = ei.value
    assert e.error_code == errno.EINVAL, (STATE_NAMES[frm], STATE_NAMES[to], hex(mask), str(e))
    for n in names:
        assert f"IBV_QP_{n}" in str(e), (n, str(e))
    for c in contains:
        assert c in str(e), (c, str(e))
    assert _snapshot(qp) == before, "a failed modify changed the QP"


def _expect_ok(env, frm, to, qpt, mask_names, *, with_state=True):
    qp = env.qp(qpt)
    try:
        drive(env.ctx, qp, frm)
        mask = bits(mask_names) | (STATE if with_state else 0)
        attr = full_attr(env.ctx, to, frm)
        qp.modify(attr, mask)
        assert qp.qp_state == to
        got, _ = qp.query()
        assert got.qp_state == to
        if to not in (RESET, ERR):
            for n in mask_names:
                if n in FIELD_OF:
                    assert getattr(got, FIELD_OF[n]) == getattr(attr, FIELD_OF[n]), n
                if n == "AV":
                    assert got.ah_attr.gr.dgid == attr.ah_attr.gr.dgid
                    assert got.ah_attr.is_global == 1
                if n == "ALT_PATH":
                    assert got.alt_ah_attr.gr.dgid == attr.alt_ah_attr.gr.dgid
    finally:
        qp.close()


def _reachable_legal():
    for qpt in TYPES:
        for (frm, to), (req, opt) in _legal_cases(qpt):
            if frm != SQE and to != SQE:
                yield pytest.param(qpt, frm, to, req, opt,
                                   id=f"{TYPE_NAMES[qpt]}-{STATE_NAMES[frm]}-{STATE_NAMES[to]}")


@pytest.mark.parametrize("qpt,frm,to,req,opt", list(_reachable_legal()))
def test_legal_transition_on_real_qps(env, qpt, frm, to, req, opt):
    req_wo_state = req - {"STATE"}
    # required only; required + each optional; required + all optional
    _expect_ok(env, frm, to, qpt, req_wo_state)
    for o in sorted(opt):
        _expect_ok(env, frm, to, qpt, req_wo_state | {o})
    _expect_ok(env, frm, to, qpt, req_wo_state | opt)
    if frm == to:  # a same-state modify is also legal without IBV_QP_STATE
        _expect_ok(env, frm, to, qpt, req_wo_state | opt, with_state=False)

    qp = env.qp(qpt)
    try:
        drive(env.ctx, qp, frm)
        full = bits(req_wo_state | opt)
        # each required attribute removed -> EINVAL naming it
        for r in sorted(req_wo_state):
            _expect_fail(env, qp, frm, to, STATE | (full & ~MASK_BITS[r]), names=[r])
        # each forbidden bit added -> EINVAL naming it
        allowed = req | opt | {"STATE"}
        for f in sorted(set(MASK_BITS) - allowed):
            _expect_fail(env, qp, frm, to, STATE | bits(req_wo_state) | MASK_BITS[f], names=[f])
    finally:
        qp.close()


def _illegal_pairs():
    for qpt in TYPES:
        for frm in REACHABLE:
            for to in ALL_STATES:
                if (frm, to) not in TABLE[qpt]:
                    yield pytest.param(qpt, frm, to,
                                       id=f"{TYPE_NAMES[qpt]}-{STATE_NAMES[frm]}-{STATE_NAMES[to]}")


@pytest.mark.parametrize("qpt,frm,to", list(_illegal_pairs()))
def test_illegal_transition_on_real_qps(env, qpt, frm, to):
    qp = env.qp(qpt)
    try:
        drive(env.ctx, qp, frm)
        # with STATE only, and with every attribute a transition into ``to`` could need
        union = set()
        for (a, b), (req, opt) in TABLE[qpt].items():
            if b == to:
                union |= (req | opt) - {"STATE", "CUR_STATE"}
        for mask in (STATE, STATE | bits(union)):
            _expect_fail(env, qp, frm, to, mask,
                         contains=[f"{STATE_NAMES[frm]}->{STATE_NAMES[to]}"])
    finally:
        qp.close()


@pytest.mark.parametrize("frm", [INIT, RTR, RTS, SQD, ERR])
@pytest.mark.parametrize("qpt", TYPES)
def test_same_state_without_state_bit(env, qpt, frm):
    """Without IBV_QP_STATE the QP stays put: legal only where the table has X->X."""
    qp = env.qp(qpt)
    try:
        drive(env.ctx, qp, frm)
        if (frm, frm) in TABLE[qpt]:
            qp.modify(full_attr(env.ctx, frm, frm), 0)
            assert qp.qp_state == frm
        else:  # e.g. RTR->RTR is not in the table
            _expect_fail(env, qp, frm, frm, 0)
    finally:
        qp.close()


def test_reset_to_err_is_rejected_as_the_kernel_does(env):
    qp = env.qp(RC)
    try:
        _expect_fail(env, qp, RESET, ERR, STATE, contains=["RESET->ERR"])
    finally:
        qp.close()


# -- SQE (and every row) at the check_transition level ---------------------------------

def _check_ok(cur, new, qpt, mask):
    check_transition(cur, new, qpt, mask)  # must not raise


def _check_fail(cur, new, qpt, mask, names=()):
    with pytest.raises(PyverbsRDMAError) as ei:
        check_transition(cur, new, qpt, mask)
    assert ei.value.error_code == errno.EINVAL
    for n in names:
        assert f"IBV_QP_{n}" in str(ei.value)


@pytest.mark.parametrize("qpt", TYPES)
def test_check_transition_full_matrix(qpt):
    """Every (from, to) of all seven states, SQE included, with every mask variation."""
    for frm, to in itertools.product(ALL_STATES, ALL_STATES):
        entry = TABLE[qpt].get((frm, to))
        if entry is None:
            _check_fail(frm, to, qpt, STATE)
            _check_fail(frm, to, qpt, STATE | bits(set(MASK_BITS) - {"CAP", "RATE_LIMIT"}))
            continue
        req, opt = entry
        rq = bits(req) | STATE
        _check_ok(frm, to, qpt, rq)
        for o in opt:
            _check_ok(frm, to, qpt, rq | MASK_BITS[o])
        _check_ok(frm, to, qpt, rq | bits(opt))
        for r in req - {"STATE"}:
            _check_fail(frm, to, qpt, (rq | bits(opt)) & ~MASK_BITS[r], names=[r])
        for f in set(MASK_BITS) - req - opt - {"STATE"}:
            _check_fail(frm, to, qpt, rq | MASK_BITS[f], names=[f])


def test_sqe_rows_explicitly():
    # SQE->RTS: UD may carry QKEY, UC ACCESS_FLAGS, RC nothing (kernel difference 1)
    _check_ok(SQE, RTS, UD, STATE | MASK_BITS["QKEY"] | MASK_BITS["CUR_STATE"])
    _check_ok(SQE, RTS, UC, STATE | MASK_BITS["ACCESS_FLAGS"] | MASK_BITS["CUR_STATE"])
    _check_ok(SQE, RTS, RC, STATE)
    _check_fail(SQE, RTS, RC, STATE | MASK_BITS["ACCESS_FLAGS"], names=["ACCESS_FLAGS"])
    _check_fail(SQE, RTS, UD, STATE | MASK_BITS["ACCESS_FLAGS"], names=["ACCESS_FLAGS"])
    for qpt in TYPES:
        _check_ok(SQE, RESET, qpt, STATE)
        _check_ok(SQE, ERR, qpt, STATE)
        for to in (INIT, RTR, SQD, SQE):
            _check_fail(SQE, to, qpt, STATE)


def test_unknown_mask_bits_are_rejected():
    with pytest.raises(PyverbsRDMAError) as ei:
        check_transition(RESET, INIT, RC, STATE | bits(["PKEY_INDEX", "PORT", "ACCESS_FLAGS"])
                         | (1 << 21))
    assert ei.value.error_code in (errno.EINVAL, errno.EOPNOTSUPP)


# -- attribute values rxe checks ---------------------------------------------------------

def _qp_in(env, qpt, state):
    qp = env.qp(qpt)
    drive(env.ctx, qp, state)
    return qp


def _modify_fails(env, qp, frm, to, mask_names, field_name, **values):
    attr = full_attr(env.ctx, to, frm)
    for k, v in values.items():
        setattr(attr, k, v)
    before = _snapshot(qp)
    with pytest.raises(PyverbsRDMAError) as ei:
        qp.modify(attr, bits(mask_names) | STATE)
    assert ei.value.error_code == errno.EINVAL
    assert field_name in str(ei.value), str(ei.value)
    assert _snapshot(qp) == before


def _modify_ok(env, qp, frm, to, mask_names, **values):
    attr = full_attr(env.ctx, to, frm)
    for k, v in values.items():
        setattr(attr, k, v)
    qp.modify(attr, bits(mask_names) | STATE)
    return qp.query()[0]


RC_RTR = TABLE[RC][(INIT, RTR)][0] - {"STATE"}
RC_RTS = TABLE[RC][(RTR, RTS)][0] - {"STATE"}
RC_INIT = TABLE[RC][(RESET, INIT)][0] - {"STATE"}


@pytest.mark.parametrize("mtu", [0, 6, 7, -1])
def test_path_mtu_out_of_range(env, mtu):
    qp = _qp_in(env, RC, INIT)
    _modify_fails(env, qp, INIT, RTR, RC_RTR, "path_mtu", path_mtu=mtu)
    qp.close()


@pytest.mark.parametrize("mtu", [1, 2, 3, 4, 5])
def test_path_mtu_in_range(env, mtu):
    qp = _qp_in(env, RC, INIT)
    assert _modify_ok(env, qp, INIT, RTR, RC_RTR, path_mtu=mtu).path_mtu == mtu
    qp.close()


@pytest.mark.parametrize("field,bad,good", [("timeout", 32, 31), ("retry_cnt", 8, 7),
                                            ("rnr_retry", 8, 7), ("max_rd_atomic", 129, 128)])
def test_rts_attribute_limits(env, field, bad, good):
    qp = _qp_in(env, RC, RTR)
    _modify_fails(env, qp, RTR, RTS, RC_RTS, field, **{field: bad})
    assert getattr(_modify_ok(env, qp, RTR, RTS, RC_RTS, **{field: good}), field) == good
    qp.close()


@pytest.mark.parametrize("field,bad,good", [("min_rnr_timer", 32, 31),
                                            ("max_dest_rd_atomic", 129, 128)])
def test_rtr_attribute_limits(env, field, bad, good):
    qp = _qp_in(env, RC, INIT)
    _modify_fails(env, qp, INIT, RTR, RC_RTR, field, **{field: bad})
    assert getattr(_modify_ok(env, qp, INIT, RTR, RC_RTR, **{field: good}), field) == good
    qp.close()


@pytest.mark.parametrize("given,expected", [(0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (17, 32),
                                            (100, 128), (128, 128)])
def test_rd_atomic_rounded_up_to_power_of_two(env, given, expected):
    qp = _qp_in(env, RC, INIT)
    assert _modify_ok(env, qp, INIT, RTR, RC_RTR, max_dest_rd_atomic=given).max_dest_rd_atomic \
        == expected
    assert _modify_ok(env, qp, RTR, RTS, RC_RTS, max_rd_atomic=given).max_rd_atomic == expected
    qp.close()


def test_port_and_pkey_index(env):
    qp = env.qp(RC)
    _modify_fails(env, qp, RESET, INIT, RC_INIT, "port_num", port_num=2)
    _modify_fails(env, qp, RESET, INIT, RC_INIT, "port_num", port_num=0)
    _modify_fails(env, qp, RESET, INIT, RC_INIT, "pkey_index", pkey_index=64)
    assert _modify_ok(env, qp, RESET, INIT, RC_INIT, pkey_index=63).pkey_index == 63
    qp.close()


def test_av_needs_a_grh_and_a_valid_sgid_index(env):
    ctx = env.ctx
    qp = _qp_in(env, RC, INIT)
    _modify_fails(env, qp, INIT, RTR, RC_RTR, "GRH", ah_attr=AHAttr(port_num=1))
    _modify_fails(env, qp, INIT, RTR, RC_RTR, "GRH",
                  ah_attr=AHAttr(is_global=0, port_num=1,
                                 gr=GlobalRoute(dgid=ctx.query_gid(1, 1), sgid_index=1)))
    ngids = len(ctx.query_gid_table())
    for idx in (ngids, ngids + 5, 1023):
        _modify_fails(env, qp, INIT, RTR, RC_RTR, "sgid_index", ah_attr=loopback_av(ctx, idx))
    _modify_fails(env, qp, INIT, RTR, RC_RTR, "port_num",
                  ah_attr=AHAttr(is_global=1, port_num=2,
                                 gr=GlobalRoute(dgid=ctx.query_gid(1, 1), sgid_index=1)))
    # the alternate path is checked the same way
    qp.close()
    qp = _qp_in(env, RC, INIT)
    attr = full_attr(ctx, RTR, INIT)
    attr.alt_ah_attr = AHAttr(port_num=1)
    with pytest.raises(PyverbsRDMAError) as ei:
        qp.modify(attr, bits(RC_RTR | {"ALT_PATH"}) | STATE)
    assert ei.value.error_code == errno.EINVAL and qp.qp_state == INIT
    qp.close()


def test_reset_clears_attributes(env):
    fresh = env.qp(RC)
    blank, _ = fresh.query()
    qp = _qp_in(env, RC, RTS)
    used, _ = qp.query()
    assert used.dest_qp_num != blank.dest_qp_num and used.timeout != blank.timeout
    qp.modify(full_attr(env.ctx, RESET, RTS), STATE)
    cleared, _ = qp.query()
    assert cleared == blank
    # and the QP can be brought up again
    drive(env.ctx, qp, RTS)
    qp.close()
    fresh.close()


def test_cur_qp_state_must_be_allowed_and_consistent(env):
    qp = _qp_in(env, RC, RTS)
    attr = full_attr(env.ctx, RTS, RTS)
    attr.cur_qp_state = RTS
    qp.modify(attr, STATE | MASK_BITS["CUR_STATE"] | MASK_BITS["MIN_RNR_TIMER"])
    qp.close()
    qp = _qp_in(env, RC, INIT)
    # CUR_STATE is not allowed from INIT (ib_modify_qp_is_ok), even if it is correct
    _expect_fail(env, qp, INIT, INIT, STATE | MASK_BITS["CUR_STATE"], names=["CUR_STATE"])
    qp.close()


def test_qpn_allocation_starts_at_16_and_is_unique():
    """rxe's order, which softrdma keeps in sequential mode (replays pin QPNs with it); the
    default, random QPNs, is tested in tests/test_security.py."""
    dev = add_device("127.0.0.9", name="softrdma-qpn-test")
    dev.sequential_qpn = True
    try:
        with Context(name="softrdma-qpn-test") as ctx:
            e = Env(ctx)
            qps = [e.qp(t) for t in (RC, UC, UD, RC)]
            nums = [q.qp_num for q in qps]
            assert nums[0] == 16  # 0 (SMI) and 1 (GSI) and 2..15 are reserved, as in rxe
            assert len(set(nums)) == len(nums) and min(nums) >= 16
            qps[1].close()
            more = [e.qp(RC) for _ in range(20)]
            live = [q.qp_num for q in qps if not q.closed] + [q.qp_num for q in more]
            assert len(set(live)) == len(live) and min(live) >= 16
            assert all(0 < n < (1 << 24) for n in live)
        assert dev.contexts == 0
    finally:
        remove_device("softrdma-qpn-test")


def _ring(n):  # rxe_queue_init: slots = roundup_pow_of_two(n + 1), usable = slots - 1
    slots = 1
    while slots < n + 1:
        slots *= 2
    return slots - 1


@pytest.mark.parametrize("send_wr,recv_wr,send_sge,inline", [
    (128, 128, 1, 0), (1, 1, 1, 0), (100, 3, 4, 0), (255, 256, 1, 100), (16, 16, 2, 400),
    (0x4000, 0x4000, 32, 64)])
def test_cap_rounding_like_rxe(env, send_wr, recv_wr, send_sge, inline):
    cap = QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=send_sge,
                max_recv_sge=1, max_inline_data=inline)
    qp = env.qp(RC, cap=cap)
    got = qp.query()[1].cap
    wqe = max(send_sge * 16, inline)  # sizeof(struct ib_sge) == 16
    assert got.max_send_wr == _ring(send_wr)
    assert got.max_recv_wr == _ring(recv_wr)
    assert got.max_inline_data == wqe
    assert got.max_send_sge == wqe // 16
    assert got.max_recv_sge == 1
    qp.close()


def test_cap_128_reports_255(env):
    qp = env.qp(RC, cap=QPCap(max_send_wr=128, max_recv_wr=128))
    assert (qp.query()[1].cap.max_send_wr, qp.query()[1].cap.max_recv_wr) == (255, 255)
    qp.close()


@pytest.mark.parametrize("field,value", [("max_send_wr", 0x4001), ("max_recv_wr", 0x4001),
                                         ("max_send_sge", 33), ("max_recv_sge", 33),
                                         ("max_inline_data", 401)])
def test_cap_above_device_limits(env, field, value):
    lim = env.ctx.query_device()
    assert {"max_send_wr": lim.max_qp_wr, "max_recv_wr": lim.max_qp_wr,
            "max_send_sge": lim.max_sge, "max_recv_sge": lim.max_sge,
            "max_inline_data": 400}[field] == value - 1
    cap = QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    setattr(cap, field, value)
    n_children = len(env.ctx.children)
    with pytest.raises(PyverbsRDMAError) as ei:
        env.qp(RC, cap=cap)
    assert ei.value.error_code == errno.EINVAL and field in str(ei.value)
    assert len(env.ctx.children) == n_children  # nothing half-made left behind


def test_sqd_while_draining_only_leaves_to_err(env):
    """rxe_qp_chk_attr: while the send queue drains, SQD may only go to ERR."""
    from softrdma.verbs_api import SendWR
    qp = _qp_in(env, RC, RTS)
    qp.post_send(SendWR(wr_id=1))  # an RC SEND goes out and waits for an ACK (no peer)
    qp.modify(full_attr(env.ctx, SQD, RTS), STATE)
    assert qp.query()[0].sq_draining == 1
    for to in (RTS, SQD, RESET):
        _expect_fail(env, qp, SQD, to, STATE, contains=["draining"])
    qp.modify(full_attr(env.ctx, SQD, SQD), MASK_BITS["TIMEOUT"])  # no STATE: allowed
    qp.modify(full_attr(env.ctx, ERR, SQD), STATE)
    assert [(w.wr_id, w.status) for w in env.cq.poll_all()] == [(1, 5)]  # WR_FLUSH_ERR
    qp.close()
