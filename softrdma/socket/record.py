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
  (only returns credits);
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
``b"SRS1"``, version 1, feature flags (INLINE 0x01), the number of receive slots the
sender posted (its peer's initial credits) and the largest INLINE payload it accepts.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

__all__ = ["RecordType", "MORE", "RECORD", "RECORD_SIZE", "Record", "Hello", "HELLO_SIZE",
           "MAGIC", "FEATURE_INLINE", "ProtocolError", "CTRL_SLOTS"]

RECORD = struct.Struct("!BBHIIIQHHI")
RECORD_SIZE = RECORD.size  # 32
MORE = 0x01
#: receive slots each side posts for the peer's CREDIT records, beyond the data slots
CTRL_SLOTS = 4
MAGIC = b"SRS1"
VERSION = 1
FEATURE_INLINE = 0x01
_HELLO = struct.Struct("!4sBBHI")
HELLO_SIZE = _HELLO.size  # 12


class ProtocolError(ConnectionError):
    """The peer sent something the protocol does not allow (the connection is dropped)."""


class RecordType(enum.IntEnum):
    NORMAL = 1
    ACK = 2
    CLOSE = 3
    INLINE = 4
    CREDIT = 5


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

    def pack(self) -> bytes:
        return _HELLO.pack(MAGIC, self.version, self.features, self.slots, self.inline_max)

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
        return cls(slots, inline_max, features, version)
