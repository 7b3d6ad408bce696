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
from typing import Any, Callable

from .headers import (
    AETH, ATMACK, ATMETH, BTH, BTH_ACK, BTH_BECN, BTH_FECN, BTH_MIG, BTH_PAD_SHIFT,
    BTH_PSN_MASK, BTH_QPN_MASK, BTH_SE, BTH_TVER_MASK, DEFAULT_PKEY, DETH, EXT_ATTRS, FETH,
    HEADERS, IETH, IMMDT, RETH, Hdr, word_sources,
)
from .opcodes import ICRC_SIZE, OpInfo, OPCODE_LIST

__all__ = ["DecodeError", "RocePacket", "parse", "build", "build_request", "REQUEST_BUILDERS",
           "REQUEST_IOV_BUILDERS", "build_iov", "FIELDS_BY_HEADER"]

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
    bits are properties over BTH byte 1 or the buffer, which keeps ``parse`` cheap. ``parse``
    returns an instance of a subclass per header layout (see ``_layout_class``) whose slots
    are the extension fields that layout carries; the fields it lacks read as the None
    class attributes of this class. Slots make each store in ``parse`` a fixed-offset write
    instead of an instance-dict insertion.
    """

    __slots__ = ("info", "buf", "opcode", "pkey", "dest_qp", "ackreq", "psn", "pad",
                 "payload_len", "_flags")

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
    buf: bytes | bytearray | memoryview  # what parse was given, not copied
    opcode: int
    pkey: int
    dest_qp: int
    ackreq: bool
    psn: int
    pad: int
    payload_len: int
    _flags: int  # BTH byte 1: SE, MigReq, PadCnt, TVer

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
        return bool(self.buf[4] << 24 & BTH_FECN)

    @property
    def becn(self) -> bool:
        return bool(self.buf[4] << 24 & BTH_BECN)

    @property
    def resv6(self) -> int:
        return self.buf[4] & 0x3F

    @property
    def resv7(self) -> int:
        return self.buf[8] & 0x7F

    @property
    def icrc(self) -> int:
        """The ICRC field as an integer. Read on demand: the receive path checks the ICRC
        without it (:func:`softrdma.wire.icrc.icrc_ok_ipv4`)."""
        buf = self.buf
        return _icrc_unpack(buf, len(buf) - ICRC_SIZE)[0]

    @property
    def payload_offset(self) -> int:
        """Where the payload starts: the BTH and the opcode's extension headers."""
        return self.info.length

    @property
    def payload(self) -> memoryview:
        o = self.info.length
        return memoryview(self.buf)[o:o + self.payload_len]

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
_LAYOUT_CLASSES: dict[tuple[Hdr, ...], type[RocePacket]] = {}


def _layout_class(headers: tuple[Hdr, ...]) -> type[RocePacket]:
    """The RocePacket subclass for packets carrying ``headers``: one slot per field they
    fill (shared by every opcode with that layout)."""
    cls = _LAYOUT_CLASSES.get(headers)
    if cls is None:
        slots = tuple(dict.fromkeys(a for h in headers for a in FIELDS_BY_HEADER[h]))
        cls = type("RocePacket", (RocePacket,), {"__slots__": slots,
                                                  "__module__": RocePacket.__module__})
        cls.__qualname__ = f"RocePacket[{'+'.join(h.name for h in headers) or 'BTH'}]"
        _LAYOUT_CLASSES[headers] = cls
    return cls


# Per opcode: its layout class, and which of parse's branches decodes its extension
# headers (0: none; the others are the layouts' order of frequency in RC traffic).
_CLASS: list[type[RocePacket] | None] = [
    _layout_class(tuple(h for h, _ in i.headers)) if i else None for i in OPCODE_LIST]
_K_NONE, _K_RETH, _K_AETH, _K_IMMDT, _K_RETH_IMMDT, _K_ATMETH, _K_AETH_ATMACK, _K_IETH, \
    _K_DETH, _K_DETH_IMMDT, _K_FETH_RETH, _K_CNP = range(12)
