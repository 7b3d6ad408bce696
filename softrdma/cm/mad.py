"""The management datagram (MAD): the 24-byte common header and the 256-byte MAD.

Every CM message is a MAD of exactly 256 bytes (``IB_MGMT_MAD_SIZE``): this common header
(IBTA 13.4.3, ``struct ib_mad_hdr`` in include/rdma/ib_mad.h) and 232 bytes of class data,
the CM message. What the CM puts in it (drivers/infiniband/core/cm.c
``cm_format_mad_hdr``): base version 1, management class 0x07 (CM), class version 2,
method SEND (0x03; the CM never uses response methods), status 0, class specific 0, the
attribute ID naming the message, and an attribute modifier that is 0 unless ECE options are
exchanged (REQ, REP, SIDR_REP since Linux 5.8; 0 with rxe)::

     0        1        2        3
    +--------+--------+--------+--------+
    | BaseVer| MgmtCls| ClassVr| Method |   0
    +--------+--------+--------+--------+
    |     Status      |  ClassSpecific  |   4
    +-----------------+-----------------+
    |     TransactionID (64 bits)       |   8
    +-----------------+-----------------+
    |   AttributeID   |    reserved     |  16
    +-----------------+-----------------+
    |       AttributeModifier           |  20
    +-----------------------------------+

**Transaction IDs.** A message that starts a transaction (REQ, DREQ, SIDR_REQ) gets a
new TID; every answer echoes the TID of what it answers: REP, RTU, REJ and MRA carry the
REQ's, DREP the DREQ's, SIDR_REP the SIDR_REQ's, and a retransmission reuses its TID.
Linux forms a new TID as ``(mad_agent.hi_tid << 32) | local_comm_id``, where the comm ID,
a big-endian field, is read as a host integer on a little-endian machine: the low 32 bits
hold the comm ID byte-swapped (comm ID 0x3fc95036 → TID 0x00000002_3650c93f in the
ucmatose capture). Linux matches CM messages by their comm IDs, never by TID, so the TID is
opaque to a receiver: echo it, and form new ones with :func:`new_tid` to look like Linux.

    >>> hex(new_tid(0x3FC95036, hi_tid=2)), hex(tid_comm_id(0x000000023650C93F))
    ('0x23650c93f', '0x3fc95036')
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields as dc_fields, replace

from ..wire.headers import Field
from .layout import Layout

__all__ = [
    "MAD_SIZE", "MAD_HDR_SIZE", "MAD_DATA_SIZE", "BASE_VERSION", "MGMT_CLASS_CM",
    "CM_CLASS_VERSION", "Method", "AttrId", "MAD_HEADER", "MadHeader", "MadError",
    "parse_mad", "build_mad", "cm_mad_header", "cm_mad_drop_reason", "new_tid",
    "tid_comm_id",
]

MAD_SIZE = 256  # IB_MGMT_MAD_SIZE: what rxe advertises as max_mad_size and what GSI sends
MAD_HDR_SIZE = 24  # IB_MGMT_MAD_HDR
MAD_DATA_SIZE = MAD_SIZE - MAD_HDR_SIZE  # 232: the CM message
BASE_VERSION = 1  # IB_MGMT_BASE_VERSION (OPA's 0x80 is not for RoCE)
MGMT_CLASS_CM = 0x07  # IB_MGMT_CLASS_CM
CM_CLASS_VERSION = 2  # IB_CM_CLASS_VERSION: IBTA 1.2 layouts


class Method(enum.IntEnum):
    """MAD methods (IBTA 13.4.5). The CM sends every message with SEND."""

    GET = 0x01
    SET = 0x02
    SEND = 0x03
    TRAP = 0x05
    REPORT = 0x06
    TRAP_REPRESS = 0x07
    GET_RESP = 0x81
    REPORT_RESP = 0x86


class AttrId(enum.IntEnum):
    """CM attribute IDs (IBTA 12.6, ``CM_*_ATTR_ID`` in cm.c): which message a MAD holds."""

    CLASS_PORT_INFO = 0x0001
    REQ = 0x0010
    MRA = 0x0011
    REJ = 0x0012
    REP = 0x0013
    RTU = 0x0014
    DREQ = 0x0015
    DREP = 0x0016
    SIDR_REQ = 0x0017
    SIDR_REP = 0x0018
    LAP = 0x0019
    APR = 0x001A


def _f(name: str, bits: int, doc: str) -> Field:
    return Field(name, bits, doc, attr=name)


#: The common MAD header, described once: MadHeader, parse and build derive from it.
MAD_HEADER = Layout("MAD", "!BBBBHHQHHI", (
    _f("base_version", 8, "MAD base version: 1"),
    _f("mgmt_class", 8, "management class: 0x07 is the CM"),
    _f("class_version", 8, "class version: 2 for the CM"),
    _f("method", 8, "method: SEND (0x03) for every CM message"),
    _f("status", 16, "status: 0 (the CM never sets it)"),
    _f("class_specific", 16, "class specific: 0 for the CM"),
    _f("tid", 64, "transaction ID: new for REQ/DREQ/SIDR_REQ, echoed by the answers"),
    _f("attr_id", 16, "attribute ID: which CM message"),
    Field("resv", 16, "reserved"),
    _f("attr_mod", 32, "attribute modifier: ECE options, 0 with rxe"),
))


class MadError(ValueError):
    """Bytes that are not a MAD the CM takes. ``reason`` is a short stable token for
    counters (``mad_size``, ``base_version``, ``mgmt_class``, ``class_version``,
    ``method``, ``attr_id``, ``unsupported``); the message says it in words."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MadHeader:
    """The 24-byte common header, field for field (names as in :data:`MAD_HEADER`)."""

    base_version: int
    mgmt_class: int
    class_version: int
    method: int
    status: int
    class_specific: int
    tid: int
    attr_id: int
    attr_mod: int

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview, offset: int = 0) -> "MadHeader":
        return cls(**MAD_HEADER.unpack_from(buf, offset))

    def pack_into(self, buf: bytearray | memoryview, offset: int = 0) -> None:
        MAD_HEADER.pack_into(buf, offset, self.as_dict())

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dc_fields(self)}

    def replace(self, **changes: int) -> "MadHeader":
        return replace(self, **changes)


