"""libibverbs enumerations, with the values of <infiniband/verbs.h>.

This module sits at the bottom of the package (it imports nothing from softrdma), so the
sans-IO core (:mod:`softrdma.qp`, :mod:`softrdma.soft`) can use the constants without
importing :mod:`softrdma.verbs_api`; users import them from :mod:`softrdma.verbs_api` (or
:mod:`softrdma.verbs_api.enums`), which re-exports this module.

Each enum is an IntEnum named as in pyverbs' ``pyverbs.libibverbs_enums`` (``ibv_qp_state``,
``ibv_wr_opcode``...), and every member is also exported at module level under its C name
(``IBV_QPS_RTS``, ``IBV_WR_SEND``...), so both spellings pyverbs users know work::

    from softrdma.verbs_api import IBV_QPS_RTS, ibv_qp_state
    assert IBV_QPS_RTS is ibv_qp_state.IBV_QPS_RTS
"""

from __future__ import annotations

import enum


class ibv_node_type(enum.IntEnum):
    IBV_NODE_UNKNOWN = -1
    IBV_NODE_CA = 1
    IBV_NODE_SWITCH = 2
    IBV_NODE_ROUTER = 3
    IBV_NODE_RNIC = 4


class ibv_transport_type(enum.IntEnum):
    IBV_TRANSPORT_UNKNOWN = -1
    IBV_TRANSPORT_IB = 0
    IBV_TRANSPORT_IWARP = 1


class ibv_qp_type(enum.IntEnum):
    IBV_QPT_RC = 2
    IBV_QPT_UC = 3
    IBV_QPT_UD = 4
    IBV_QPT_RAW_PACKET = 8
    IBV_QPT_XRC_SEND = 9
    IBV_QPT_XRC_RECV = 10


class ibv_qp_state(enum.IntEnum):
    IBV_QPS_RESET = 0
    IBV_QPS_INIT = 1
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_QPS_SQD = 4
    IBV_QPS_SQE = 5
    IBV_QPS_ERR = 6
    IBV_QPS_UNKNOWN = 7


class ibv_mig_state(enum.IntEnum):
    IBV_MIG_MIGRATED = 0
    IBV_MIG_REARM = 1
    IBV_MIG_ARMED = 2


class ibv_mtu(enum.IntEnum):
    IBV_MTU_256 = 1
    IBV_MTU_512 = 2
    IBV_MTU_1024 = 3
    IBV_MTU_2048 = 4
    IBV_MTU_4096 = 5


class ibv_port_state(enum.IntEnum):
    IBV_PORT_NOP = 0
    IBV_PORT_DOWN = 1
    IBV_PORT_INIT = 2
    IBV_PORT_ARMED = 3
    IBV_PORT_ACTIVE = 4
    IBV_PORT_ACTIVE_DEFER = 5


class ibv_link_layer(enum.IntEnum):
    IBV_LINK_LAYER_UNSPECIFIED = 0
    IBV_LINK_LAYER_INFINIBAND = 1
    IBV_LINK_LAYER_ETHERNET = 2


class ibv_gid_type(enum.IntEnum):
    IBV_GID_TYPE_IB = 0
    IBV_GID_TYPE_ROCE_V1 = 1
    IBV_GID_TYPE_ROCE_V2 = 2


class ibv_qp_attr_mask(enum.IntFlag):
    IBV_QP_STATE = 1 << 0
    IBV_QP_CUR_STATE = 1 << 1
    IBV_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2
    IBV_QP_ACCESS_FLAGS = 1 << 3
    IBV_QP_PKEY_INDEX = 1 << 4
    IBV_QP_PORT = 1 << 5
    IBV_QP_QKEY = 1 << 6
    IBV_QP_AV = 1 << 7
    IBV_QP_PATH_MTU = 1 << 8
    IBV_QP_TIMEOUT = 1 << 9
    IBV_QP_RETRY_CNT = 1 << 10
    IBV_QP_RNR_RETRY = 1 << 11
    IBV_QP_RQ_PSN = 1 << 12
    IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
    IBV_QP_ALT_PATH = 1 << 14
    IBV_QP_MIN_RNR_TIMER = 1 << 15
    IBV_QP_SQ_PSN = 1 << 16
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
    IBV_QP_PATH_MIG_STATE = 1 << 18
    IBV_QP_CAP = 1 << 19
    IBV_QP_DEST_QPN = 1 << 20
    IBV_QP_RATE_LIMIT = 1 << 25