_KIND_OF_LAYOUT = {
    (): _K_NONE, (Hdr.RETH,): _K_RETH, (Hdr.AETH,): _K_AETH, (Hdr.IMMDT,): _K_IMMDT,
    (Hdr.RETH, Hdr.IMMDT): _K_RETH_IMMDT, (Hdr.ATMETH,): _K_ATMETH,
    (Hdr.AETH, Hdr.ATMACK): _K_AETH_ATMACK, (Hdr.IETH,): _K_IETH, (Hdr.DETH,): _K_DETH,
    (Hdr.DETH, Hdr.IMMDT): _K_DETH_IMMDT, (Hdr.FETH, Hdr.RETH): _K_FETH_RETH,
    (Hdr.CNP,): _K_CNP,
}
_KIND: list[int] = [_KIND_OF_LAYOUT[tuple(h for h, _ in i.headers)] if i else 0
                    for i in OPCODE_LIST]
#: Per opcode, what parse needs in one lookup: (OpInfo, layout class, branch, headers +
#: ICRC bytes); None: not an opcode.
_PARSE: list[tuple[OpInfo, type[RocePacket], int, int] | None] = [
    (i, _CLASS[i.opcode], _KIND[i.opcode], i.length + ICRC_SIZE) if i else None
    for i in OPCODE_LIST]
# parse inlines these BTH constants: the definitions must still say the same.
if (BTH_PAD_SHIFT, ICRC_SIZE, BTH_ACK, BTH_QPN_MASK, BTH_PSN_MASK, BTH_SE, BTH_MIG,
        BTH_TVER_MASK, BTH_FECN, BTH_BECN) != (4, 4, 0x80000000, 0xFFFFFF, 0xFFFFFF, 0x80,
                                              0x40, 0x0F, 0x80000000, 0x40000000):
    raise AssertionError("BTH constants differ from those parse and build inline")
# parse's branches hard-code the offsets: the table must still say the same.
_OFFSETS_OF_KIND = {
    _K_RETH: (12,), _K_AETH: (12,), _K_IMMDT: (12,), _K_RETH_IMMDT: (12, 28),
    _K_ATMETH: (12,), _K_AETH_ATMACK: (12, 16), _K_IETH: (12,), _K_DETH: (12,),
    _K_DETH_IMMDT: (12, 20), _K_FETH_RETH: (12, 16), _K_CNP: (12,), _K_NONE: ()}
for _i in OPCODE_LIST:
    if _i is not None and tuple(o for _, o in _i.headers) != _OFFSETS_OF_KIND[_KIND[_i.opcode]]:
        raise AssertionError(f"{_i.name}: header offsets differ from parse's")
del _i


def _compile_head(headers: tuple[Hdr, ...]) -> Any:
    """``head(op, flags, pkey, w1, w2, <EXT_ATTRS>)``: the BTH and ``headers`` as bytes,
    from one struct of the whole layout (rather than a pack per header into the packet).

    The field expressions are :func:`~softrdma.wire.headers.word_sources` of the header
    descriptions, so ``build`` writes exactly what :meth:`Header.pack_into` would.
    """
    fmt = "!BBHII" + "".join(HEADERS[h].fmt.lstrip("!") for h in headers)
    words = ["op", "flags", "pkey", "w1", "w2"]
    for h in headers:
        words += word_sources(HEADERS[h], lambda attr: attr)
    src = (f"def head(op, flags, pkey, w1, w2, {', '.join(EXT_ATTRS)}):\n"
           f"    return pack({', '.join(words)})\n")
    namespace: dict = {"pack": struct.Struct(fmt).pack}
    exec(compile(src, f"<build head {'+'.join(h.name for h in headers) or 'BTH'}>", "exec"),
         namespace)
    head = namespace["head"]
    head.source = src  # what exactly runs, for readers and tests
    return head


