"""Opcode names as Wireshark shows them, for ``softrdma dissect --wireshark-names``.

Wireshark's InfiniBand dissector (epan/dissectors/packet-infiniband.c) names a packet in
its Info column from the value_string ``OpCodeMap``: ``"RC Send First "``, ``"RC RDMA
Write Only "``, ``"UD Send Only "``... (each with a trailing space, dropped here, as the
column is read). Debian's tshark 4.0 shows exactly these for every opcode below except
three it does not know, which it calls ``Unknown OpCode``: RC FLUSH (0x1C) and RC ATOMIC
WRITE (0x1D), added to the IBTA spec after the table was written, and the RoCEv2 CNP
(0x81). They get names in the table's style here (``RC Flush``, ``RC Atomic Write``,
``CNP``, the last as Wireshark's ``infiniband.bth.opcode`` field calls the CNP).

    >>> from softrdma.wire.wireshark import wireshark_name
    >>> wireshark_name(0x04), wireshark_name(0x64)
    ('RC Send Only', 'UD Send Only')
"""

from __future__ import annotations

from .opcodes import Opcode

__all__ = ["WIRESHARK_NAMES", "wireshark_name"]

_O = Opcode

#: BTH opcode -> the name Wireshark's Info column gives it.
WIRESHARK_NAMES: dict[int, str] = {
    _O.RC_SEND_FIRST: "RC Send First",
    _O.RC_SEND_MIDDLE: "RC Send Middle",
    _O.RC_SEND_LAST: "RC Send Last",
    _O.RC_SEND_LAST_WITH_IMMEDIATE: "RC Send Last Immediate",
    _O.RC_SEND_ONLY: "RC Send Only",
    _O.RC_SEND_ONLY_WITH_IMMEDIATE: "RC Send Only Immediate",
    _O.RC_RDMA_WRITE_FIRST: "RC RDMA Write First",
    _O.RC_RDMA_WRITE_MIDDLE: "RC RDMA Write Middle",
    _O.RC_RDMA_WRITE_LAST: "RC RDMA Write Last",
    _O.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE: "RC RDMA Write Last Immediate",
    _O.RC_RDMA_WRITE_ONLY: "RC RDMA Write Only",
    _O.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: "RC RDMA Write Only Immediate",
    _O.RC_RDMA_READ_REQUEST: "RC RDMA Read Request",
    _O.RC_RDMA_READ_RESPONSE_FIRST: "RC RDMA Read Response First",
    _O.RC_RDMA_READ_RESPONSE_MIDDLE: "RC RDMA Read Response Middle",
    _O.RC_RDMA_READ_RESPONSE_LAST: "RC RDMA Read Response Last",
    _O.RC_RDMA_READ_RESPONSE_ONLY: "RC RDMA Read Response Only",
    _O.RC_ACKNOWLEDGE: "RC Acknowledge",
    _O.RC_ATOMIC_ACKNOWLEDGE: "RC Atomic Acknowledge",
    _O.RC_COMPARE_SWAP: "RC Compare Swap",
    _O.RC_FETCH_ADD: "RC Fetch Add",
    _O.RC_SEND_LAST_WITH_INVALIDATE: "RC Send Last Invalidate",
    _O.RC_SEND_ONLY_WITH_INVALIDATE: "RC Send Only Invalidate",
    _O.RC_FLUSH: "RC Flush",  # not in Wireshark's table (tshark 4.0: Unknown OpCode)
    _O.RC_ATOMIC_WRITE: "RC Atomic Write",  # likewise
    _O.UC_SEND_FIRST: "UC Send First",
    _O.UC_SEND_MIDDLE: "UC Send Middle",
    _O.UC_SEND_LAST: "UC Send Last",
    _O.UC_SEND_LAST_WITH_IMMEDIATE: "UC Send Last Immediate",
    _O.UC_SEND_ONLY: "UC Send Only",
    _O.UC_SEND_ONLY_WITH_IMMEDIATE: "UC Send Only Immediate",
    _O.UC_RDMA_WRITE_FIRST: "UC RDMA Write First",
    _O.UC_RDMA_WRITE_MIDDLE: "UC RDMA Write Middle",
    _O.UC_RDMA_WRITE_LAST: "UC RDMA Write Last",
    _O.UC_RDMA_WRITE_LAST_WITH_IMMEDIATE: "UC RDMA Write Last Immediate",
    _O.UC_RDMA_WRITE_ONLY: "UC RDMA Write Only",
    _O.UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: "UC RDMA Write Only Immediate",
    _O.UD_SEND_ONLY: "UD Send Only",
    _O.UD_SEND_ONLY_WITH_IMMEDIATE: "UD Send Only Immediate",
    _O.CNP: "CNP",  # not in the Info column's table (tshark 4.0: Unknown OpCode)
}


def wireshark_name(opcode: int) -> str:
    """Wireshark's name of ``opcode``; ``Unknown OpCode`` (Wireshark's words) otherwise."""
    return WIRESHARK_NAMES.get(opcode, "Unknown OpCode")