class ibv_access_flags(enum.IntFlag):
    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 1 << 1
    IBV_ACCESS_REMOTE_READ = 1 << 2
    IBV_ACCESS_REMOTE_ATOMIC = 1 << 3
    IBV_ACCESS_MW_BIND = 1 << 4
    IBV_ACCESS_ZERO_BASED = 1 << 5
    IBV_ACCESS_ON_DEMAND = 1 << 6
    IBV_ACCESS_HUGETLB = 1 << 7
    IBV_ACCESS_FLUSH_GLOBAL = 1 << 8
    IBV_ACCESS_FLUSH_PERSISTENT = 1 << 9
    IBV_ACCESS_RELAXED_ORDERING = 1 << 20


class ibv_wr_opcode(enum.IntEnum):
    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_WRITE_WITH_IMM = 1
    IBV_WR_SEND = 2
    IBV_WR_SEND_WITH_IMM = 3
    IBV_WR_RDMA_READ = 4
    IBV_WR_ATOMIC_CMP_AND_SWP = 5
    IBV_WR_ATOMIC_FETCH_AND_ADD = 6
    IBV_WR_LOCAL_INV = 7
    IBV_WR_BIND_MW = 8
    IBV_WR_SEND_WITH_INV = 9
    IBV_WR_TSO = 10
    IBV_WR_DRIVER1 = 11
    IBV_WR_FLUSH = 14
    IBV_WR_ATOMIC_WRITE = 15


class ibv_send_flags(enum.IntFlag):
    IBV_SEND_FENCE = 1
    IBV_SEND_SIGNALED = 1 << 1
    IBV_SEND_SOLICITED = 1 << 2
    IBV_SEND_INLINE = 1 << 3
    IBV_SEND_IP_CSUM = 1 << 4


class ibv_wc_status(enum.IntEnum):
    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_LEN_ERR = 1
    IBV_WC_LOC_QP_OP_ERR = 2
    IBV_WC_LOC_EEC_OP_ERR = 3
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_MW_BIND_ERR = 6
    IBV_WC_BAD_RESP_ERR = 7
    IBV_WC_LOC_ACCESS_ERR = 8
    IBV_WC_REM_INV_REQ_ERR = 9
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_REM_OP_ERR = 11
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_RNR_RETRY_EXC_ERR = 13
    IBV_WC_LOC_RDD_VIOL_ERR = 14
    IBV_WC_REM_INV_RD_REQ_ERR = 15
    IBV_WC_REM_ABORT_ERR = 16
    IBV_WC_INV_EECN_ERR = 17
    IBV_WC_INV_EEC_STATE_ERR = 18
    IBV_WC_FATAL_ERR = 19
    IBV_WC_RESP_TIMEOUT_ERR = 20
    IBV_WC_GENERAL_ERR = 21


class ibv_wc_opcode(enum.IntEnum):
    IBV_WC_SEND = 0
    IBV_WC_RDMA_WRITE = 1
    IBV_WC_RDMA_READ = 2
    IBV_WC_COMP_SWAP = 3
    IBV_WC_FETCH_ADD = 4
    IBV_WC_BIND_MW = 5
    IBV_WC_LOCAL_INV = 6
    IBV_WC_TSO = 7
    IBV_WC_FLUSH = 8
    IBV_WC_ATOMIC_WRITE = 9
    IBV_WC_RECV = 1 << 7
    IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1


class ibv_wc_flags(enum.IntFlag):
    IBV_WC_GRH = 1 << 0
    IBV_WC_WITH_IMM = 1 << 1
    IBV_WC_IP_CSUM_OK = 1 << 2
    IBV_WC_WITH_INV = 1 << 3


class ibv_event_type(enum.IntEnum):
    IBV_EVENT_CQ_ERR = 0
    IBV_EVENT_QP_FATAL = 1
    IBV_EVENT_QP_REQ_ERR = 2
    IBV_EVENT_QP_ACCESS_ERR = 3
    IBV_EVENT_COMM_EST = 4
    IBV_EVENT_SQ_DRAINED = 5
    IBV_EVENT_PATH_MIG = 6
    IBV_EVENT_PATH_MIG_ERR = 7
    IBV_EVENT_DEVICE_FATAL = 8
    IBV_EVENT_PORT_ACTIVE = 9
    IBV_EVENT_PORT_ERR = 10
    IBV_EVENT_LID_CHANGE = 11
    IBV_EVENT_PKEY_CHANGE = 12
    IBV_EVENT_SM_CHANGE = 13
    IBV_EVENT_SRQ_ERR = 14
    IBV_EVENT_SRQ_LIMIT_REACHED = 15
    IBV_EVENT_QP_LAST_WQE_REACHED = 16
    IBV_EVENT_CLIENT_REREGISTER = 17
    IBV_EVENT_GID_CHANGE = 18
    IBV_EVENT_WQ_FATAL = 19


class ibv_mw_type(enum.IntEnum):
    IBV_MW_TYPE_1 = 1
    IBV_MW_TYPE_2 = 2


class ibv_srq_attr_mask(enum.IntFlag):
    IBV_SRQ_MAX_WR = 1 << 0
    IBV_SRQ_LIMIT = 1 << 1


