"""The CM messages, each described once: parse, build, the dissector and docs/cm.md derive
from these descriptions.

A CM message is the 232-byte data of a 256-byte MAD (:mod:`softrdma.cm.mad`): fixed fields
described by a :class:`~softrdma.cm.layout.Layout` (IBTA vol. 1 chapter 12, tables 106-120;
include/rdma/ibta_vol1_c12.h), then private data to the end of the MAD. The layouts are
checked at import to fill exactly 232 bytes with their private data. Field names are the
stable ``attr`` names used as build keywords, on a parsed :class:`CMMessage` and, prefixed
with ``cm_``, as the dissector's JSON keys.

================  =====  ================================  =============
message           attr   carries                           private data
================  =====  ================================  =============
REQ               0x10   connection request: QPN, PSN,     92 bytes
                         path, service ID, timeouts
MRA               0x11   message receipt acknowledgement   222
REJ               0x12   reject, with a reason and ARI     148
REP               0x13   reply: QPN, PSN, resources        196
RTU               0x14   ready to use                      224
DREQ              0x15   disconnection request             220
DREP              0x16   disconnection reply               224
SIDR_REQ          0x17   service ID resolution (UD)        216
SIDR_REP          0x18   its reply: QPN, Q_Key, status     136
LAP / APR         0x19/  alternate path (APM): **not       --
                  0x1A   supported on RoCE** (Linux drops
                         them there; no layouts here)
================  =====  ================================  =============

Build one and read it back::

    >>> from softrdma.cm.messages import RTU, build_cm, parse_cm
    >>> mad = build_cm(RTU, tid=0x23650c93f, local_comm_id=0x3fc95036,
    ...                remote_comm_id=0x0f409226)
    >>> m = parse_cm(mad)
    >>> m.name, hex(m.local_comm_id), hex(m.remote_comm_id), len(m.private_data)
    ('RTU', '0x3fc95036', '0xf409226', 224)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..wire.headers import Field
from .layout import Layout, Value
from .mad import (
    MAD_DATA_SIZE, MAD_HDR_SIZE, AttrId, MadError, MadHeader, build_mad, cm_mad_drop_reason,
    cm_mad_header, parse_mad,
)

__all__ = [
    "RejectReason", "MsgResponse", "TransportType", "SidrStatus", "MessageType", "CMMessage",
    "REQ", "MRA", "REJ", "REP", "RTU", "DREQ", "DREP", "SIDR_REQ", "SIDR_REP", "MESSAGES",
    "UNSUPPORTED", "BY_NAME", "parse_cm", "build_cm",
]


class RejectReason(enum.IntEnum):
    """REJ reason codes (IBTA table 109; ``enum ib_cm_rej_reason`` in include/rdma/ib_cm.h).

    What Linux sends: 8 (no listener for the service ID), 10 (stale connection), 12 (the
    path from a REQ does not resolve), 28 (``rdma_reject`` and every rdma_cm-level failure),
    4 (an id in REQ_SENT destroyed) and 35 (``rdma_reject_ece``)."""

    NO_QP = 1
    NO_EEC = 2
    NO_RESOURCES = 3
    TIMEOUT = 4
    UNSUPPORTED = 5
    INVALID_COMM_ID = 6
    INVALID_COMM_INSTANCE = 7
    INVALID_SERVICE_ID = 8
    INVALID_TRANSPORT_TYPE = 9
    STALE_CONN = 10
    RDC_NOT_EXIST = 11
    INVALID_GID = 12
    INVALID_LID = 13
    INVALID_SL = 14
    INVALID_TRAFFIC_CLASS = 15
    INVALID_HOP_LIMIT = 16
    INVALID_PACKET_RATE = 17
    INVALID_ALT_GID = 18
    INVALID_ALT_LID = 19
    INVALID_ALT_SL = 20
    INVALID_ALT_TRAFFIC_CLASS = 21
    INVALID_ALT_HOP_LIMIT = 22
    INVALID_ALT_PACKET_RATE = 23
    PORT_CM_REDIRECT = 24
    PORT_REDIRECT = 25
    INVALID_MTU = 26
    INSUFFICIENT_RESP_RESOURCES = 27
    CONSUMER_DEFINED = 28
    INVALID_RNR_RETRY = 29
    DUPLICATE_LOCAL_COMM_ID = 30
    INVALID_CLASS_VERSION = 31
    INVALID_FLOW_LABEL = 32
    INVALID_ALT_FLOW_LABEL = 33
    VENDOR_OPTION_NOT_SUPPORTED = 35


class MsgResponse(enum.IntEnum):
    """The message a REJ rejects or an MRA acknowledges (``enum cm_msg_response``)."""

    REQ = 0
    REP = 1
    OTHER = 2


class TransportType(enum.IntEnum):
    """REQ transport service type (2 bits). XRC also sets extended transport type 1."""

    RC = 0
    UC = 1
    XRC = 3


class SidrStatus(enum.IntEnum):
    """SIDR_REP status (``enum ib_cm_sidr_status``)."""

    SUCCESS = 0
    UNSUPPORTED = 1  # no listener for the service ID
    REJECT = 2  # rdma_reject, or an rdma_cm-level failure
    NO_QP = 3
    REDIRECT = 4
    UNSUPPORTED_VERSION = 5


def _enum_name(enum_cls: type[enum.IntEnum]) -> Callable[[int], str]:
    def name(v: int) -> str:
        try:
            return enum_cls(v).name
        except ValueError:
            return str(v)
    return name


def _enum_code(enum_cls: type[enum.IntEnum]) -> Callable[[int], str]:
    """``CONSUMER_DEFINED(28)``: the name and the number, for codes people look up."""
    def show(v: int) -> str:
        try:
            return f"{enum_cls(v).name}({v})"
        except ValueError:
            return str(v)
    return show


def _f(name: str, bits: int, doc: str, **kw: Any) -> Field:
    kw.setdefault("attr", name)
    if bits > 64:
        kw.setdefault("show", lambda b: b.hex())
    return Field(name, bits, doc, **kw)


def _resv(name: str, bits: int) -> Field:
    return Field(name, bits, "reserved: sent as zero, ignored on receive")


_dec = str
_qpn = "0x{:06x}".format
_hex8 = "0x{:08x}".format
_hex16 = "0x{:016x}".format


def _comm_ids() -> tuple[Field, ...]:
    return (_f("local_comm_id", 32, "the sender's communication ID", show=_hex8),
            _f("remote_comm_id", 32, "the receiver's communication ID (0 if not yet known)",
               show=_hex8))


def _path(prefix: str, what: str) -> tuple[Field, ...]:
    """A REQ path (primary or alternate): 44 bytes from the local LID to the ACK timeout."""
    p = prefix
    return (
        _f(f"{p}_local_lid", 16, f"{what} local port LID (0xFFFF, permissive, on RoCE)"),
        _f(f"{p}_remote_lid", 16, f"{what} remote port LID (0xFFFF on RoCE)"),
        _f(f"{p}_local_gid", 128, f"{what} local port GID: the sender's IP, as a RoCEv2 GID"),
        _f(f"{p}_remote_gid", 128, f"{what} remote port GID: the receiver's IP"),
        _f(f"{p}_flow_label", 20, f"{what} flow label; on RoCEv2 it picks the RC UDP source "
                                  "port"),
        _resv(f"{p}_resv0", 6),
        _f(f"{p}_packet_rate", 6, f"{what} static rate (IBTA rate enum; 0 from rxe)"),
        _f(f"{p}_traffic_class", 8, f"{what} traffic class (the rdma_cm TOS)", show=_dec),
        _f(f"{p}_hop_limit", 8, f"{what} hop limit (the IP TTL; 64)", show=_dec),
        _f(f"{p}_sl", 4, f"{what} service level", show=_dec),
        _f(f"{p}_subnet_local", 1, f"{what}: 1 if the peer is in the local subnet", show=_dec),
        _resv(f"{p}_resv1", 3),
        _f(f"{p}_local_ack_timeout", 5, f"{what} local ACK timeout (4.096 us x 2^t): the "
                                        "passive side's QP timeout", show=_dec),
        *((_f("sap_supported", 1, "the sender supports the alternate path (APM)"),
           _resv(f"{p}_resv2", 2)) if p == "alt" else (_resv(f"{p}_resv2", 3),)),
    )


@dataclass(frozen=True, slots=True)
class MessageType:
    """One CM message: its attribute ID, its fixed fields, and its private data (the rest
    of the MAD). ``shown`` lists the fields the dissector's text line prints."""

    name: str
    attr_id: AttrId
    title: str
    layout: Layout
    shown: tuple[str, ...] = ()
    private_data_size: int = field(init=False)
    private_data_offset: int = field(init=False)  # from the start of the MAD

    def __post_init__(self) -> None:
        if self.layout.size > MAD_DATA_SIZE:
            raise ValueError(f"{self.name}: the fields overflow the MAD")
        object.__setattr__(self, "private_data_size", MAD_DATA_SIZE - self.layout.size)
        object.__setattr__(self, "private_data_offset", MAD_HDR_SIZE + self.layout.size)
        missing = set(self.shown) - set(self.layout.attrs)
        if missing:
            raise ValueError(f"{self.name}: shows unknown fields {missing}")

    @property
    def attrs(self) -> tuple[str, ...]:
        return self.layout.attrs

    def offsets(self) -> dict[str, tuple[int, int, int]]:
        """``{attr: (MAD byte offset, first bit from the MSB, bits)}``, private data
        included: the table docs/cm.md prints and tests check against the kernel's."""
        out = {a: (o + MAD_HDR_SIZE, b, n) for a, (o, b, n) in self.layout.offsets().items()}
        out["private_data"] = (self.private_data_offset, 0, 8 * self.private_data_size)
        return out


