"""Parse and build RoCE transport packets: the bytes of a UDP 4791 payload, BTH to ICRC.

``parse`` turns bytes into a :class:`RocePacket` whose attributes are the decoded header
fields (only the headers the opcode carries are set; the others read as ``None``) plus a
zero-copy ``payload`` view. ``build`` does the reverse from keyword fields. Both are driven
by the opcode table, so the set of headers, their order and their offsets are stated once.

Parsing is structural, like the first checks of rxe's ``rxe_rcv``: the opcode must be known
and the packet long enough for the BTH, the opcode's headers, the pad and the ICRC.
Everything else (TVer, P_Key, QPN, PSN, ICRC) is judged by the receive path, so a
dissector can still show a packet rxe would drop. Every failure is a :class:`DecodeError`.

    >>> from softrdma.wire.packet import build, parse
    >>> from softrdma.wire.opcodes import Opcode
    >>> raw = build(Opcode.RC_SEND_ONLY, dest_qp=0x11, psn=7, ackreq=True, payload=b"hi!")
    >>> p = parse(raw)
    >>> p.name, p.dest_qp, p.psn, p.pad, bytes(p.payload)
    ('RC_SEND_ONLY', 17, 7, 1, b'hi!')
"""

from __future__ import annotations

import struct
from typing import Any

from .headers import (
    AETH, ATMACK, ATMETH, BTH, BTH_ACK, BTH_BECN, BTH_FECN, BTH_MIG, BTH_PAD_SHIFT,
    BTH_PSN_MASK, BTH_QPN_MASK, BTH_SE, BTH_TVER_MASK, DEFAULT_PKEY, DETH, EXT_ATTRS, FETH,
    HEADERS, IETH, IMMDT, RETH, Hdr, compile_packer,
)
from .opcodes import ICRC_SIZE, OpInfo, OPCODE_LIST

__all__ = ["DecodeError", "RocePacket", "parse", "build", "FIELDS_BY_HEADER"]

#: The RocePacket attributes each extension header fills, in header order.
FIELDS_BY_HEADER: dict[Hdr, tuple[str, ...]] = {h: d.attrs for h, d in HEADERS.items()}


class DecodeError(ValueError):
    """Bytes that are not a well-formed RoCE transport packet.

    ``reason`` is a short stable token (``truncated``, ``unknown_opcode``, ...) suitable for
    counters; the message says what was wrong in words.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RocePacket:
    """A decoded RoCE packet. Header fields the opcode does not carry read as None.

    BTH: ``opcode se migreq pad tver pkey fecn becn resv6 dest_qp ackreq resv7 psn``.
    RETH: ``va rkey dma_len``; AtomicETH: ``va rkey swap_add compare``; AETH: ``syndrome
    msn``; AtomicAckETH: ``orig``; ImmDt: ``imm``; IETH: ``ieth_rkey``; DETH: ``qkey
    src_qp``; FETH: ``feth``. ``payload`` is a memoryview into the original buffer (pad and
    ICRC excluded); ``icrc`` is the ICRC as the integer zlib.crc32 would produce.

    The fields the engines read on every packet are plain attributes; the rarely used BTH
    bits are properties over the raw BTH words, which keeps ``parse`` cheap.
    """

    # The extension-header fields, for type checkers; their class-level None defaults are
    # set from the header descriptions below the class (parse sets only what the opcode
    # carries), and a test checks this list against those descriptions.
    va: int | None
    rkey: int | None
    dma_len: int | None
    syndrome: int | None
    msn: int | None
    swap_add: int | None
    compare: int | None
    orig: int | None
    imm: int | None
    ieth_rkey: int | None
    qkey: int | None
    src_qp: int | None
    feth: int | None

    info: OpInfo
    buf: memoryview
    opcode: int
    pkey: int
    dest_qp: int
    ackreq: bool
    psn: int
    pad: int
    payload_offset: int
    payload_len: int
    icrc: int
    _flags: int  # BTH byte 1: SE, MigReq, PadCnt, TVer
    _w1: int  # BTH word 1: FECN, BECN, resv6, DestQP
    _w2: int  # BTH word 2: AckReq, resv7, PSN

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def se(self) -> bool:
        return bool(self._flags & BTH_SE)

    @property
    def migreq(self) -> bool:
        return bool(self._flags & BTH_MIG)

    @property
    def tver(self) -> int:
        return self._flags & BTH_TVER_MASK

    @property
    def fecn(self) -> bool:
        return bool(self._w1 & BTH_FECN)

    @property
    def becn(self) -> bool:
        return bool(self._w1 & BTH_BECN)

    @property
    def resv6(self) -> int:
        return (self._w1 >> 24) & 0x3F

    @property
    def resv7(self) -> int:
        return (self._w2 >> 24) & 0x7F

    @property
    def payload(self) -> memoryview:
        o = self.payload_offset
        return self.buf[o:o + self.payload_len]

    def fields(self) -> dict[str, Any]:
        """Every decoded field, BTH first then the extension headers in wire order."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _BTH_FIELDS}
        for hdr, _ in self.info.headers:
            for k in FIELDS_BY_HEADER[hdr]:
                out[k] = getattr(self, k)
        return out

    def to_bytes(self) -> bytearray:
        """Rebuild the packet from its fields (the ICRC is copied, not recomputed)."""
        return build(self.opcode, payload=self.payload, icrc=self.icrc, **{
            k: v for k, v in self.fields().items() if k != "opcode"})

    def __repr__(self) -> str:
        parts = [f"{self.name}", f"qpn=0x{self.dest_qp:06x}", f"psn={self.psn}"]
        if self.ackreq:
            parts.append("A")
        for hdr, _ in self.info.headers:
            for k in FIELDS_BY_HEADER[hdr]:
                parts.append(f"{k}={getattr(self, k)}")
        parts.append(f"len={self.payload_len}")
        return f"<RocePacket {' '.join(parts)}>"


