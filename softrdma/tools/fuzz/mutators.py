"""The fuzzer's mutators: each a small function named for what it attacks, in weighted tables.

A frame is made in stages (:mod:`.frames`), and each stage draws from one table here:

==========  ==========================================  ===============================
table       draws                                       a mutator takes / gives
==========  ==========================================  ===============================
OPCODE      one number: the opcode is swapped or kept   ``(r) -> opcode``
QPN         aimed at a live QP, or at another QPN       ``(r, fields, known_qpn)``
PSN         where the PSN is put, near the QP's or not  ``(r, base) -> psn``
RETH        a real MR's key and range, or random bytes  ``(r, length) -> (va, rkey, len)``
RKEY        the real key kept, or one byte of it wrong  ``(r, rkey) -> rkey``
RANGE       inside the MR, at its edges, odd lengths    ``(r, mr_length, n) -> (off, n)``
ATOMIC      the captured operands, or random ones       ``(r, fields)``
AETH        the captured AETH, or another syndrome/MSN  ``(r, fields)``
BTH         at most one of P_Key, TVer, the flag bits   ``(r, fields)``
SIZE        the payload kept, or resized                ``(r, payload) -> payload``
PAD         the pad count computed, or forced           ``(r) -> pad``
BYTES       byte-level damage to the built frame        ``(r, data)``, in place
ICRC        right, right for another port, flipped      ``(r, data, src, dst, sport)``
POST_ICRC   after a right ICRC: a bit flipped under it  ``(r, data)``, in place
==========  ==========================================  ===============================

A :class:`Table` holds :class:`Mutator` entries with probabilities (``weight``); the frame
maker draws one ``random()`` per table and takes the entry whose stretch of [0, 1) it
falls in (:meth:`Table.choose`), or none when it falls past the last. An entry without
``apply`` (a :func:`keep`) is an outcome that changes nothing, named so the table reads
as the whole distribution; an entry with ``attack=False`` aims rather than damages and is
not counted among the mutations. BYTES is different: its weights are integers, one
mutator is drawn per damage step with ``randrange`` over their sum
(:meth:`Table.choose_int`).

The draws (how many, in which order, from which call) are those of the fuzzer before it
was split into tables, so a seed makes the same frames as it did then
(``tests/test_fuzz_mutators.py`` pins a hash of them). The one difference: the PSN draw
picked ``psn_far`` for exactly 0.9 and now picks ``psn_random``, a value ``random()``
returns once in 2^53 draws or so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ...wire.icrc import icrc_ipv4
from ...wire.opcodes import OPCODE_LIST

__all__ = ["Mutator", "Table", "keep", "INTERESTING8", "INTERESTING32",
           "OPCODE", "QPN", "PSN", "RETH", "RKEY", "RANGE", "ATOMIC", "AETH", "BTH", "SIZE",
           "PAD", "BYTES", "ICRC", "POST_ICRC", "TABLES", "REQUEST_OPS", "ALL_OPS",
           "boundary_values"]

INTERESTING8 = (0x00, 0x01, 0x7F, 0x80, 0xFF)
INTERESTING32 = (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFF, 0x10000)
REQUEST_OPS = [op for op, i in enumerate(OPCODE_LIST) if i is not None and i.is_request]
ALL_OPS = [op for op, i in enumerate(OPCODE_LIST) if i is not None]
MTU = 1024  # the path MTU of the fuzzed QPs (live.connect)
Rng = random.Random


@dataclass(frozen=True)
class Mutator:
    """One named way to damage (or aim) a frame, and how often it is drawn."""

    name: str
    weight: float  # a probability (an integer weight in BYTES)
    apply: Callable[..., Any] | None = None  # None: the outcome that changes nothing
    # BYTES only: whether it applies to a frame of this many bytes (a mutator that does
    # not is drawn all the same and does nothing: the step is spent)
    fits: Callable[[int], bool] = field(default=lambda n: True)
    attack: bool = True  # False: a way of aiming, not counted among the mutations

    @property
    def attacks(self) -> str:
        """What it attacks: the first line of its function's docstring."""
        return (self.apply.__doc__ or "").strip().splitlines()[0] if self.apply else ""


def keep(name: str, weight: float) -> Mutator:
    """An outcome that changes nothing (the frame stays as the earlier stages left it)."""
    return Mutator(name, weight, attack=False)