class ibv_atomic_cap(enum.IntEnum):
    IBV_ATOMIC_NONE = 0
    IBV_ATOMIC_HCA = 1
    IBV_ATOMIC_GLOB = 2


class ibv_placement_type(enum.IntFlag):
    """FLUSH placement types (IBTA 1.5 A19, the FETH's PLT field): global visibility, or
    persistence. Bits, as libibverbs defines them."""

    IBV_FLUSH_GLOBAL = 1 << 0
    IBV_FLUSH_PERSISTENT = 1 << 1


class ibv_selectivity_level(enum.IntEnum):
    """FLUSH selectivity level (the FETH's SEL field): the RETH's range, or the whole
    memory region its rkey names."""

    IBV_FLUSH_RANGE = 0
    IBV_FLUSH_MR = 1


class ibv_qp_create_send_ops_flags(enum.IntFlag):
    """The operations an extended QP may post (``send_ops_flags`` of ibv_create_qp_ex)."""

    IBV_QP_EX_WITH_RDMA_WRITE = 1 << 0
    IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM = 1 << 1
    IBV_QP_EX_WITH_SEND = 1 << 2
    IBV_QP_EX_WITH_SEND_WITH_IMM = 1 << 3
    IBV_QP_EX_WITH_RDMA_READ = 1 << 4
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP = 1 << 5
    IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD = 1 << 6
    IBV_QP_EX_WITH_LOCAL_INV = 1 << 7
    IBV_QP_EX_WITH_BIND_MW = 1 << 8
    IBV_QP_EX_WITH_SEND_WITH_INV = 1 << 9
    IBV_QP_EX_WITH_TSO = 1 << 10
    IBV_QP_EX_WITH_FLUSH = 1 << 11
    IBV_QP_EX_WITH_ATOMIC_WRITE = 1 << 12


class ibv_device_cap_flags_ex(enum.IntFlag):
    """The bits of ``device_cap_flags_ex`` above the 32 of ``device_cap_flags``
    (IB_UVERBS_DEVICE_* in ib_user_verbs.h) that rxe sets since Linux 6.2."""

    IBV_DEVICE_FLUSH_GLOBAL = 1 << 38
    IBV_DEVICE_FLUSH_PERSISTENT = 1 << 39
    IBV_DEVICE_ATOMIC_WRITE = 1 << 40


ALL_ENUMS = [ibv_node_type, ibv_transport_type, ibv_qp_type, ibv_qp_state, ibv_mig_state,
             ibv_mtu, ibv_port_state, ibv_link_layer, ibv_gid_type, ibv_qp_attr_mask,
             ibv_access_flags, ibv_wr_opcode, ibv_send_flags, ibv_wc_status, ibv_wc_opcode,
             ibv_wc_flags, ibv_event_type, ibv_mw_type, ibv_srq_attr_mask, ibv_atomic_cap,
             ibv_placement_type, ibv_selectivity_level, ibv_qp_create_send_ops_flags,
             ibv_device_cap_flags_ex]

__all__ = [e.__name__ for e in ALL_ENUMS] + ["mtu_to_bytes", "bytes_to_mtu", "wc_status_str",
                                             "qp_state_str", "event_type_str"]
for _e in ALL_ENUMS:
    for _m in _e:
        globals()[_m.name] = _m
        __all__.append(_m.name)


def mtu_to_bytes(mtu: int) -> int:
    """IBV_MTU_1024 -> 1024."""
    return 128 << int(mtu)


def bytes_to_mtu(n: int) -> ibv_mtu:
    """The largest IBV_MTU_* not above ``n`` bytes (at least IBV_MTU_256)."""
    for m in reversed(ibv_mtu):
        if mtu_to_bytes(m) <= n:
            return m
    return ibv_mtu.IBV_MTU_256


_WC_STATUS_STR = {
    0: "success", 1: "local length error", 2: "local QP operation error",
    3: "local EE context operation error", 4: "local protection error",
    5: "Work Request Flushed Error", 6: "memory management operation error",
    7: "bad response error", 8: "local access error", 9: "remote invalid request error",
    10: "remote access error", 11: "remote operation error",
    12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
    14: "local RDD violation error", 15: "remote invalid RD request",
    16: "aborted error", 17: "invalid EE context number", 18: "invalid EE context state",
    19: "fatal error", 20: "response timeout error", 21: "general error",
}


def wc_status_str(status: int) -> str:
    """Like ibv_wc_status_str()."""
    return _WC_STATUS_STR.get(int(status), "unknown")


def qp_state_str(state: int) -> str:
    return ibv_qp_state(state).name.removeprefix("IBV_QPS_")


def event_type_str(event: int) -> str:
    return ibv_event_type(event).name.removeprefix("IBV_EVENT_").replace("_", " ").lower()