for _attr in EXT_ATTRS:
    setattr(RocePacket, _attr, None)
del _attr

_BTH_FIELDS = BTH.attrs
# Plain ints for the header kinds: comparing against IntEnum members costs an attribute
# lookup per test on the hot path.
_RETH, _AETH, _ATMETH, _ATMACK, _IETH, _DETH, _IMMDT, _FETH = (
    int(Hdr.RETH), int(Hdr.AETH), int(Hdr.ATMETH), int(Hdr.ATMACK), int(Hdr.IETH),
    int(Hdr.DETH), int(Hdr.IMMDT), int(Hdr.FETH))
_EXT = [tuple((int(h), off) for h, off in i.headers) if i else () for i in OPCODE_LIST]
# For build: the compiled packer and offset of each extension header, per opcode.
_PACKERS = {h: compile_packer(d, EXT_ATTRS) for h, d in HEADERS.items()}
_PACK = [tuple((_PACKERS[h], off) for h, off in i.headers) if i else () for i in OPCODE_LIST]
_bth_unpack = BTH.struct.unpack_from
_bth_pack_into = BTH.struct.pack_into
_reth_unpack = RETH.struct.unpack_from
_aeth_unpack = AETH.struct.unpack_from
_atm_unpack = ATMETH.struct.unpack_from
_atmack_unpack = ATMACK.struct.unpack_from
_ieth_unpack = IETH.struct.unpack_from
_deth_unpack = DETH.struct.unpack_from
_imm_unpack = IMMDT.struct.unpack_from
_feth_unpack = FETH.struct.unpack_from
_icrc_unpack = struct.Struct("<I").unpack_from


def parse(data: bytes | bytearray | memoryview) -> RocePacket:
    """Decode a RoCE packet (BTH .. ICRC). Raises :class:`DecodeError` on malformed input.

    Hand-unrolled for speed (one unpack per header, no per-field loop); the layouts it
    unrolls are those of :mod:`softrdma.wire.headers`, and tests/test_wire_headers.py
    checks it against :meth:`Header.unpack_from` for every opcode.
    """
    buf = data if type(data) is memoryview else memoryview(data)
    n = len(buf)
    if n < 16:  # BTH + ICRC
        raise DecodeError("truncated", f"packet of {n} bytes is shorter than BTH + ICRC (16)")
    op, flags, pkey, w1, w2 = _bth_unpack(buf, 0)
    info = OPCODE_LIST[op]
    if info is None:
        raise DecodeError("unknown_opcode", f"opcode 0x{op:02x} is not a known RoCE opcode")
    pad = (flags >> BTH_PAD_SHIFT) & 3
    hlen = info.length
    paylen = n - hlen - ICRC_SIZE - pad
    if paylen < 0:
        if n < hlen + ICRC_SIZE:
            raise DecodeError("truncated", f"{info.name} needs {hlen + ICRC_SIZE} bytes of "
                                           f"headers and ICRC, packet has {n}")
        raise DecodeError("bad_pad", f"{info.name}: pad count {pad} exceeds the "
                                     f"{n - hlen - ICRC_SIZE} bytes after the headers")
    p = RocePacket()
    p.buf = buf
    p.info = info
    p.opcode = op
    p._flags = flags
    p.pkey = pkey
    p._w1 = w1
    p._w2 = w2
    p.dest_qp = w1 & BTH_QPN_MASK
    p.ackreq = w2 >= BTH_ACK
    p.psn = w2 & BTH_PSN_MASK
    p.pad = pad
    for hdr, off in _EXT[op]:
        if hdr == _RETH:
            p.va, p.rkey, p.dma_len = _reth_unpack(buf, off)
        elif hdr == _AETH:
            (w,) = _aeth_unpack(buf, off)
            p.syndrome = w >> 24
            p.msn = w & 0xFFFFFF
        elif hdr == _IMMDT:
            (p.imm,) = _imm_unpack(buf, off)
        elif hdr == _DETH:
            p.qkey, sqp = _deth_unpack(buf, off)
            p.src_qp = sqp & 0xFFFFFF  # resv8 dropped
        elif hdr == _ATMETH:
            p.va, p.rkey, p.swap_add, p.compare = _atm_unpack(buf, off)
        elif hdr == _ATMACK:
            (p.orig,) = _atmack_unpack(buf, off)
        elif hdr == _IETH:
            (p.ieth_rkey,) = _ieth_unpack(buf, off)
        elif hdr == _FETH:
            (p.feth,) = _feth_unpack(buf, off)
    p.payload_offset = hlen
    p.payload_len = paylen
    (p.icrc,) = _icrc_unpack(buf, n - ICRC_SIZE)
    return p


