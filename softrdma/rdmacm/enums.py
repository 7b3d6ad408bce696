"""librdmacm's names and values (rdma_cma.h): events, port spaces, address flags, options.

The values are the C ones, so numbers read from a C program, a log or a capture mean the
same here; ``event_str`` gives the names ``rdma_event_str`` prints.
"""

from __future__ import annotations

import enum

__all__ = [
    "rdma_cm_event_type", "rdma_port_space", "RdmaCmState", "event_str",
    "RDMA_PS_IPOIB", "RDMA_PS_TCP", "RDMA_PS_UDP", "RDMA_PS_IB",
    "RAI_PASSIVE", "RAI_NUMERICHOST", "RAI_NOROUTE", "RAI_FAMILY",
    "RDMA_OPTION_ID", "RDMA_OPTION_IB", "RDMA_OPTION_ID_TOS", "RDMA_OPTION_ID_REUSEADDR",
    "RDMA_OPTION_ID_AFONLY", "RDMA_OPTION_ID_ACK_TIMEOUT", "RDMA_MAX_RESP_RES",
    "RDMA_MAX_INIT_DEPTH", "RDMA_UDP_QKEY", "REQ_PRIVATE_DATA", "REP_PRIVATE_DATA",
    "REJ_PRIVATE_DATA", "SIDR_REQ_PRIVATE_DATA", "SIDR_REP_PRIVATE_DATA",
]


class rdma_cm_event_type(enum.IntEnum):
    """``enum rdma_cm_event_type``, same order and values."""

    RDMA_CM_EVENT_ADDR_RESOLVED = 0
    RDMA_CM_EVENT_ADDR_ERROR = 1
    RDMA_CM_EVENT_ROUTE_RESOLVED = 2
    RDMA_CM_EVENT_ROUTE_ERROR = 3
    RDMA_CM_EVENT_CONNECT_REQUEST = 4
    RDMA_CM_EVENT_CONNECT_RESPONSE = 5
    RDMA_CM_EVENT_CONNECT_ERROR = 6
    RDMA_CM_EVENT_UNREACHABLE = 7
    RDMA_CM_EVENT_REJECTED = 8
    RDMA_CM_EVENT_ESTABLISHED = 9
    RDMA_CM_EVENT_DISCONNECTED = 10
    RDMA_CM_EVENT_DEVICE_REMOVAL = 11
    RDMA_CM_EVENT_MULTICAST_JOIN = 12
    RDMA_CM_EVENT_MULTICAST_ERROR = 13
    RDMA_CM_EVENT_ADDR_CHANGE = 14
    RDMA_CM_EVENT_TIMEWAIT_EXIT = 15


globals().update(rdma_cm_event_type.__members__)
__all__ += list(rdma_cm_event_type.__members__)


class rdma_port_space(enum.IntEnum):
    """``enum rdma_port_space``: which transport a port number belongs to."""

    RDMA_PS_IPOIB = 0x0002
    RDMA_PS_TCP = 0x0106  # RC, connected with REQ/REP/RTU
    RDMA_PS_UDP = 0x0111  # UD, resolved with SIDR
    RDMA_PS_IB = 0x013F  # RC or UD, as the QP type says


RDMA_PS_IPOIB = rdma_port_space.RDMA_PS_IPOIB
RDMA_PS_TCP = rdma_port_space.RDMA_PS_TCP
RDMA_PS_UDP = rdma_port_space.RDMA_PS_UDP
RDMA_PS_IB = rdma_port_space.RDMA_PS_IB

RAI_PASSIVE = 0x1
RAI_NUMERICHOST = 0x2
RAI_NOROUTE = 0x4
RAI_FAMILY = 0x8

RDMA_OPTION_ID = 0
RDMA_OPTION_IB = 1
RDMA_OPTION_ID_TOS = 0
RDMA_OPTION_ID_REUSEADDR = 1
RDMA_OPTION_ID_AFONLY = 2
RDMA_OPTION_ID_ACK_TIMEOUT = 3

#: "use the default" in ConnParam's resources and depth
RDMA_MAX_RESP_RES = 0xFF
RDMA_MAX_INIT_DEPTH = 0xFF
#: ``rdma_cm_mc_join_flags``: a full member receives (its QP is attached); a send-only
#: full member only sends (librdmacm does not attach its QP)
RDMA_MC_JOIN_FLAG_FULLMEMBER = 0
RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER = 1

#: the Q_Key rdma_cm gives UD QPs (``RDMA_UDP_QKEY``, cma.c ``cma_set_qkey``)
RDMA_UDP_QKEY = 0x01234567

#: private data sizes the events report (cma.c): REQ user data after the 36-byte cma
#: header, REP, REJ, SIDR_REQ user data, SIDR_REP
REQ_PRIVATE_DATA = 56
REP_PRIVATE_DATA = 196
REJ_PRIVATE_DATA = 148
SIDR_REQ_PRIVATE_DATA = 180
SIDR_REP_PRIVATE_DATA = 136


class RdmaCmState(enum.IntEnum):
    """``enum rdma_cm_state`` (drivers/infiniband/core/cma_priv.h), same order."""

    IDLE = 0
    ADDR_QUERY = 1
    ADDR_RESOLVED = 2
    ROUTE_QUERY = 3
    ROUTE_RESOLVED = 4
    CONNECT = 5
    DISCONNECT = 6
    ADDR_BOUND = 7
    LISTEN = 8
    DEVICE_REMOVAL = 9
    DESTROYING = 10


def event_str(event: int) -> str:
    """``rdma_event_str``: the event's C name, or ``UNKNOWN EVENT``."""
    try:
        return rdma_cm_event_type(event).name
    except ValueError:
        return "UNKNOWN EVENT"