_mraed = dict(show=_enum_name(MsgResponse), hex=False)

REQ = MessageType("REQ", AttrId.REQ, "connection request", Layout("REQ", (
    "!IIQQIIIIIIHBBHH16s16sIBBBBHH16s16sIBBBB"), (
    _f("local_comm_id", 32, "the active side's communication ID", show=_hex8),
    _resv("resv0", 8),
    _f("vendor_id", 24, "ECE vendor ID (0 without ECE)"),
    _f("service_id", 64, "service ID: the rdma_cm port space and port", show=_hex16),
    _f("local_ca_guid", 64, "the active side's node GUID", show=_hex16),
    _resv("resv1", 32),
    _f("local_qkey", 32, "local Q_Key (0 for RC)", show=_hex8),
    _f("local_qpn", 24, "the active side's QP number", show=_qpn),
    _f("responder_resources", 8, "RDMA READ/atomic requests the sender will answer at "
                                 "once: the peer's initiator depth", show=_dec),
    _f("local_eecn", 24, "local EE context (RD only; 0)"),
    _f("initiator_depth", 8, "RDMA READ/atomic requests the sender keeps outstanding: "
                             "the peer's responder resources", show=_dec),
    _f("remote_eecn", 24, "remote EE context (RD only; 0)"),
    _f("remote_cm_response_timeout", 5, "how long the passive side may take to answer "
                                        "(4.096 us x 2^t)", show=_dec),
    _f("transport_type", 2, "transport service type: RC 0, UC 1, XRC 3",
       show=_enum_name(TransportType), hex=False),
    _f("flow_control", 1, "end-to-end flow control", show=_dec),
    _f("starting_psn", 24, "the PSN the active side's receive queue expects first: the "
                           "passive side's send PSN", show=_dec),
    _f("local_cm_response_timeout", 5, "how long the active side may take to answer "
                                       "(4.096 us x 2^t)", show=_dec),
    _f("retry_count", 3, "transport retries on timeout, for both QPs", show=_dec),
    _f("pkey", 16, "partition key (0xFFFF)"),
    _f("path_mtu", 4, "path MTU (IBTA enum: 1=256 .. 5=4096)", show=_dec),
    _f("rdc_exists", 1, "RD channel exists (RD only)", show=_dec),
    _f("rnr_retry_count", 3, "RNR retries for the passive side's QP (7 = forever)",
       show=_dec),
    _f("max_cm_retries", 4, "CM retransmissions the passive side may make", show=_dec),
    _f("srq", 1, "the active side's QP has an SRQ", show=_dec),
    _f("extended_transport", 3, "extended transport type (1 = XRC)", show=_dec),
    *_path("primary", "primary path"),
    *_path("alt", "alternate path"),
)), shown=("local_comm_id", "service_id", "local_qpn", "starting_psn", "responder_resources",
           "initiator_depth", "transport_type", "retry_count", "rnr_retry_count", "path_mtu"))

