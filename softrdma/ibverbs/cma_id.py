"""The C side of an rdma_cm id on librdmacm: :class:`RdmaCmId` (one ``struct rdma_cm_id``,
its addresses and the QP transitions rdma_cm prescribes), the sockaddr conversions, and the
verbs_api Context of the device librdmacm opened (:func:`context_of`)."""

from __future__ import annotations

import ctypes
import socket
import threading
from ctypes import byref, c_int
from ipaddress import IPv4Address, IPv6Address
from typing import Any

from ..rdmacm.enums import RDMA_MAX_INIT_DEPTH, RDMA_MAX_RESP_RES, RDMA_PS_UDP
from ..verbs_api.enums import ibv_qp_state as Q, ibv_qp_type as T
from . import cma_ffi as F, convert
from .context import HwContext

__all__ = ["RdmaCmId", "context_of", "sockaddr", "from_sockaddr", "ids_on"]

_UD_SPACES = (RDMA_PS_UDP,)
_lock = threading.Lock()
_ids: dict[int, "RdmaCmId"] = {}  # rdma_cm_id* -> its object: an event names the CMID's own
_contexts: dict[int, Any] = {}  # ibv_context* -> its Context: one per device, as librdmacm's


def context_of(verbs: int) -> Any:
    """The verbs_api Context of an ``ibv_context*`` librdmacm opened (made once)."""
    with _lock:
        ctx = _contexts.get(verbs)
        if ctx is None or ctx.closed:
            ctx = _contexts[verbs] = HwContext.adopt(verbs)
        return ctx


def ids_on(channel: Any) -> list["RdmaCmId"]:
    """The ids whose events go to ``channel``."""
    with _lock:
        return [rid for rid in _ids.values() if rid.channel is channel]


# ---- sockaddr <-> (ip, port) ----------------------------------------------------------------

def sockaddr(ip: Any, port: int) -> Any:
    """A ``sockaddr_in``/``sockaddr_in6`` for ``ip`` (None: the IPv4 wildcard)."""
    ip = IPv4Address(0) if ip is None else ip
    if isinstance(ip, IPv4Address):
        sa = F.sockaddr_in(sin_family=F.AF_INET, sin_port=socket.htons(port))
        sa.sin_addr.s_addr = int.from_bytes(ip.packed, "little")
        return sa
    sa6 = F.sockaddr_in6(sin6_family=F.AF_INET6, sin6_port=socket.htons(port))
    ctypes.memmove(ctypes.addressof(sa6.sin6_addr), ip.packed, 16)
    return sa6


def from_sockaddr(storage: Any) -> tuple[Any, int]:
    """``(ip_address or None, port)`` of a ``sockaddr_storage``."""
    fam = storage.ss_family
    base = ctypes.addressof(storage)
    if fam == F.AF_INET:
        sa = F.sockaddr_in.from_address(base)
        return IPv4Address(sa.sin_addr.s_addr.to_bytes(4, "little")), socket.ntohs(sa.sin_port)
    if fam == F.AF_INET6:
        sa6 = F.sockaddr_in6.from_address(base)
        return IPv6Address(bytes(sa6.sin6_addr)), socket.ntohs(sa6.sin6_port)
    return None, 0


# ---- the C id ---------------------------------------------------------------------------------

