"""pyverbs.device: Context, Device, get_device_list, DeviceAttr(Ex), PortAttr, GIDEntry.

The extended queries answer what Linux rxe answers: no ODP, TSO, RSS, tag matching,
device memory or packet pacing (all zero), one completion vector, RoCE v2 GIDs.
"""

from __future__ import annotations

import errno
import sys as _sys
from dataclasses import dataclass, field
from typing import Any

from ..errors import PyverbsRDMAError, PyverbsUserError  # noqa: F401
from ..verbs_api import device as _d
from ..verbs_api.device import AsyncEvent, DeviceAttr, PortAttr  # noqa: F401
from . import unsupported
from ._close import CascadeClose  # noqa: F401
from .addr import GID

__all__ = ["Context", "Device", "get_device_list", "DeviceAttr", "DeviceAttrEx", "PortAttr",
           "GIDEntry", "AsyncEvent", "ODPCaps", "TSOCaps", "RSSCaps", "TMCaps",
           "CQModerationCaps", "PacketPacingCaps", "PCIAtomicCaps", "QueryDeviceExInput"]


class Device(_d.Device):
    pass


def get_device_list() -> list:
    """The devices; ``guid`` is ibv_get_device_guid's __be64 as pyverbs reads it (host
    order), so ``guid_format(dev.guid)`` prints the node GUID."""
    out = []
    for dev in _d.get_device_list():
        dv = Device(dev.name, int.from_bytes(dev.guid.to_bytes(8, "big"), _sys.byteorder),
                    index=dev.index)
        out.append(dv)
    return out


def rdma_get_devices() -> list:
    return get_device_list()


@dataclass
class ODPCaps:
    general_caps: int = 0
    rc_odp_caps: int = 0
    uc_odp_caps: int = 0
    ud_odp_caps: int = 0
    xrc_odp_caps: int = 0


@dataclass
class TSOCaps:
    max_tso: int = 0
    supported_qpts: int = 0


@dataclass
class RSSCaps:
    supported_qpts: int = 0
    max_rwq_indirection_tables: int = 0
    rx_hash_fields_mask: int = 0
    rx_hash_function: int = 0
    max_rwq_indirection_table_size: int = 0


@dataclass
class TMCaps:
    max_rndv_hdr_size: int = 0
    max_num_tags: int = 0
    flags: int = 0
    max_ops: int = 0
    max_sge: int = 0


@dataclass
class CQModerationCaps:
    max_cq_count: int = 0
    max_cq_period: int = 0


@dataclass
class PacketPacingCaps:
    qp_rate_limit_min: int = 0
    qp_rate_limit_max: int = 0
    supported_qpts: int = 0


@dataclass
class PCIAtomicCaps:
    fetch_add: int = 0
    swap: int = 0
    compare_swap: int = 0


class QueryDeviceExInput:
    def __init__(self, comp_mask: int = 0) -> None:
        self.comp_mask = comp_mask


@dataclass
class DeviceAttrEx:
    """ibv_device_attr_ex as rxe fills it: ``orig_attr`` plus the extended capabilities."""

    orig_attr: DeviceAttr
    comp_mask: int = 0
    odp_caps: ODPCaps = field(default_factory=ODPCaps)
    completion_timestamp_mask: int = 0
    hca_core_clock: int = 0
    device_cap_flags_ex: int = 0
    tso_caps: TSOCaps = field(default_factory=TSOCaps)
    rss_caps: RSSCaps = field(default_factory=RSSCaps)
    max_wq_type_rq: int = 0
    raw_packet_caps: int = 0
    tm_caps: TMCaps = field(default_factory=TMCaps)
    cq_mod_caps: CQModerationCaps = field(default_factory=CQModerationCaps)
    max_dm_size: int = 0
    pci_atomic_caps: PCIAtomicCaps = field(default_factory=PCIAtomicCaps)
    xrc_odp_caps: int = 0
    phys_port_cnt_ex: int = 1

    @property
    def max_dm_size_(self) -> int:
        return self.max_dm_size