MRA = MessageType("MRA", AttrId.MRA, "message receipt acknowledgement", Layout(
    "MRA", "!IIBB", (
        *_comm_ids(),
        _f("message_mraed", 2, "the message acknowledged: REQ 0, REP 1, other 2", **_mraed),
        _resv("resv0", 6),
        _f("service_timeout", 5, "how much longer the sender needs (4.096 us x 2^t)",
           show=_dec),
        _resv("resv1", 3),
    )), shown=("local_comm_id", "remote_comm_id", "message_mraed", "service_timeout"))

REJ = MessageType("REJ", AttrId.REJ, "reject", Layout("REJ", "!IIBBH72s", (
    *_comm_ids(),
    _f("message_rejected", 2, "the message rejected: REQ 0, REP 1, other 2", **_mraed),
    _resv("resv0", 6),
    _f("reject_info_length", 7, "bytes of ARI that mean something", show=_dec),
    _resv("resv1", 1),
    _f("reason", 16, "reject reason (RejectReason)", show=_enum_code(RejectReason),
       hex=False),
    _f("ari", 576, "additional reject information (72 bytes)"),
)), shown=("local_comm_id", "remote_comm_id", "message_rejected", "reason"))

REP = MessageType("REP", AttrId.REP, "connection reply", Layout("REP", "!IIIIIIBBBBQ", (
    *_comm_ids(),
    _f("local_qkey", 32, "local Q_Key (0 for RC)", show=_hex8),
    _f("local_qpn", 24, "the passive side's QP number", show=_qpn),
    _f("vendor_id_hi", 8, "ECE vendor ID, bits 23..16"),
    _f("local_eecn", 24, "local EE context (RD; XRC: the SRQ's QPN)"),
    _f("vendor_id_mid", 8, "ECE vendor ID, bits 15..8"),
    _f("starting_psn", 24, "the PSN the passive side's receive queue expects first: the "
                           "active side's send PSN", show=_dec),
    _f("vendor_id_lo", 8, "ECE vendor ID, bits 7..0"),
    _f("responder_resources", 8, "the passive side's responder resources: the active "
                                 "side's max_rd_atomic", show=_dec),
    _f("initiator_depth", 8, "the passive side's initiator depth", show=_dec),
    _f("target_ack_delay", 5, "the passive side's CA ACK delay (rxe 15)", show=_dec),
    _f("failover_accepted", 2, "alternate path accepted (0 = yes, APM only)", show=_dec),
    _f("flow_control", 1, "end-to-end flow control", show=_dec),
    _f("rnr_retry_count", 3, "RNR retries for the active side's QP", show=_dec),
    _f("srq", 1, "the passive side's QP has an SRQ", show=_dec),
    _resv("resv0", 4),
    _f("local_ca_guid", 64, "the passive side's node GUID", show=_hex16),
)), shown=("local_comm_id", "remote_comm_id", "local_qpn", "starting_psn",
           "responder_resources", "initiator_depth", "rnr_retry_count"))