_HEADS: dict[tuple[Hdr, ...], Any] = {}
for _i in OPCODE_LIST:
    if _i is not None:
        _k = tuple(h for h, _ in _i.headers)
        if _k not in _HEADS:
            _HEADS[_k] = _compile_head(_k)
#: Per opcode: its compiled ``head`` (None: not an opcode).
_HEAD = [_HEADS[tuple(h for h, _ in i.headers)] if i else None for i in OPCODE_LIST]
del _i, _k
# build passes the extension fields to head() positionally, in this order.
if EXT_ATTRS != ("va", "rkey", "dma_len", "syndrome", "msn", "swap_add", "compare", "orig",
                 "ieth_rkey", "qkey", "src_qp", "imm", "feth"):
    raise AssertionError("EXT_ATTRS differs from the order build passes the fields in")
#: The pad and a zero ICRC, by pad count: what follows the payload of a built packet.
_ZERO_TAILS = tuple(bytes(pad + ICRC_SIZE) for pad in range(4))
_bth_unpack = BTH.struct.unpack_from
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
    # The BTH constants are inlined below (pad shift 4, ICRC 4 bytes, AckReq bit 31, 24-bit
    # QPN and PSN; checked against headers.py at import): a global lookup each costs.
    buf = data  # as given: a memoryview is made only when the payload is asked for
    n = len(buf)
    if n < 16:  # BTH + ICRC
        raise DecodeError("truncated", f"packet of {n} bytes is shorter than BTH + ICRC (16)")
    op, flags, pkey, w1, w2 = _bth_unpack(buf, 0)
    entry = _PARSE[op]
    if entry is None:
        raise DecodeError("unknown_opcode", f"opcode 0x{op:02x} is not a known RoCE opcode")
    info, cls, kind, fixed = entry
    pad = (flags >> 4) & 3
    paylen = n - fixed - pad
    if paylen < 0:
        hlen = info.length
        if n < hlen + ICRC_SIZE:
            raise DecodeError("truncated", f"{info.name} needs {hlen + ICRC_SIZE} bytes of "
                                           f"headers and ICRC, packet has {n}")
        raise DecodeError("bad_pad", f"{info.name}: pad count {pad} exceeds the "
                                     f"{n - hlen - ICRC_SIZE} bytes after the headers")
    p = cls()
    p.buf = buf
    p.info = info
    p.opcode = op
    p._flags = flags
    p.pkey = pkey
    p.dest_qp = w1 & 0xFFFFFF
    p.ackreq = w2 >= 0x80000000
    p.psn = w2 & 0xFFFFFF
    p.pad = pad
    p.payload_len = paylen
    # Extension headers at their fixed offsets after the 12-byte BTH (opcodes.py lays them
    # out; tests/test_wire_headers.py holds these branches to the header descriptions).
    if kind:
        if kind == _K_RETH:
            p.va, p.rkey, p.dma_len = _reth_unpack(buf, 12)
        elif kind == _K_AETH:
            (w,) = _aeth_unpack(buf, 12)
            p.syndrome = w >> 24
            p.msn = w & 0xFFFFFF
        elif kind == _K_IMMDT:
            (p.imm,) = _imm_unpack(buf, 12)
        elif kind == _K_RETH_IMMDT:
            p.va, p.rkey, p.dma_len = _reth_unpack(buf, 12)
            (p.imm,) = _imm_unpack(buf, 28)
        elif kind == _K_ATMETH:
            p.va, p.rkey, p.swap_add, p.compare = _atm_unpack(buf, 12)
        elif kind == _K_AETH_ATMACK:
            (w,) = _aeth_unpack(buf, 12)
            p.syndrome = w >> 24
            p.msn = w & 0xFFFFFF
            (p.orig,) = _atmack_unpack(buf, 16)
        elif kind == _K_IETH:
            (p.ieth_rkey,) = _ieth_unpack(buf, 12)
        elif kind == _K_DETH or kind == _K_DETH_IMMDT:
            p.qkey, sqp = _deth_unpack(buf, 12)
            p.src_qp = sqp & 0xFFFFFF  # resv8 dropped
            if kind == _K_DETH_IMMDT:
                (p.imm,) = _imm_unpack(buf, 20)
        elif kind == _K_FETH_RETH:
            (p.feth,) = _feth_unpack(buf, 12)
            p.va, p.rkey, p.dma_len = _reth_unpack(buf, 16)
        # _K_CNP: 16 reserved bytes, no fields
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
    op = opcode & 0xFF
    head = _HEAD[op]
    if head is None:
        raise ValueError(f"opcode 0x{opcode:02x} is not a known RoCE opcode")
    if pad is None:
        pad = -len(payload) & 3
    elif not 0 <= pad <= 3:
        raise ValueError(f"pad must be 0..3, got {pad}")
    # BTH_SE 0x80, BTH_MIG 0x40, pad << 4, TVer 4 bits; BTH_FECN 1 << 31, BTH_BECN 1 << 30,
    # resv6 bits 24..29, 24-bit QPN; BTH_ACK 1 << 31, resv7 bits 24..30, 24-bit PSN
    # (inlined: the import-time check above holds them to softrdma.wire.headers).
    flags = (0x80 if se else 0) | (0x40 if migreq else 0) | (pad << 4) | (tver & 0x0F)
    w1 = ((0x80000000 if fecn else 0) | (0x40000000 if becn else 0) | ((resv6 & 0x3F) << 24)
          | (dest_qp & 0xFFFFFF))
    w2 = (0x80000000 if ackreq else 0) | ((resv7 & 0x7F) << 24) | (psn & 0xFFFFFF)
    hdr = head(op, flags, pkey & 0xFFFF, w1, w2, va, rkey, dma_len, syndrome, msn, swap_add,
               compare, orig, ieth_rkey, qkey, src_qp, imm, feth)
    if icrc:
        tail = bytes(pad) + (icrc & 0xFFFFFFFF).to_bytes(ICRC_SIZE, "little")
    else:
        tail = _ZERO_TAILS[pad]
    # One allocation and one copy of each part: a zeroed bytearray of the full size
    # filled by slice assignment costs about twice as much for a 4 KiB payload.
    return bytearray().join((hdr, payload, tail))