class GIDEntry:
    """ibv_gid_entry. ``gid_subnet_prefix``/``gid_interface_id`` are the two 64-bit halves
    as the C union holds them (read in host byte order), as pyverbs reports them."""

    def __init__(self, subnet_prefix: int = 0, interface_id: int = 0, gid_index: int = 0,
                 port_num: int = 0, gid_type: int = 0, ndev_ifindex: int = 0) -> None:
        self.gid_subnet_prefix = subnet_prefix
        self.gid_interface_id = interface_id
        self.gid_index = gid_index
        self.port_num = port_num
        self.gid_type = gid_type
        self.ndev_ifindex = ndev_ifindex

    @classmethod
    def _of(cls, raw: bytes, index: int, gid_type: int, ifindex: int) -> "GIDEntry":
        return cls(int.from_bytes(raw[:8], _sys.byteorder), int.from_bytes(raw[8:], _sys.byteorder),
                   index, 1, gid_type, ifindex)

    def _raw(self) -> bytes:
        return self.gid_subnet_prefix.to_bytes(8, _sys.byteorder) + \
            self.gid_interface_id.to_bytes(8, _sys.byteorder)

    def gid_str(self) -> str:
        return GID(self._raw()).gid

    def __str__(self) -> str:
        f = "{:<24}: {:<20}\n"
        return (f.format("GID", self.gid_str()) + f.format("GID Index", self.gid_index) +
                f.format("Port number", self.port_num) +
                f.format("GID type", translate_gid_type(self.gid_type)) +
                f.format("Ndev ifindex", self.ndev_ifindex))


# ibv_gid_type (sysfs) values of struct ibv_gid_entry: IB 0, RoCE v1 1, RoCE v2 2
_GID_ENTRY_ROCE_V2 = 2


class Context(_d.Context):
    """ibv_context. ``Context(name='softrdma0')``; closing it closes everything made in it."""

    def __init__(self, name: Any = None, **kwargs: Any) -> None:
        if kwargs.get("cmd_fd") is not None:
            raise PyverbsRDMAError("Failed to import device", errno.EOPNOTSUPP)
        if name is None and kwargs.get("cmid") is None and kwargs.get("attr") is None:
            raise PyverbsUserError("Device name must be provided")
        super().__init__(name)

    def close(self) -> None:  # the whole context: verbs_api closes every child
        super().close()

    @property
    def num_comp_vectors(self) -> int:
        return 1

    @property
    def cmd_fd(self) -> int:
        return self.async_fd

    def query_device(self) -> DeviceAttr:
        try:
            return super().query_device()
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to query device {self.name}", e.error_code) from None

    def query_device_ex(self, ex_input: Any = None) -> DeviceAttrEx:
        try:
            attr = super().query_device()
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to query EX device {self.name}",
                                   e.error_code) from None
        return DeviceAttrEx(orig_attr=attr, device_cap_flags_ex=attr.device_cap_flags_ex
                            or attr.device_cap_flags,
                            phys_port_cnt_ex=attr.phys_port_cnt)

    def query_port(self, port_num: int = 1) -> PortAttr:
        try:
            attr = super().query_port(port_num)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to query port {port_num}", e.error_code) from None
        # rdma-core 49 on: the kernel's speed in the wider field too (same value for rxe)
        attr.active_speed_ex = getattr(attr, "active_speed_ex", 0) or attr.active_speed
        return attr

    def query_port_speed(self, port_num: int) -> int:
        """ibv_query_port_speed (rdma-core 63 on): a provider op rxe lacks, so EOPNOTSUPP."""
        raise PyverbsRDMAError(f"Failed to query port speed for port {port_num}",
                               errno.EOPNOTSUPP)

    def get_pkey_index(self, port_num: int, pkey: int) -> int:
        """ibv_get_pkey_index: the first index whose P_Key is ``pkey`` (libibverbs' search
        through query_pkey, as for rxe, whose provider has no op of its own)."""
        n = self.query_port(port_num).pkey_tbl_len
        for i in range(n):
            if self.query_pkey(port_num, i) == pkey:
                return i
        raise PyverbsRDMAError(f"Failed to get pkey index of pkey = {pkey} of port {port_num}")

    def query_gid(self, port_num: int, index: int) -> GID:
        try:
            return GID(super().query_gid(port_num, index).raw)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to query gid {index} of port {port_num}",
                                   e.error_code) from None

    def query_gid_type(self, port_num: int, index: int) -> int:
        try:
            return super().query_gid_type(port_num, index)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to query gid type of port {port_num} in index "
                                   f"{index}", e.error_code) from None

    def _entries(self) -> list[GIDEntry]:
        ifindex = getattr(getattr(self.device, "netdev", None), "ifindex", 0) or 0
        return [GIDEntry._of(g, i, _GID_ENTRY_ROCE_V2, ifindex)
                for i, g in enumerate(self.device.gid_table) if any(g)]

    def query_gid_table(self, max_entries: int, flags: int = 0) -> list[GIDEntry]:
        """ibv_query_gid_table: the populated entries; fewer slots than entries is -EINVAL
        (the C function returns a negative errno, which pyverbs passes on)."""
        self._check()
        ents = self._entries()
        if flags != 0 or max_entries < len(ents):
            raise PyverbsRDMAError("Failed to query gid tables of the device", -errno.EINVAL)
        return ents

    def query_gid_ex(self, port_num: int, gid_index: int, flags: int = 0) -> GIDEntry:
        self._check()
        what = f"Failed to query gid table of port {port_num} in index {gid_index}"
        if port_num != 1 or flags != 0 or gid_index >= self.device.limits.gid_tbl_len:
            raise PyverbsRDMAError(what, errno.EINVAL)
        for ent in self._entries():
            if ent.gid_index == gid_index:
                return ent
        raise PyverbsRDMAError(what, errno.ENODATA)

    def query_pkey(self, port_num: int, index: int) -> int:
        try:
            return super().query_pkey(port_num, index)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(f"Failed to query pkey {index} of port {port_num}",
                                   e.error_code) from None

    def query_rt_values_ex(self, comp_mask: int = 1) -> Any:
        raise PyverbsRDMAError("Failed to query the RT values", errno.EOPNOTSUPP)

    def get_async_event(self, block: bool = True) -> Any:
        return super().get_async_event(block)