RTU = MessageType("RTU", AttrId.RTU, "ready to use", Layout("RTU", "!II", _comm_ids()),
                  shown=("local_comm_id", "remote_comm_id"))

DREQ = MessageType("DREQ", AttrId.DREQ, "disconnection request", Layout("DREQ", "!III", (
    *_comm_ids(),
    _f("remote_qpn", 24, "the receiver's QP number (a mismatch is dropped)", show=_qpn),
    _resv("resv0", 8),
)), shown=("local_comm_id", "remote_comm_id", "remote_qpn"))

DREP = MessageType("DREP", AttrId.DREP, "disconnection reply",
                   Layout("DREP", "!II", _comm_ids()),
                   shown=("local_comm_id", "remote_comm_id"))

SIDR_REQ = MessageType("SIDR_REQ", AttrId.SIDR_REQ, "service ID resolution request",
                       Layout("SIDR_REQ", "!IHHQ", (
                           _f("request_id", 32, "the requester's ID for this resolution",
                              show=_hex8),
                           _f("pkey", 16, "partition key (0xFFFF)"),
                           _resv("resv0", 16),
                           _f("service_id", 64, "the service to resolve", show=_hex16),
                       )), shown=("request_id", "service_id"))

SIDR_REP = MessageType("SIDR_REP", AttrId.SIDR_REP, "service ID resolution reply",
                       Layout("SIDR_REP", "!IBBHIQI72s", (
                           _f("request_id", 32, "the SIDR_REQ's request ID", show=_hex8),
                           _f("status", 8, "SidrStatus: 0 success", show=_enum_code(SidrStatus),
                              hex=False),
                           _f("additional_info_length", 8, "bytes of additional information",
                              show=_dec),
                           _f("vendor_id_hi", 16, "ECE vendor ID, bits 23..8"),
                           _f("qpn", 24, "the service's UD QP number", show=_qpn),
                           _f("vendor_id_lo", 8, "ECE vendor ID, bits 7..0"),
                           _f("service_id", 64, "the service ID resolved", show=_hex16),
                           _f("qkey", 32, "the service QP's Q_Key (rdma_cm: 0x01234567)",
                              show=_hex8),
                           _f("additional_info", 576, "additional information (72 bytes)"),
                       )), shown=("request_id", "status", "qpn", "qkey", "service_id"))

