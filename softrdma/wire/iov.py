"""Packets as lists of buffers: the zero-copy form of a packet on the send path.

A packet the engines send is either one buffer (``bytes`` or ``bytearray``: BTH .. ICRC
in one piece) or a ``list`` of exactly three buffers that together are those bytes, in
order:

    [headers (BTH and extension headers, bytes), payload (a memoryview of the MR: no copy),
     pad + ICRC (bytes, the ICRC in its last four bytes)]

The list goes as it is from the requester (or the responder's READ RESPONSE) through
``SoftDevice.send_packet``, which continues the ICRC's CRC over the header bytes and then
the view (softrdma.wire.icrc.icrc_ipv4_iov), to the UDP transport's queue, its trains
(softrdma.wire.trains.train_iov) and ``sendmsg``, which gathers the buffers: the payload's
only copy is the kernel's. Whatever keeps a packet past the call that sends it, or reads it
as one piece (the capture, the fault injector, the trace, the in-device loopback, the
source-port fallback), joins it with :func:`packet_bytes` first, where the cost does not
matter. docs/wire.md ("Zero copy") says what a view of the MR means for the bytes on the
wire.

``SOFTRDMA_ZEROCOPY=0`` turns the form off (every packet is one buffer, as before, and
received packets are copied out of the receive buffer first): :func:`zero_copy_enabled`.
"""

from __future__ import annotations

import os
from typing import Mapping, Union

__all__ = ["Packet", "packet_bytes", "packet_len", "zero_copy_enabled", "ZERO_COPY_MIN",
           "ENV_ZEROCOPY"]

#: One buffer, or a list of buffers (module doc).
Packet = Union[bytes, bytearray, memoryview, list]
ENV_ZEROCOPY = "SOFTRDMA_ZEROCOPY"
#: Payloads shorter than this are copied into the packet even with zero copy on: below it
#: the list gains nothing measurable (docs/wire.md, "Zero copy"), and one buffer is what
#: every slow path takes as it is.
ZERO_COPY_MIN = 512


def zero_copy_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether packets may be lists of buffers and received packets views of the receive
    buffer: on unless ``SOFTRDMA_ZEROCOPY`` is 0, no, off or false."""
    return env.get(ENV_ZEROCOPY, "1").strip().lower() not in ("0", "no", "off", "false")


def packet_bytes(pkt: Packet) -> bytes:
    """The packet as one ``bytes`` object: a copy (a snapshot of the MR bytes a list's view
    shows now), for whatever keeps it or reads it whole."""
    if type(pkt) is list:
        return b"".join(pkt)
    return pkt if type(pkt) is bytes else bytes(pkt)


def packet_len(pkt: Packet) -> int:
    """The packet's length in bytes, BTH .. ICRC."""
    if type(pkt) is list:
        return len(pkt[0]) + len(pkt[1]) + len(pkt[2])
    return len(pkt)
