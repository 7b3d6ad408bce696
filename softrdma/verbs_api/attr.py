"""Attribute objects: QP capabilities and attributes, address-handle attributes, GIDs.

Named and shaped as pyverbs' (``QPCap``, ``QPInitAttr``, ``QPAttr``, ``GID``,
``GlobalRoute``, ``AHAttr``, ``SrqAttr``, ``SrqInitAttr``), with the same keyword
arguments and defaults, as plain Python objects you can print and compare.
"""

from __future__ import annotations

import copy
import errno
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from ..errors import PyverbsRDMAError
from ._check import kind, show
from .enums import ibv_mig_state, ibv_mtu, ibv_qp_state, ibv_qp_type

__all__ = ["GID", "GlobalRoute", "AHAttr", "QPCap", "QPInitAttr", "QPAttr", "SrqAttr",
           "SrqInitAttr"]


class GID:
    """A 16-byte GID. ``GID("fe80::1")``, ``GID(b"...16 bytes...")``, the pyverbs colon
    form ``GID("0000:0000:0000:0000:0000:ffff:0a00:0001")`` or an IPv4 address (its RoCEv2
    GID). ``.gid`` gives the colon form. Anything else is PyverbsRDMAError(EINVAL) naming
    the value."""

    __slots__ = ("raw",)

    def __init__(self, val: "str | bytes | bytearray | GID | None" = None) -> None:
        self.raw = GID.parse(val).raw if val is not None else bytes(16)

    @staticmethod
    def parse(val: Any, what: str = "Invalid GID") -> "GID":
        """``val`` (a GID, 16 bytes, an IPv6 or IPv4 address as text or ``ipaddress``
        object) as a GID, or PyverbsRDMAError(EINVAL) whose message starts with ``what``
        (the caller's context: ``"Failed to create AH: attr.gr.dgid"``)."""
        g = GID.__new__(GID)
        if isinstance(val, GID):
            g.raw = val.raw
            return g
        if isinstance(val, (bytes, bytearray, memoryview)):
            if len(val) != 16:
                raise PyverbsRDMAError(f"{what}: a GID is 16 bytes, got {len(val)}",
                                       errno.EINVAL)
            g.raw = bytes(val)
            return g
        if isinstance(val, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
            val = str(val)
        if not isinstance(val, str):
            raise PyverbsRDMAError(f"{what}: {show(val)} is {kind(val)}, not a GID (a str, "
                                   f"16 bytes or a GID)", errno.EINVAL)
        try:
            g.raw = ipaddress.IPv6Address(val).packed
        except ValueError:
            try:
                a = ipaddress.IPv4Address(val)  # an IPv4 address: its RoCEv2 GID
            except ValueError:
                raise PyverbsRDMAError(f"{what}: {show(val)} is not a GID or an IP address",
                                       errno.EINVAL) from None
            g.raw = bytes(10) + b"\xff\xff" + a.packed
        return g

    @property
    def gid(self) -> str:
        h = self.raw.hex()
        return ":".join(h[i:i + 4] for i in range(0, 32, 4))

    @property
    def ip(self) -> str:
        """The IP address a RoCEv2 GID stands for (IPv4-mapped GIDs give IPv4)."""
        if self.raw[:12] == bytes(10) + b"\xff\xff":
            return str(ipaddress.IPv4Address(self.raw[12:]))
        return str(ipaddress.IPv6Address(self.raw))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GID) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __bool__(self) -> bool:
        return self.raw != bytes(16)

    def __str__(self) -> str:
        return self.gid

    def __repr__(self) -> str:
        return f"GID({str(ipaddress.IPv6Address(self.raw))!r})"


@dataclass
class GlobalRoute:
    """The GRH part of an address: ``ibv_global_route``."""

    dgid: GID | None = None
    flow_label: int = 0
    sgid_index: int = 0
    hop_limit: int = 1
    traffic_class: int = 0

    def __post_init__(self) -> None:
        if self.dgid is not None and not isinstance(self.dgid, GID):
            self.dgid = GID.parse(self.dgid, "GlobalRoute: dgid")


@dataclass
class AHAttr:
    """``ibv_ah_attr``. On RoCE the GRH is mandatory: ``is_global=1`` with a ``gr``."""

    dlid: int = 0
    sl: int = 0
    src_path_bits: int = 0
    static_rate: int = 0
    is_global: int = 0
    port_num: int = 1
    gr: GlobalRoute | None = None

    # pyverbs exposes the GRH fields directly on AHAttr as well
    @property
    def dgid(self) -> GID | None:
        return self.gr.dgid if self.gr else None

    @property
    def sgid_index(self) -> int:
        return self.gr.sgid_index if self.gr else 0

    @property
    def hop_limit(self) -> int:
        return self.gr.hop_limit if self.gr else 0

    @property
    def traffic_class(self) -> int:
        return self.gr.traffic_class if self.gr else 0

    @property
    def flow_label(self) -> int:
        return self.gr.flow_label if self.gr else 0


@dataclass
class QPCap:
    max_send_wr: int = 1
    max_recv_wr: int = 10
    max_send_sge: int = 1
    max_recv_sge: int = 1
    max_inline_data: int = 0


@dataclass
class QPInitAttr:
    """``ibv_qp_init_attr``; ``scq``/``rcq`` are the send and receive CQs (pyverbs names)."""

    qp_type: int = ibv_qp_type.IBV_QPT_UD
    qp_context: Any = None
    scq: Any = None
    rcq: Any = None
    srq: Any = None
    cap: QPCap | None = None
    sq_sig_all: int = 1

    def __post_init__(self) -> None:
        if self.cap is None:
            self.cap = QPCap()


@dataclass
class QPAttr:
    """``ibv_qp_attr``: every attribute modify_qp can set and query_qp reports."""

    qp_state: int = ibv_qp_state.IBV_QPS_INIT
    cur_qp_state: int = ibv_qp_state.IBV_QPS_RESET
    path_mtu: int = ibv_mtu.IBV_MTU_1024
    path_mig_state: int = ibv_mig_state.IBV_MIG_MIGRATED
    qkey: int = 0
    rq_psn: int = 0
    sq_psn: int = 0
    dest_qp_num: int = 0
    qp_access_flags: int = 0
    cap: QPCap = field(default_factory=QPCap)
    ah_attr: AHAttr = field(default_factory=AHAttr)
    alt_ah_attr: AHAttr = field(default_factory=AHAttr)
    pkey_index: int = 0
    alt_pkey_index: int = 0
    en_sqd_async_notify: int = 0
    sq_draining: int = 0
    max_rd_atomic: int = 0
    max_dest_rd_atomic: int = 0
    min_rnr_timer: int = 0
    port_num: int = 1
    timeout: int = 0
    retry_cnt: int = 0
    rnr_retry: int = 0
    alt_port_num: int = 0
    alt_timeout: int = 0
    rate_limit: int = 0

    def copy(self) -> "QPAttr":
        return copy.deepcopy(self)


@dataclass
class SrqAttr:
    max_wr: int = 100
    max_sge: int = 1
    srq_limit: int = 0


@dataclass
class SrqInitAttr:
    attr: SrqAttr = field(default_factory=SrqAttr)
    srq_context: Any = None
