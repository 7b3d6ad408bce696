"""RoCEv2 transport headers, described once: the layouts everything else derives from.

Each header is a :class:`Header`: its struct format (big-endian words) and its
:class:`Field` list, most significant bits first, each field with its width, its meaning,
and the names it goes by. From these descriptions come

* the offsets and sizes in the opcode table (:mod:`softrdma.wire.opcodes`),
* ``build`` and the reference decoder :meth:`Header.unpack_from` that the hand-unrolled
  fast ``parse`` is tested against (:mod:`softrdma.wire.packet`),
* the dissector's record keys and text line (:mod:`softrdma.wire.dissect`),
* the scapy layers' ``fields_desc`` (:mod:`softrdma.wire.scapy_layers`).

One naming scheme. A field has a ``name`` inside its header (``IETH.rkey``, as the IBTA
spec and scapy call it) and an ``attr``: its name on a decoded
:class:`~softrdma.wire.packet.RocePacket` and as a ``build`` keyword. All of a packet's
headers share that one namespace, so ``attr`` is the name unless that would mean two
things: the IETH's rkey is ``ieth_rkey`` (a key to *invalidate*, never one to check
access with, which is what ``rkey`` means on RETH and AtomicETH). The dissector's record
key is the header's ``prefix`` plus the name (``reth_va``, ``deth_qkey``), except the one
key published before this scheme existed, ``reth_len``. Reserved fields have no ``attr``:
they are written as zero and not decoded.

BTH (12 bytes)::

     0       1       2       3
    +-------+-+-+---+-------+---------------+
    |opcode |S|M|Pad| TVer  |     P_Key     |
    +-+-+---+-------+-------+---------------+
    |F|B|resv6      |      Destination QP   |
    +-+-------------+-----------------------+
    |A| resv7       |         PSN           |
    +-+-------------+-----------------------+

Example::

    >>> from softrdma.wire.headers import DETH
    >>> raw = bytearray(8)
    >>> DETH.pack_into(raw, 0, {"qkey": 0x80010000, "src_qp": 0x12})
    >>> raw.hex(), DETH.unpack_from(raw)
    ('8001000000000012', {'qkey': 2147549184, 'src_qp': 18})
    >>> [(f.name, f.bits, f.attr) for f in DETH.fields]
    [('qkey', 32, 'qkey'), ('resv8', 8, None), ('src_qp', 24, 'src_qp')]
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    # values with a name on the wire
    "ROCE_V2_UDP_DPORT", "DEFAULT_PKEY", "GSI_QKEY", "PSN_MASK", "QPN_MASK",
    "BTH_SE", "BTH_MIG", "BTH_PAD_MASK", "BTH_PAD_SHIFT", "BTH_TVER_MASK", "BTH_FECN",
    "BTH_BECN", "BTH_RESV6A_MASK", "BTH_QPN_MASK", "BTH_ACK", "BTH_RESV7_MASK",
    "BTH_PSN_MASK", "BTH_OPCODE_OFFSET", "BTH_FLAGS_OFFSET", "BTH_PKEY_OFFSET",
    "BTH_QPN_OFFSET", "BTH_ACK_OFFSET", "BTH_PSN_OFFSET",
    "AETH_TYPE_MASK", "AETH_VALUE_MASK", "AETH_MSN_MASK", "AETH_ACK_UNLIMITED",
    "AethType", "NakCode", "aeth_type", "aeth_value", "aeth_syndrome_name", "make_syndrome",
    "FETH_PLT_MASK", "FETH_SEL_MASK", "FETH_SEL_SHIFT", "FETH_RESV_MASK", "feth_value",
    "feth_plt", "feth_sel", "feth_name",
    # the descriptions
    "Hdr", "Field", "Header", "BTH", "RETH", "AETH", "ATMETH", "ATMACK", "IETH", "DETH",
    "IMMDT", "FETH", "CNP", "HEADERS", "EXT_ATTRS", "Packer", "compile_packer", "word_sources",
]

ROCE_V2_UDP_DPORT = 4791
DEFAULT_PKEY = 0xFFFF
GSI_QKEY = 0x80010000  # the well-known Q_Key of QP1 (IBTA C9-49)

#: PSNs and QP numbers are 24-bit; PSN arithmetic is modulo 2**24 (see softrdma.qp.psn).
PSN_MASK = 0xFFFFFF
QPN_MASK = 0xFFFFFF

# BTH bit fields (rxe_hdr.h), by the BTH word they sit in: byte 1, word 1, word 2.
BTH_SE = 0x80
BTH_MIG = 0x40
BTH_PAD_MASK = 0x30
BTH_PAD_SHIFT = 4
BTH_TVER_MASK = 0x0F
BTH_FECN = 0x80000000
BTH_BECN = 0x40000000
BTH_RESV6A_MASK = 0x3F000000
BTH_QPN_MASK = QPN_MASK
BTH_ACK = 0x80000000
BTH_RESV7_MASK = 0x7F000000
BTH_PSN_MASK = PSN_MASK

# AETH: an 8-bit syndrome (resv | 2-bit type | 5-bit value) then the 24-bit MSN.
AETH_TYPE_MASK = 0x60
AETH_VALUE_MASK = 0x1F
AETH_MSN_MASK = 0xFFFFFF


class AethType(enum.IntEnum):
    """The type bits of the AETH syndrome (``syndrome & AETH_TYPE_MASK``)."""

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
    """ACK, RNR_NAK, NAK (or RESERVED) from a syndrome byte."""
    return AethType(syndrome & AETH_TYPE_MASK)


def aeth_value(syndrome: int) -> int:
    """The low five bits of a syndrome: ACK credit, RNR timer code or NAK code."""
    return syndrome & AETH_VALUE_MASK


def make_syndrome(kind: AethType, value: int) -> int:
    """Build a syndrome from its type and its 5-bit value (credit, RNR timer or NAK code)."""
    return (int(kind) | (value & AETH_VALUE_MASK)) & 0x7F


def aeth_syndrome_name(syndrome: int) -> str:
    """Readable form of an AETH syndrome: ``ACK credit=31``, ``RNR_NAK timer=12``, ..."""
    kind = syndrome & AETH_TYPE_MASK
    value = syndrome & AETH_VALUE_MASK
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


# FETH (IBTA 1.5 A19.3, rxe_hdr.h): 26 reserved bits, the selectivity level (2 bits: 0 the
# RETH's range, 1 the whole memory region) and the placement type (4 bits: 1 global
# visibility, 2 persistence).
FETH_PLT_MASK = 0x0000000F
FETH_SEL_MASK = 0x00000030
FETH_SEL_SHIFT = 4
FETH_RESV_MASK = 0xFFFFFFC0


def feth_value(plt: int, sel: int) -> int:
    """The FETH word for placement type ``plt`` and selectivity level ``sel`` (feth_init)."""
    return ((sel << FETH_SEL_SHIFT) & FETH_SEL_MASK) | (plt & FETH_PLT_MASK)


def feth_plt(feth: int) -> int:
    """The placement type bits of a FETH word (1 global, 2 persistent)."""
    return feth & FETH_PLT_MASK


def feth_sel(feth: int) -> int:
    """The selectivity level of a FETH word (0 range, 1 memory region)."""
    return (feth & FETH_SEL_MASK) >> FETH_SEL_SHIFT


_PLT_NAMES = {1: "global", 2: "persistent"}
_SEL_NAMES = {0: "range", 1: "mr"}


def feth_name(feth: int) -> str:
    """Readable FETH: ``plt=global sel=range`` (numbers for values IBTA does not name)."""
    plt = feth_plt(feth)
    names = [n for b, n in _PLT_NAMES.items() if plt & b]
    if plt & ~3 or not names:
        names = [str(plt)]
    sel = feth_sel(feth)
    return f"plt={'+'.join(names)} sel={_SEL_NAMES.get(sel, str(sel))}"


class Hdr(enum.IntEnum):
    """Extension headers that may follow the BTH (rxe_hdr_type)."""

    RETH = 1  # RDMA extended transport header: va, rkey, dma length
    AETH = 2  # ACK extended transport header: syndrome, MSN
    ATMETH = 3  # atomic extended transport header: va, rkey, swap/add, compare
    ATMACK = 4  # atomic ACK extended transport header: original remote data
    IETH = 5  # invalidate extended transport header: rkey to invalidate
    DETH = 6  # datagram extended transport header: Q_Key, source QP
    IMMDT = 7  # immediate data
    FETH = 8  # flush extended transport header (IBTA 1.5, rxe 6.2+)
    CNP = 9  # the 16 reserved bytes of a RoCEv2 congestion notification packet


_ITEM_BITS = {"B": 8, "H": 16, "I": 32, "Q": 64}


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a header: ``bits`` wide, in wire order.

    ``attr`` is the RocePacket attribute and ``build`` keyword (None: reserved, written
    as zero); ``key`` the dissector record key (None: the header prefix + ``name``).
    ``text`` is the label in the dissector's text line (None: ``name``; "": the value
    alone) and ``show`` renders the value there. ``describe`` names what a value means
    (the AETH syndrome's ``ACK credit=31``): the text line shows it instead of the number,
    scapy beside it, and the record adds ``derived`` keys computed from the value.
    ``hex`` picks scapy's X-field (hex display). ``parts`` splits the field into the
    sub-fields scapy shows, e.g. the FETH word into resv, sel and plt.
    """

    name: str
    bits: int
    doc: str
    attr: str | None = None
    key: str | None = None
    text: str | None = None
    show: Callable[[int], str] = "0x{:x}".format
    describe: Callable[[int], str] | None = None
    derived: tuple[tuple[str, Callable[[int], Any]], ...] = ()
    hex: bool = True
    parts: tuple["Field", ...] = ()


