"""Address handles and address vectors.

On RoCE every address carries a GRH: ``AHAttr(is_global=1, gr=GlobalRoute(dgid=...,
sgid_index=1))``. The destination GID names the peer's IP address (IPv4-mapped GIDs are
IPv4), the source GID index must name a GID of this device of the same family.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from ..errors import PyverbsRDMAError
from .attr import AHAttr, GID, GlobalRoute
from ._check import U8, U16, as_flag, as_int, require
from .base import Sibling
from .pd import PD

__all__ = ["AH", "SoftAH", "AddressVector", "resolve_av", "ah_attr_from_wc"]


@dataclass(frozen=True)
class AddressVector:
    """What the data path needs to address a packet (rxe's ``rxe_av``)."""

    dgid: bytes
    dst_ip: bytes  # 4 or 16 bytes
    sgid_index: int
    hop_limit: int
    traffic_class: int
    flow_label: int


def resolve_av(device: Any, attr: Any, what: str, field: str = "attr") -> AddressVector:
    """Check an ``AHAttr`` (``field`` names it in errors, e.g. ``attr.ah_attr``) against
    the device and return the address vector the data path uses."""
    require(attr, AHAttr, what, field)
    for name, hi in (("dlid", U16), ("sl", U8), ("src_path_bits", U8), ("static_rate", U8),
                     ("port_num", U8)):
        as_int(getattr(attr, name), what, f"{field}.{name}", hi)
    is_global = as_flag(attr.is_global, what, f"{field}.is_global")
    if attr.port_num != 1:
        raise PyverbsRDMAError(f"{what}: {field}.port_num {attr.port_num} is not 1", errno.EINVAL)
    if not is_global or attr.gr is None:
        raise PyverbsRDMAError(f"{what}: {field}: RoCE needs a GRH ({field}.is_global=1 and "
                               f"{field}.gr, a GlobalRoute with the destination GID)",
                               errno.EINVAL)
    gr: GlobalRoute = require(attr.gr, GlobalRoute, what, f"{field}.gr")
    g = f"{field}.gr"
    dgid_obj = gr.dgid if isinstance(gr.dgid, GID) else \
        GID.parse(gr.dgid, f"{what}: {g}.dgid") if gr.dgid is not None else None
    if dgid_obj is None or not dgid_obj:
        raise PyverbsRDMAError(f"{what}: {g}.dgid: the destination GID is zero", errno.EINVAL)
    for name, val, hi in (("sgid_index", gr.sgid_index, U8), ("hop_limit", gr.hop_limit, U8),
                          ("traffic_class", gr.traffic_class, U8),
                          ("flow_label", gr.flow_label, (1 << 20) - 1)):
        as_int(val, what, f"{g}.{name}", hi, desc=f"does not fit {hi.bit_length()} bits")
    if not 0 <= gr.sgid_index < len(device.gid_table):
        raise PyverbsRDMAError(f"{what}: {g}.sgid_index {gr.sgid_index} is not a populated GID "
                               f"(table has {len(device.gid_table)})", errno.EINVAL)
    dgid = dgid_obj.raw
    dst_ip = device.ip_of_gid(dgid)
    src_ip = device.ip_of_gid(device.gid_table[gr.sgid_index])
    if len(dst_ip) != len(src_ip):
        raise PyverbsRDMAError(f"{what}: {g}.dgid {GID(dgid).gid} and {g}.sgid_index "
                               f"{gr.sgid_index} are of different IP families", errno.EINVAL)
    return AddressVector(dgid, dst_ip, int(gr.sgid_index), int(gr.hop_limit),
                         int(gr.traffic_class), int(gr.flow_label))


class AH(Sibling):
    """``ibv_ah``: the destination of UD sends. ``AH(pd, attr=AHAttr(...))``."""

    _kind = "AH"
    _pool = "ah"

    def __init__(self, pd: Any, attr: AHAttr | None = None) -> None:
        require(pd, PD, "Failed to create AH", "pd")
        pd._check()
        if attr is None:
            raise PyverbsRDMAError("Failed to create AH: attr (AHAttr) is required", errno.EINVAL)
        self._create(pd.context, "AH", pd, attr)
        self.pd = pd
        self.attr = attr
        self._use(pd)

    def _parents(self) -> tuple[Any, ...]:
        return (self.pd,)


class SoftAH:
    """A soft AH is its resolved path: ``av`` (the soft QP copies it into each UD WQE)."""

    extras = frozenset({"av"})

    def __init__(self, owner: AH, pd: Any, attr: AHAttr) -> None:
        self.av = resolve_av(pd.device, attr, "Failed to create AH", "attr")

    def destroy(self) -> None:
        pass


def ah_attr_from_wc(wc: Any, grh: bytes, gid_table: list[bytes], port_num: int = 1) -> AHAttr:
    """``ibv_init_ah_from_wc`` on RoCE: the address that answers a UD receive, from the 40
    bytes at the start of its buffer -- a GRH (IPv6, or RoCEv1), or for RoCEv2 over IPv4 20
    unused bytes and the packet's IPv4 header. The reply goes to the packet's source, from
    the GID table entry holding its destination. EINVAL if there is no such entry."""
    what = "Failed to create AH from WC"
    grh = bytes(grh)
    if len(grh) < 40:
        raise PyverbsRDMAError(f"{what}: the receive buffer holds no GRH", errno.EINVAL)
    if grh[20] >> 4 == 4:  # RoCEv2 over IPv4
        mapped = bytes(10) + b"\xff\xff"
        src, dst = mapped + grh[32:36], mapped + grh[36:40]
        tclass, flow = grh[21], 0
    else:  # an IPv6 header (RoCEv2) or an IB GRH (RoCEv1): one layout
        word = int.from_bytes(grh[0:4], "big")
        src, dst = grh[8:24], grh[24:40]
        tclass, flow = (word >> 20) & 0xFF, word & 0xFFFFF
    table = [bytes(g) for g in gid_table]
    if dst not in table:
        raise PyverbsRDMAError(f"{what}: no GID table entry holds the packet's destination",
                               errno.EINVAL)
    # the last entry holding it: the RoCEv2 one (librdmacm picks the packet's GID type)
    idx = max(i for i, g in enumerate(table) if g == dst)
    return AHAttr(dlid=getattr(wc, "slid", 0), sl=getattr(wc, "sl", 0), is_global=1,
                  port_num=port_num, gr=GlobalRoute(dgid=GID(src), flow_label=flow,
                                                    sgid_index=idx, hop_limit=0xFF,
                                                    traffic_class=tclass))
