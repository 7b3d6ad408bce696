"""Shared helpers for the verbs tests: an independent transcription of the QP transition
table, and small builders for QPs driven through legal transitions.

The table below is transcribed by hand from the RDMA Aware Networks Programming User
Manual's table "Legal transitions with required / optional attr_mask" (Mellanox/NVIDIA,
section "ibv_modify_qp"), NOT from softrdma.qp.transitions. Where the kernel's
ib_modify_qp_is_ok() (drivers/infiniband/core/verbs.c, qp_state_table) differs from the
manual, the difference is applied explicitly in :func:`_apply_kernel_differences`:

1. RC SQE->RTS: the kernel's table has a valid SQE->RTS entry for RC with no optional
   attributes (the manual has no SQE row for RC, since RC never enters SQE). Harmless.
2. RESET->ERR: the manual says "* -> ERR", but the kernel's RESET row only has RESET and
   INIT, so rxe answers EINVAL to RESET->ERR.
"""

from __future__ import annotations

from softrdma.verbs_api import (
    AHAttr, CQ, GlobalRoute, PD, QP, QPAttr, QPCap, QPInitAttr,
)

RESET, INIT, RTR, RTS, SQD, SQE, ERR = range(7)  # enum ibv_qp_state values (seed §2.2)
STATE_NAMES = ["RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"]
RC, UC, UD = 2, 3, 4  # enum ibv_qp_type values
TYPE_NAMES = {RC: "RC", UC: "UC", UD: "UD"}

# IBV_QP_* bit values as listed in seed §2.3 (hidden bits 21-24 excluded).
MASK_BITS = {
    "STATE": 1 << 0, "CUR_STATE": 1 << 1, "EN_SQD_ASYNC_NOTIFY": 1 << 2,
    "ACCESS_FLAGS": 1 << 3, "PKEY_INDEX": 1 << 4, "PORT": 1 << 5, "QKEY": 1 << 6,
    "AV": 1 << 7, "PATH_MTU": 1 << 8, "TIMEOUT": 1 << 9, "RETRY_CNT": 1 << 10,
    "RNR_RETRY": 1 << 11, "RQ_PSN": 1 << 12, "MAX_QP_RD_ATOMIC": 1 << 13,
    "ALT_PATH": 1 << 14, "MIN_RNR_TIMER": 1 << 15, "SQ_PSN": 1 << 16,
    "MAX_DEST_RD_ATOMIC": 1 << 17, "PATH_MIG_STATE": 1 << 18, "CAP": 1 << 19,
    "DEST_QPN": 1 << 20, "RATE_LIMIT": 1 << 25,
}


def _row(req: str, opt: str) -> tuple[frozenset[str], frozenset[str]]:
    split = lambda s: frozenset(x.strip() for x in s.split(",") if x.strip() not in ("", "-"))  # noqa: E731
    return split(req), split(opt)


# (from, to) -> (required, optional), written as in the seed tables ("-" = none).
_SEED_UD = {
    (RESET, INIT): _row("STATE, PKEY_INDEX, PORT, QKEY", "-"),
    (INIT, INIT): _row("-", "PKEY_INDEX, PORT, QKEY"),
    (INIT, RTR): _row("STATE", "PKEY_INDEX, QKEY"),
    (RTR, RTS): _row("STATE, SQ_PSN", "CUR_STATE, QKEY"),
    (RTS, RTS): _row("-", "CUR_STATE, QKEY"),
    (RTS, SQD): _row("STATE", "EN_SQD_ASYNC_NOTIFY"),
    (SQD, RTS): _row("STATE", "CUR_STATE, QKEY"),
    (SQD, SQD): _row("-", "PKEY_INDEX, QKEY"),
    (SQE, RTS): _row("STATE", "CUR_STATE, QKEY"),
}
_SEED_UC = {
    (RESET, INIT): _row("STATE, PKEY_INDEX, PORT, ACCESS_FLAGS", "-"),
    (INIT, INIT): _row("-", "PKEY_INDEX, PORT, ACCESS_FLAGS"),
    (INIT, RTR): _row("STATE, PATH_MTU, AV, DEST_QPN, RQ_PSN", "PKEY_INDEX, ALT_PATH, ACCESS_FLAGS"),
    (RTR, RTS): _row("STATE, SQ_PSN", "CUR_STATE, ACCESS_FLAGS, ALT_PATH, PATH_MIG_STATE"),
    (RTS, RTS): _row("-", "CUR_STATE, ACCESS_FLAGS, ALT_PATH, PATH_MIG_STATE"),
    (RTS, SQD): _row("STATE", "EN_SQD_ASYNC_NOTIFY"),
    (SQD, RTS): _row("STATE", "CUR_STATE, ACCESS_FLAGS, ALT_PATH, PATH_MIG_STATE"),
    (SQD, SQD): _row("-", "PKEY_INDEX, ACCESS_FLAGS, AV, ALT_PATH, PATH_MIG_STATE"),
    (SQE, RTS): _row("STATE", "CUR_STATE, ACCESS_FLAGS"),
}
_SEED_RC = {
    (RESET, INIT): _row("STATE, PKEY_INDEX, PORT, ACCESS_FLAGS", "-"),
    (INIT, INIT): _row("-", "PKEY_INDEX, PORT, ACCESS_FLAGS"),
    (INIT, RTR): _row("STATE, AV, PATH_MTU, DEST_QPN, RQ_PSN, MAX_DEST_RD_ATOMIC, MIN_RNR_TIMER",
                      "PKEY_INDEX, ACCESS_FLAGS, ALT_PATH"),
    (RTR, RTS): _row("STATE, SQ_PSN, TIMEOUT, RETRY_CNT, RNR_RETRY, MAX_QP_RD_ATOMIC",
                     "CUR_STATE, ACCESS_FLAGS, MIN_RNR_TIMER, ALT_PATH, PATH_MIG_STATE"),
    (RTS, RTS): _row("-", "CUR_STATE, ACCESS_FLAGS, MIN_RNR_TIMER, ALT_PATH, PATH_MIG_STATE"),
    (RTS, SQD): _row("STATE", "EN_SQD_ASYNC_NOTIFY"),
    (SQD, RTS): _row("STATE", "CUR_STATE, ACCESS_FLAGS, MIN_RNR_TIMER, ALT_PATH, PATH_MIG_STATE"),
    (SQD, SQD): _row("-", "PKEY_INDEX, PORT, ACCESS_FLAGS, AV, MAX_QP_RD_ATOMIC, MIN_RNR_TIMER, "
                          "ALT_PATH, TIMEOUT, RETRY_CNT, RNR_RETRY, MAX_DEST_RD_ATOMIC, "
                          "PATH_MIG_STATE"),
}


