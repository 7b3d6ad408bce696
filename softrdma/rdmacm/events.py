"""What rdma_cm calls take and its events carry: ``struct rdma_conn_param``,
``struct rdma_ud_param`` and ``struct rdma_cm_event``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .enums import rdma_cm_event_type as E

if TYPE_CHECKING:  # the id module imports this one
    from .cm_id import RdmaCmId

__all__ = ["ConnParams", "UdParams", "RdmaCmEvent"]


@dataclass
class ConnParams:
    """``struct rdma_conn_param``: what a connect/accept asks for, what an event reports."""

    private_data: bytes = b""
    responder_resources: int = 0
    initiator_depth: int = 0
    flow_control: int = 0
    retry_count: int = 0
    rnr_retry_count: int = 0
    srq: int = 0
    qp_num: int = 0


@dataclass
class UdParams:
    """``struct rdma_ud_param``: a resolved UD service (ESTABLISHED on a UD id)."""

    private_data: bytes = b""
    ah_attr: Any = None
    qp_num: int = 0
    qkey: int = 0
    context: Any = None  # a multicast join's: the context given to rdma_join_multicast


@dataclass
class RdmaCmEvent:
    """``struct rdma_cm_event``: ``event``, ``id``, ``listen_id``, ``status`` and the
    connection (``conn``) or UD (``ud``) parameters."""

    event: E
    id: "RdmaCmId"
    listen_id: "RdmaCmId | None" = None
    status: int = 0
    conn: ConnParams | None = None
    ud: UdParams | None = None

    @property
    def private_data(self) -> bytes:
        p = self.ud if self.ud is not None else self.conn
        return p.private_data if p is not None else b""

    def __repr__(self) -> str:
        return f"RdmaCmEvent({self.event.name}, status={self.status}, id={self.id!r})"
