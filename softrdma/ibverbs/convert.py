"""The verbs_api attribute objects to and from their C structs (``AHAttr`` <->
``ibv_ah_attr``, ``QPAttr`` <-> ``ibv_qp_attr``, ``QPCap`` <-> ``ibv_qp_cap``).

Values are checked for type and C width on the way in (the ``_check`` helpers name the
field, as the soft backend does); whether a value is acceptable is the device's decision,
reported by the verb's errno.
"""

from __future__ import annotations

from typing import Any

from ..verbs_api._check import U8, U16, U32, as_flag, as_int, require
from ..verbs_api.attr import GID, AHAttr, GlobalRoute, QPAttr, QPCap
from ..verbs_api.enums import ibv_qp_attr_mask as M
from . import ffi

__all__ = ["ah_attr_to_c", "ah_attr_from_c", "qp_attr_to_c", "qp_attr_from_c", "cap_to_c",
           "cap_from_c"]

_CAP = ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data")


def cap_to_c(cap: QPCap | None, c: ffi.ibv_qp_cap, what: str, field: str) -> None:
    cap = require(cap, QPCap, what, field, optional=True) or QPCap()
    for n in _CAP:
        setattr(c, n, as_int(getattr(cap, n), what, f"{field}.{n}", U32))


def cap_from_c(c: ffi.ibv_qp_cap) -> QPCap:
    return QPCap(**{n: getattr(c, n) for n in _CAP})


def ah_attr_to_c(attr: Any, c: ffi.ibv_ah_attr, what: str, field: str) -> None:
    require(attr, AHAttr, what, field)
    for n, hi in (("dlid", U16), ("sl", U8), ("src_path_bits", U8), ("static_rate", U8),
                  ("port_num", U8)):
        setattr(c, n, as_int(getattr(attr, n), what, f"{field}.{n}", hi))
    c.is_global = as_flag(attr.is_global, what, f"{field}.is_global")
    gr = attr.gr
    if gr is not None:
        g = f"{field}.gr"
        require(gr, GlobalRoute, what, g)
        if gr.dgid is not None:
            dgid = gr.dgid if isinstance(gr.dgid, GID) else GID.parse(gr.dgid, f"{what}: {g}.dgid")
            c.grh.dgid.raw = (ffi.c_uint8 * 16).from_buffer_copy(dgid.raw)
        c.grh.flow_label = as_int(gr.flow_label, what, f"{g}.flow_label", (1 << 20) - 1,
                                  desc="does not fit 20 bits")
        c.grh.sgid_index = as_int(gr.sgid_index, what, f"{g}.sgid_index", U8)
        c.grh.hop_limit = as_int(gr.hop_limit, what, f"{g}.hop_limit", U8)
        c.grh.traffic_class = as_int(gr.traffic_class, what, f"{g}.traffic_class", U8)


def ah_attr_from_c(c: ffi.ibv_ah_attr) -> AHAttr:
    g = c.grh
    gr = GlobalRoute(dgid=GID(bytes(g.dgid.raw)), flow_label=g.flow_label,
                     sgid_index=g.sgid_index, hop_limit=g.hop_limit,
                     traffic_class=g.traffic_class)
    return AHAttr(dlid=c.dlid, sl=c.sl, src_path_bits=c.src_path_bits,
                  static_rate=c.static_rate, is_global=c.is_global, port_num=c.port_num, gr=gr)


# the scalar fields of ibv_qp_attr with their C widths (enums are C ints, taken as U32)
_QP_SCALARS = (("qp_state", U32), ("cur_qp_state", U32), ("path_mtu", U32),
               ("path_mig_state", U32), ("qkey", U32), ("rq_psn", U32), ("sq_psn", U32),
               ("dest_qp_num", U32), ("qp_access_flags", U32), ("pkey_index", U16),
               ("alt_pkey_index", U16), ("en_sqd_async_notify", U8), ("sq_draining", U8),
               ("max_rd_atomic", U8), ("max_dest_rd_atomic", U8), ("min_rnr_timer", U8),
               ("port_num", U8), ("timeout", U8), ("retry_cnt", U8), ("rnr_retry", U8),
               ("alt_port_num", U8), ("alt_timeout", U8), ("rate_limit", U32))

# the attr_mask bits whose QPAttr fields are read only when set
IBV_QP_CAP, IBV_QP_AV, IBV_QP_ALT_PATH = int(M.IBV_QP_CAP), int(M.IBV_QP_AV), int(M.IBV_QP_ALT_PATH)


def qp_attr_to_c(attr: Any, mask: int, what: str = "Failed to modify QP") -> ffi.ibv_qp_attr:
    """An ``ibv_qp_attr`` holding every scalar of ``attr`` (each checked for its width) and
    the address vectors and caps the mask names."""
    require(attr, QPAttr, what, "attr")
    c = ffi.ibv_qp_attr()
    for n, hi in _QP_SCALARS:
        v = getattr(attr, n)
        if type(v) is not int or not 0 <= v <= hi:
            v = as_int(v, what, f"attr.{n}", hi)
        setattr(c, n, v)
    if mask & IBV_QP_CAP:
        cap_to_c(attr.cap, c.cap, what, "attr.cap")
    if mask & IBV_QP_AV:
        ah_attr_to_c(attr.ah_attr, c.ah_attr, what, "attr.ah_attr")
    if mask & IBV_QP_ALT_PATH:
        ah_attr_to_c(attr.alt_ah_attr, c.alt_ah_attr, what, "attr.alt_ah_attr")
    return c


def qp_attr_from_c(c: ffi.ibv_qp_attr) -> QPAttr:
    a = QPAttr(**{n: getattr(c, n) for n, _ in _QP_SCALARS})
    a.cap = cap_from_c(c.cap)
    a.ah_attr = ah_attr_from_c(c.ah_attr)
    a.alt_ah_attr = ah_attr_from_c(c.alt_ah_attr)
    return a
