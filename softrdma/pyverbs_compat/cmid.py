"""The ``pyverbs.cmid`` module shim: what ``import pyverbs.cmid`` gives a pyverbs program
on softrdma (CMEventChannel, CMEvent, CMID, AddrInfo, ConnParam, UDParam, JoinMCAttrEx).

It is softrdma's own pyverbs-shaped rdma_cm API (:mod:`softrdma.rdmacm.cmid`):
``CMEventChannel``, ``CMEvent``, ``ConnParam`` and ``UDParam`` are those classes
themselves; ``CMID`` and ``AddrInfo`` subclass them for what pyverbs adds:

* the id's PD, the MRs of ``reg_msgs``/``reg_read``/``reg_write``, the QP and CQs of
  ``create_qp`` are pyverbs_compat's (``mr.write``/``mr.read``, cascade close...), and
  ``MR(cmid, length, access)`` registers through the id as pyverbs does
  (``rdma_reg_msgs``/``_read``/``_write`` by the access flag);
* ``join_multicast``/``leave_multicast`` with pyverbs' signatures (an AddrInfo or a
  JoinMCAttrEx): the RoCEv2 join of softrdma's rdma_cm (RDMA_CM_EVENT_MULTICAST_JOIN, the
  QP attached to the group).
"""

from __future__ import annotations

import errno
import types
from typing import Any

from ..errors import PyverbsRDMAError, PyverbsUserError
from ..rdmacm import cmid as _c
from ..rdmacm.enums import RAI_PASSIVE, RDMA_PS_TCP
from .base import PyverbsRDMAErrno  # noqa: F401

__all__ = ["CMEventChannel", "CMEvent", "CMID", "AddrInfo", "ConnParam", "UDParam",
           "JoinMCAttrEx", "PyverbsRDMAErrno"]


CMEventChannel = _c.CMEventChannel
CMEvent = _c.CMEvent
ConnParam = _c.ConnParam
UDParam = _c.UDParam


class AddrInfo(_c.AddrInfo):
    """pyverbs' ``AddrInfo``: a source address alone (no ``dst``, no ``RAI_PASSIVE``) is
    accepted, as pyverbs resolves it with ``RAI_PASSIVE`` first (rdmacm_utils' multicast
    addresses are made so). Made with no address (rdma-core 62 on: ``AddrInfo()`` then
    ``get_addrinfo(...)``), it resolves nothing until ``get_addrinfo`` is called."""

    def __init__(self, src: Any = None, dst: Any = None, src_service: Any = None,
                 dst_service: Any = None, port_space: int = 0, flags: int = 0) -> None:
        self.src = self.dst = None
        self.src_port = self.dst_port = 0
        self.port_space, self.flags = port_space or RDMA_PS_TCP, flags
        if src or dst or src_service or dst_service:  # as pyverbs: nothing given, no lookup
            self.get_addrinfo(src, dst, src_service, dst_service, port_space, flags)

    def get_addrinfo(self, src: Any = None, dst: Any = None, src_service: Any = None,
                     dst_service: Any = None, port_space: int = 0, flags: int = 0) -> None:
        """``rdma_getaddrinfo`` into this object (pyverbs' ``AddrInfo.get_addrinfo``)."""
        src_only = dst is None and src is not None and not flags & RAI_PASSIVE
        super().__init__(src, dst, src_service, dst_service, port_space,
                         flags | (RAI_PASSIVE if src_only else 0))
        self.flags = flags


class JoinMCAttrEx:
    """``rdma_cm_join_mc_attr_ex``: ``addr`` (an AddrInfo), ``comp_mask``, ``join_flags``."""

    def __init__(self, addr: AddrInfo, comp_mask: int = 0, join_flags: int = 0) -> None:
        if not isinstance(addr, _c.AddrInfo):
            raise TypeError("JoinMCAttrEx: addr must be an AddrInfo")
        self.addr = addr
        self.comp_mask = comp_mask
        self.join_flags = join_flags


def _compat_verbs() -> types.SimpleNamespace:
    from .cq import CQ, CompChannel
    from .mr import MR
    from .pd import PD
    from .qp import QP
    return types.SimpleNamespace(PD=PD, MR=MR, QP=QP, CQ=CQ, CompChannel=CompChannel)


