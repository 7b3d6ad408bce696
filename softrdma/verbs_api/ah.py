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
from .base import Resource

__all__ = ["AH", "AddressVector", "resolve_av"]


@dataclass(frozen=True)
class AddressVector:
    """What the data path needs to address a packet (rxe's ``rxe_av``)."""

    dgid: bytes
    dst_ip: bytes  # 4 or 16 bytes
    sgid_index: int
    hop_limit: int
    traffic_class: int
    flow_label: int


def resolve_av(device: Any, attr: AHAttr, what: str) -> AddressVector:
    if attr.port_num != 1:
        raise PyverbsRDMAError(f"{what}: port_num {attr.port_num} is not 1", errno.EINVAL)
    if not attr.is_global or attr.gr is None:
        raise PyverbsRDMAError(f"{what}: RoCE needs a GRH (is_global=1 and a GlobalRoute "
                               f"with the destination GID)", errno.EINVAL)
    gr: GlobalRoute = attr.gr
    if gr.dgid is None or not GID(gr.dgid):
        raise PyverbsRDMAError(f"{what}: the destination GID is zero", errno.EINVAL)
    if not 0 <= gr.sgid_index < len(device.gid_table):
        raise PyverbsRDMAError(f"{what}: sgid_index {gr.sgid_index} is not a populated GID "
                               f"(table has {len(device.gid_table)})", errno.EINVAL)
    for name, val, bits in (("hop_limit", gr.hop_limit, 8), ("traffic_class", gr.traffic_class, 8),
                            ("flow_label", gr.flow_label, 20)):
        if not 0 <= val < (1 << bits):
            raise PyverbsRDMAError(f"{what}: {name} {val} does not fit {bits} bits", errno.EINVAL)
    dgid = GID(gr.dgid).raw
    dst_ip = device.ip_of_gid(dgid)
    src_ip = device.ip_of_gid(device.gid_table[gr.sgid_index])
    if len(dst_ip) != len(src_ip):
        raise PyverbsRDMAError(f"{what}: destination GID {GID(dgid).gid} and source GID index "
                               f"{gr.sgid_index} are of different IP families", errno.EINVAL)
    return AddressVector(dgid, dst_ip, gr.sgid_index, gr.hop_limit, gr.traffic_class,
                         gr.flow_label)


class AH(Resource):
    """``ibv_ah``: the destination of UD sends. ``AH(pd, attr=AHAttr(...))``."""

    _kind = "AH"

    def __init__(self, pd: Any, attr: AHAttr | None = None, **kwargs: Any) -> None:
        pd._check()
        if attr is None:
            raise PyverbsRDMAError("Failed to create AH: attr (AHAttr) is required", errno.EINVAL)
        av = resolve_av(pd.device, attr, "Failed to create AH")
        super().__init__(pd.context)
        self.pd = pd
        self.attr = attr
        self.av = av
        self._use(pd)

    def _destroy(self) -> None:
        if not self.closed:
            self._release(self.pd)
        super()._destroy()
