"""pyverbs.cq: CompChannel, CQ, CqInitAttrEx, CQEX, PollCqAttr, WC.

As pyverbs: ``channel.get_cq_event(expected_cq)`` counts the event on the CQ
(``cq.num_events``) and raises if it came for another CQ; closing a CQ closes the QPs
using it and acknowledges its events first; closing a channel closes its CQs first.
``CQEX`` polls with ``start_poll``/``poll_next``/``end_poll`` (2, ENOENT, when empty) and
the ``read_*`` accessors; it accepts the ``wc_flags`` Linux rxe accepts.
"""

from __future__ import annotations

import errno
import socket
import sys as _sys
from typing import Any

from ..completion import WC
from ..errors import PyverbsRDMAError
from ..verbs_api.enums import ibv_wc_flags as _wcf
from ..verbs_api.cq import CQ as _CQ, CompChannel as _CompChannel
from . import unsupported
from ._close import CascadeClose, close_tree

_WC_WITH_IMM = int(_wcf.IBV_WC_WITH_IMM)

__all__ = ["CompChannel", "CQ", "CqInitAttrEx", "CQEX", "PollCqAttr", "WC", "WcTmInfo"]

# librxe's RXE_SUP_WC_EX_FLAGS: BYTE_LEN, IMM, QP_NUM, SRC_QP, SLID, SL, DLID_PATH_BITS
RXE_SUP_WC_EX_FLAGS = 1 | 2 | 4 | 8 | 16 | 32 | 64


class CompChannel(CascadeClose, _CompChannel):
    def __init__(self, context: Any) -> None:
        try:
            super().__init__(context)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to create a completion channel",
                                   e.error_code) from None

    def get_cq_event(self, expected_cq: Any = None, timeout: float | None = None) -> Any:
        try:
            return super().get_cq_event(expected_cq, timeout)
        except PyverbsRDMAError as e:
            if e.error_code == errno.EINVAL and expected_cq is not None:
                raise PyverbsRDMAError("Received event on an unexpected CQ", e.error_code) \
                    from None
            raise PyverbsRDMAError("Failed to get CQ event", e.error_code) from None


def _c_int(v: Any) -> Any:
    return int(v) if isinstance(v, float) else v


class _CQMixin:
    @property
    def comp_channel(self) -> Any:
        return self.channel

    @property
    def num_events(self) -> int:
        return self._events_unacked

    @num_events.setter
    def num_events(self, v: int) -> None:
        self._events_unacked = v

    def poll(self, num_entries: int = 1) -> tuple[int, list]:
        """As pyverbs: a completion's ``imm_data`` is the raw ``__be32`` of ``ibv_wc``
        (``socket.ntohl`` gives the integer whose big-endian bytes were on the wire)."""
        n, wcs = super().poll(num_entries)
        for wc in wcs:
            if wc.wc_flags & _WC_WITH_IMM:
                wc.imm_data = socket.htonl(wc.imm_data)
        return n, wcs

    def close(self) -> None:
        if self.closed:
            return
        for u in list(self.users):
            close_tree(u)
        self._events_unacked = 0  # pyverbs acks the CQ's events before destroying it
        try:
            super().close()
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to close CQ", e.error_code) from None


class CQ(_CQMixin, _CQ):
    def __init__(self, context: Any, cqe: int, cq_context: Any = None, channel: Any = None,
                 comp_vector: int = 0) -> None:
        try:  # Cython converts a float to the C int (truncating); so does this
            super().__init__(context, _c_int(cqe), cq_context, channel, _c_int(comp_vector))
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to create a CQ", e.error_code) from None

    def resize(self, cqe: int) -> None:
        try:
            super().resize(cqe)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to resize CQ to {cqe}", e.error_code) from None

    def req_notify(self, solicited_only: bool = False) -> None:
        super().req_notify(bool(solicited_only))


class CqInitAttrEx:
    def __init__(self, cqe: int = 100, channel: Any = None, comp_vector: int = 0,
                 wc_flags: int = 0, comp_mask: int = 0, flags: int = 0,
                 parent_domain: Any = None) -> None:
        self.cqe = cqe
        self.comp_channel = channel
        self.comp_vector = comp_vector
        self.wc_flags = wc_flags
        self.comp_mask = comp_mask
        self.flags = flags
        self.parent_domain = parent_domain
        self.cq_context = None


class PollCqAttr:
    def __init__(self) -> None:
        self.comp_mask = 0


class WcTmInfo:
    def __init__(self) -> None:
        self.tag = 0
        self.priv = 0


class CQEX(_CQMixin, _CQ):
    """ibv_cq_ex (``ibv_create_cq_ex``)."""

    def __init__(self, context: Any, init_attr: CqInitAttrEx | None = None) -> None:
        init_attr = init_attr or CqInitAttrEx()
        if init_attr.wc_flags & ~RXE_SUP_WC_EX_FLAGS or init_attr.parent_domain is not None \
                or init_attr.comp_mask & ~0x3 or init_attr.flags:
            raise PyverbsRDMAError("Failed to create extended CQ", errno.EOPNOTSUPP)
        try:
            super().__init__(context, _c_int(init_attr.cqe), None, init_attr.comp_channel,
                             _c_int(init_attr.comp_vector))
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to create extended CQ", e.error_code) from None
        self.wc_flags = init_attr.wc_flags
        self._cur: WC | None = None

    def _next(self) -> int:
        n, wcs = self.poll(1)
        if not n:
            self._cur = None
            return errno.ENOENT
        self._cur = wcs[0]
        return 0

    def start_poll(self, attr: Any = None) -> int:
        return self._next()

    def poll_next(self) -> int:
        return self._next()

    def end_poll(self) -> None:
        self._cur = None

    def _wc(self) -> WC:
        if self._cur is None:
            raise PyverbsRDMAError("No completion is being polled (start_poll)", errno.EINVAL)
        return self._cur

    @property
    def status(self) -> int:
        return self._wc().status

    @status.setter
    def status(self, v: int) -> None:
        self._wc().status = v

    @property
    def wr_id(self) -> int:
        return self._wc().wr_id

    @wr_id.setter
    def wr_id(self, v: int) -> None:
        self._wc().wr_id = v

    def read_opcode(self) -> int:
        return self._wc().opcode

    def read_vendor_err(self) -> int:
        return self._wc().vendor_err

    def read_byte_len(self) -> int:
        return self._wc().byte_len

    def read_imm_data(self) -> int:
        return self._wc().imm_data

    def read_invalidated_rkey(self) -> int:
        return self._wc().invalidated_rkey

    def read_qp_num(self) -> int:
        return self._wc().qp_num

    def read_src_qp(self) -> int:
        return self._wc().src_qp

    def read_wc_flags(self) -> int:
        return self._wc().wc_flags

    def read_slid(self) -> int:
        return self._wc().slid

    def read_sl(self) -> int:
        return self._wc().sl

    def read_dlid_path_bits(self) -> int:
        return self._wc().dlid_path_bits

    def _unsupported(self, *a: Any) -> int:
        raise PyverbsRDMAError("not supported by this CQ", errno.EOPNOTSUPP)

    read_timestamp = read_cvlan = read_flow_tag = read_tm_info = _unsupported
    read_completion_wallclock_ns = _unsupported


def _flags_to_str(flags: int, names: dict[int, str]) -> str:
    return " ".join(n for b, n in names.items() if flags & b)


def cqe_status_to_str(status: int) -> str:
    from ..verbs_api.enums import wc_status_str
    return wc_status_str(status)


unsupported.fill_missing(_sys.modules[__name__], "cq")