class Table:
    """Mutators with their weights, and the one draw that picks among them."""

    def __init__(self, name: str, *entries: Mutator) -> None:
        self.name = name
        self.entries = entries
        # cumulative weights, rounded so that 0.45 + 0.35 is the 0.8 the table means
        c = 0.0
        self.thresholds: list[float] = []
        for m in entries:
            c = round(c + m.weight, 12)
            self.thresholds.append(c)

    def __iter__(self) -> Iterator[Mutator]:
        return iter(self.entries)

    def __getitem__(self, name: str) -> Mutator:
        return next(m for m in self.entries if m.name == name)

    def choose(self, r: Rng) -> Mutator | None:
        """One ``r.random()``: the entry whose stretch of [0, 1) it falls in, or None past
        the last entry (the probabilities may sum to less than 1)."""
        u = r.random()
        for m, t in zip(self.entries, self.thresholds):
            if u < t:
                return m
        return None

    def choose_int(self, r: Rng) -> Mutator:
        """One ``r.randrange(sum of the integer weights)``: an entry in proportion to its
        weight."""
        k = r.randrange(int(self.thresholds[-1]))
        return next(m for m, t in zip(self.entries, self.thresholds) if k < t)


def boundary_values(r: Rng, bits: int) -> int | bytes:
    """One boundary value of a ``bits``-wide field: 0, 1, the largest, the largest - 1,
    the top bit alone, random; a byte string (GIDs, ARI) all zero, all ones or random."""
    if bits > 64:
        n = bits // 8
        return r.choice((bytes(n), b"\xff" * n, r.randbytes(n)))
    top = (1 << bits) - 1
    return r.choice((0, 1, top, max(top - 1, 0), 1 << (bits - 1), r.getrandbits(bits)))


# -- the opcode -------------------------------------------------------------------------------

def opcode_swap(r: Rng) -> int:
    """The opcode tables and the header parser: another opcode, rebuilt with its headers
    (a request most of the time, so the responder's paths see it), so headers, lengths and
    the QP's opcode sequence disagree with what the seed was."""
    return r.choice(REQUEST_OPS if r.random() < 0.6 else ALL_OPS)


OPCODE = Table("OPCODE", Mutator("opcode_swap", 0.12, opcode_swap))


# -- the QP and the PSN ----------------------------------------------------------------------

def qpn_other(r: Rng, f: dict[str, Any], known_qpn: int) -> None:
    """The QP lookup: QP0, QP1, the multicast QPN, a random QPN, one near a live one, one
    below the first user QPN; with a random PSN."""
    f["dest_qp"] = r.choice((0, 1, 0xFFFFFF, r.randrange(1 << 24), known_qpn + 100,
                             r.randrange(16, 64)))
    f["psn"] = r.randrange(1 << 24)


QPN = Table("QPN", keep("live_qp", 0.93), Mutator("qpn_other", 0.07, qpn_other))


def psn_exact(r: Rng, base: Callable[[], int]) -> int:
    """The deep paths behind the sequence check: the PSN the QP expects, so the packet is
    taken as the next one (opcode sequence, RETH checks, ACK handling)."""
    return base()


def psn_near(r: Rng, base: Callable[[], int]) -> int:
    """Duplicates and small gaps: within 8 of the expected PSN (the duplicate-request path,
    the sequence-error NAK, stale ACKs)."""
    return (base() + r.randint(-8, 8)) & 0xFFFFFF


def psn_far(r: Rng, base: Callable[[], int]) -> int:
    """The 24-bit PSN comparison at its wrap: 2^22 to 2^23 away from the expected PSN,
    where "before" and "after" change sign."""
    b = base()
    return (b + r.choice((1 << 23, (1 << 23) - 1, -(1 << 23), 1 << 22, 4096))) & 0xFFFFFF


def psn_random(r: Rng, base: Callable[[], int]) -> int:
    """The sequence check as a whole: any PSN."""
    return r.randrange(1 << 24)


# ``base`` gives the target's expected PSN (calling it may draw: a response's base is the
# completer's or the requester's PSN, picked at random), so psn_random never calls it
PSN = Table("PSN",
            Mutator("psn_exact", 0.45, psn_exact),
            Mutator("psn_near", 0.35, psn_near),
            Mutator("psn_far", 0.10, psn_far),
            Mutator("psn_random", 0.10, psn_random))


# -- memory: RETH and AtomicETH --------------------------------------------------------------

def reth_random(r: Rng, length: int) -> tuple[int, int, int]:
    """The key lookup with no real key: a random address and rkey, an interesting length."""
    return r.getrandbits(64), r.getrandbits(32), r.choice(INTERESTING32 + (length,))


RETH = Table("RETH", Mutator("reth_random", 0.1, reth_random), keep("real_mr", 0.9))

# which MR of the target a real key is taken from: mostly the one peers may write, also
# the sentinels (remote read only, local only, no access, another PD) and the local MRs,
# so every access check is reached
MR_CHOICES = ("rw", "ro", "local", "none", "otherpd", "recv", "sink")
MR_WEIGHTS = (10, 3, 1, 1, 2, 1, 1)