# -- the string helpers of pyverbs.device (same texts) ----------------------------------
def _fmt(table: dict[int, Any], v: int, bad: str) -> str:
    return f"{table[v]} ({v})" if v in table else bad


def translate_mtu(mtu: int) -> str:
    return _fmt({1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}, mtu, f"Invalid MTU ({mtu})")


def width_to_str(width: int) -> str:
    return _fmt({1: "1X", 2: "4X", 4: "8X", 16: "2X"}, width, "Invalid width")


def speed_to_str(speed: int, speed_ex: int = 0) -> str:
    """The port speed's text; rdma-core 49 on pass ``active_speed_ex`` too (used when set)."""
    return _fmt({0: "0.0 Gbps", 1: "2.5 Gbps", 2: "5.0 Gbps", 4: "5.0 Gbps", 8: "10.0 Gbps",
                 16: "14.0 Gbps", 32: "25.0 Gbps", 64: "50.0 Gbps", 128: "100.0 Gbps",
                 256: "200.0 Gbps"}, speed_ex or speed, "Invalid speed")


def phys_state_to_str(phys: int) -> str:
    return _fmt({1: "Sleep", 2: "Polling", 3: "Disabled", 4: "Port configuration training",
                 5: "Link up", 6: "Link error recovery", 7: "Phy test"}, phys,
                "Invalid physical state")


def port_state_to_str(state: int) -> str:
    return _fmt({0: "NOP", 1: "Down", 2: "Init", 3: "Armed", 4: "Active", 5: "Defer"}, state,
                f"Invalid state ({state})")


def translate_link_layer(ll: int) -> str:
    t = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
    return t.get(ll, f"Invalid link layer ({ll})")


def translate_gid_type(t: int) -> str:
    return {0: "IB/RoCE v1", 1: "RoCE v1", 2: "RoCE v2"}.get(t, f"Invalid GID type ({t})")


def translate_node_type(t: int) -> str:
    return {1: "CA", 2: "Switch", 3: "Router", 4: "RNIC", 5: "USNIC",
            6: "USNIC UDP"}.get(t, "Unknown")


def translate_transport_type(t: int) -> str:
    return {0: "IB", 1: "IWARP", 2: "USNIC", 3: "USNIC UDP"}.get(t, "Unknown")


def translate_event_type(t: int) -> str:
    from ..verbs_api.enums import ibv_event_type
    try:
        return ibv_event_type(t).name
    except ValueError:
        return "Invalid"


def _be64toh(num: int) -> int:
    return int.from_bytes(num.to_bytes(8, "big"), _sys.byteorder) if _sys.byteorder != "big" \
        else num


def guid_format(num: int) -> str:
    h = "%016x" % _be64toh(num)
    return ":".join(h[i:i + 4] for i in range(0, 16, 4))


def guid_to_hex(node_guid: int) -> str:
    return hex(node_guid).replace("L", "").replace("0x", "")


def str_from_flags(flags: int, dictionary: dict[int, str]) -> str:
    out = "\n  "
    for bit, name in dictionary.items():
        if flags & bit:
            out += name + "\n  "
    return out


def gid_str(subnet_prefix: int, interface_id: int) -> str:
    return GIDEntry(subnet_prefix, interface_id).gid_str()


unsupported.fill_missing(_sys.modules[__name__], "device")  # DM, AllocDmAttr: EOPNOTSUPP, as rxe
