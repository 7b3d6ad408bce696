"""Which backend an rdma_cm object runs on, decided as the verbs API decides (docs/backends.md).

``softrdma.rdmacm``'s ``CMEventChannel``, ``CMEvent`` and ``CMID`` ask :func:`on_hardware`
when they are made from nothing or from an address (an event, or an id made on a channel,
follows its channel):

- ``SOFTRDMA_BACKEND=ibverbs`` (or ``set_backend("ibverbs")``): every channel and id is
  librdmacm's (:mod:`softrdma.ibverbs.cma`);
- ``soft``: never (librdmacm is not loaded);
- ``auto`` (the default): an id made from an ``AddrInfo`` whose own address (``src``) a
  libibverbs device holds in its GID table, and no soft device has, is librdmacm's;
  everything else is soft, so a program that names no real device's address behaves the
  same on every machine (as ``Context()`` is the soft device).

Nothing here loads a library: the GID tables are read from sysfs, as rdma_cm itself sees
them.
"""

from __future__ import annotations

import glob
from ipaddress import IPv4Address, ip_address
from typing import Any

__all__ = ["on_hardware", "hw_holds_address"]

SYSFS_GIDS = "/sys/class/infiniband/*/ports/*/gids/*"


def _gid(ip: Any) -> bytes:
    ip = ip_address(ip)
    return (b"\0" * 10 + b"\xff\xff" + ip.packed) if isinstance(ip, IPv4Address) else ip.packed


def hw_holds_address(ip: Any) -> bool:
    """Whether a kernel RDMA device (rxe0, a NIC) has ``ip`` in a GID table."""
    want = _gid(ip)
    for path in glob.glob(SYSFS_GIDS):
        try:
            with open(path) as fh:
                if bytes.fromhex(fh.read().strip().replace(":", "")) == want:
                    return True
        except (OSError, ValueError):
            continue
    return False


def _soft_holds_address(ip: Any) -> bool:
    from ..verbs_api.device import soft_devices
    return any(ip_address(d.ip) == ip_address(ip) for d in soft_devices())


def on_hardware(creator: Any) -> bool:
    """Whether a channel (``creator`` None) or an id made from ``creator`` runs on
    librdmacm (module docstring)."""
    from ..verbs_api.device import get_backend
    backend = get_backend()
    if backend != "auto":
        return backend == "ibverbs"
    src = getattr(creator, "src", None)
    return src is not None and not src.is_unspecified and hw_holds_address(src) \
        and not _soft_holds_address(src)
