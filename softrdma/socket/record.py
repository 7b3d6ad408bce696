"""The socket layer's wire format: the 32-byte MetaData record and the connect-time hello.

Every message between two ``softrdma.socket`` endpoints is one RC SEND of a record,
sometimes followed (INLINE) by the message's bytes in the same SEND; large messages are
announced by a NORMAL record and pulled by the receiver with one RDMA READ. Byte by byte
(big-endian; docs/socket.md has the same table)::

     0      1      2      4       8        12       16              24     26     32
    +------+------+------+-------+--------+--------+---------------+------+------+
    | type |flags |credit|  seq  | length |  rkey  |     addr      |ctrlcr| rsvd |
    +------+------+------+-------+--------+--------+---------------+------+------+

* ``type``: NORMAL 1 (a registered buffer to READ: ``addr``, ``rkey``, ``length``),
  ACK 2 (``seq`` was read: its sender may free the buffer), CLOSE 3 (no more messages
  will follow), INLINE 4 (``length`` bytes follow the record in this SEND), CREDIT 5
  (only returns credits), ABORT 6 (the record's sender broke the connection, and says
  why: ``rkey`` a reason (:class:`AbortReason`), ``seq`` the message at fault,
  ``addr`` the offending value, ``length`` the limit it broke; sent only to a peer whose
  hello has FEATURE_LIMITS);
* ``flags``: MORE 0x01, another frame of the same message follows (the message queue
  delivers a run of frames contiguously);
* ``credit``: receive slots the record's sender has posted again for the peer's
  records other than CREDIT, since its last record: credits returned (the seed counted
  them locally; here they travel, so a sender knows exactly how many records the peer
  can still take);
* ``ctrlcr`` (control credit): the same for the peer's CREDIT records, which use
  :data:`CTRL_SLOTS` receive slots of their own. Because a CREDIT never spends a data
  credit, returning credits can never be blocked by a lack of them, and a CREDIT is
  never answered by a CREDIT (docs/socket.md, "Credits");
* ``seq``: message number, per direction, from 0 (NORMAL, INLINE, and the ACK naming one).

The **hello** is the rdma_cm private data of the REQ and of the REP (12 bytes): magic
``b"SRS1"``, version 1, feature flags (INLINE 0x01, LIMITS 0x02), the number of receive
slots the sender posted (its peer's initial credits) and the largest INLINE payload it
accepts. With LIMITS, 12 more bytes follow: the largest message the sender of the hello
takes (``max_message``, 4 bytes) and the largest run of frames (``max_run``, 8 bytes, 0:
no limit), so its peer refuses an oversized message locally, before sending it. A peer
that predates LIMITS reads the first 12 bytes and ignores the rest (the flag, not the
length, says they are there: rdma_cm pads the REQ's private data with zeros).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

__all__ = ["RecordType", "MORE", "RECORD", "RECORD_SIZE", "Record", "Hello", "HELLO_SIZE",
           "HELLO_LIMITS_SIZE", "MAGIC", "FEATURE_INLINE", "FEATURE_LIMITS", "ProtocolError",
           "AbortReason", "describe_abort", "CTRL_SLOTS"]

RECORD = struct.Struct("!BBHIIIQHHI")
RECORD_SIZE = RECORD.size  # 32
MORE = 0x01
#: receive slots each side posts for the peer's CREDIT records, beyond the data slots
CTRL_SLOTS = 4
MAGIC = b"SRS1"
VERSION = 1
FEATURE_INLINE = 0x01
#: the hello carries the sender's max_message and max_run; ABORT records are understood
FEATURE_LIMITS = 0x02
_HELLO = struct.Struct("!4sBBHI")
HELLO_SIZE = _HELLO.size  # 12
_LIMITS = struct.Struct("!IQ")
HELLO_LIMITS_SIZE = HELLO_SIZE + _LIMITS.size  # 24: fits the REQ's 56 bytes of private data


class AbortReason(enum.IntEnum):
    """Why an ABORT record's sender broke the connection (its ``rkey`` field)."""

    PROTOCOL = 1  # a record the protocol does not allow
    MESSAGE_SIZE = 2  # a message over the receiver's max_message
    RUN_SIZE = 3  # a run of frames over the receiver's max_run