def _apply_kernel_differences() -> dict[int, dict[tuple[int, int], tuple[frozenset, frozenset]]]:
    table = {}
    for qpt, seed in ((UD, _SEED_UD), (UC, _SEED_UC), (RC, _SEED_RC)):
        t = dict(seed)
        for s in range(7):  # "*->RESET, *->ERR: STATE required, nothing optional"
            t[(s, RESET)] = _row("STATE", "-")
            t[(s, ERR)] = _row("STATE", "-")
        table[qpt] = t
    # Kernel difference 1: RC SQE->RTS is in the kernel table, no optional attributes.
    table[RC][(SQE, RTS)] = _row("STATE", "-")
    # Kernel difference 2: no RESET->ERR entry in the kernel table.
    for qpt in table:
        del table[qpt][(RESET, ERR)]
    return table


#: qp_type -> {(from, to): (required names, optional names)}; names without "IBV_QP_".
TABLE = _apply_kernel_differences()


def bits(names) -> int:
    m = 0
    for n in names:
        m |= MASK_BITS[n]
    return m


def loopback_av(ctx, sgid_index: int = 1) -> AHAttr:
    return AHAttr(is_global=1, port_num=1,
                  gr=GlobalRoute(dgid=ctx.query_gid(1, 1), sgid_index=sgid_index))


NO_SUCH_QPN = 0xFFFFF0  # never allocated in the tests (QPNs count up from 16)


def full_attr(ctx, target: int, cur: int) -> QPAttr:
    """A QPAttr with a valid value for every attribute, targeting ``target``."""
    a = QPAttr(qp_state=target, cur_qp_state=cur)
    a.pkey_index = 0
    a.port_num = 1
    a.qkey = 0x11111111
    a.qp_access_flags = 0x7  # LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
    a.ah_attr = loopback_av(ctx)
    a.alt_ah_attr = loopback_av(ctx)
    a.alt_port_num = 1
    a.alt_timeout = 14
    a.path_mtu = 3  # IBV_MTU_1024
    a.dest_qp_num = NO_SUCH_QPN
    a.rq_psn = 0x123456
    a.sq_psn = 0x654321
    a.max_dest_rd_atomic = 1
    a.max_rd_atomic = 1
    a.min_rnr_timer = 12
    a.timeout = 14
    a.retry_cnt = 7
    a.rnr_retry = 7
    a.path_mig_state = 0  # IBV_MIG_MIGRATED
    a.en_sqd_async_notify = 1
    return a


# The path each reachable state is reached by, from RESET, with required masks only.
PATHS = {RESET: [], INIT: [INIT], RTR: [INIT, RTR], RTS: [INIT, RTR, RTS],
         SQD: [INIT, RTR, RTS, SQD], ERR: [INIT, ERR]}


def drive(ctx, qp, target: int) -> None:
    """Move a fresh (RESET) QP to ``target`` through legal transitions."""
    cur = RESET
    for nxt in PATHS[target]:
        req, _ = TABLE[int(qp.qp_type)][(cur, nxt)]
        qp.modify(full_attr(ctx, nxt, cur), bits(req) | MASK_BITS["STATE"])
        cur = nxt
    assert qp.qp_state == target


class Env:
    """One context, PD and CQ shared by many QPs."""

    def __init__(self, ctx, cqe: int = 4096) -> None:
        self.ctx = ctx
        self.pd = PD(ctx)
        self.cq = CQ(ctx, cqe, None, None, 0)

    def qp(self, qpt: int, *, cap: QPCap | None = None, sq_sig_all: int = 1, srq=None,
           scq=None, rcq=None, pd=None) -> QP:
        ia = QPInitAttr(qp_type=qpt, scq=self.cq if scq is None else scq,
                        rcq=self.cq if rcq is None else rcq, srq=srq,
                        cap=cap or QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=2,
                                         max_recv_sge=2),
                        sq_sig_all=sq_sig_all)
        return QP(pd or self.pd, ia)

    def close(self) -> None:
        self.cq.close()
        self.pd.close()
