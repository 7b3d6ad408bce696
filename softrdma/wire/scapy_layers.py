"""Scapy layers for every RoCEv2 extension header, bound by softrdma's opcode table.

scapy's contrib module (:mod:`scapy.contrib.roce`) has the BTH (with the ICRC as a
trailer it computes over IPv4 and IPv6), GRH, the CNP padding and an AETH bound only to
the ACKNOWLEDGE opcodes; everything else after the BTH dissects as ``Raw``. Importing this
module, like loading a scapy contrib, adds the missing layers and binds them so that every
opcode of :data:`softrdma.wire.opcodes.OPCODES` dissects into its complete header chain:

============================================  ==========================================
opcode                                        layers after UDP
============================================  ==========================================
RC_SEND_ONLY (0x04)                           BTH / Raw
RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE (0x0b)      BTH / RETH / ImmDt / Raw
RC_RDMA_READ_RESPONSE_ONLY (0x10)             BTH / AETH / Raw
RC_ATOMIC_ACKNOWLEDGE (0x12)                  BTH / AETH / AtomicAckETH
RC_COMPARE_SWAP (0x13)                        BTH / AtomicETH
RC_FLUSH (0x1c)                               BTH / FETH / RETH
UD_SEND_ONLY_WITH_IMMEDIATE (0x65)            BTH / DETH / ImmDt / Raw
============================================  ==========================================

The BTH binds to the first extension header by opcode; after that, which header comes
next depends on the BTH opcode, not on the extension header's own fields, so each
extension layer's ``guess_payload_class`` finds its enclosing BTH and asks the table. The
ICRC stays scapy's: a trailer of the BTH computed over BTH and everything after it, so
packets built from these layers get a correct ICRC for IPv4 and IPv6 (leave
``BTH.icrc`` unset). The dissected ``BTH.icrc`` is the four wire bytes read big-endian,
i.e. byte-swapped against ``zlib.crc32`` and :attr:`RocePacket.icrc
<softrdma.wire.packet.RocePacket.icrc>`; :func:`icrc_ok` checks a dissected packet.

Every extension layer's ``fields_desc`` is derived from the header's description in
:mod:`softrdma.wire.headers`, so its fields carry the names the description gives them
(``va rkey dma_len syndrome msn swap_add compare orig imm qkey resv8 src_qp``; the IETH's
field is ``rkey``, which :class:`~softrdma.wire.packet.RocePacket` calls ``ieth_rkey``;
the FETH word shows as its parts ``resv sel plt``, with ``feth`` a property over them).
The BTH keeps scapy's names (``dqpn``, ``solicited``, ``padcount``, ``version``...),
mapped by :data:`BTH_FIELD_ALIASES`. scapy neither adds nor strips the pad: the
``Raw`` payload holds the data *and* its ``padcount`` pad bytes (:func:`roce_payload`
strips them, :func:`roce_packet` adds them).

scapy is an optional dependency of softrdma: nothing else in the package imports this
module at import time.

Example::

    >>> from scapy.layers.l2 import Ether
    >>> from scapy.layers.inet import IP, UDP
    >>> from softrdma.wire.scapy_layers import (BTH, RETH, ImmDt, icrc_ok,
    ...                                           roce_packet, roce_payload)
    >>> pkt = (Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    ...        / IP(src="10.0.0.1", dst="10.0.0.2", flags="DF", id=0)
    ...        / UDP(sport=0xC000, dport=4791, chksum=0)
    ...        / roce_packet(0x0B, dqpn=0x12, psn=5, va=0x1000, rkey=0x77, dma_len=3,
    ...                      imm=0xCAFE, payload=b"abc"))
    >>> frame = bytes(pkt)                      # ICRC computed by scapy's BTH
    >>> d = Ether(frame)
    >>> [layer.__name__ for layer in d.layers()][3:]
    ['BTH', 'RETH', 'ImmDt', 'Raw']
    >>> hex(d[RETH].va), d[ImmDt].imm, roce_payload(d), icrc_ok(d)
    ('0x1000', 51966, b'abc', True)

(Always give ``Ether`` explicit ``src`` and ``dst``: without them scapy resolves the
addresses with ARP/ND whenever the packet is built.)
"""

from __future__ import annotations

from typing import Any

from scapy.config import conf
from scapy.contrib import roce as _scapy_roce
from scapy.contrib.roce import BTH, CNPPadding, GRH, cnp
from scapy.fields import (
    BitField, ByteField, Field as ScapyField, IntField, LongField, ShortField, XBitField,
    XByteField, XIntField, XLongField, XShortField,
)
from scapy.packet import Packet, Raw, bind_layers, bind_top_down, split_layers

