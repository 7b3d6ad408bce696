"""rdma_cm's port spaces: which ids hold which port (``rdma_bind_addr``'s bookkeeping).

A port belongs to a port space (TCP, UDP, IB, IPoIB) as in cma.c's per-namespace
``idr``s; binding checks conflicts as ``cma_check_port`` does (a wildcard address
conflicts with every address on its port; two ids that both set REUSEADDR share one
unless it listens) and port 0 takes an ephemeral port from :data:`PORT_RANGE`, as
``cma_alloc_any_port`` does with ``inet_get_local_port_range``.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import threading
from ipaddress import IPv4Address, IPv6Address
from typing import Any, Protocol

from ..errors import PyverbsRDMAError
from .enums import RdmaCmState

__all__ = ["PortSpaces", "PORTS", "PORT_RANGE"]

#: Linux's default ip_local_port_range, where ephemeral rdma_cm ports come from
PORT_RANGE = (32768, 60999)

IPAddress = IPv4Address | IPv6Address


class PortOwner(Protocol):
    """What the bookkeeping reads of an id that binds a port."""

    ps: int
    src_ip: IPAddress | None
    src_port: int
    reuseaddr: bool
    state: RdmaCmState


class PortSpaces:
    """Bound ports per port space: ``rdma_bind_addr``'s conflicts and ephemeral ports."""

    def __init__(self) -> None:
        self.bound: dict[tuple[int, int], list[Any]] = {}
        self.lock = threading.Lock()
        self.rng = random.Random()

    def bind(self, cid: PortOwner, ip: IPAddress | None, port: int) -> int:
        """Enter ``cid`` on ``port`` (0: a free ephemeral one) of its port space; the port.
        EADDRINUSE when another id holds it, EADDRNOTAVAIL when no port is free."""
        ps = cid.ps
        with self.lock:
            if port == 0:
                lo, hi = PORT_RANGE
                start = self.rng.randint(lo, hi)
                for p in itertools.chain(range(start, hi + 1), range(lo, start)):
                    if not self._conflict(ps, ip, p, cid):
                        port = p
                        break
                else:
                    raise PyverbsRDMAError("rdma_bind_addr: no free port",
                                           errno.EADDRNOTAVAIL)
            elif self._conflict(ps, ip, port, cid):
                raise PyverbsRDMAError(f"rdma_bind_addr: port {port} is in use"
                                       f"{'' if ip is None else f' on {ip}'}",
                                       errno.EADDRINUSE)
            self.bound.setdefault((ps, port), []).append(cid)
            return port

    def _conflict(self, ps: int, ip: IPAddress | None, port: int, cid: PortOwner) -> bool:
        for other in self.bound.get((ps, port), ()):
            if other is cid:
                continue
            oip = other.src_ip
            if cid.reuseaddr and other.reuseaddr and other.state != RdmaCmState.LISTEN:
                continue
            if ip is None or oip is None or oip == ip:
                return True
        return False

    def unbind(self, cid: PortOwner) -> None:
        with self.lock:
            ids = self.bound.get((cid.ps, cid.src_port))
            if ids and cid in ids:
                ids.remove(cid)
                if not ids:
                    del self.bound[(cid.ps, cid.src_port)]

    def reset(self) -> None:
        """Forget every binding (a forked child: the parent's ids stay the parent's), and
        a fresh random source so parent and child do not pick the same ports."""
        self.bound = {}
        self.lock = threading.Lock()
        self.rng = random.Random()


PORTS = PortSpaces()
os.register_at_fork(after_in_child=PORTS.reset)