class RdmaCmId:
    """One ``struct rdma_cm_id``: its addresses, device, channel and the QP given to it.
    The same object for the CMID and for every event about the id."""

    def __init__(self, addr: int, channel: Any) -> None:
        self.addr = addr
        self.c = F.rdma_cm_id.from_address(addr)
        self.channel = channel
        self.qp: Any = None
        self.is_ud = self.c.ps in _UD_SPACES
        with _lock:
            _ids[addr] = self

    @staticmethod
    def of(addr: int | None, channel: Any) -> "RdmaCmId | None":
        """The object of ``addr``: the known one, or a new one (an id librdmacm made for a
        connection request)."""
        if not addr:
            return None
        with _lock:
            rid = _ids.get(addr)
        return rid if rid is not None else RdmaCmId(addr, channel)

    # -- addresses (the soft id's names) -------------------------------------------------
    @property
    def local_ip(self) -> Any:
        return from_sockaddr(self.c.route.addr.src_storage)[0]

    @property
    def src_port(self) -> int:
        return from_sockaddr(self.c.route.addr.src_storage)[1]

    @property
    def dst_ip(self) -> Any:
        return from_sockaddr(self.c.route.addr.dst_storage)[0]

    @property
    def dst_port(self) -> int:
        return from_sockaddr(self.c.route.addr.dst_storage)[1]

    @property
    def verbs(self) -> int:
        """The ``ibv_context*`` the id is bound to (0: none yet)."""
        return self.c.verbs or 0

    @property
    def packet_life_time(self) -> int | None:
        """The route's path record's packet lifetime (None without a path)."""
        if self.c.route.num_paths < 1 or not self.c.route.path_rec:
            return None
        return F.ibv_sa_path_rec.from_address(self.c.route.path_rec).packet_life_time

    # -- the QP's transitions (cma.c's ucma_modify_qp_*) ----------------------------------
    def init_qp_attr(self, state: int) -> tuple[Any, int]:
        """``rdma_init_qp_attr``: the attributes and mask for moving the QP to ``state``."""
        a, mask = F.ibv_qp_attr(qp_state=int(state)), c_int(0)
        F.call(f"Failed to get QP attributes for state {int(state)}", "rdma_init_qp_attr",
               self.addr, byref(a), byref(mask))
        return a, mask.value

    def modify_qp(self, state: int, **override: int) -> None:
        """Move the id's QP to ``state`` with rdma_cm's attributes (``override`` replaces
        some, as librdmacm does with the connection's resources)."""
        a, mask = self.init_qp_attr(state)
        for name, val in override.items():
            setattr(a, name, val)
        self.qp.modify(convert.qp_attr_from_c(a), mask)

    def to_rts(self, resp_res: int = RDMA_MAX_RESP_RES,
               init_depth: int = RDMA_MAX_INIT_DEPTH) -> None:
        """INIT (again: rdma_cm's values may have changed), RTR, RTS (``ucma_modify_qp_rtr``
        and ``_rts``; RDMA_MAX_* keeps the kernel's numbers)."""
        self.modify_qp(Q.IBV_QPS_INIT)
        rtr = {} if resp_res == RDMA_MAX_RESP_RES else {"max_dest_rd_atomic": resp_res}
        self.modify_qp(Q.IBV_QPS_RTR, **rtr)
        rts = {} if init_depth == RDMA_MAX_INIT_DEPTH else {"max_rd_atomic": init_depth}
        self.modify_qp(Q.IBV_QPS_RTS, **rts)

    def attach_qp(self, qp: Any) -> None:
        """The QP becomes the id's, in INIT (UD: up to RTS, ``ucma_init_ud_qp``)."""
        self.qp = qp
        try:
            self.modify_qp(Q.IBV_QPS_INIT)
            if qp.qp_type == T.IBV_QPT_UD:
                from ..verbs_api import QPAttr
                from ..verbs_api.enums import ibv_qp_attr_mask as M
                qp.modify(QPAttr(qp_state=Q.IBV_QPS_RTR), int(M.IBV_QP_STATE))
                qp.modify(QPAttr(qp_state=Q.IBV_QPS_RTS, sq_psn=0),
                          int(M.IBV_QP_STATE | M.IBV_QP_SQ_PSN))
        except BaseException:
            self.qp = None
            raise

    def migrate(self, channel: Any) -> None:
        F.call("Failed to migrate the id", "rdma_migrate_id", self.addr, channel.handle)
        self.channel = channel

    def destroy(self) -> None:
        with _lock:
            if _ids.pop(self.addr, None) is None:
                return
        F.need().rdma_destroy_id(self.addr)

    def __repr__(self) -> str:
        return f"<rdma_cm_id {self.local_ip}:{self.src_port} -> {self.dst_ip}:{self.dst_port}>"
