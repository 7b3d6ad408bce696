"""Which QP state transitions are legal, with which attributes: the kernel's
``ib_modify_qp_is_ok()`` table (drivers/infiniband/core/verbs.c), restated as data.

For each (current state, next state) the table gives, per QP type, the attributes that are
*required* and those that are *optional*; any other attribute in the mask makes the
modify fail with EINVAL. Every state may go to RESET, and every state but RESET to ERR,
with only IBV_QP_STATE (the kernel's table has no RESET->ERR entry).
Without IBV_QP_STATE in the mask the QP stays in its state (e.g. RTS->RTS to change
min_rnr_timer).
"""

from __future__ import annotations

import errno

from ..errors import PyverbsRDMAError
from ..enums import ibv_qp_attr_mask as M, ibv_qp_state as S, ibv_qp_type as T

__all__ = ["TRANSITIONS", "check_transition", "mask_names", "STANDARD_MASK"]

RC, UC, UD = T.IBV_QPT_RC, T.IBV_QPT_UC, T.IBV_QPT_UD

_ALL = (RC, UC, UD)


def _same(bits: int) -> dict[T, int]:
    return {t: bits for t in _ALL}


# (cur, next) -> (required per type, optional per type)
TRANSITIONS: dict[tuple[S, S], tuple[dict[T, int], dict[T, int]]] = {
    (S.IBV_QPS_RESET, S.IBV_QPS_INIT): (
        {UD: M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_QKEY,
         UC: M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS,
         RC: M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS},
        _same(0)),
    (S.IBV_QPS_INIT, S.IBV_QPS_INIT): (
        _same(0),
        {UD: M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_QKEY,
         UC: M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS,
         RC: M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS}),
    (S.IBV_QPS_INIT, S.IBV_QPS_RTR): (
        {UD: 0,
         UC: M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN,
         RC: M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
             | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER},
        {UD: M.IBV_QP_PKEY_INDEX | M.IBV_QP_QKEY,
         UC: M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_PKEY_INDEX,
         RC: M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_PKEY_INDEX}),
    (S.IBV_QPS_RTR, S.IBV_QPS_RTS): (
        {UD: M.IBV_QP_SQ_PSN,
         UC: M.IBV_QP_SQ_PSN,
         RC: M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY | M.IBV_QP_SQ_PSN
             | M.IBV_QP_MAX_QP_RD_ATOMIC},
        {UD: M.IBV_QP_CUR_STATE | M.IBV_QP_QKEY,
         UC: M.IBV_QP_CUR_STATE | M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS
             | M.IBV_QP_PATH_MIG_STATE,
         RC: M.IBV_QP_CUR_STATE | M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS
             | M.IBV_QP_MIN_RNR_TIMER | M.IBV_QP_PATH_MIG_STATE}),
    (S.IBV_QPS_RTS, S.IBV_QPS_RTS): (
        _same(0),
        {UD: M.IBV_QP_CUR_STATE | M.IBV_QP_QKEY,
         UC: M.IBV_QP_CUR_STATE | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_ALT_PATH
             | M.IBV_QP_PATH_MIG_STATE,
         RC: M.IBV_QP_CUR_STATE | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_ALT_PATH
             | M.IBV_QP_PATH_MIG_STATE | M.IBV_QP_MIN_RNR_TIMER}),
    (S.IBV_QPS_RTS, S.IBV_QPS_SQD): (
        _same(0),
        _same(M.IBV_QP_EN_SQD_ASYNC_NOTIFY)),
    (S.IBV_QPS_SQD, S.IBV_QPS_RTS): (
        _same(0),
        {UD: M.IBV_QP_CUR_STATE | M.IBV_QP_QKEY,
         UC: M.IBV_QP_CUR_STATE | M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS
             | M.IBV_QP_PATH_MIG_STATE,
         RC: M.IBV_QP_CUR_STATE | M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS
             | M.IBV_QP_MIN_RNR_TIMER | M.IBV_QP_PATH_MIG_STATE}),
    (S.IBV_QPS_SQD, S.IBV_QPS_SQD): (
        _same(0),
        {UD: M.IBV_QP_PKEY_INDEX | M.IBV_QP_QKEY,
         UC: M.IBV_QP_AV | M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_PKEY_INDEX
             | M.IBV_QP_PATH_MIG_STATE,
         RC: M.IBV_QP_PORT | M.IBV_QP_AV | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT
             | M.IBV_QP_RNR_RETRY | M.IBV_QP_MAX_QP_RD_ATOMIC | M.IBV_QP_MAX_DEST_RD_ATOMIC
             | M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_PKEY_INDEX
             | M.IBV_QP_MIN_RNR_TIMER | M.IBV_QP_PATH_MIG_STATE}),
    (S.IBV_QPS_SQE, S.IBV_QPS_RTS): (
        _same(0),
        {UD: M.IBV_QP_CUR_STATE | M.IBV_QP_QKEY,
         UC: M.IBV_QP_CUR_STATE | M.IBV_QP_ACCESS_FLAGS,
         RC: 0}),
}
_REAL_STATES = [s for s in S if s != S.IBV_QPS_UNKNOWN]
for _s in _REAL_STATES:
    TRANSITIONS[(_s, S.IBV_QPS_RESET)] = (_same(0), _same(0))
    # Every state but RESET may go to ERR: the kernel's table has no RESET->ERR entry, so
    # ibv_modify_qp(RESET->ERR) fails with EINVAL on rxe (a QP must be INIT first).
    if _s != S.IBV_QPS_RESET:
        TRANSITIONS[(_s, S.IBV_QPS_ERR)] = (_same(0), _same(0))

