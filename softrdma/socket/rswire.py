"""The rsocket protocol on the wire, as librdmacm/rsocket.c (rdma-core 44) defines it:
its constants, the layout of ``struct rs_conn_data``, ``struct rs_sge`` and ``struct
rs_iomap``, and the immediate data that says what each RDMA WRITE WITH IMM is.

* Connect: the REQ private data is ``struct rs_conn_data`` (40 bytes, big-endian
  fields): version 1, flags (bit 0 NET: the sender is big-endian, bit 1 IOMAP),
  credits (receives posted, 384), target_iomap_size (a scaled u8), ``target_sgl``
  {addr, rkey, 2}: where the peer writes buffer grants, ``data_buf`` {addr, rkey,
  rbuf/2}: the first half of the receive ring. The REP carries the acceptor's.
  REQ: flow_control 1, retry 7, RNR retry 7; the acceptor echoes the REQ's values.
* Data: RDMA WRITE WITH IMM into the granted half of the peer's ring,
  ``imm = (op << 29) | len`` with op 0 (DATA); one receive (credit) each.
* Credits: the receiver writes a 16-byte ``rs_sge`` {addr, rkey, len} (in the
  *reader's* byte order, from the NET flag) into the sender's ``target_sgl`` slot and
  ``imm = (4 << 29) | (rseq_no + rq_size)`` (op SGL: the new sequence limit); with no
  half free it sends the same imm as a 0-byte write.
* iomap (riomap/riowrite): a 24-byte ``rs_iomap`` written after the two SGL slots,
  ``imm = (6 << 29) | index``; riowrite is a plain RDMA WRITE into the mapped buffer.
* Control: ``imm = (7 << 29) | {0 disconnect, 1 keepalive, 2 shutdown}`` as 0-byte
  writes (keepalive: a 0-byte RDMA WRITE without immediate).
"""

from __future__ import annotations

import errno
import struct
from typing import NamedTuple

__all__ = [
    "RS_OLAP_START_SIZE", "RS_MAX_TRANSFER", "RS_SNDLOWAT", "RS_QP_MIN_SIZE",
    "RS_QP_MAX_SIZE", "RS_QP_CTRL_SIZE", "RS_SGL_SIZE", "RS_OP_DATA", "RS_OP_WRITE",
    "RS_OP_SGL", "RS_OP_IOMAP_SGL", "RS_OP_CTRL", "RS_CTRL_DISCONNECT", "RS_CTRL_KEEPALIVE",
    "RS_CTRL_SHUTDOWN", "RS_CONN_FLAG_NET", "RS_CONN_FLAG_IOMAP", "RS_WR_ID_FLAG_RECV",
    "CONN_DATA", "SGE_LE", "SGE_BE", "IOMAP_LE", "IOMAP_BE", "ConnData", "msg_set",
    "value_to_scale", "scale_to_value", "seq_diff",
]

RS_OLAP_START_SIZE = 2048  # the first transfer of a send; each next one doubles
RS_MAX_TRANSFER = 65536
RS_SNDLOWAT = 2048  # send-buffer room below which nothing more is sent
RS_QP_MIN_SIZE = 16
RS_QP_MAX_SIZE = 0xFFFE
RS_QP_CTRL_SIZE = 4  # send queue entries kept for control messages
RS_SGL_SIZE = 2  # the target SGL: the two halves of the receive ring

# what a message is (the immediate's top 3 bits)
RS_OP_DATA, RS_OP_WRITE, RS_OP_SGL, RS_OP_IOMAP_SGL, RS_OP_CTRL = 0, 2, 4, 6, 7
RS_CTRL_DISCONNECT, RS_CTRL_KEEPALIVE, RS_CTRL_SHUTDOWN = 0, 1, 2
RS_CONN_FLAG_NET, RS_CONN_FLAG_IOMAP = 1, 2
RS_WR_ID_FLAG_RECV = 1 << 63

CONN_DATA = struct.Struct(">BBH3xBQIIQII")  # struct rs_conn_data, 40 bytes
SGE_LE, SGE_BE = struct.Struct("<QII"), struct.Struct(">QII")  # struct rs_sge
IOMAP_LE, IOMAP_BE = struct.Struct("<QQII"), struct.Struct(">QQII")  # struct rs_iomap


def msg_set(op: int, data: int) -> int:
    """rs_msg_set: the immediate data of a message."""
    return ((op << 29) | (data & 0x1FFFFFFF)) & 0xFFFFFFFF


def value_to_scale(value: int, bits: int = 8) -> int:
    """rs_value_to_scale: a size in ``bits`` bits (large ones scaled down)."""
    return value if value <= (1 << (bits - 1)) else (1 << (bits - 1)) | (value >> bits)


def scale_to_value(value: int, bits: int = 8) -> int:
    """rs_scale_to_value: the size a scaled value stands for."""
    return value if value <= (1 << (bits - 1)) else (value & ~(1 << (bits - 1))) << bits


def seq_diff(a: int, b: int) -> int:
    """``(int16_t)(a - b)``: how far 16-bit sequence number ``a`` is past ``b``."""
    v = (a - b) & 0xFFFF
    return v - 0x10000 if v & 0x8000 else v


class ConnData(NamedTuple):
    """``struct rs_conn_data``: what each side tells the other in the REQ and REP."""

    version: int
    flags: int  # RS_CONN_FLAG_*
    credits: int  # receives posted for the peer's messages
    target_iomap_size: int  # scaled (value_to_scale)
    target_sgl_addr: int  # where the peer writes buffer grants (rs_sge x RS_SGL_SIZE)
    target_sgl_key: int
    target_sgl_length: int
    data_buf_addr: int  # the first half of the receive ring, granted at once
    data_buf_key: int
    data_buf_length: int

    def pack(self) -> bytes:
        return CONN_DATA.pack(*self)

    @classmethod
    def unpack(cls, data: bytes) -> "ConnData":
        """ConnectionError (EPROTO: too short, ENOTSUP: not version 1)."""
        if len(data) < CONN_DATA.size:
            raise ConnectionError(errno.EPROTO, f"rsocket: {len(data)} bytes of "
                                  f"connection data, {CONN_DATA.size} needed")
        cd = cls(*CONN_DATA.unpack_from(data))
        if cd.version != 1:
            raise ConnectionError(errno.ENOTSUP, f"rsocket: connection data version "
                                  f"{cd.version}")
        return cd