_REQUEST_PARAMS = ("opcode", "psn", "dest_qp", "ackreq", "se", "va", "rkey", "dma_len",
                   "swap_add", "compare", "imm", "ieth_rkey", "qkey", "src_qp", "payload")


def _compile_request_builder(headers: tuple[Hdr, ...],
                             iov: bool = False) -> Callable[..., Any]:
    """A :func:`build_request` for one header layout, as straight-line code: the BTH and
    extension fields packed by one struct, joined with the payload and the zero tail; with
    ``iov``, the three as a list of buffers instead (softrdma.wire.iov: the payload, a view
    of the MR, is not copied)."""
    fmt = "!BBHII" + "".join(HEADERS[h].fmt.lstrip("!") for h in headers)
    given = set(_REQUEST_PARAMS)
    words = ["opcode", "(0x80 | pad << 4) if se else pad << 4", "0xFFFF",
             "dest_qp & 0xFFFFFF", "(0x80000000 | w2) if ackreq else w2"]
    for h in headers:  # fields the requester does not pass are None (written as 0)
        words += word_sources(HEADERS[h], lambda a: a if a in given else "None")
    src = (f"def build_request({', '.join(_REQUEST_PARAMS)}):\n"
           f"    pad = -len(payload) & 3\n"
           f"    w2 = psn & 0xFFFFFF\n"
           + (f"    return [pack({', '.join(words)}), payload, tails[pad]]\n" if iov else
              f"    return join((pack({', '.join(words)}), payload, tails[pad]))\n"))
    namespace: dict = {"pack": struct.Struct(fmt).pack, "join": bytearray().join,
                       "tails": _ZERO_TAILS}
    exec(compile(src, f"<build_request{'_iov' if iov else ''} "
                      f"{'+'.join(h.name for h in headers) or 'BTH'}>", "exec"), namespace)
    fn = namespace["build_request"]
    fn.source = src  # what exactly runs, for readers and tests
    return fn