#: bits ibv_modify_qp knows; anything else is EOPNOTSUPP like the kernel's uverbs. A plain
#: int: ``~`` of an IntFlag only complements the defined bits, so ``mask & ~STANDARD_MASK``
#: would miss 1 << 26 and above.
STANDARD_MASK = 0
for _m in M:
    STANDARD_MASK |= int(_m)


def required_mask(cur: int, new: int, qp_type: int) -> int:
    """The attribute mask a move from ``cur`` to ``new`` needs on ``qp_type``, IBV_QP_STATE
    included: what pyverbs' ``to_init``/``to_rtr``/``to_rts`` pass."""
    return int(TRANSITIONS[(S(cur), S(new))][0][T(qp_type)]) | int(M.IBV_QP_STATE)


def mask_names(mask: int) -> str:
    """``IBV_QP_AV|IBV_QP_PATH_MTU`` for a mask value."""
    names = [m.name for m in M if mask & m]
    rest = mask & ~STANDARD_MASK
    if rest:
        names.append(f"0x{rest:x}")
    return "|".join(names) or "0"


def _st(s: int) -> str:
    return S(s).name.removeprefix("IBV_QPS_")


def check_transition(cur: int, new: int, qp_type: int, mask: int) -> None:
    """Raise PyverbsRDMAError(EINVAL) naming the problem unless ``ib_modify_qp_is_ok``.

    ``cur`` is the current state (or attr.cur_qp_state if IBV_QP_CUR_STATE is in the mask),
    ``new`` the target state (``cur`` when IBV_QP_STATE is not in the mask).
    """
    if mask & ~STANDARD_MASK:
        raise PyverbsRDMAError(f"Failed to modify QP: unknown attribute mask bits "
                               f"0x{mask & ~STANDARD_MASK:x}", errno.EOPNOTSUPP)
    tname = T(qp_type).name.removeprefix("IBV_QPT_")
    if cur not in S.__members__.values() or new not in S.__members__.values() or \
            cur == S.IBV_QPS_UNKNOWN or new == S.IBV_QPS_UNKNOWN:
        raise PyverbsRDMAError(f"Failed to modify QP: invalid QP state {new if cur in S.__members__.values() else cur}",
                               errno.EINVAL)
    if mask & M.IBV_QP_CUR_STATE and cur not in (S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD,
                                                  S.IBV_QPS_SQE):
        raise PyverbsRDMAError(f"Failed to modify QP: IBV_QP_CUR_STATE is not allowed when "
                               f"the QP is in {_st(cur)}", errno.EINVAL)
    entry = TRANSITIONS.get((S(cur), S(new)))
    if entry is None:
        raise PyverbsRDMAError(f"Failed to modify QP: {_st(cur)}->{_st(new)} is not a legal "
                               f"transition", errno.EINVAL)
    req, opt = entry[0][T(qp_type)], entry[1][T(qp_type)]
    missing = req & ~mask
    if missing:
        raise PyverbsRDMAError(f"Failed to modify QP: {mask_names(missing)} is required for "
                               f"{_st(cur)}->{_st(new)} on {tname}", errno.EINVAL)
    extra = mask & ~(req | opt | M.IBV_QP_STATE)
    if extra:
        raise PyverbsRDMAError(f"Failed to modify QP: {mask_names(extra)} is not allowed for "
                               f"{_st(cur)}->{_st(new)} on {tname}", errno.EINVAL)
