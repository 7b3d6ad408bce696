"""pyverbs.addr: GID, GlobalRoute, AHAttr, AH, GRH."""

from __future__ import annotations

import sys as _sys
from typing import Any

from ..verbs_api.ah import AH as _AH
from ..verbs_api.attr import GID as _GID, AHAttr as _AHAttr, GlobalRoute
from . import unsupported
from ._close import CascadeClose

__all__ = ["GID", "GlobalRoute", "AHAttr", "AH", "GRH", "gid_str", "gid_str_to_array"]


class GID(_GID):
    """A GID; ``str(gid)`` and ``gid.gid`` are the colon form, as in pyverbs."""

    __slots__ = ()

    def __init__(self, val: Any = None) -> None:
        super().__init__(val.raw if isinstance(val, _GID) else val)

    @property
    def gid(self) -> str:
        return _GID.gid.fget(self)

    @gid.setter
    def gid(self, val: str) -> None:
        self.raw = _GID.parse(val).raw


class AHAttr(_AHAttr):
    """ibv_ah_attr; pyverbs' keyword form ``AHAttr(port_num=1, is_global=1, gr=gr, dlid=0,
    sl=0, src_path_bits=0, static_rate=0, vlan_id=0)``."""

    def __init__(self, vlan_id: int = 0, port_num: int = 1, sl: int = 0, src_path_bits: int = 0,
                 is_global: int = 0, gr: Any = None, dlid: int = 0, static_rate: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(dlid=dlid, sl=sl, src_path_bits=src_path_bits,
                         static_rate=static_rate, is_global=is_global, port_num=port_num, gr=gr)

    # RoCE takes the VLAN from the netdev; kept out of the instance's fields, which the
    # verbs layer copies
    vlan_id = 0


class GRH:
    def __init__(self, gr: Any = None, ip_version: int = 0, paylen: int = 0,
                 next_hdr: int = 0, hop_limit: int = 0, sgid: Any = None, dgid: Any = None):
        self.gr, self.ip_version, self.paylen, self.next_hdr = gr, ip_version, paylen, next_hdr
        self.hop_limit, self.sgid, self.dgid = hop_limit, sgid, dgid


class AH(CascadeClose, _AH):
    def __init__(self, pd: Any, wc: Any = None, port_num: int = 1, grh: Any = None,
                 attr: Any = None) -> None:
        if wc is not None:
            attr = _ah_attr_from_wc(pd, wc, port_num, grh)
        super().__init__(pd, attr=attr)


def _ah_attr_from_wc(pd: Any, wc: Any, port_num: int, grh: Any) -> AHAttr:
    """libibverbs' ``ibv_init_ah_from_wc`` on RoCE: the 40 bytes at ``grh`` (an address in
    one of the PD's context's MRs, where the UD receive put them) are a GRH, or, for
    RoCEv2 over IPv4, 20 zero bytes and the IPv4 header; the reply goes to its source
    address, from the table entry holding its destination."""
    import errno

    from ..errors import PyverbsRDMAError
    from ..verbs_api.mr import MR as _BaseMR
    what = "Failed to create AH from WC"
    ctx = pd.context
    raw = None
    for obj in list(getattr(ctx, "children", ())):
        if isinstance(obj, _BaseMR) and not obj.closed and \
                obj.buf <= int(grh) and int(grh) + 40 <= obj.buf + obj.length:
            off = int(grh) - obj.buf
            raw = bytes(obj.mem[off:off + 40])
            break
    if raw is None or not wc.wc_flags & 1:  # IBV_WC_GRH
        raise PyverbsRDMAError(what, errno.EINVAL)
    from ..verbs_api.ah import ah_attr_from_wc
    return ah_attr_from_wc(wc, raw, ctx.device.gid_table, port_num)


def gid_str(subnet_prefix: int, interface_id: int) -> str:
    from .device import GIDEntry
    return GIDEntry(subnet_prefix, interface_id).gid_str()


def gid_str_to_array(val: str, gid: Any) -> None:
    h = val.replace(":", "")
    for i in range(16):
        gid[i] = int(h[2 * i:2 * i + 2], 16)


unsupported.fill_missing(_sys.modules[__name__], "addr")
