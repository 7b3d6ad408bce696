"""softrdma.cm: the wire format of IB connection management over RoCEv2 (sans-IO).

The foundation the CM state machine and rdma_cm build on, stateless like
:mod:`softrdma.wire` (and importing nothing above it): the 256-byte MAD and its common
header with the TID rules (:mod:`.mad`), every CM message described once with parse and
build derived from the descriptions (:mod:`.messages`), what rdma_cm adds, the service
ID's port space and the cma header in REQ private data (:mod:`.cma`), QP1 framing
(:mod:`.qp1`), and the dissector's CM decoding (:mod:`.dissect`). docs/cm.md describes the
wire format message by message. On top of it, :mod:`.state` is the CM's connection state
machine (:class:`~softrdma.cm.state.CmAgent`), sans-IO as well.
"""

from .cma import (
    CMA_HDR_SIZE, CmaError, CmaHeader, PortSpace, cma_private_data, format_service_id,
    gid_from_ip, ip_from_gid, service_id, split_cma_private_data, split_service_id,
)
from .mad import (
    MAD_SIZE, AttrId, MadError, MadHeader, Method, build_mad, cm_mad_header, new_tid,
    parse_mad, tid_comm_id,
)
from .messages import (
    DREP, DREQ, MESSAGES, MRA, REJ, REP, REQ, RTU, SIDR_REP, SIDR_REQ, CMMessage, MessageType,
    MsgResponse, RejectReason, SidrStatus, TransportType, build_cm, parse_cm,
)
from .qp1 import GSI_QKEY, QP1_QPN, QP1_UDP_SPORT, build_qp1, qp1_drop_reason
from .state import CmAgent, CmEvent, CmEventType, IbCmId, CmState, CmStateError

__all__ = [
    "CMA_HDR_SIZE", "CmaError", "CmaHeader", "PortSpace", "cma_private_data",
    "format_service_id", "gid_from_ip", "ip_from_gid", "service_id", "split_cma_private_data",
    "split_service_id",
    "MAD_SIZE", "AttrId", "MadError", "MadHeader", "Method", "build_mad", "cm_mad_header",
    "new_tid", "parse_mad", "tid_comm_id",
    "DREP", "DREQ", "MESSAGES", "MRA", "REJ", "REP", "REQ", "RTU", "SIDR_REP", "SIDR_REQ",
    "CMMessage", "MessageType", "MsgResponse", "RejectReason", "SidrStatus", "TransportType",
    "build_cm", "parse_cm",
    "GSI_QKEY", "QP1_QPN", "QP1_UDP_SPORT", "build_qp1", "qp1_drop_reason",
    "CmAgent", "CmEvent", "CmEventType", "IbCmId", "CmState", "CmStateError",
]