def cm_mad_header(attr_id: int, tid: int, attr_mod: int = 0) -> MadHeader:
    """The header the CM sends (``cm_format_mad_hdr``): version 1, class CM, class
    version 2, method SEND, status 0, and the given attribute and TID."""
    return MadHeader(BASE_VERSION, MGMT_CLASS_CM, CM_CLASS_VERSION, Method.SEND, 0, 0,
                     tid, attr_id, attr_mod)


def parse_mad(buf: bytes | bytearray | memoryview) -> tuple[MadHeader, bytes]:
    """``(header, data)`` of a MAD: exactly 256 bytes, else :class:`MadError`."""
    if len(buf) != MAD_SIZE:
        raise MadError("mad_size", f"a MAD is {MAD_SIZE} bytes, this is {len(buf)}")
    return MadHeader.unpack(buf), bytes(buf[MAD_HDR_SIZE:])


def build_mad(header: MadHeader, data: bytes | bytearray = b"") -> bytes:
    """A 256-byte MAD: ``header`` then ``data`` (at most 232 bytes), zero-padded."""
    if len(data) > MAD_DATA_SIZE:
        raise MadError("mad_size", f"MAD data is at most {MAD_DATA_SIZE} bytes, got {len(data)}")
    out = bytearray(MAD_SIZE)
    header.pack_into(out)
    out[MAD_HDR_SIZE:MAD_HDR_SIZE + len(data)] = data
    return bytes(out)


def cm_mad_drop_reason(header: MadHeader) -> str | None:
    """Why the kernel's MAD layer would not hand this header's MAD to the CM (``None``:
    it would). K/mad.c ``validate_mad`` and the agent table: base version 1, the CM's
    class and class version, and method SEND (the CM registers for nothing else)."""
    if header.base_version != BASE_VERSION:
        return "base_version"
    if header.mgmt_class != MGMT_CLASS_CM:
        return "mgmt_class"
    if header.class_version != CM_CLASS_VERSION:
        return "class_version"
    if header.method != Method.SEND:
        return "method"
    return None


def new_tid(local_comm_id: int, hi_tid: int = 0) -> int:
    """A TID as Linux forms it for a new transaction: ``hi_tid`` (the MAD agent's, an
    arbitrary 32-bit value) above the local comm ID byte-swapped (``cm_form_tid``)."""
    if not 0 <= local_comm_id <= 0xFFFFFFFF or not 0 <= hi_tid <= 0xFFFFFFFF:
        raise ValueError("the comm ID and hi_tid are 32-bit values")
    return (hi_tid << 32) | int.from_bytes(local_comm_id.to_bytes(4, "big"), "little")


def tid_comm_id(tid: int) -> int:
    """The comm ID a Linux-formed TID was made from (the inverse of :func:`new_tid`)."""
    return int.from_bytes((tid & 0xFFFFFFFF).to_bytes(4, "little"), "big")
