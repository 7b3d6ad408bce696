"""``softrdma devices`` and ``softrdma devinfo``: ibv_devices and ibv_devinfo, in softrdma.

Devices are the soft devices of this process: the embedded default ``softrdma0`` on
127.0.0.1 (or SOFTRDMA_IP), one ``softrdma-<IP>`` per ``--addr`` given, and for
``devinfo -d softrdma-<IP>`` the device on that address (any local address); then the
libibverbs devices, if any. Both commands only describe: a soft device's attributes, GIDs
and node GUID follow from its address, so nothing is bound, and a device another process
holds (a pingpong server on 127.0.0.1) is described as it is, not moved to a free address.
``devices`` prints the node GUID as 16 hex digits and ``devinfo`` as four groups, as
ibv_devices and ibv_devinfo do."""

from __future__ import annotations

import argparse
import socket
from typing import Any

from ..enums import ibv_port_state, mtu_to_bytes
from ..verbs_api import Context
from ..verbs_api.device import (
    DEFAULT_NAME, NAME_RULE, add_device, address_of_name, device_name_for, find_device,
    get_device_list, get_soft_device,
)
from .argtypes import ip_address
from .common import ToolError

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    d = sub.add_parser("devices", help="list soft devices (like ibv_devices)")
    d.add_argument("-a", "--addr", action="append", default=[], type=ip_address,
                   help="also make a device for this IP address (repeatable)")
    d.set_defaults(func=run_devices)
    v = sub.add_parser("devinfo", help="device and port attributes (like ibv_devinfo)")
    v.add_argument("-d", "--ib-dev", metavar="NAME",
                   help="only this device: softrdma0 (the default device), softrdma-<IP> (the "
                        "device on IP, any local address) or a libibverbs device (rxe0)")
    v.add_argument("-a", "--addr", action="append", default=[], type=ip_address,
                   help="also make a device for this IP address (repeatable)")
    v.add_argument("-v", "--verbose", action="store_true", help="all attributes, GIDs, counters")
    v.set_defaults(func=run_devinfo)


def _make(addrs: list[str]) -> None:
    # queried only: no socket, no progress thread, no moving to a free address
    get_soft_device(DEFAULT_NAME).live = False
    for ip in addrs:
        name = device_name_for(ip)
        if find_device(name) is None:
            add_device(ip, name=name, live=False)


def _is_local(ip: str) -> bool:
    """Whether this host holds address ``ip`` (a socket can be bound to it; port 0, so
    UDP 4791 and whoever holds it are left alone)."""
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def _only(name: str, names: list[str]) -> str:
    """The device ``devinfo -d name`` describes (made, query-only, for an address name)."""
    ip = address_of_name(name)
    if ip is not None:
        canonical = device_name_for(ip)
        if canonical not in names:
            if not _is_local(ip) and ip != get_soft_device(DEFAULT_NAME).ip:
                raise ToolError(f"IB device '{name}' wasn't found: {ip} is not an address of "
                                f"this host")
            add_device(ip, name=canonical, live=False)
        return canonical
    if name not in names:
        raise ToolError(f"IB device '{name}' wasn't found; softrdma's devices are {NAME_RULE}")
    return name


def _guid(g: int) -> str:
    h = f"{g:016x}"
    return ":".join(h[i:i + 4] for i in range(0, 16, 4))


def run_devices(a: argparse.Namespace) -> int:
    _make(a.addr)
    print(f"    {'device':<16}\t   node GUID")
    print(f"    {'------':<16}\t----------------")
    for d in get_device_list():
        print(f"    {d.name.decode():<16}\t{d.guid:016x}")
    return 0


def run_devinfo(a: argparse.Namespace) -> int:
    _make(a.addr)
    names = [d.name.decode() for d in get_device_list()]
    if a.ib_dev:
        names = [_only(a.ib_dev, names)]
    for name in names:
        with Context(name=name) as ctx:
            at = ctx.query_device()
            pa = ctx.query_port(1)
            print(f"hca_id:\t{name}")
            print("\ttransport:\t\t\tInfiniBand (0)")
            print("\tfw_ver:\t\t\t\t0.0.0")
            print(f"\tnode_guid:\t\t\t{_guid(at.node_guid)}")
            print(f"\tsys_image_guid:\t\t\t{_guid(at.sys_image_guid)}")
            print(f"\tvendor_id:\t\t\t0x{at.vendor_id:04x}")
            print(f"\tvendor_part_id:\t\t\t{at.vendor_part_id}")
            print(f"\thw_ver:\t\t\t\t0x{at.hw_ver:X}")
            print(f"\tphys_port_cnt:\t\t\t{at.phys_port_cnt}")
            if a.verbose:
                for k in ("max_mr_size", "page_size_cap", "max_qp", "max_qp_wr", "device_cap_flags",
                          "max_sge", "max_sge_rd", "max_cq", "max_cqe", "max_mr", "max_pd",
                          "max_qp_rd_atom", "max_ee_rd_atom", "max_res_rd_atom",
                          "max_qp_init_rd_atom", "max_ee_init_rd_atom", "atomic_caps", "max_ee",
                          "max_rdd", "max_mw", "max_raw_ipv6_qp", "max_raw_ethy_qp",
                          "max_mcast_grp", "max_mcast_qp_attach", "max_total_mcast_qp_attach",
                          "max_ah", "max_fmr", "max_map_per_fmr", "max_srq", "max_srq_wr",
                          "max_srq_sge", "max_pkeys", "local_ca_ack_delay"):
                    v = getattr(at, k)
                    shown = f"0x{v:x}" if k in ("max_mr_size", "page_size_cap", "device_cap_flags") else str(int(v))
                    print(f"\t{k + ':':<24}\t{shown}")
            print("\t\tport:\t1")
            print(f"\t\t\tstate:\t\t\t{ibv_port_state(pa.state).name.removeprefix('IBV_')} ({int(pa.state)})")
            print(f"\t\t\tmax_mtu:\t\t{mtu_to_bytes(pa.max_mtu)} ({int(pa.max_mtu)})")
            print(f"\t\t\tactive_mtu:\t\t{mtu_to_bytes(pa.active_mtu)} ({int(pa.active_mtu)})")
            print("\t\t\tsm_lid:\t\t\t0")
            print("\t\t\tport_lid:\t\t0")
            print("\t\t\tport_lmc:\t\t0x00")
            print("\t\t\tlink_layer:\t\tEthernet")
            if a.verbose:
                print(f"\t\t\tmax_msg_sz:\t\t0x{pa.max_msg_sz:x}")
                print(f"\t\t\tport_cap_flags:\t\t0x{pa.port_cap_flags:08x}")
                print(f"\t\t\tgid_tbl_len:\t\t{pa.gid_tbl_len}")
                print(f"\t\t\tpkey_tbl_len:\t\t{pa.pkey_tbl_len}")
                for i, gid, _t in ctx.query_gid_table():
                    # as ibv_devinfo prints it (inet_ntop): fe80::..., ::ffff:10.0.0.1
                    shown = socket.inet_ntop(socket.AF_INET6,
                                             bytes.fromhex(gid.gid.replace(":", "")))
                    print(f"\t\t\tGID[{i:3d}]:\t\t{shown}, RoCE v2")
                print(f"\t\t\taddress:\t\t{ctx.device.ip} (UDP {4791})")
                for k, val in ctx.device.counters.as_dict().items():
                    print(f"\t\t\tcounter {k + ':':<24}{val}")
            print()
    return 0