class CMID(_c.CMID):
    """``pyverbs.cmid.CMID(creator=None, qp_init_attr=None, pd=None,
    port_space=RDMA_PS_TCP, listen_id=None)``, creator a CMEventChannel, an AddrInfo or a
    CMEvent: softrdma's :class:`softrdma.rdmacm.cmid.CMID` whose PD, MRs, QP and CQs are
    pyverbs objects, with ECE and multicast."""

    @staticmethod
    def _verbs() -> Any:
        return _compat_verbs()

    def __init__(self, creator: Any = None, qp_init_attr: Any = None, pd: Any = None,
                 port_space: int = RDMA_PS_TCP, listen_id: Any = None) -> None:
        super().__init__(creator, qp_init_attr, pd, port_space, listen_id)

    def set_local_ece(self, ece: Any) -> None:
        """``rdma_set_local_ece``: the ECE the REQ/REP would carry (kept; softrdma's
        QPs have no ECE options to offer, as librxe, whose ``query_ece`` is EOPNOTSUPP)."""
        self._check()
        self._local_ece = ece

    def get_remote_ece(self) -> Any:
        """``rdma_get_remote_ece``: what the peer offered, none here (vendor_id 0)."""
        from .qp import ECE
        self._check()
        return ECE(vendor_id=0, options=0, comp_mask=0)

    def resolve_addrinfo(self, node: Any = None, service: Any = None, port_space: int = 0,
                         flags: int = 0) -> None:
        """``rdma_resolve_addrinfo`` (rdma-core 62): librdmacm resolves, then posts
        ``RDMA_CM_EVENT_ADDRINFO_RESOLVED`` through the kernel's ``WRITE_CM_EVENT`` ucma
        command, which Linux gained in 2026: 6.1's and 6.12's ucma refuse the unknown
        command (EINVAL), so on rxe the call fails; it fails so here."""
        self._check()
        raise PyverbsRDMAError("Failed to Resolve AddrInfo", errno.EINVAL)

    def query_addrinfo(self) -> AddrInfo:
        """``rdma_query_addrinfo``: nothing was resolved (above), ENOENT as librdmacm."""
        self._check()
        raise PyverbsRDMAError("Failed to Query AddrInfo", errno.ENOENT)

    def join_multicast(self, addr: AddrInfo | None = None,
                       mc_attr: JoinMCAttrEx | None = None, context: Any = None) -> None:
        """pyverbs' ``join_multicast``: ``rdma_join_multicast`` with an AddrInfo whose
        source is the group, or ``rdma_join_multicast_ex`` with a JoinMCAttrEx (its
        join flags). RDMA_CM_EVENT_MULTICAST_JOIN follows on the channel
        (:meth:`softrdma.rdmacm.cm_id.RdmaCmId.join_multicast`)."""
        if addr is None and mc_attr is None:
            raise PyverbsUserError("Join to multicast must have AddrInfo or JoinMCAttrEx "
                                   "arguments")
        flags = 0
        if mc_attr is not None:
            addr = mc_attr.addr
            if mc_attr.comp_mask & ~(_JOIN_ADDRESS | _JOIN_FLAGS) or \
                    not mc_attr.comp_mask & _JOIN_ADDRESS:
                raise PyverbsRDMAError("Failed to Join multicast: comp_mask must name the "
                                       "address (and no unknown bit)", errno.EINVAL)
            if mc_attr.comp_mask & _JOIN_FLAGS:
                flags = mc_attr.join_flags
        if not isinstance(addr, _c.AddrInfo):
            raise PyverbsUserError("join_multicast: addr must be an AddrInfo")
        super().join_multicast(addr, context, flags)

    def leave_multicast(self, addr: AddrInfo) -> None:
        """pyverbs' ``leave_multicast`` (``rdma_leave_multicast``)."""
        if not isinstance(addr, _c.AddrInfo):
            raise PyverbsUserError("leave_multicast: addr must be an AddrInfo")
        super().leave_multicast(addr)


_JOIN_ADDRESS, _JOIN_FLAGS = 1, 2  # RDMA_CM_JOIN_MC_ATTR_ADDRESS, _JOIN_FLAGS
