"""A soft device's network interface, as pyverbs programs look it up.

rdma-core's tests (``tests/base.py``, ``RDMATestCase._get_ip_mac``) find a device's IP
address the Linux way::

    os.path.exists('/sys/class/infiniband/<dev>/device/net/')
    subprocess.check_output(['ls', '/sys/class/infiniband/<dev>/device/net/'])
    subprocess.check_output(['ip', '-j', 'addr', 'show', <netdev>])
    subprocess.check_output(['rdma', 'link', 'show', '-j'])      # rdma-core 46 on
    subprocess.check_output(['cat', '/sys/class/infiniband/<dev>/ports/1/pkeys/0'])

A soft device has no sysfs entry, and the interface holding its address (``lo``) holds
127.0.0.1 first, whichever 127.0.0.x the device has. :func:`install` (called by
``softrdma run``, in the program's process only) answers exactly these lookups for soft
devices: the device's net directory lists one interface, ``lo:<device>`` (the label
Linux gives an extra address on ``lo``), and ``ip -j addr show lo:<device>`` gives the
device's address and MAC in iproute2's JSON. Every other path and command goes to the
real ``os.path`` and ``subprocess`` unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

SYSFS = "/sys/class/infiniband/"
LABEL = "lo:"

_real_exists = os.path.exists
_real_check_output = subprocess.check_output
_installed = False


def _soft_device(name: str) -> Any | None:
    from ..verbs_api.device import soft_devices
    for dev in soft_devices():
        if dev.name == name:
            return dev
    return None


def _sysfs_device(path: Any) -> tuple[Any, str] | None:
    """(soft device, the rest of the path) for /sys/class/infiniband/<soft dev>/...."""
    try:
        p = os.fspath(path)
    except TypeError:
        return None
    if isinstance(p, bytes) or not p.startswith(SYSFS):
        return None
    name, _, rest = p[len(SYSFS):].partition("/")
    dev = _soft_device(name)
    return (dev, rest.strip("/")) if dev is not None else None


def net_name(dev: Any) -> str:
    return LABEL + dev.name


def ip_json(dev: Any) -> list[dict[str, Any]]:
    """``ip -j addr show`` of the device's interface: its address first."""
    import ipaddress
    ip = ipaddress.ip_address(dev.ip)
    mac = ":".join(f"{b:02x}" for b in bytes(dev.mac))
    return [{"ifindex": 1, "ifname": net_name(dev), "flags": ["LOOPBACK", "UP", "LOWER_UP"],
             "mtu": 65536, "operstate": "UNKNOWN", "link_type": "loopback", "address": mac,
             "addr_info": [{"family": "inet" if ip.version == 4 else "inet6",
                            "local": str(ip), "prefixlen": 8 if ip.version == 4 else 128,
                            "scope": "host", "label": net_name(dev)}]}]


def exists(path: Any) -> bool:
    hit = _sysfs_device(path)
    if hit is None:
        return _real_exists(path)
    rest = hit[1]
    return rest in ("", "device", "device/net", f"device/net/{net_name(hit[0])}")


def rdma_links() -> list[dict[str, Any]]:
    """``rdma link show -j`` rows of the soft devices (iproute2's JSON, one port each)."""
    from ..verbs_api.device import soft_devices
    return [{"ifindex": 0, "ifname": d.name, "port": 1, "state": "ACTIVE",
             "physical_state": "LINK_UP", "netdev": net_name(d), "netdev_index": 1}
            for d in soft_devices()]


def check_output(args: Any, *a: Any, **kw: Any) -> Any:
    argv = list(args) if isinstance(args, (list, tuple)) else None
    out = None
    if argv and argv[:3] == ["rdma", "link", "show"] and "-j" in argv[3:] and len(argv) == 4:
        # rdma-core 46 on looks a port's netdev up so (tests/base.py get_net_name); the
        # kernel's links (none without NETLINK_RDMA, as in a container) then the soft ones
        try:
            real = json.loads(_real_check_output(args, stderr=subprocess.DEVNULL) or b"[]")
        except (OSError, subprocess.CalledProcessError, ValueError):
            real = []
        out = json.dumps(real + rdma_links()) + "\n"
    elif argv and argv[0] == "cat" and len(argv) == 2 and _sysfs_device(argv[1]) and \
            _sysfs_device(argv[1])[1] == "ports/1/pkeys/0":
        out = "0xffff\n"  # the default P_Key, index 0 of every RoCE port (rxe's too)
    elif argv and argv[0] == "ls" and len(argv) == 2:
        hit = _sysfs_device(argv[1])
        if hit is not None and hit[1] == "device/net":
            out = net_name(hit[0]) + "\n"
    elif argv and argv[:4] == ["ip", "-j", "addr", "show"] and len(argv) == 5 and \
            argv[4].startswith(LABEL):
        dev = _soft_device(argv[4][len(LABEL):])
        if dev is not None:
            out = json.dumps(ip_json(dev)) + "\n"
    if out is None:
        return _real_check_output(args, *a, **kw)
    return out if kw.get("text") or kw.get("universal_newlines") or kw.get("encoding") \
        else out.encode()


def install() -> None:
    """Answer the lookups above for soft devices in this process (idempotent)."""
    global _installed
    if not _installed:
        os.path.exists = exists
        subprocess.check_output = check_output
        _installed = True


def uninstall() -> None:
    global _installed
    os.path.exists = _real_exists
    subprocess.check_output = _real_check_output
    _installed = False
