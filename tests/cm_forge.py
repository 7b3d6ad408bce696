"""Forged CM MADs for the tests of what an off-path peer can make rdma_cm hold.

The template is the real REQ of ``pcaps/linux-rxe/ucmatose.pcap`` (Linux rxe,
10.77.0.12 -> 10.77.0.11, TCP port 7471): a forger needs nothing else. Each forged REQ gets
its own comm ID and QPN (otherwise the CM takes it for a duplicate or a stale connection),
and goes into a manual device as the packet QP1 would receive.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from softrdma.cm.cma import CmaHeader, service_id
from softrdma.cm.messages import REQ, SIDR_REQ, build_cm, parse_cm
from softrdma.cm.qp1 import QP1_UDP_SPORT, build_qp1
from softrdma.harness.replay import load_capture
from softrdma.rdmacm import RAI_PASSIVE, AddrInfo, CMEventChannel, CMID
from softrdma.wire.packet import parse

from .conftest import PCAPS

SERVER, FORGER = "10.77.0.11", "10.77.0.12"
PORT = 7471  # the capture's service: TCP port 7471
_REQ = next(cp for cp in load_capture(str(PCAPS / "ucmatose.pcap")) if cp.pkt.dest_qp == 1)
REQ_MSG = parse_cm(_REQ.pkt.payload)


def forged_req(n: int, private_data: bytes | None = None, **fields: Any) -> bytes:
    """The capture's REQ as the ``n``-th of a flood: comm ID, QPN and TID of its own;
    ``fields`` override REQ fields by name, ``private_data`` the cma header and data."""
    vals = {a: getattr(REQ_MSG, a) for a in REQ.attrs}
    vals.update(local_comm_id=0x10000 + n, local_qpn=0x100 + n)
    vals.update(fields)
    pd = bytes(REQ_MSG.private_data) if private_data is None else private_data
    return build_cm(REQ, tid=REQ_MSG.tid + n, private_data=pd, **vals)


def cma_header(dst: str = SERVER, sport: int = 40000) -> bytes:
    """A cma header from the forger to ``dst``."""
    return CmaHeader(src=ipaddress.ip_address(FORGER), dst=ipaddress.ip_address(dst),
                     sport=sport).pack()


def forged_sidr_req(n: int, port: int) -> bytes:
    """A SIDR_REQ from the forger to a UDP-port-space listener on ``port``, as rdma_cm's
    active side builds it (the cma header first in the private data)."""
    return build_cm(SIDR_REQ, tid=0x5000 + n, request_id=0x20000 + n, pkey=0xFFFF,
                    service_id=service_id(0x0111, port),
                    private_data=cma_header(sport=40000 + n))


def deliver(dev: Any, mad: bytes) -> None:
    """``mad`` arrives at ``dev``'s QP1 from the forger."""
    dev.receive(bytes(build_qp1(mad)), ipaddress.ip_address(FORGER).packed,
                ipaddress.ip_address(SERVER).packed, sport=QP1_UDP_SPORT, verify_icrc=False)


class Wire:
    """What a device sends, kept (``dev.transmit`` replaced): the CM MADs as parsed
    messages, in order. ``forward`` also hands each packet on (a manual device's own
    loopback)."""

    def __init__(self, dev: Any, forward: bool = False) -> None:
        self.packets: list[Any] = []
        self.at: list[float] = []
        orig = dev.transmit

        def transmit(data: bytes, dst: bytes, sport: int) -> None:
            self.packets.append(parse(bytes(data)))
            self.at.append(dev.now)
            if forward:
                orig(data, dst, sport)
        dev.transmit = transmit

    def mads(self, name: str | None = None) -> list[Any]:
        out = [parse_cm(p.payload) for p in self.packets if p.dest_qp == 1]
        return [m for m in out if name is None or m.name == name]

    def times(self, name: str) -> list[float]:
        return [t for t, p in zip(self.at, self.packets)
                if p.dest_qp == 1 and parse_cm(p.payload).name == name]


def listening(ch: CMEventChannel, backlog: int, ps: int | None = None) -> CMID:
    """A listener on the capture's address and port (``ps``: its port space)."""
    kw = {} if ps is None else {"port_space": ps}
    lid = CMID(ch, **kw)
    lid.bind_addr(AddrInfo(src=SERVER, src_service=str(PORT), flags=RAI_PASSIVE, **kw))
    lid.listen(backlog)
    return lid
