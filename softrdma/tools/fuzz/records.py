"""The ``records`` target's mutators: the socket layer's hello and its 32-byte records.

The hello (:class:`softrdma.socket.record.Hello`, the REQ's private data after the cma
header) and each record (:class:`softrdma.socket.record.Record`: type, flags, credit, seq,
length, rkey, addr, control credit, two reserved fields) are built from what a correct
sender would send next and then damaged by draws from these tables (the names the
summary counts):

=============  ===========================================================================
table          draws
=============  ===========================================================================
HELLO          the hello as a correct sender makes it (kept), or one field at an edge, or
               its LIMITS extension cut short or at an edge, or a wrong magic, or cut short
REC_TYPE       the record type: a correct one, or 0, the first unknown, 255, or ABORT
REC_FIELDS     one to three of flags, credit, seq, length, rkey, addr, control credit,
               the reserved words, each at an edge (0, 1, largest, top bit, random) or
               near what is due (seq +-1, length of the SEND +-1, the inline limit +1,
               the message limit and one more)
REC_SEND       the SEND around the record: its length as the record says, or cut inside
               the record (0, 1, 31 bytes), or longer than a receive slot
=============  ===========================================================================

A NORMAL record names a real MR of the forger most of the time (so the receiver's RDMA
READ succeeds and its message is delivered), and lengths stay within the receiver's
``max_message``: what a record makes the receiver allocate is what is being bounded.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from typing import Any

from ...socket.record import (
    FEATURE_INLINE, FEATURE_LIMITS, HELLO_LIMITS_SIZE, HELLO_SIZE, MAGIC, MORE, RECORD,
    RECORD_SIZE, RecordType,
)
from .mutators import Mutator, Table, boundary_values, keep
from .stats import Stats

__all__ = ["hello_bytes", "HELLO", "REC_TYPE", "REC_FIELDS", "REC_SEND", "RECORD_TABLES",
           "RecordMaker", "Due"]

Rng = random.Random
_HELLO = struct.Struct("!4sBBHI")
_LIMITS = struct.Struct("!IQ")  # the hello's LIMITS extension: max_message, max_run


# -- [HELLO] --------------------------------------------------------------------------------

def _hello(slots: int = 8, inline_max: int = 256, features: int = FEATURE_INLINE,
           version: int = 1, magic: bytes = MAGIC) -> bytes:
    return _HELLO.pack(magic, version, features, slots, inline_max)


def hello_field(r: Rng) -> bytes:
    """The hello's fields: version (0, 2, 255), features (0, 0xFF), slots (0, 1, 2,
    0xFFFF), inline limit (0, 1, 2^32-1)."""
    k = r.randrange(4)
    if k == 0:
        return _hello(version=r.choice((0, 2, 255)))
    if k == 1:
        return _hello(features=r.choice((0, 0xFE, 0xFF)))
    if k == 2:
        return _hello(slots=r.choice((0, 1, 2, 0xFFFF)))
    return _hello(inline_max=r.choice((0, 1, 0xFFFFFFFF)))


def hello_limits(r: Rng) -> bytes:
    """The hello's LIMITS extension (feature 0x02, 12 more bytes: max_message, max_run):
    cut short (13 to 23 bytes), or a limit at an edge (0, 1, largest)."""
    base = _hello(features=FEATURE_INLINE | FEATURE_LIMITS)
    if r.randrange(3) == 0:
        return (base + r.randbytes(12))[:r.randrange(HELLO_SIZE + 1, HELLO_LIMITS_SIZE)]
    return base + _LIMITS.pack(r.choice((0, 1, 0xFFFFFFFF)),
                               r.choice((0, 1, 0xFFFFFFFFFFFFFFFF)))


def hello_magic(r: Rng) -> bytes:
    """The hello's magic: another protocol's private data (rsocket's, zeros, random)."""
    return _hello(magic=r.choice((b"\0\0\0\0", b"SRS0", b"SRS2", r.randbytes(4))))


def hello_short(r: Rng) -> bytes:
    """The hello's length check: 0 to 11 of its 12 bytes."""
    return _hello()[:r.randrange(HELLO_SIZE)]


HELLO = Table("HELLO", keep("hello_ok", 0.7),
              Mutator("hello_field", 0.12, hello_field),
              Mutator("hello_limits", 0.06, hello_limits),
              Mutator("hello_magic", 0.06, hello_magic),
              Mutator("hello_short", 0.06, hello_short))


def hello_bytes(r: Rng, stats: Stats | None = None) -> bytes:
    """A hello drawn from :data:`HELLO` (a correct one 70 % of the time)."""
    m = HELLO.choose(r)
    if m is None or m.apply is None:
        return _hello()
    if stats is not None:
        stats.m(m.name)
    return m.apply(r)


# -- records ----------------------------------------------------------------------------------

@dataclass
class Due:
    """What a correct sender would put in its next record, and what the receiver takes."""

    seq: int  # the next message number the receiver expects
    inline_max: int  # the receiver's inline limit (its hello)
    max_message: int  # the receiver's largest NORMAL message
    rkey: int  # a real MR of the forger, remote-readable
    addr: int
    mr_len: int
    out: list[int]  # sequence numbers of ACKs the receiver could send


def rec_type(r: Rng, rec: dict[str, int], due: Due) -> None:
    """The record type dispatch: 0, the first unknown, 255, or an ABORT (a sender telling
    the receiver why it gives up, with whatever reason and values the other fields hold)."""
    rec["type"] = r.choice((0, max(RecordType) + 1, 255, int(RecordType.ABORT)))


REC_TYPE = Table("REC_TYPE", Mutator("rec_type", 0.05, rec_type))


def _field_value(r: Rng, k: str, rec: dict[str, int], due: Due) -> int:
    bits = {"flags": 8, "credit": 16, "seq": 32, "length": 32, "rkey": 32, "addr": 64,
            "ctrl": 16, "resv1": 16, "resv2": 32}[k]
    v = boundary_values(r, bits)
    assert isinstance(v, int)
    if r.random() < 0.5:  # near what is due rather than at an edge
        if k == "seq":
            v = (due.seq + r.choice((-1, 1, 2, 1 << 31))) & 0xFFFFFFFF
        elif k == "length":
            v = r.choice((due.inline_max, due.inline_max + 1, due.max_message,
                          due.max_message + 1, rec["length"] + 1, max(rec["length"] - 1, 0)))
        elif k == "addr":
            v = r.choice((due.addr - 1, due.addr + due.mr_len, due.addr + due.mr_len - 1)) \
                & 0xFFFFFFFFFFFFFFFF
        elif k == "rkey":
            v = (due.rkey ^ r.choice((1, 0x100, 0x80000000))) & 0xFFFFFFFF
        elif k == "flags":
            v = r.choice((MORE, 0x02, 0xFE))
    return v & ((1 << bits) - 1)  # (length + 1 of a length already at 2^32 - 1 wraps)


def rec_field(r: Rng, rec: dict[str, int], due: Due) -> None:
    """Every record field: flags, credit, seq, length, rkey, addr, control credit and
    the reserved words, one at an edge or just beside what is due."""
    k = r.choice(("flags", "credit", "seq", "length", "rkey", "addr", "ctrl", "resv1",
                  "resv2"))
    rec[k] = _field_value(r, k, rec, due)


REC_FIELDS = Table("REC_FIELDS", Mutator("rec_field", 0.45, rec_field))
FIELD_STEPS = (1, 1, 2, 3)


def send_short(r: Rng, n: int, slot: int) -> int:
    """The record's own length check: a SEND of 0, 1, 16 or 31 bytes."""
    return r.choice((0, 1, 16, RECORD_SIZE - 1))


def send_long(r: Rng, n: int, slot: int) -> int:
    """The receive slot: a SEND one byte longer than it (the receiver's QP gets a local
    length error and the connection ends), or with bytes after a non-INLINE record."""
    return r.choice((slot + 1, n + 1, n + 64))


REC_SEND = Table("REC_SEND", Mutator("send_short", 0.03, send_short),
                 Mutator("send_long", 0.03, send_long))

RECORD_TABLES = (HELLO, REC_TYPE, REC_FIELDS, REC_SEND)

# which record a forger starts from: a correct one of these kinds, by weight
KINDS = ((RecordType.INLINE, 5), (RecordType.NORMAL, 3), (RecordType.CREDIT, 1),
         (RecordType.ACK, 1), (RecordType.CLOSE, 0.3))


class RecordMaker:
    """Makes the SENDs a forger sends: a record a correct sender would send next, then
    damaged."""

    def __init__(self, rng: Rng, stats: Stats) -> None:
        self.rng = rng
        self.stats = stats

    def _draw(self, table: Table, *args: Any) -> Any:
        m = table.choose(self.rng)
        if m is None or m.apply is None:
            return None
        if m.attack:
            self.stats.m(m.name)
        return m.apply(self.rng, *args)

    def make(self, due: Due, slot: int) -> tuple[bytes, int, bool]:
        """(the SEND's bytes, the record type it started as, whether it is still the
        correct record a sender would send)."""
        r = self.rng
        kinds, weights = zip(*KINDS)
        t = int(r.choices(kinds, weights)[0])
        payload = b""
        rec = {"type": t, "flags": 0, "credit": 0, "seq": 0, "length": 0, "rkey": 0,
               "addr": 0, "ctrl": 0, "resv1": 0, "resv2": 0}
        if t == RecordType.INLINE:
            n = r.randrange(0, min(due.inline_max, 512) + 1)
            payload = r.randbytes(n)
            rec.update(seq=due.seq, length=n, flags=MORE if r.random() < 0.2 else 0)
        elif t == RecordType.NORMAL:
            n = r.randrange(1, due.mr_len + 1)
            rec.update(seq=due.seq, length=n, rkey=due.rkey, addr=due.addr)
        elif t == RecordType.ACK:
            rec["seq"] = r.choice(due.out) if due.out else r.getrandbits(32)
        before = dict(rec)
        self._draw(REC_TYPE, rec, due)
        for _ in range(r.choice(FIELD_STEPS)):
            self._draw(REC_FIELDS, rec, due)
        data = RECORD.pack(rec["type"], rec["flags"], rec["credit"], rec["seq"],
                           rec["length"], rec["rkey"], rec["addr"], rec["ctrl"], rec["resv1"],
                           rec["resv2"]) + payload
        n = self._draw(REC_SEND, len(data), slot)
        if n is not None:
            data = data[:n] if n <= len(data) else data + r.randbytes(n - len(data))
        return data, t, rec == before and n is None
