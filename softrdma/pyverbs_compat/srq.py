"""pyverbs.srq: SRQ, SrqAttr, SrqInitAttr, SrqInitAttrEx (basic SRQs; XRC and tag-matching
SRQs are EOPNOTSUPP, as librxe answers ibv_create_srq_ex)."""

from __future__ import annotations

import errno
import sys as _sys
from typing import Any

from ..errors import PyverbsRDMAError
from ..verbs_api.attr import SrqAttr as _SrqAttr, SrqInitAttr as _SrqInitAttr
from ..verbs_api.srq import SRQ as _SRQ
from . import unsupported
from ._close import CascadeClose

__all__ = ["SRQ", "SrqAttr", "SrqInitAttr", "SrqInitAttrEx"]

IBV_SRQ_INIT_ATTR_TYPE, IBV_SRQ_INIT_ATTR_PD = 1, 2
IBV_SRQT_BASIC = 0


class SrqAttr(_SrqAttr):
    def __init__(self, max_wr: int = 100, max_sge: int = 1, srq_limit: int = 0) -> None:
        super().__init__(max_wr=max_wr, max_sge=max_sge, srq_limit=srq_limit)


class SrqInitAttr(_SrqInitAttr):
    def __init__(self, attr: Any = None) -> None:
        super().__init__(attr=attr if attr is not None else SrqAttr())


class SrqInitAttrEx:
    def __init__(self, max_wr: int = 100, max_sge: int = 1, srq_limit: int = 0) -> None:
        self.attr = SrqAttr(max_wr, max_sge, srq_limit)
        self.comp_mask = 0
        self.srq_type = IBV_SRQT_BASIC
        self.pd = None
        self.xrcd = None
        self.cq = None
        self.tm = None
        self.max_num_tags = 0
        self.max_ops = 0


class SRQ(CascadeClose, _SRQ):
    def __init__(self, creator: Any, attr: Any) -> None:
        if isinstance(attr, SrqInitAttrEx):
            # ibv_create_srq_ex: a basic SRQ with at most a PD falls back to ibv_create_srq;
            # anything else needs the provider's create_srq_ex, which librxe lacks
            if attr.comp_mask & ~(IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD) or \
                    attr.srq_type != IBV_SRQT_BASIC:
                raise PyverbsRDMAError("Failed to create SRQ", errno.EOPNOTSUPP)
            pd = attr.pd if attr.pd is not None else creator
            init = _SrqInitAttr(attr=attr.attr)
        else:
            pd, init = creator, attr
        try:
            super().__init__(pd, init)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to create SRQ", e.error_code) from None

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        try:
            super().post_recv(wr, bad_wr)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to post receive to SRQ.", e.error_code) from None

    def modify(self, attr: Any, comp_mask: int) -> None:
        try:
            super().modify(attr, comp_mask)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to modify SRQ", e.error_code) from None

    def query(self) -> Any:
        try:
            return super().query()
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to query SRQ", e.error_code) from None

    def get_srq_num(self) -> int:
        raise PyverbsRDMAError("Failed to retrieve SRQ number", errno.EOPNOTSUPP)


unsupported.fill_missing(_sys.modules[__name__], "srq")
