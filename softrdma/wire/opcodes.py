"""The RoCEv2 opcode table: one row per BTH opcode, driving both parsing and building.

This mirrors rxe's ``rxe_opcode[]`` (drivers/infiniband/sw/rxe/rxe_opcode.c): for every
opcode it records which extension headers follow the BTH, in which order and at which
offset, and the properties the requester, completer and responder key on (``mask`` bits in
rxe). The values of the opcodes come from the IBTA spec (ib_pack.h): the top three bits
select the transport (RC 0x00, UC 0x20, RD 0x40, UD 0x60, CNP 0x80), the low five bits
the operation.

Example::

    >>> from softrdma.wire.opcodes import OPCODES, Opcode
    >>> info = OPCODES[Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE]
    >>> [(h.name, off) for h, off in info.headers]
    [('RETH', 12), ('IMMDT', 28)]
    >>> info.length, info.is_request, info.consumes_rwqe
    (32, True, True)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .headers import BTH, HEADERS, Hdr

__all__ = [
    "Hdr",
    "HDR_SIZE",
    "BTH_SIZE",
    "ICRC_SIZE",
    "Opcode",
    "OpInfo",
    "OPCODES",
    "OPCODE_BY_NAME",
    "Transport",
    "lookup",
]

BTH_SIZE = BTH.size
ICRC_SIZE = 4


#: Size in bytes of each extension header, from its description in :mod:`.headers`.
HDR_SIZE: dict[Hdr, int] = {h: d.size for h, d in HEADERS.items()}


class Transport(enum.IntEnum):
    RC = 0x00
    UC = 0x20
    RD = 0x40
    UD = 0x60
    CNP = 0x80


class Opcode(enum.IntEnum):
    """BTH opcodes softrdma knows (RC, UC, UD and the RoCEv2 CNP)."""

    RC_SEND_FIRST = 0x00
    RC_SEND_MIDDLE = 0x01
    RC_SEND_LAST = 0x02
    RC_SEND_LAST_WITH_IMMEDIATE = 0x03
    RC_SEND_ONLY = 0x04
    RC_SEND_ONLY_WITH_IMMEDIATE = 0x05
    RC_RDMA_WRITE_FIRST = 0x06
    RC_RDMA_WRITE_MIDDLE = 0x07
    RC_RDMA_WRITE_LAST = 0x08
    RC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RC_RDMA_WRITE_ONLY = 0x0A
    RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    RC_RDMA_READ_REQUEST = 0x0C
    RC_RDMA_READ_RESPONSE_FIRST = 0x0D
    RC_RDMA_READ_RESPONSE_MIDDLE = 0x0E
    RC_RDMA_READ_RESPONSE_LAST = 0x0F
    RC_RDMA_READ_RESPONSE_ONLY = 0x10
    RC_ACKNOWLEDGE = 0x11
    RC_ATOMIC_ACKNOWLEDGE = 0x12
    RC_COMPARE_SWAP = 0x13
    RC_FETCH_ADD = 0x14
    RC_SEND_LAST_WITH_INVALIDATE = 0x16
    RC_SEND_ONLY_WITH_INVALIDATE = 0x17
    RC_FLUSH = 0x1C
    RC_ATOMIC_WRITE = 0x1D

    UC_SEND_FIRST = 0x20
    UC_SEND_MIDDLE = 0x21
    UC_SEND_LAST = 0x22
    UC_SEND_LAST_WITH_IMMEDIATE = 0x23
    UC_SEND_ONLY = 0x24
    UC_SEND_ONLY_WITH_IMMEDIATE = 0x25
    UC_RDMA_WRITE_FIRST = 0x26
    UC_RDMA_WRITE_MIDDLE = 0x27
    UC_RDMA_WRITE_LAST = 0x28
    UC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x29
    UC_RDMA_WRITE_ONLY = 0x2A
    UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x2B

    UD_SEND_ONLY = 0x64
    UD_SEND_ONLY_WITH_IMMEDIATE = 0x65

    CNP = 0x81


@dataclass(frozen=True, slots=True)
class OpInfo:
    """Everything rxe's table says about one opcode.

    ``headers`` lists ``(header, offset)`` pairs after the BTH, in wire order; ``length`` is
    BTH plus all of them, i.e. the offset of the payload. The boolean properties are rxe's
    mask bits under readable names.
    """

    opcode: int
    name: str
    transport: Transport
    headers: tuple[tuple[Hdr, int], ...]
    length: int
    is_request: bool  # RXE_REQ_MASK: travels requester -> responder
    is_response: bool  # RXE_ACK_MASK: travels responder -> requester (ACKs, read responses)
    first: bool  # RXE_START_MASK
    middle: bool  # RXE_MIDDLE_MASK
    last: bool  # RXE_END_MASK
    has_payload: bool  # RXE_PAYLOAD_MASK
    consumes_rwqe: bool  # RXE_RWR_MASK: takes a receive WQE from the RQ/SRQ
    completes: bool  # RXE_COMP_MASK: produces a receive completion
    send: bool
    write: bool
    read: bool
    atomic: bool
    with_imm: bool
    with_inv: bool
    flush: bool = False
    atomic_write: bool = False

    @property
    def only(self) -> bool:
        return self.first and self.last

    def offset(self, hdr: Hdr) -> int | None:
        """Byte offset of ``hdr`` from the start of the BTH, or None if absent."""
        for h, off in self.headers:
            if h == hdr:
                return off
        return None

    def has(self, hdr: Hdr) -> bool:
        return self.offset(hdr) is not None

    @property
    def short_name(self) -> str:
        """Name without the transport prefix, e.g. ``SEND_ONLY``."""
        return self.name.split("_", 1)[1] if "_" in self.name else self.name


def _row(op: Opcode, hdrs: tuple[Hdr, ...], **props: bool) -> OpInfo:
    headers = []
    off = BTH_SIZE
    for h in hdrs:
        headers.append((h, off))
        off += HDR_SIZE[h]
    flags = dict(
        is_request=False, is_response=False, first=False, middle=False, last=False,
        has_payload=False, consumes_rwqe=False, completes=False, send=False, write=False,
        read=False, atomic=False, with_imm=False, with_inv=False,
    )
    flags.update(props)
    return OpInfo(opcode=int(op), name=op.name, transport=Transport(int(op) & 0xE0),
                  headers=tuple(headers), length=off, **flags)


def _build_table() -> dict[int, OpInfo]:
    R, I, D, A, AT, AA, IE, F = (Hdr.RETH, Hdr.IMMDT, Hdr.DETH, Hdr.AETH, Hdr.ATMETH,
                                 Hdr.ATMACK, Hdr.IETH, Hdr.FETH)
    req = dict(is_request=True)
    rows: list[OpInfo] = []
    # Request opcodes shared by RC and UC (the UC value is the RC value + 0x20).
    shared = [
        ("SEND_FIRST", (), dict(send=True, first=True, has_payload=True, consumes_rwqe=True)),
        ("SEND_MIDDLE", (), dict(send=True, middle=True, has_payload=True)),
        ("SEND_LAST", (), dict(send=True, last=True, has_payload=True, completes=True)),
        ("SEND_LAST_WITH_IMMEDIATE", (I,),
         dict(send=True, last=True, has_payload=True, completes=True, with_imm=True)),
        ("SEND_ONLY", (), dict(send=True, first=True, last=True, has_payload=True,
                               consumes_rwqe=True, completes=True)),
        ("SEND_ONLY_WITH_IMMEDIATE", (I,),
         dict(send=True, first=True, last=True, has_payload=True, consumes_rwqe=True,
              completes=True, with_imm=True)),
        ("RDMA_WRITE_FIRST", (R,), dict(write=True, first=True, has_payload=True)),
        ("RDMA_WRITE_MIDDLE", (), dict(write=True, middle=True, has_payload=True)),
        ("RDMA_WRITE_LAST", (), dict(write=True, last=True, has_payload=True)),
        ("RDMA_WRITE_LAST_WITH_IMMEDIATE", (I,),
         dict(write=True, last=True, has_payload=True, consumes_rwqe=True, completes=True,
              with_imm=True)),
        ("RDMA_WRITE_ONLY", (R,), dict(write=True, first=True, last=True, has_payload=True)),
        ("RDMA_WRITE_ONLY_WITH_IMMEDIATE", (R, I),
         dict(write=True, first=True, last=True, has_payload=True, consumes_rwqe=True,
              completes=True, with_imm=True)),
    ]
    for tname, base in (("RC", 0x00), ("UC", 0x20)):
        for name, hdrs, props in shared:
            rows.append(_row(Opcode[f"{tname}_{name}"], hdrs, **req, **props))
    rc = Opcode
    rows += [
        _row(rc.RC_RDMA_READ_REQUEST, (R,), **req, read=True, first=True, last=True),
        _row(rc.RC_RDMA_READ_RESPONSE_FIRST, (A,), is_response=True, read=True, first=True,
             has_payload=True),
        _row(rc.RC_RDMA_READ_RESPONSE_MIDDLE, (), is_response=True, read=True, middle=True,
             has_payload=True),
        _row(rc.RC_RDMA_READ_RESPONSE_LAST, (A,), is_response=True, read=True, last=True,
             has_payload=True),
        _row(rc.RC_RDMA_READ_RESPONSE_ONLY, (A,), is_response=True, read=True, first=True,
             last=True, has_payload=True),
        _row(rc.RC_ACKNOWLEDGE, (A,), is_response=True, first=True, last=True),
        _row(rc.RC_ATOMIC_ACKNOWLEDGE, (A, AA), is_response=True, atomic=True, first=True,
             last=True),
        _row(rc.RC_COMPARE_SWAP, (AT,), **req, atomic=True, first=True, last=True),
        _row(rc.RC_FETCH_ADD, (AT,), **req, atomic=True, first=True, last=True),
        _row(rc.RC_SEND_LAST_WITH_INVALIDATE, (IE,), **req, send=True, last=True,
             has_payload=True, completes=True, with_inv=True),
        _row(rc.RC_SEND_ONLY_WITH_INVALIDATE, (IE,), **req, send=True, first=True, last=True,
             has_payload=True, consumes_rwqe=True, completes=True, with_inv=True),
        _row(rc.RC_FLUSH, (F, R), **req, first=True, last=True, flush=True),
        _row(rc.RC_ATOMIC_WRITE, (R,), **req, first=True, last=True, has_payload=True,
             atomic_write=True),
        _row(rc.UD_SEND_ONLY, (D,), **req, send=True, first=True, last=True, has_payload=True,
             consumes_rwqe=True, completes=True),
        _row(rc.UD_SEND_ONLY_WITH_IMMEDIATE, (D, I), **req, send=True, first=True, last=True,
             has_payload=True, consumes_rwqe=True, completes=True, with_imm=True),
        # RoCEv2 congestion notification: BTH + 16 reserved bytes. Not a transport packet;
        # rxe ignores it, dissect shows it.
        _row(rc.CNP, (Hdr.CNP,)),
    ]
    return {r.opcode: r for r in rows}


#: opcode value -> OpInfo, for every opcode softrdma knows.
OPCODES: dict[int, OpInfo] = _build_table()
#: the same rows indexed by opcode value for the hot path: a list of 256, None if unknown.
OPCODE_LIST: list[OpInfo | None] = [OPCODES.get(i) for i in range(256)]
OPCODE_BY_NAME: dict[str, OpInfo] = {r.name: r for r in OPCODES.values()}


def lookup(opcode: int) -> OpInfo | None:
    """The table row for ``opcode``, or None for an opcode rxe does not implement."""
    return OPCODE_LIST[opcode & 0xFF]