from .headers import (
    ATMACK, ATMETH, DETH as DETH_H, EXT_ATTRS, FETH as FETH_H, HEADERS, IETH as IETH_H,
    IMMDT, RETH as RETH_H, AETH as AETH_H, AethType, Field, Header, aeth_syndrome_name,
    aeth_type,
)
from .opcodes import OPCODES, Hdr, Opcode, lookup

__all__ = [
    "BTH", "GRH", "CNPPadding", "cnp",
    "RETH", "AETH", "AtomicETH", "AtomicAckETH", "IETH", "DETH", "ImmDt", "FETH",
    "LAYER_BY_HDR", "HDR_BY_LAYER", "BTH_FIELD_ALIASES", "fields_desc_of",
    "header_layers", "roce_packet", "roce_payload", "icrc_ok",
]


# scapy field classes by width: (decimal, hex). Other widths are bit fields.
_SCAPY_FIELD = {64: (LongField, XLongField), 32: (IntField, XIntField),
                16: (ShortField, XShortField), 8: (ByteField, XByteField)}


def _scapy_field(f: Field) -> ScapyField:
    """The scapy field for one described field (no parts)."""
    if f.bits in _SCAPY_FIELD:
        cls = _SCAPY_FIELD[f.bits][f.hex]
        if f.describe is not None:
            return _described(cls, f.describe)(f.name, 0)
        return cls(f.name, 0)
    return (XBitField if f.hex else BitField)(f.name, 0, f.bits)


def _described(cls: type, describe) -> type:
    """``cls`` showing a value's meaning beside it: ``0x1f (ACK credit=31)``."""

    class Described(cls):  # type: ignore[misc, valid-type]
        def i2repr(self, pkt: Packet | None, x: Any) -> str:
            if x is None:
                return super().i2repr(pkt, x)
            return f"{super().i2repr(pkt, x)} ({describe(int(x))})"
    Described.__name__ = f"Described{cls.__name__}"
    return Described


def fields_desc_of(h: Header) -> list[ScapyField]:
    """A scapy ``fields_desc`` from a header description: one field per described field,
    or per part where the description splits a field (the FETH word)."""
    return [_scapy_field(p) for f in h.fields for p in (f.parts or (f,))]


def _word_property(f: Field) -> property:
    """``layer.<f.name>`` as the whole word of a field scapy shows as its parts."""
    def get(self: Packet) -> int:
        w = 0
        for p in f.parts:
            w = (w << p.bits) | (int(getattr(self, p.name)) & ((1 << p.bits) - 1))
        return w

    def set_(self: Packet, value: int) -> None:
        shift = f.bits
        for p in f.parts:
            shift -= p.bits
            setattr(self, p.name, (value >> shift) & ((1 << p.bits) - 1))
    return property(get, set_, doc=f"the whole {f.bits}-bit {f.name} word: {f.doc}")


class _RoceExt(Packet):
    """Base of the extension headers: the next header comes from the BTH opcode."""

    hdr: Hdr  # which extension header this layer is, in softrdma's table

    def _bth(self) -> BTH | None:
        lower = self.underlayer
        while lower is not None and not isinstance(lower, BTH):
            lower = lower.underlayer
        return lower

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        bth = self._bth()
        if bth is not None:
            info = lookup(int(bth.opcode))
            if info is not None:
                hdrs = [h for h, _ in info.headers]
                if self.hdr in hdrs:
                    i = hdrs.index(self.hdr)
                    if i + 1 < len(hdrs):
                        return LAYER_BY_HDR[hdrs[i + 1]]
        return conf.raw_layer or Raw


class RETH(_RoceExt):
    """RDMA extended transport header (16 bytes)."""

    name = "RETH"
    hdr = Hdr.RETH
    fields_desc = fields_desc_of(RETH_H)


class AETH(_RoceExt, _scapy_roce.AETH):
    """ACK extended transport header (4 bytes): syndrome (8 bits) and MSN (24 bits).

    Subclasses scapy's AETH, so ``pkt[scapy.contrib.roce.AETH]`` finds it too. ``kind``
    is the :class:`~softrdma.wire.headers.AethType` (ACK, RNR_NAK, NAK) of the syndrome.
    """

    name = "AETH"
    hdr = Hdr.AETH
    match_subclass = True
    fields_desc = fields_desc_of(AETH_H)

    @property
    def kind(self) -> AethType:
        return aeth_type(int(self.syndrome))

    def mysummary(self) -> str:
        return f"AETH {aeth_syndrome_name(int(self.syndrome))} msn={int(self.msn)}"


class AtomicETH(_RoceExt):
    """Atomic extended transport header (28 bytes), in the IBA/rxe order: VA, R_Key,
    Swap (or Add) data, Compare data. For FETCH_ADD ``swap_add`` is the addend."""

    name = "AtomicETH"
    hdr = Hdr.ATMETH
    fields_desc = fields_desc_of(ATMETH)