def rkey_wrong_byte(r: Rng, rkey: int) -> int:
    """The key's check of its variant byte: a real MR's rkey with its low byte changed."""
    return (rkey & ~0xFF) | ((rkey + r.randrange(1, 256)) & 0xFF)


RKEY = Table("RKEY", Mutator("rkey_wrong_byte", 0.1, rkey_wrong_byte))


def inside(r: Rng, mr_length: int, n: int) -> tuple[int, int]:
    """(Not an attack: a range well inside the MR, the deep paths' way in.)"""
    return r.randrange(0, max(1, mr_length - max(n, 8))), n


def va_edge(r: Rng, mr_length: int, n: int) -> tuple[int, int]:
    """The range check at the MR's bounds: a start before, at or across either edge."""
    return r.choice((-1, -8, -4096, 0, mr_length - n, mr_length - n + 1, mr_length,
                     mr_length - 8, mr_length + 4096)), n


def dma_len_odd(r: Rng, mr_length: int, n: int) -> tuple[int, int]:
    """The length checks and their overflow: 0, 1, the MR's length and one more, 2^31,
    2^32-1, off by one from the payload, random; anywhere in the MR."""
    off = r.randrange(0, mr_length)
    return off, r.choice((0, 1, mr_length, mr_length + 1, 1 << 31, 0xFFFFFFFF, n + 1, n - 1,
                          r.getrandbits(32)))


RANGE = Table("RANGE",
              Mutator("inside", 0.55, inside, attack=False),
              Mutator("va_edge", 0.20, va_edge),
              Mutator("dma_len_odd", 0.25, dma_len_odd))
ATOMIC_ALIGNED = 0.85  # an atomic's address is 8-byte aligned this often (else: as drawn)


def atomic_operands(r: Rng, f: dict[str, Any]) -> None:
    """The atomic execution: random 64-bit swap/add and compare operands."""
    f["swap_add"], f["compare"] = r.getrandbits(64), r.getrandbits(64)


ATOMIC = Table("ATOMIC", Mutator("atomic_operands", 0.3, atomic_operands))


# -- other headers ----------------------------------------------------------------------------

def aeth(r: Rng, f: dict[str, Any]) -> None:
    """The completer's AETH decoding: ACK, RNR and NAK syndromes (reserved codes too) and
    an MSN random or off by up to 2."""
    f["syndrome"] = r.choice((0x1F, 0x00, 0x20, 0x3F, 0x60, 0x61, 0x62, 0x63, 0x64, 0x40,
                              0x80, 0xFF, r.randrange(256)))
    f["msn"] = r.randrange(1 << 24) if r.random() < 0.3 else \
        (int(f.get("msn") or 0) + r.randint(-2, 2)) & 0xFFFFFF


AETH = Table("AETH", Mutator("aeth", 0.5, aeth))


def pkey(r: Rng, f: dict[str, Any]) -> None:
    """The P_Key check: 0, the limited and full default keys' edges, a random key."""
    f["pkey"] = r.choice((0, 0x7FFF, 0x8000, r.randrange(1 << 16)))


def tver(r: Rng, f: dict[str, Any]) -> None:
    """The transport version check: a TVer other than 0."""
    f["tver"] = r.randrange(1, 16)


def bth_bits(r: Rng, f: dict[str, Any]) -> None:
    """The BTH flags and reserved bits: SE, MigReq, AckReq, FECN, BECN at random, the
    reserved fields non-zero."""
    f["se"], f["migreq"], f["ackreq"] = (r.random() < 0.5 for _ in range(3))
    f["fecn"], f["becn"] = r.random() < 0.2, r.random() < 0.2
    f["resv6"], f["resv7"] = r.randrange(64), r.randrange(128)


BTH = Table("BTH",  # at most one of them
            Mutator("pkey", 0.05, pkey),
            Mutator("tver", 0.03, tver),
            Mutator("bth_bits", 0.06, bth_bits))


