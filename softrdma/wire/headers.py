"""RoCEv2 transport headers: layouts, field constants and readable dataclass views.

All headers are big-endian. The struct formats here are the single definition the fast
parser (:mod:`softrdma.wire.packet`) and the dataclass views share. The views exist for
tools, tests and teaching; the data path reads fields straight from the buffer.

BTH (12 bytes)::

     0       1       2       3
    +-------+-+-+---+-------+---------------+
    |opcode |S|M|Pad| TVer  |     P_Key     |
    +-+-+---+-------+-------+---------------+
    |F|B|resv6      |      Destination QP   |
    +-+-------------+-----------------------+
    |A| resv7       |         PSN           |
    +-+-------------+-----------------------+
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

__all__ = [
    "BTH_STRUCT", "RETH_STRUCT", "AETH_STRUCT", "ATMETH_STRUCT", "ATMACK_STRUCT",
    "U32_STRUCT", "DETH_STRUCT",
    "AethType", "NakCode", "AETH_ACK_UNLIMITED",
    "aeth_type", "aeth_syndrome_name", "make_syndrome",
    "DEFAULT_PKEY", "GSI_QKEY", "ROCE_V2_UDP_DPORT",
    "Bth", "Reth", "Aeth", "AtomicEth", "AtomicAckEth", "ImmDt", "Ieth", "Deth", "Feth",
]

ROCE_V2_UDP_DPORT = 4791
DEFAULT_PKEY = 0xFFFF
GSI_QKEY = 0x80010000

BTH_STRUCT = struct.Struct("!BBHII")  # opcode, flags, pkey, fecn|becn|resv6|qpn, ackreq|psn
RETH_STRUCT = struct.Struct("!QII")  # va, rkey, dma length
AETH_STRUCT = struct.Struct("!I")  # syndrome << 24 | msn
ATMETH_STRUCT = struct.Struct("!QIQQ")  # va, rkey, swap_add, compare (28 bytes, packed)
ATMACK_STRUCT = struct.Struct("!Q")  # original remote data
U32_STRUCT = struct.Struct("!I")  # ImmDt, IETH, FETH
DETH_STRUCT = struct.Struct("!II")  # qkey, resv8 | source QP

# BTH bit fields (rxe_hdr.h)
BTH_SE = 0x80
BTH_MIG = 0x40
BTH_PAD_MASK = 0x30
BTH_TVER_MASK = 0x0F
BTH_FECN = 0x80000000
BTH_BECN = 0x40000000
BTH_RESV6A_MASK = 0x3F000000
BTH_QPN_MASK = 0x00FFFFFF
BTH_ACK = 0x80000000
BTH_RESV7_MASK = 0x7F000000
BTH_PSN_MASK = 0x00FFFFFF


class AethType(enum.IntEnum):
    """The top three bits of the AETH syndrome."""

    ACK = 0x00
    RNR_NAK = 0x20
    RESERVED = 0x40
    NAK = 0x60


class NakCode(enum.IntEnum):
    """Full NAK syndromes (type NAK | code)."""

    PSN_SEQ_ERROR = 0x60
    INVALID_REQUEST = 0x61
    REMOTE_ACCESS_ERROR = 0x62
    REMOTE_OPERATIONAL_ERROR = 0x63
    INVALID_RD_REQUEST = 0x64


#: ACK with the credit field at 31 ("unlimited"), what rxe always sends.
AETH_ACK_UNLIMITED = 0x1F


def aeth_type(syndrome: int) -> AethType:
    return AethType(syndrome & 0x60)


def make_syndrome(kind: AethType, value: int) -> int:
    """Build a syndrome from its type and its 5-bit value (credit, RNR timer or NAK code)."""
    return (int(kind) | (value & 0x1F)) & 0x7F


def aeth_syndrome_name(syndrome: int) -> str:
    """Readable form of an AETH syndrome: ``ACK credit=31``, ``RNR_NAK timer=12``, ..."""
    kind = syndrome & 0x60
    value = syndrome & 0x1F
    if kind == AethType.ACK:
        return f"ACK credit={value}"
    if kind == AethType.RNR_NAK:
        return f"RNR_NAK timer={value}"
    if kind == AethType.NAK:
        try:
            return f"NAK {NakCode(syndrome & 0x7F).name}"
        except ValueError:
            return f"NAK code={value}"
    return f"RESERVED 0x{syndrome:02x}"


@dataclass(slots=True)
class Bth:
    """Base transport header."""

    opcode: int
    se: bool = False
    migreq: bool = False
    pad: int = 0
    tver: int = 0
    pkey: int = DEFAULT_PKEY
    fecn: bool = False
    becn: bool = False
    resv6: int = 0
    dest_qp: int = 0
    ackreq: bool = False
    resv7: int = 0
    psn: int = 0

    SIZE = 12

    def pack(self) -> bytes:
        flags = ((BTH_SE if self.se else 0) | (BTH_MIG if self.migreq else 0)
                 | ((self.pad & 3) << 4) | (self.tver & 0xF))
        w1 = ((BTH_FECN if self.fecn else 0) | (BTH_BECN if self.becn else 0)
              | ((self.resv6 & 0x3F) << 24) | (self.dest_qp & BTH_QPN_MASK))
        w2 = (BTH_ACK if self.ackreq else 0) | ((self.resv7 & 0x7F) << 24) | (self.psn & BTH_PSN_MASK)
        return BTH_STRUCT.pack(self.opcode, flags, self.pkey, w1, w2)

    @classmethod
    def unpack_from(cls, buf: bytes | bytearray | memoryview, offset: int = 0) -> "Bth":
        op, flags, pkey, w1, w2 = BTH_STRUCT.unpack_from(buf, offset)
        return cls(op, bool(flags & BTH_SE), bool(flags & BTH_MIG), (flags >> 4) & 3,
                   flags & 0xF, pkey, bool(w1 & BTH_FECN), bool(w1 & BTH_BECN),
                   (w1 >> 24) & 0x3F, w1 & BTH_QPN_MASK, bool(w2 & BTH_ACK),
                   (w2 >> 24) & 0x7F, w2 & BTH_PSN_MASK)


@dataclass(slots=True)
class Reth:
    """RDMA extended transport header: target virtual address, rkey and DMA length."""

    va: int
    rkey: int
    length: int
    SIZE = 16

    def pack(self) -> bytes:
        return RETH_STRUCT.pack(self.va, self.rkey, self.length)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "Reth":
        return cls(*RETH_STRUCT.unpack_from(buf, offset))


@dataclass(slots=True)
class Aeth:
    """ACK extended transport header: a syndrome (ACK / RNR NAK / NAK) and the MSN."""

    syndrome: int
    msn: int
    SIZE = 4

    def pack(self) -> bytes:
        return AETH_STRUCT.pack(((self.syndrome & 0xFF) << 24) | (self.msn & 0xFFFFFF))

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "Aeth":
        (w,) = AETH_STRUCT.unpack_from(buf, offset)
        return cls(w >> 24, w & 0xFFFFFF)

    @property
    def kind(self) -> AethType:
        return aeth_type(self.syndrome)

    def __str__(self) -> str:
        return f"{aeth_syndrome_name(self.syndrome)} msn={self.msn}"


@dataclass(slots=True)
class AtomicEth:
    """Atomic extended transport header. For FETCH_ADD, ``swap_add`` is the value to add."""

    va: int
    rkey: int
    swap_add: int
    compare: int
    SIZE = 28

    def pack(self) -> bytes:
        return ATMETH_STRUCT.pack(self.va, self.rkey, self.swap_add, self.compare)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "AtomicEth":
        return cls(*ATMETH_STRUCT.unpack_from(buf, offset))


@dataclass(slots=True)
class AtomicAckEth:
    """Atomic ACK extended transport header: the value the target held before the atomic."""

    orig: int
    SIZE = 8

    def pack(self) -> bytes:
        return ATMACK_STRUCT.pack(self.orig)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "AtomicAckEth":
        return cls(*ATMACK_STRUCT.unpack_from(buf, offset))


@dataclass(slots=True)
class ImmDt:
    """Immediate data: 32 bits carried opaquely (network order on the wire)."""

    imm: int
    SIZE = 4

    def pack(self) -> bytes:
        return U32_STRUCT.pack(self.imm)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "ImmDt":
        return cls(*U32_STRUCT.unpack_from(buf, offset))


@dataclass(slots=True)
class Ieth:
    """Invalidate extended transport header: the rkey the responder must invalidate."""

    rkey: int
    SIZE = 4

    def pack(self) -> bytes:
        return U32_STRUCT.pack(self.rkey)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "Ieth":
        return cls(*U32_STRUCT.unpack_from(buf, offset))


@dataclass(slots=True)
class Deth:
    """Datagram extended transport header: the Q_Key and the sender's QP number."""

    qkey: int
    src_qp: int
    SIZE = 8

    def pack(self) -> bytes:
        return DETH_STRUCT.pack(self.qkey, self.src_qp & 0xFFFFFF)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "Deth":
        q, s = DETH_STRUCT.unpack_from(buf, offset)
        return cls(q, s & 0xFFFFFF)


@dataclass(slots=True)
class Feth:
    """Flush extended transport header (placement type and selectivity level)."""

    value: int
    SIZE = 4

    def pack(self) -> bytes:
        return U32_STRUCT.pack(self.value)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "Feth":
        return cls(*U32_STRUCT.unpack_from(buf, offset))
