"""Packet trains: many RoCE packets in one UDP send or receive (Linux UDP GSO and GRO).

A message of many MTU-sized packets costs one ``sendto`` per packet, and in Python the
system call is a large part of each packet's cost. Linux can take one datagram made of
equal-size segments in a single ``sendmsg`` (the ``UDP_SEGMENT`` control message: generic
segmentation offload, "GSO") and cut it into one UDP packet per segment, each with its own
IP and UDP header: at the sending device if it cannot carry the train, else at the
receiver. A receiving socket with ``UDP_GRO`` set takes a train whole in one ``recvmsg``,
told the segment size. So a train is just the packets a QP sends back to back, each a
complete RoCE packet (BTH .. ICRC); nothing RoCE-specific crosses the wire, and rxe, which
never sees a train, receives ordinary packets.

The rules a train must follow (udp_send_skb in net/ipv4/udp.c):

* every segment but the last has the same size (``gso_size``); the last may be shorter;
* at most :data:`MAX_SEGMENTS` segments and :data:`MAX_TRAIN_BYTES` bytes in all (one UDP
  datagram's length);
* one destination and one source port (one socket).

One thing does cross into RoCE: the IPv4 identification field. The kernel numbers the
segments of a train it cuts ``id, id + 1, ...`` where ``id`` is the train's own IP ID, 0
for an unconnected DF socket such as softrdma's (ip_select_ident_segs; checked on a real
kernel in tests/test_trains.py). The ICRC covers the IP ID, so segment ``k`` of an IPv4
train must carry the ICRC computed for IP ID ``k``. CRC-32 is affine: two messages of the
same length that differ only in the ID differ in CRC by a value that depends only on the
two IDs and the length. :func:`ip_id_delta` computes it once per (ID, length) and
:func:`train_iov` XORs it in, so a packet's ICRC, right or deliberately wrong (fault
injection), is moved from ID 0 to ID ``k`` without reading the payload again.

All of this is sans-IO: :func:`coalesce` groups a list of queued packets into trains,
:func:`train_iov` gives the buffers for one ``sendmsg``, :func:`split` cuts a received train.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Iterator, Sequence

from .crc import crc32
from .headers import BTH_ACK_OFFSET, BTH_OPCODE_OFFSET, BTH_QPN_OFFSET
from .opcodes import OPCODE_LIST

__all__ = ["MAX_SEGMENTS", "MAX_TRAIN_BYTES", "coalesce", "ip_id_delta", "train_iov",
           "split", "split_unsized"]

#: UDP_MAX_SEGMENTS was 64 before Linux 6.2 (128 since): the smaller, so any kernel takes it.
MAX_SEGMENTS = 64
#: a UDP datagram's payload: 65535 - 8 (UDP) - 20 (IPv4); IPv6 allows 20 more, unused here
MAX_TRAIN_BYTES = 65507
#: a train of small packets (each at most this many bytes) is joined into one buffer and its
#: ICRCs moved by one big-integer XOR (:func:`_joined_train`); SOFTRDMA_SMALL_MSG=0: per packet
SMALL_PACKET = 512
SMALL_MSG = os.environ.get("SOFTRDMA_SMALL_MSG", "1").strip().lower() not in (
    "0", "no", "off", "false")
_IPV4_ID_OFFSET = 8 + 4  # in the bytes the ICRC covers: 8 x 0xff, then the IPv4 header's ID


@lru_cache(maxsize=4096)
def ip_id_delta(ip_id: int, length: int) -> int:
    """What to XOR into the ICRC (as an integer) of an IPv4 RoCE packet of ``length``
    bytes (BTH .. ICRC) computed for IP ID 0, to get the ICRC for IP ID ``ip_id``.

    The ICRC is CRC-32 over ``8 x 0xff + IP + UDP + BTH..payload`` (36 + length - 4 bytes
    over IPv4), and CRC-32 is affine: for messages A, B, C of one length, crc(A ^ B ^ C) =
    crc(A) ^ crc(B) ^ crc(C). With A the covered bytes for ID 0, B zeros but the ID field
    and C all zeros, A ^ B ^ C is the packet with ID ``ip_id``: its CRC is crc(A) ^ the
    value returned here, crc(B) ^ crc(C)."""
    covered = 36 + length - 4
    head = bytes(_IPV4_ID_OFFSET) + (ip_id & 0xFFFF).to_bytes(2, "big")
    rest = bytes(covered - len(head))
    with_id = crc32(rest, crc32(head))
    zeros = crc32(rest, crc32(bytes(len(head))))
    return with_id ^ zeros


# (packet: one buffer or a list of buffers (softrdma.wire.iov), destination IP (packed),
# UDP source port)
Queued = tuple[Any, bytes, int]


def coalesce(pending: Sequence[Queued], max_segments: int = MAX_SEGMENTS,
             max_bytes: int = MAX_TRAIN_BYTES) -> Iterator[tuple[bytes, int, int, list]]:
    """Group queued ``(data, dst_ip, sport)`` packets, in order, into trains.

    Yields ``(dst_ip, sport, gso_size, packets)``: consecutive packets for the same
    destination and source port, all ``gso_size`` bytes but the last, which may be shorter.
    Order is never changed. A packet followed by shorter ones that form a train of their
    own (a WRITE FIRST, with its RETH, before the MIDDLEs) leaves alone, so the rest can go
    together; a train of one is sent as an ordinary datagram.
    """
    n = len(pending)
    # a zero-copy packet is a list of three buffers: its length is theirs (one pass, here)
    sizes = [len(d) if type(d) is not list else len(d[0]) + len(d[1]) + len(d[2])
             for d, _, _ in pending]
    i = 0
    while i < n:
        data, dst, sport = pending[i]
        size = sizes[i]
        j = i + 1
        if j < n:
            _, dst1, sp1 = pending[j]
            n1 = sizes[j]
            if n1 < size and dst1 == dst and sp1 == sport and j + 1 < n:
                _, dst2, sp2 = pending[j + 1]
                if sizes[j + 1] == n1 and dst2 == dst and sp2 == sport:
                    yield dst, sport, size, [data]  # FIRST alone; the MIDDLEs make a train
                    i = j
                    continue
        total = size
        while j < n and j - i < max_segments:
            _, dj, sj = pending[j]
            k = sizes[j]
            if dj != dst or sj != sport or k > size or total + k > max_bytes:
                break
            total += k
            j += 1
            if k < size:
                break  # only the last segment may be shorter
        yield dst, sport, size, [p[0] for p in pending[i:j]]
        i = j


def train_iov(packets: list, ipv4: bool) -> list:
    """The buffers of one ``sendmsg`` carrying ``packets`` as a train: the packets
    themselves over IPv6; over IPv4 each packet after the first with its ICRC moved to the
    IP ID the kernel will give it (its index in the train).

    A packet that is a list of buffers (softrdma.wire.iov: headers, payload, pad + ICRC)
    gives its buffers, the payload view passed on, not copied; its pad and ICRC (moved, over
    IPv4) are joined with the next packet's headers into one small buffer, since every
    buffer of a ``sendmsg`` costs the kernel more than a few bytes joined here."""
    if not any(type(p) is list for p in packets):
        if not ipv4:
            return packets
        n = len(packets[0])
        if SMALL_MSG and n <= SMALL_PACKET and len(packets) > 1:
            joined = _joined_train(packets, n)
            if joined is not None:
                return joined
        iov = [packets[0]]
        for k in range(1, len(packets)):
            p = packets[k]
            n = len(p)
            mv = memoryview(p)
            icrc = int.from_bytes(mv[n - 4:], "little") ^ ip_id_delta(k, n)
            iov.append(mv[:n - 4])
            iov.append(icrc.to_bytes(4, "little"))
        return iov
    iov: list = []
    carry = b""  # the previous packet's pad and ICRC, not yet in iov
    for k in range(len(packets)):
        p = packets[k]
        if type(p) is list:
            head, body, tail = p
            if k and ipv4:
                t = len(tail)
                n = len(head) + len(body) + t
                icrc = int.from_bytes(tail[t - 4:], "little") ^ ip_id_delta(k, n)
                tail = tail[:t - 4] + icrc.to_bytes(4, "little")
            iov.append(carry + head if carry else head)
            iov.append(body)
            carry = tail
            continue
        if carry:
            iov.append(carry)
            carry = b""
        if not k or not ipv4:
            iov.append(p)
            continue
        n = len(p)
        mv = memoryview(p)
        icrc = int.from_bytes(mv[n - 4:], "little") ^ ip_id_delta(k, n)
        iov.append(mv[:n - 4])
        iov.append(icrc.to_bytes(4, "little"))
    if carry:
        iov.append(carry)
    return iov


def _joined_train(packets: list, n: int) -> list | None:
    """:func:`train_iov` of small IPv4 packets, each ``n`` bytes but a shorter last one:
    the same bytes as one buffer. Per packet, moving an ICRC costs a few Python operations,
    more than the packet's bytes; XORed as one integer with every packet's delta in place
    (:func:`_id_mask`), a train of 64 costs about as much as 10. None if the sizes do not
    fit that shape (the general loop takes it)."""
    m = len(packets)
    last = len(packets[-1])
    if last > n:
        return None
    for k in range(1, m - 1):
        if len(packets[k]) != n:
            return None
    joined = b"".join(packets)
    size = len(joined)
    return [(int.from_bytes(joined, "little") ^ _id_mask(n, m, last)).to_bytes(size, "little")]


@lru_cache(maxsize=256)
def _id_mask(n: int, m: int, last: int) -> int:
    """The XOR that moves the ICRCs of a joined train of ``m`` packets (``n`` bytes each,
    the last ``last``) from IP ID 0 to IDs 0, 1, ..., m - 1 (:func:`ip_id_delta`), as a
    little-endian integer over the whole train."""
    mask = 0
    for k in range(1, m):
        length = n if k < m - 1 else last
        mask |= ip_id_delta(k, length) << (8 * (k * n + length - 4))
    return mask


def split(buf: memoryview, nbytes: int, gso_size: int) -> list[memoryview]:
    """Cut a train received with UDP_GRO (``nbytes`` in ``buf``, segments of
    ``gso_size``) into its packets."""
    if gso_size <= 0 or nbytes <= gso_size:
        return [buf[:nbytes]]
    return [buf[o:min(o + gso_size, nbytes)] for o in range(0, nbytes, gso_size)]


_PATH_MTUS = (4096, 2048, 1024, 512, 256)
_QPN, _QPN_END = BTH_QPN_OFFSET, BTH_ACK_OFFSET  # the destination QPN's bytes in the BTH


def split_unsized(roce: bytes) -> list[bytes]:
    """Cut a train whose segment size is unknown: what a raw IP socket sees of a train
    that crossed loopback whole (the UDP socket's copy has the size; the raw one does not).

    A train's segments are equal, so the first packet's length ``L`` is a path MTU's worth
    of payload after its headers (a message's packets before the last), or its headers
    alone (ACKs); the candidate where every ``L``-th byte starts a known opcode for the
    same QP wins. Anything that fits no candidate is one packet.
    """
    n = len(roce)
    if n < 32:
        return [roce]
    first = OPCODE_LIST[roce[BTH_OPCODE_OFFSET]]
    if first is None:
        return [roce]
    qpn = roce[_QPN:_QPN_END]
    for seg in [first.length + m + 4 for m in _PATH_MTUS] + [first.length + 4]:
        if seg >= n:
            continue
        if all(n - o >= 16 and roce[o + _QPN:o + _QPN_END] == qpn and
               OPCODE_LIST[roce[o + BTH_OPCODE_OFFSET]] is not None
               for o in range(seg, n, seg)):
            return [roce[o:o + seg] for o in range(0, n, seg)]
    return [roce]