def size(r: Rng, payload: bytes) -> bytes:
    """The length checks against the MTU, the RETH and the receive buffer: a payload of 0,
    1, 3, 7, 8 bytes, the MTU and one either side, 4096, 4097, twice the MTU, up to 9000."""
    n = r.choice((0, 1, 3, 7, 8, MTU - 1, MTU, MTU + 1, 4096, 4097, 2 * MTU,
                  r.randrange(0, 9000)))
    return (payload * (n // max(1, len(payload)) + 1))[:n] if payload else r.randbytes(n)


SIZE = Table("SIZE", Mutator("size", 0.15, size))


def pad(r: Rng) -> int:
    """The pad count's use in the payload length: a pad count of 0..3 whatever the payload."""
    return r.randrange(4)


PAD = Table("PAD", Mutator("pad", 0.08, pad))


# -- bytes ------------------------------------------------------------------------------------
BYTE_MUTATED = 0.3  # a frame gets byte-level damage this often ...
BYTE_STEPS = (1, 1, 1, 2, 3, 4)  # ... in this many steps (drawn from these)


def bit_flip(r: Rng, data: bytearray) -> None:
    """Any field, one bit at a time: one bit flipped anywhere."""
    i = r.randrange(len(data))
    data[i] ^= 1 << r.randrange(8)


def byte_set(r: Rng, data: bytearray) -> None:
    """Boundary values in any field: one byte set to 0, 1, 0x7F, 0x80, 0xFF or random."""
    data[r.randrange(len(data))] = r.choice(INTERESTING8 + (r.randrange(256),))


def truncate(r: Rng, data: bytearray) -> None:
    """The parser's length checks: the frame cut inside the BTH, at its end (12), around
    the extended headers (16, 28) or anywhere."""
    n = len(data)
    del data[r.choice((0, 1, 11, 12, 15, 16, 27, 28, r.randrange(n + 1))):]


def extend(r: Rng, data: bytearray) -> None:
    """The payload length and the ICRC's place: random bytes appended (1 to 2047)."""
    data += r.randbytes(r.choice((1, 3, 4, 8, 64, r.randrange(2048))))


def header_byte(r: Rng, data: bytearray) -> None:
    """The header fields: one byte of the first 48 (where the headers are) set at random."""
    data[r.randrange(min(len(data), 48))] = r.randrange(256)


def opcode_byte(r: Rng, data: bytearray) -> None:
    """The opcode table: the opcode byte set at random (undefined opcodes too), the
    headers left as they were."""
    data[0] = r.randrange(256)


def delete_insert(r: Rng, data: bytearray) -> None:
    """Header alignment: 1 to 8 bytes deleted or inserted anywhere, shifting what follows."""
    i = r.randrange(len(data))
    if r.random() < 0.5:
        del data[i:i + r.randrange(1, 9)]
    else:
        data[i:i] = r.randbytes(r.randrange(1, 9))


BYTES = Table("BYTES",  # integer weights; ``fits``: the frame sizes each applies to
              Mutator("bit_flip", 1, bit_flip, lambda n: n > 0),
              Mutator("byte_set", 1, byte_set, lambda n: n > 0),
              Mutator("truncate", 1, truncate),
              Mutator("extend", 1, extend),
              Mutator("header_byte", 1, header_byte, lambda n: n > 12),
              Mutator("opcode_byte", 1, opcode_byte, lambda n: n > 0),
              Mutator("delete_insert", 1, delete_insert, lambda n: n > 8))


# -- the ICRC ---------------------------------------------------------------------------------

def icrc_right(r: Rng, data: bytearray, src: bytes, dst: bytes, sport: int) -> None:
    """(Not an attack: the ICRC right for the sending socket, so the packet passes it.)"""
    data[-4:] = icrc_ipv4(data, src, dst, sport).to_bytes(4, "little")


def icrc_wrong_port(r: Rng, data: bytearray, src: bytes, dst: bytes, sport: int) -> None:
    """The ICRC's cover of the UDP header: right for the addresses, but for the next
    source port."""
    data[-4:] = icrc_ipv4(data, src, dst, (sport + 1) & 0xFFFF).to_bytes(4, "little")


def icrc_flipped(r: Rng, data: bytearray, src: bytes, dst: bytes, sport: int) -> None:
    """The ICRC check itself: one bit of the ICRC as built flipped."""
    data[-1 - r.randrange(4)] ^= 1 << r.randrange(8)


ICRC_MIN = 16  # frames shorter than this keep what they carry (the draw is made anyway)
ICRC = Table("ICRC",
             Mutator("icrc_right", 0.65, icrc_right, attack=False),
             Mutator("icrc_wrong_port", 0.10, icrc_wrong_port),
             Mutator("icrc_flipped", 0.15, icrc_flipped),
             keep("icrc_as_built", 0.10))


def post_icrc_flip(r: Rng, data: bytearray) -> None:
    """The ICRC check against damage it covers: a bit flipped after a right ICRC."""
    i = r.randrange(len(data))
    data[i] ^= 1 << r.randrange(8)


POST_ICRC = Table("POST_ICRC", Mutator("post_icrc_flip", 0.03, post_icrc_flip))

TABLES = (OPCODE, QPN, PSN, RETH, RKEY, RANGE, ATOMIC, AETH, BTH, SIZE, PAD, BYTES, ICRC,
          POST_ICRC)