_REQUEST_BUILDERS: dict[tuple[Hdr, ...], Callable[..., bytearray]] = {}
_REQUEST_IOV_BUILDERS: dict[tuple[Hdr, ...], Callable[..., list]] = {}
for _i in OPCODE_LIST:
    if _i is not None:
        _k = tuple(h for h, _ in _i.headers)
        if _k not in _REQUEST_BUILDERS:
            _REQUEST_BUILDERS[_k] = _compile_request_builder(_k)
            _REQUEST_IOV_BUILDERS[_k] = _compile_request_builder(_k, iov=True)
#: Per opcode: :func:`build_request` compiled for its layout (None: not an opcode). The
#: requester calls ``REQUEST_BUILDERS[opcode](opcode, psn, ...)`` directly, which spares
#: it the dispatch.
REQUEST_BUILDERS: list[Callable[..., bytearray] | None] = [
    _REQUEST_BUILDERS[tuple(h for h, _ in i.headers)] if i else None for i in OPCODE_LIST]
#: Per opcode: the same builder returning the packet as a list of buffers (softrdma.wire.iov):
#: ``[headers, payload, pad + zero ICRC]``, the payload (a view of the MR) not copied; the
#: device fills the ICRC (``SoftDevice.send_packet``). ``b"".join`` of the list is what
#: :data:`REQUEST_BUILDERS` returns for the same arguments.
REQUEST_IOV_BUILDERS: list[Callable[..., list] | None] = [
    _REQUEST_IOV_BUILDERS[tuple(h for h, _ in i.headers)] if i else None for i in OPCODE_LIST]
del _i, _k


def build_request(opcode: int, psn: int, dest_qp: int, ackreq: bool, se: bool, va: int,
                  rkey: int, dma_len: int, swap_add: int, compare: int, imm: int,
                  ieth_rkey: int, qkey: int, src_qp: int,
                  payload: bytes | bytearray | memoryview) -> bytearray:
    """``build(opcode, psn=.., dest_qp=.., ackreq=.., se=.., va=.., ..., payload=..)`` for the
    requester, which passes these fields for every packet: the same bytes, positionally.

    Fourteen keyword arguments cost ``build`` about as much as the rest of its work; the
    other BTH fields take build's defaults (P_Key 0xffff, no MigReq, FECN, BECN or
    reserved bits, TVer 0), the pad is rxe's and the ICRC slot is zero. Fields the opcode's
    headers do not carry are ignored, as by ``build``.
    """
    fn = REQUEST_BUILDERS[opcode]
    if fn is None:
        raise ValueError(f"opcode 0x{opcode:02x} is not a known RoCE opcode")
    return fn(opcode, psn, dest_qp, ackreq, se, va, rkey, dma_len, swap_add, compare, imm,
              ieth_rkey, qkey, src_qp, payload)


def build_iov(opcode: int, *, payload: bytes | bytearray | memoryview, **fields: Any) -> list:
    """:func:`build` as a list of buffers (softrdma.wire.iov): ``[headers, payload, pad +
    zero ICRC]``, the payload not copied (a READ RESPONSE's view of the MR). ``fields`` are
    :func:`build`'s; the pad is rxe's. ``b"".join`` of the result is ``build(opcode,
    payload=payload, **fields)``."""
    pad = -len(payload) & 3
    whole = build(opcode, payload=b"", pad=pad, **fields)
    cut = len(whole) - pad - ICRC_SIZE
    return [bytes(whole[:cut]), payload, _ZERO_TAILS[pad]]