def _f(name: str, bits: int, doc: str, **kw) -> Field:
    """A field whose attribute is its name (the common case)."""
    kw.setdefault("attr", name)
    return Field(name, bits, doc, **kw)


def _resv(name: str, bits: int) -> Field:
    return Field(name, bits, "reserved: sent as zero, ignored on receive")


@dataclass(frozen=True, slots=True)
class Header:
    """A header's layout: a struct format of whole words, and the fields packed in them.

    ``prefix`` starts the dissector's record keys, ``label`` its text-line group (None:
    the fields print without one). ``__post_init__`` checks that the fields fill the
    struct's words exactly, so a description cannot disagree with its own format.
    """

    hdr: Hdr | None  # None for the BTH, which every packet has
    name: str
    title: str
    fmt: str
    fields: tuple[Field, ...]
    prefix: str = ""
    label: str | None = None
    struct: struct.Struct = field(init=False)
    size: int = field(init=False)
    #: per struct item: the (field, shift) pairs packed into it, shift from the LSB.
    items: tuple[tuple[tuple[Field, int], ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        s = struct.Struct(self.fmt)
        object.__setattr__(self, "struct", s)
        object.__setattr__(self, "size", s.size)
        widths = [_ITEM_BITS[c] for c in self.fmt.lstrip("!") if c != "x"]
        pending = list(self.fields)
        items = []
        for width in widths:
            group, used = [], 0
            while used < width:
                if not pending:
                    raise ValueError(f"{self.name}: fields end inside a {width}-bit word")
                f = pending.pop(0)
                used += f.bits
                group.append((f, width - used))
            if used != width:
                raise ValueError(f"{self.name}: field {group[-1][0].name} crosses a word")
            items.append(tuple(group))
        if pending:
            raise ValueError(f"{self.name}: fields beyond the struct format")
        for f in self.fields:
            if f.parts and sum(p.bits for p in f.parts) != f.bits:
                raise ValueError(f"{self.name}: parts of {f.name} do not add up")
        object.__setattr__(self, "items", tuple(items))

    @property
    def attrs(self) -> tuple[str, ...]:
        """The RocePacket attributes this header fills, in wire order."""
        return tuple(f.attr for f in self.fields if f.attr is not None)

    def record_key(self, f: Field) -> str:
        """The dissector record key of one of this header's fields (``reth_va``)."""
        return f.key if f.key is not None else self.prefix + f.name

    def unpack_from(self, buf: bytes | bytearray | memoryview, offset: int = 0
                    ) -> dict[str, int]:
        """Decode the header at ``offset`` into ``{attr: value}`` (reserved bits dropped).

        The reference decoder: slower than ``parse``, which is tested against it."""
        out = {}
        for word, group in zip(self.struct.unpack_from(buf, offset), self.items):
            for f, shift in group:
                if f.attr is not None:
                    out[f.attr] = (word >> shift) & ((1 << f.bits) - 1)
        return out

    def pack_into(self, buf: bytearray | memoryview, offset: int,
                  values: Mapping[str, int | None]) -> None:
        """Encode the header at ``offset`` from ``{attr: value}``; missing or None is 0.

        A field as wide as its word is written as given (out of range: struct.error); a
        narrower one is masked to its width, reserved ones are zero. The reference
        encoder: ``build`` runs the same layout compiled by :func:`compile_packer`."""
        words = []
        for group in self.items:
            if len(group) == 1 and group[0][0].attr is not None:
                words.append(values.get(group[0][0].attr) or 0)
                continue
            w = 0
            for f, shift in group:
                if f.attr is not None:
                    w |= ((values.get(f.attr) or 0) & ((1 << f.bits) - 1)) << shift
            words.append(w)
        self.struct.pack_into(buf, offset, *words)


#: A compiled header writer: ``pack(buf, offset, values)`` with ``values`` a tuple.
Packer = Callable[[bytearray | memoryview, int, tuple], None]


def word_sources(h: Header, ref: Callable[[str], str]) -> list[str]:
    """Python expressions for the struct items of ``h``, one per item, as its
    :meth:`Header.pack_into` computes them; ``ref(attr)`` is the expression of a field's
    value (None counts as 0). For code generators: :func:`compile_packer` and ``build``."""
    words = []
    for group in h.items:
        terms = []
        for f, shift in group:
            if f.attr is None:
                continue  # reserved: zero
            v = f"({ref(f.attr)} or 0)"
            if len(group) > 1:  # narrower than its word: mask, then move into place
                v = f"({v} & {(1 << f.bits) - 1:#x})" + (f" << {shift}" if shift else "")
                v = f"({v})"
            terms.append(v)
        words.append(" | ".join(terms) or "0")
    return words


def compile_packer(h: Header, order: tuple[str, ...]) -> Packer:
    """:meth:`Header.pack_into` compiled into straight-line code, for ``build``.

    ``values`` is a tuple of field values in ``order`` (``build`` passes its keyword
    arguments in :data:`EXT_ATTRS` order). A loop over the fields, or a dict of them,
    would cost ``build`` a fifth more per packet. For the AETH the source reads::

        def pack(buf, offset, v):
            pack_into(buf, offset, (((v[3] or 0) & 0xff) << 24) | ((v[4] or 0) & 0xffffff))
    """
    words = word_sources(h, lambda attr: f"v[{order.index(attr)}]")
    src = f"def pack(buf, offset, v):\n    pack_into(buf, offset, {', '.join(words)})\n"
    namespace: dict = {"pack_into": h.struct.pack_into}
    exec(compile(src, f"<packer {h.name}>", "exec"), namespace)
    pack = namespace["pack"]
    pack.__doc__ = f"Write a {h.name} at ``offset`` (generated by compile_packer)."
    pack.source = src  # what exactly runs, for readers and tests
    return pack


_hex8 = "0x{:08x}".format

#: The BTH, for reference and for checking scapy's BTH layer; ``parse`` and ``build``
#: handle it inline with the BTH_* masks above, since every packet has one.
BTH = Header(None, "BTH", "base transport header", "!BBHII", (
    _f("opcode", 8, "operation: transport (top 3 bits) and operation (low 5)"),
    _f("se", 1, "solicited event: the receiver should raise a completion event"),
    _f("migreq", 1, "migration request (APM state)"),
    _f("pad", 2, "pad bytes after the payload, to a 4-byte multiple"),
    _f("tver", 4, "transport header version, 0"),
    _f("pkey", 16, "partition key"),
    _f("fecn", 1, "forward explicit congestion notification"),
    _f("becn", 1, "backward explicit congestion notification"),
    _f("resv6", 6, "reserved"),
    _f("dest_qp", 24, "destination queue pair number", key="qpn"),
    _f("ackreq", 1, "acknowledge request: the responder must ACK this packet"),
    _f("resv7", 7, "reserved"),
    _f("psn", 24, "packet sequence number"),
))


def _byte_offset(h: Header, name: str) -> int:
    """Where field ``name`` of ``h`` starts, in bytes from the header's start."""
    bits = 0
    for f in h.fields:
        if f.name == name:
            if bits % 8:
                raise ValueError(f"{h.name}.{name} does not start on a byte")
            return bits // 8
        bits += f.bits
    raise KeyError(name)


#: Byte offsets into the BTH, from its description above: for code that judges a packet
#: from its bytes without decoding it (the receive path's train shortcut, softrdma.soft.rx).
#: The flags byte holds SE, MigReq, PadCnt and TVer (BTH_SE .. BTH_TVER_MASK), the P_Key is
#: two bytes, the QPN the three bytes after FECN/BECN/resv6, the AckReq byte holds AckReq
#: (its top bit) and resv7, and the PSN is the last three bytes.
BTH_OPCODE_OFFSET = _byte_offset(BTH, "opcode")  # 0
BTH_FLAGS_OFFSET = _byte_offset(BTH, "se")  # 1
BTH_PKEY_OFFSET = _byte_offset(BTH, "pkey")  # 2
BTH_QPN_OFFSET = _byte_offset(BTH, "dest_qp")  # 5
BTH_ACK_OFFSET = _byte_offset(BTH, "ackreq")  # 8
BTH_PSN_OFFSET = _byte_offset(BTH, "psn")  # 9

RETH = Header(Hdr.RETH, "RETH", "RDMA extended transport header", "!QII", (
    _f("va", 64, "virtual address of the remote buffer"),
    _f("rkey", 32, "remote key authorising access to it"),
    _f("dma_len", 32, "length of the whole RDMA operation in bytes",
       key="reth_len", show=str, hex=False),
), prefix="reth_", label="reth")

AETH = Header(Hdr.AETH, "AETH", "ACK extended transport header", "!I", (
    _f("syndrome", 8, "ACK, RNR NAK or NAK, with a credit, RNR timer or NAK code",
       text="", describe=aeth_syndrome_name,
       derived=(("aeth_type", lambda s: aeth_type(s).name), ("aeth_value", aeth_value))),
    _f("msn", 24, "message sequence number: the last message completed", show=str, hex=False),
), prefix="aeth_", label="aeth")

ATMETH = Header(Hdr.ATMETH, "AtomicETH", "atomic extended transport header", "!QIQQ", (
    _f("va", 64, "virtual address of the remote 8-byte word"),
    _f("rkey", 32, "remote key authorising access to it"),
    _f("swap_add", 64, "the value to swap in (COMPARE_SWAP) or to add (FETCH_ADD)"),
    _f("compare", 64, "the value to compare with (COMPARE_SWAP)"),
), prefix="atomic_", label="atomic")

ATMACK = Header(Hdr.ATMACK, "AtomicAckETH", "atomic ACK extended transport header", "!Q", (
    _f("orig", 64, "the remote word's value before the atomic"),
), prefix="atomic_")

IETH = Header(Hdr.IETH, "IETH", "invalidate extended transport header", "!I", (
    _f("rkey", 32, "the rkey the responder must invalidate", attr="ieth_rkey",
       text="inv_rkey"),
), prefix="ieth_")

DETH = Header(Hdr.DETH, "DETH", "datagram extended transport header", "!II", (
    _f("qkey", 32, "queue key the receiving UD QP must hold", show=_hex8),
    _resv("resv8", 8),
    _f("src_qp", 24, "the sender's QP number", show="0x{:06x}".format),
), prefix="deth_")

IMMDT = Header(Hdr.IMMDT, "ImmDt", "immediate data", "!I", (
    _f("imm", 32, "32 bits for the receiver's completion, carried opaquely", show=_hex8),
))

FETH = Header(Hdr.FETH, "FETH", "flush extended transport header", "!I", (
    _f("feth", 32, "26 reserved bits, selectivity level (2), placement type (4)",
       show=_hex8, describe=feth_name, text="",
       derived=(("feth_plt", feth_plt), ("feth_sel", feth_sel)), parts=(_resv("resv", 26), Field("sel", 2, "selectivity level", hex=False),
                          Field("plt", 4, "placement type", hex=False))),
))

CNP = Header(Hdr.CNP, "CNPPadding", "RoCEv2 congestion notification padding", "!QQ", (
    _resv("reserved1", 64), _resv("reserved2", 64),
))

#: Every extension header by kind.
HEADERS: dict[Hdr, Header] = {h.hdr: h for h in (RETH, AETH, ATMETH, ATMACK, IETH, DETH,
                                                  IMMDT, FETH, CNP) if h.hdr is not None}
#: Every extension-header attribute once, in header then field order: the keyword
#: arguments ``build`` takes besides the BTH's, and the order it hands them to packers.
EXT_ATTRS: tuple[str, ...] = tuple(dict.fromkeys(
    a for h in HEADERS.values() for a in h.attrs))