#: Every supported message by attribute ID.
MESSAGES: dict[AttrId, MessageType] = {m.attr_id: m for m in (
    REQ, MRA, REJ, REP, RTU, DREQ, DREP, SIDR_REQ, SIDR_REP)}
BY_NAME: dict[str, MessageType] = {m.name: m for m in MESSAGES.values()}
#: CM attributes that exist but are not supported on RoCE: alternate path migration
#: (LAP, APR). Linux's CM rejects LAP/APR on RoCE ports; these are never sent or parsed.
UNSUPPORTED: dict[AttrId, str] = {AttrId.LAP: "LAP", AttrId.APR: "APR"}


@dataclass(frozen=True, slots=True)
class CMMessage:
    """A decoded CM MAD: its header, its type, its fields and its private data.

    Fields read as attributes (``m.local_qpn``); ``fields`` has them all, by name."""

    type: MessageType
    header: MadHeader
    fields: Mapping[str, Value]
    private_data: bytes

    @property
    def name(self) -> str:
        return self.type.name

    @property
    def tid(self) -> int:
        return self.header.tid

    def __getattr__(self, name: str) -> Value:
        try:
            return self.fields[name]  # type: ignore[index]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} {self.type.name} has no field "
                                 f"{name!r}") from None

    def pack(self) -> bytes:
        """The 256 bytes of this message (reserved bits as zero)."""
        return build_cm(self.type, header=self.header, private_data=self.private_data,
                        **self.fields)


def parse_cm(mad: bytes | bytearray | memoryview) -> CMMessage:
    """Decode a 256-byte CM MAD. :class:`~softrdma.cm.mad.MadError` if it is not a MAD the
    CM takes (its ``reason`` says why; LAP/APR give ``unsupported``)."""
    header, data = parse_mad(mad)
    reason = cm_mad_drop_reason(header)
    if reason is not None:
        raise MadError(reason, f"not a CM MAD: bad {reason.replace('_', ' ')} "
                               f"({getattr(header, reason):#x})")
    mt = MESSAGES.get(header.attr_id)  # type: ignore[call-overload]
    if mt is None:
        if header.attr_id in UNSUPPORTED:
            raise MadError("unsupported", f"CM {UNSUPPORTED[header.attr_id]} (alternate path) "
                                          "is not supported on RoCE")
        raise MadError("attr_id", f"unknown CM attribute ID {header.attr_id:#06x}")
    return CMMessage(mt, header, mt.layout.unpack_from(data), data[mt.layout.size:])


def build_cm(mtype: MessageType | str, *, tid: int = 0, attr_mod: int = 0,
             header: MadHeader | None = None, private_data: bytes | bytearray = b"",
             **fields: Value) -> bytes:
    """A 256-byte CM MAD: the CM's header (``tid``, ``attr_mod``; or a whole ``header``
    for crafting), the fields by name (missing ones are zero), then ``private_data``
    zero-padded to the message's size. A field that does not fit, an unknown field name
    or too much private data raise ValueError."""
    mt = BY_NAME[mtype] if isinstance(mtype, str) else mtype
    if len(private_data) > mt.private_data_size:
        raise ValueError(f"{mt.name} carries at most {mt.private_data_size} bytes of private "
                         f"data, got {len(private_data)}")
    data = bytearray(MAD_DATA_SIZE)
    mt.layout.pack_into(data, 0, fields)
    data[mt.layout.size:mt.layout.size + len(private_data)] = private_data
    hdr = header if header is not None else cm_mad_header(mt.attr_id, tid, attr_mod)
    return build_mad(hdr, data)