class ProtocolError(ConnectionError):
    """The peer sent something the protocol does not allow (the connection is dropped).
    ``reason``, ``seq``, ``value`` and ``limit`` are what an ABORT record tells the peer."""

    def __init__(self, message: str, *, reason: "AbortReason | int" = 1, seq: int = 0,
                 value: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.reason, self.seq, self.value, self.limit = reason, seq, value, limit

    def abort_record(self) -> "Record":
        """The ABORT record that tells the peer why (numbers clamped to their fields)."""
        return Record(RecordType.ABORT, seq=self.seq & 0xFFFFFFFF,
                      length=min(self.limit, 0xFFFFFFFF), rkey=int(self.reason),
                      addr=min(self.value, (1 << 64) - 1))


def describe_abort(rec: "Record") -> str:
    """What a peer's ABORT record says, in words."""
    try:
        reason = AbortReason(rec.rkey)
    except ValueError:
        return f"the peer broke the connection (reason {rec.rkey})"
    if reason == AbortReason.MESSAGE_SIZE:
        return (f"the peer refused message {rec.seq}: its length {rec.addr} exceeds the "
                f"peer's max_message of {rec.length} bytes (EMSGSIZE)")
    if reason == AbortReason.RUN_SIZE:
        return (f"the peer refused message {rec.seq}: its run of frames reached {rec.addr} "
                f"bytes, over the peer's max_run of {rec.length} bytes (EMSGSIZE)")
    return f"the peer broke the connection: message {rec.seq} broke the protocol"


class RecordType(enum.IntEnum):
    NORMAL = 1
    ACK = 2
    CLOSE = 3
    INLINE = 4
    CREDIT = 5
    ABORT = 6


@dataclass(slots=True)
class Record:
    type: RecordType
    flags: int = 0
    credit: int = 0
    seq: int = 0
    length: int = 0
    rkey: int = 0
    addr: int = 0
    ctrl_credit: int = 0

    def pack_into(self, buf: memoryview | bytearray, offset: int = 0) -> None:
        RECORD.pack_into(buf, offset, self.type, self.flags, self.credit, self.seq,
                         self.length, self.rkey, self.addr, self.ctrl_credit, 0, 0)

    def pack(self) -> bytes:
        return RECORD.pack(self.type, self.flags, self.credit, self.seq, self.length,
                           self.rkey, self.addr, self.ctrl_credit, 0, 0)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview, offset: int = 0) -> "Record":
        if len(buf) - offset < RECORD_SIZE:
            raise ProtocolError(f"a record is {RECORD_SIZE} bytes, got {len(buf) - offset}")
        t, flags, credit, seq, length, rkey, addr, ctrl, _, _ = RECORD.unpack_from(buf, offset)
        try:
            rt = RecordType(t)
        except ValueError:
            raise ProtocolError(f"unknown record type {t}") from None
        return cls(rt, flags, credit, seq, length, rkey, addr, ctrl)


@dataclass(frozen=True, slots=True)
class Hello:
    """What each side tells the other in the CM private data."""

    slots: int
    inline_max: int
    features: int = FEATURE_INLINE
    version: int = VERSION
    max_message: int | None = None  # with FEATURE_LIMITS: the largest message it takes
    max_run: int | None = None  # with FEATURE_LIMITS: the largest run (None: no limit)

    def pack(self) -> bytes:
        base = _HELLO.pack(MAGIC, self.version, self.features, self.slots, self.inline_max)
        if not self.features & FEATURE_LIMITS:
            return base
        return base + _LIMITS.pack(min(self.max_message or 0, 0xFFFFFFFF),
                                   self.max_run or 0)

    @classmethod
    def unpack(cls, data: bytes) -> "Hello":
        if len(data) < HELLO_SIZE or data[:4] != MAGIC:
            raise ProtocolError("the peer is not a softrdma.socket endpoint (no hello in "
                                "the connection's private data)")
        magic, version, features, slots, inline_max = _HELLO.unpack_from(data)
        if version != VERSION:
            raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
        if slots < 2:
            raise ProtocolError(f"the peer posted {slots} receive slots; at least 2 needed")
        if not features & FEATURE_LIMITS:  # an older peer: its limits are not known
            return cls(slots, inline_max, features, version)
        if len(data) < HELLO_LIMITS_SIZE:
            raise ProtocolError(f"hello: FEATURE_LIMITS set in a {len(data)}-byte hello; "
                                f"{HELLO_LIMITS_SIZE} needed")
        max_message, max_run = _LIMITS.unpack_from(data, HELLO_SIZE)
        return cls(slots, inline_max, features, version, max_message, max_run or None)