class AtomicAckETH(_RoceExt):
    """Atomic ACK extended transport header (8 bytes): the original remote data."""

    name = "AtomicAckETH"
    hdr = Hdr.ATMACK
    fields_desc = fields_desc_of(ATMACK)


class IETH(_RoceExt):
    """Invalidate extended transport header (4 bytes): the rkey to invalidate
    (``RocePacket.ieth_rkey``)."""

    name = "IETH"
    hdr = Hdr.IETH
    fields_desc = fields_desc_of(IETH_H)


class DETH(_RoceExt):
    """Datagram extended transport header (8 bytes): Q_Key, 8 reserved bits, source QP."""

    name = "DETH"
    hdr = Hdr.DETH
    fields_desc = fields_desc_of(DETH_H)


class ImmDt(_RoceExt):
    """Immediate data (4 bytes, carried opaquely)."""

    name = "ImmDt"
    hdr = Hdr.IMMDT
    fields_desc = fields_desc_of(IMMDT)


class FETH(_RoceExt):
    """Flush extended transport header (4 bytes, IBTA 1.5): 26 reserved bits, the
    selectivity level (2 bits) and the placement type (4 bits), as rxe's ``feth_init``.
    ``feth`` reads the whole 32-bit word (``RocePacket.feth``)."""

    name = "FETH"
    hdr = Hdr.FETH
    fields_desc = fields_desc_of(FETH_H)
    feth = _word_property(FETH_H.fields[0])


#: softrdma header kind -> scapy layer (the CNP's 16 reserved bytes are scapy's CNPPadding).
LAYER_BY_HDR: dict[Hdr, type[Packet]] = {
    Hdr.RETH: RETH,
    Hdr.AETH: AETH,
    Hdr.ATMETH: AtomicETH,
    Hdr.ATMACK: AtomicAckETH,
    Hdr.IETH: IETH,
    Hdr.DETH: DETH,
    Hdr.IMMDT: ImmDt,
    Hdr.FETH: FETH,
    Hdr.CNP: CNPPadding,
}
HDR_BY_LAYER: dict[type[Packet], Hdr] = {v: k for k, v in LAYER_BY_HDR.items()}

#: RocePacket / build() names of the BTH fields -> scapy's BTH field names.
BTH_FIELD_ALIASES: dict[str, str] = {
    "dest_qp": "dqpn",
    "se": "solicited",
    "pad": "padcount",
    "tver": "version",
}


def header_layers(opcode: int) -> list[type[Packet]]:
    """The scapy layers that follow the BTH for ``opcode``, in wire order."""
    info = lookup(opcode)
    if info is None:
        raise ValueError(f"opcode 0x{opcode:02x} is not a known RoCE opcode")
    return [LAYER_BY_HDR[h] for h, _ in info.headers]


def _install() -> None:
    # Names for the opcodes scapy's BTH enum lacks (0x16/0x17 with invalidate, FLUSH,
    # ATOMIC_WRITE), so show() and summary() print them too.
    opfield = next(f for f in BTH.fields_desc if f.name == "opcode")
    for info in OPCODES.values():
        if opfield.i2s is not None and info.opcode not in opfield.i2s:
            opfield.i2s[info.opcode] = info.name
            if opfield.s2i is not None:
                opfield.s2i[info.name] = info.opcode
    # scapy binds its own AETH for RC ACKNOWLEDGE: ours replaces it. (scapy's RD
    # ACKNOWLEDGE binding, 0x51, is left alone: RD is outside softrdma's table.)
    split_layers(BTH, _scapy_roce.AETH, opcode=int(Opcode.RC_ACKNOWLEDGE))
    for info in sorted(OPCODES.values(), key=lambda i: i.opcode):
        if not info.headers or info.headers[0][0] == Hdr.CNP:
            continue  # no extension header, or scapy's own CNP binding
        bind_layers(BTH, LAYER_BY_HDR[info.headers[0][0]], opcode=info.opcode)
    # When a BTH is built on top of a first extension layer without an explicit opcode,
    # bind_layers would leave the last bound opcode as the default: prefer the ONLY one.
    for layer, op in ((RETH, Opcode.RC_RDMA_WRITE_ONLY), (AETH, Opcode.RC_ACKNOWLEDGE),
                      (AtomicETH, Opcode.RC_COMPARE_SWAP),
                      (ImmDt, Opcode.RC_SEND_ONLY_WITH_IMMEDIATE),
                      (IETH, Opcode.RC_SEND_ONLY_WITH_INVALIDATE),
                      (DETH, Opcode.UD_SEND_ONLY), (FETH, Opcode.RC_FLUSH)):
        bind_top_down(BTH, layer, opcode=int(op))