def build(
    opcode: int,
    *,
    psn: int = 0,
    dest_qp: int = 0,
    ackreq: bool = False,
    se: bool = False,
    migreq: bool = False,
    pkey: int = DEFAULT_PKEY,
    tver: int = 0,
    fecn: bool = False,
    becn: bool = False,
    resv6: int = 0,
    resv7: int = 0,
    # The extension-header fields, in EXT_ATTRS order (a test holds them to it):
    va: int | None = 0,
    rkey: int | None = 0,
    dma_len: int | None = 0,
    syndrome: int | None = 0,
    msn: int | None = 0,
    swap_add: int | None = 0,
    compare: int | None = 0,
    orig: int | None = 0,
    ieth_rkey: int | None = 0,
    qkey: int | None = 0,
    src_qp: int | None = 0,
    imm: int | None = 0,
    feth: int | None = 0,
    payload: bytes | bytearray | memoryview = b"",
    pad: int | None = None,
    icrc: int = 0,
) -> bytearray:
    """Encode a RoCE packet (BTH .. ICRC) from fields.

    The extension-header fields are named as on a parsed :class:`RocePacket` (each
    :class:`~softrdma.wire.headers.Field`'s ``attr``): ``va rkey dma_len`` (RETH),
    ``syndrome msn`` (AETH), ``va rkey swap_add compare`` (AtomicETH), ``orig``
    (AtomicAckETH), ``ieth_rkey`` (IETH), ``qkey src_qp`` (DETH), ``imm`` (ImmDt), ``feth``
    (FETH). Only the headers ``opcode`` carries are written; other fields are ignored, and
    None is written as 0. The pad count defaults to what rxe sends, ``(-len(payload)) & 3``
    zero bytes; pass ``pad`` to craft something else. ``icrc`` is written as is
    (little-endian, as on the wire): use :func:`softrdma.wire.icrc.set_icrc_ipv4` and
    friends to fill the real value.
    """
    info = OPCODE_LIST[opcode & 0xFF]
    if info is None:
        raise ValueError(f"opcode 0x{opcode:02x} is not a known RoCE opcode")
    if pad is None:
        pad = -len(payload) & 3
    elif not 0 <= pad <= 3:
        raise ValueError(f"pad must be 0..3, got {pad}")
    hlen = info.length
    plen = len(payload)
    out = bytearray(hlen + plen + pad + ICRC_SIZE)
    flags = ((BTH_SE if se else 0) | (BTH_MIG if migreq else 0) | (pad << BTH_PAD_SHIFT)
             | (tver & BTH_TVER_MASK))
    w1 = ((BTH_FECN if fecn else 0) | (BTH_BECN if becn else 0) | ((resv6 & 0x3F) << 24)
          | (dest_qp & BTH_QPN_MASK))
    w2 = (BTH_ACK if ackreq else 0) | ((resv7 & 0x7F) << 24) | (psn & BTH_PSN_MASK)
    _bth_pack_into(out, 0, opcode & 0xFF, flags, pkey & 0xFFFF, w1, w2)
    packers = _PACK[opcode & 0xFF]
    if packers:
        ext = (va, rkey, dma_len, syndrome, msn, swap_add, compare, orig, ieth_rkey, qkey,
               src_qp, imm, feth)
        for pack, off in packers:
            pack(out, off, ext)
    out[hlen:hlen + plen] = payload
    out[-ICRC_SIZE:] = (icrc & 0xFFFFFFFF).to_bytes(ICRC_SIZE, "little")
    return out