_install()


# Scapy-only field names roce_packet also takes (reserved fields, the FETH parts): the
# names of layer fields that are no RocePacket attribute.
_SCAPY_ONLY_NAMES = frozenset(
    {f.name for layer in LAYER_BY_HDR.values() for f in layer.fields_desc} - set(EXT_ATTRS))


def _layer_kwargs(h: Header, ext_kw: dict[str, Any], used: set[str]) -> dict[str, Any]:
    """The scapy keyword arguments of header ``h`` among RocePacket-named ``ext_kw``."""
    kw: dict[str, Any] = {}
    for f in h.fields:
        if f.attr is not None and f.attr in ext_kw:
            v = ext_kw[f.attr]
            used.add(f.attr)
            shift = f.bits
            for p in f.parts:  # a word scapy shows as parts: split it
                shift -= p.bits
                kw[p.name] = (v >> shift) & ((1 << p.bits) - 1)
            if not f.parts:
                kw[f.name] = v
        for p in (f.parts or (f,)):
            if p.name in _SCAPY_ONLY_NAMES and p.name in ext_kw:
                kw[p.name] = ext_kw[p.name]
                used.add(p.name)
    return kw


def roce_packet(opcode: int, *, payload: bytes = b"", pad: int | None = None,
                **fields: Any) -> Packet:
    """A ``BTH / <the opcode's extension headers> / Raw`` stack ready to put under UDP.

    ``fields`` takes scapy's BTH names or the :func:`softrdma.wire.packet.build` names
    (``dest_qp``, ``se``, ``tver``; ``pad`` pads like ``build``: by default ``(-len) & 3``
    zero bytes, appended to the Raw payload and counted in ``padcount``), and the
    extension-header fields by name (``va rkey dma_len syndrome msn swap_add compare orig
    imm qkey src_qp``, plus ``ieth_rkey`` for the IETH and ``feth`` for the FETH word).
    ``icrc`` is left unset so scapy computes it when the packet is built under IP/UDP.
    Like ``build``, fields of headers ``opcode`` does not carry are ignored; a name that is
    no RoCE field at all raises TypeError.
    """
    layers = header_layers(opcode)
    bth_names = {f.name for f in BTH.fields_desc}
    bth_kw: dict[str, Any] = {}
    ext_kw: dict[str, Any] = {}
    for k, v in fields.items():
        k2 = BTH_FIELD_ALIASES.get(k, k)
        if k2 in bth_names:
            bth_kw[k2] = v
        else:
            ext_kw[k] = v
    if pad is None:
        pad = -len(payload) & 3
    elif not 0 <= pad <= 3:
        raise ValueError(f"pad must be 0..3, got {pad}")
    bth_kw.setdefault("padcount", pad)
    pkt: Packet = BTH(opcode=opcode, **bth_kw)
    used: set[str] = set()
    for layer in layers:
        h = HEADERS[HDR_BY_LAYER[layer]]
        pkt = pkt / layer(**_layer_kwargs(h, ext_kw, used))
    unknown = set(ext_kw) - used - set(EXT_ATTRS) - _SCAPY_ONLY_NAMES
    if unknown:
        raise TypeError(f"no RoCE header has field(s) {sorted(unknown)}")
    data = bytes(payload) + b"\0" * pad
    if data:
        pkt = pkt / Raw(load=data)
    return pkt


def roce_payload(pkt: Packet) -> bytes:
    """The data a dissected RoCE packet carries: what follows its last extension header,
    without the ``padcount`` pad bytes (and without the ICRC, which scapy keeps in BTH, or
    any Ethernet padding)."""
    bth = pkt[BTH]
    last: Packet = bth
    while isinstance(last.payload, (_RoceExt, CNPPadding)):
        last = last.payload
    data = last.payload.do_build()  # do_build, unlike bytes(), leaves out Padding layers
    pad = int(bth.padcount)
    return data[:len(data) - pad] if pad else data


def icrc_ok(pkt: Packet) -> bool:
    """Whether a dissected packet's ICRC is the one scapy computes for its IP/UDP/BTH.

    Ethernet padding (a frame shorter than 60 bytes) is dropped first: scapy's
    ``BTH.compute_icrc`` would otherwise count it as RoCE payload.
    """
    q = pkt.copy()
    padding = q.getlayer(conf.padding_layer)
    if padding is not None and padding.underlayer is not None:
        padding.underlayer.remove_payload()
    bth = q[BTH]
    wire = bth.icrc
    bth.icrc = None
    return wire is not None and bth.do_build()[-4:] == int(wire).to_bytes(4, "big")
