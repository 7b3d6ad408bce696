"""The device's counters and the one list of reasons a packet is dropped.

Like rxe's hw_counters (``rdma statistic show``), plus what a software stack can say that
a NIC cannot: every dropped packet is counted under exactly one :class:`Drop` reason. The
module sits below the protocol core and the soft device, which both count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counters", "Drop"]


class Drop(str, enum.Enum):
    """Why a packet was dropped. The value is the key in ``Counters.drops`` (and the
    ``drop_<value>`` line of ``softrdma devinfo -v``)."""

    # receive checks (softrdma.soft.rx, rxe_recv.c), in the order they run
    MALFORMED_TRUNCATED = "malformed_truncated"  # shorter than its headers say
    MALFORMED_UNKNOWN_OPCODE = "malformed_unknown_opcode"  # no such opcode in the table
    MALFORMED_BAD_PAD = "malformed_bad_pad"  # pad count larger than the payload
    BAD_ICRC = "bad_icrc"  # the invariant CRC does not match
    NOT_OUR_ADDRESS = "not_our_address"  # destination IP is not the device's
    NO_MCAST_GROUP = "no_mcast_group"  # to QPN 0xFFFFFF, but no QP attached to that group
    BAD_TVER = "bad_tver"  # BTH transport version is not 0
    CNP_IGNORED = "cnp_ignored"  # congestion notification: rxe ignores them too
    BAD_PKEY = "bad_pkey"  # not the default partition
    QP0 = "qp0"  # the SMI QP does not exist on RoCE
    NO_QP = "no_qp"  # no QP with that number
    WRONG_TRANSPORT = "wrong_transport"  # RC opcode to a UC QP, and so on
    QP_NOT_READY = "qp_not_ready"  # the QP's state cannot take this packet
    WRONG_SOURCE = "wrong_source"  # a connected QP's packet from another address
    STRICT_SPORT = "strict_sport"  # strict mode: not the path's UDP source port
    QKEY_VIOLATION = "qkey_violation"  # UD Q_Key mismatch
    # QP1, the GSI (softrdma.soft.gsi: rxe_recv.c for QP1, then the MAD layer, mad.c)
    GSI_OPCODE = "gsi_opcode"  # to QP 1 but not a UD SEND_ONLY
    GSI_QKEY = "gsi_qkey"  # to QP 1 with a Q_Key other than 0x80010000
    GSI_MAD_SIZE = "gsi_mad_size"  # to QP 1 but not one 256-byte MAD
    GSI_MAD_BASE_VERSION = "gsi_mad_base_version"  # MAD base version not 1
    GSI_MAD_CLASS = "gsi_mad_class"  # management class not the CM's: no agent for it
    GSI_MAD_CLASS_VERSION = "gsi_mad_class_version"  # CM class version not 2
    GSI_MAD_METHOD = "gsi_mad_method"  # CM MAD whose method is not SEND
    GSI_NO_HANDLER = "gsi_no_handler"  # a CM MAD, but no MAD handler is registered
    # responder (softrdma.qp.responder, rxe_resp.c)
    PSN_OUT_OF_SEQ = "psn_out_of_seq"  # ahead of the expected PSN, after the one NAK
    UC_OUT_OF_SEQ = "uc_out_of_seq"  # UC: a lost packet drops the rest of the message
    UC_WRITE_NOT_ALLOWED = "uc_write_not_allowed"  # UC write without remote write access
    UC_MISSING_FIRST = "uc_missing_first"  # UC: MIDDLE/LAST with no FIRST
    UC_MISSING_LAST = "uc_missing_last"  # UC: a FIRST while a message was open
    NO_RECEIVE_WQE = "no_receive_wqe"  # UC/UD send with no receive posted
    RKEY_VIOLATION = "rkey_violation"  # UC write with a bad rkey (RC NAKs instead)
    LENGTH = "length"  # UD/UC payload longer than allowed
    DUPLICATE_WITHOUT_RESOURCE = "duplicate_without_resource"  # replay with nothing saved
    DUPLICATE_READ_MISMATCH = "duplicate_read_mismatch"  # replayed READ that changed
    DUPLICATE_ACK_LIMITED = "duplicate_ack_limited"  # far-behind duplicate, not re-ACKed
    REQUEST_QUEUE_FULL = "request_queue_full"  # arrived during a READ's response, queue full
    # transmit (softrdma.soft.device, softrdma.soft.udp)
    NO_PATH = "no_path"  # the QP has no destination yet
    NO_TRANSPORT = "no_transport"  # a manual device cannot reach another address
    INJECTED_LOSS = "injected_loss"  # fault injection: lost or dropped on purpose, tx or rx
    TX_QUEUE_FULL = "tx_queue_full"  # the socket's send buffer is full
    TX_ERROR = "tx_error"  # sendto failed (counted in send_err too)


@dataclass
class Counters:
    """Like rxe's hw_counters; every drop is counted in ``drops`` by :class:`Drop`."""

    sent_pkts: int = 0
    rcvd_pkts: int = 0
    duplicate_request: int = 0
    out_of_seq_request: int = 0
    rcvd_rnr_err: int = 0
    send_rnr_err: int = 0
    rcvd_seq_err: int = 0
    ack_deferred: int = 0
    retry_exceeded_err: int = 0
    retry_rnr_exceeded_err: int = 0
    completer_retry_err: int = 0
    send_err: int = 0
    link_downed: int = 0
    rdma_sends: int = 0
    rdma_recvs: int = 0
    icrc_err: int = 0
    malformed_pkts: int = 0
    dropped_pkts: int = 0
    # softrdma's own
    icrc_unchecked: int = 0  # IPv4 over a UDP socket: the IP ID is invisible (docs/device.md)
    sport_fallback: int = 0  # sent from port 4791: the QP's source port could not be had
    sport_evicted: int = 0  # source-port sockets closed to stay within the pool
    gso_trains: int = 0  # trains sent with one sendmsg (UDP GSO; softrdma.wire.trains) ...
    gso_packets: int = 0  # ... and the packets they carried
    gso_fallback: int = 0  # a train the kernel refused: trains off, packet by packet
    gro_trains: int = 0  # trains received whole with one recvmsg (UDP GRO)
    qp_fatal: int = 0  # QPs moved to ERR by an unexpected exception (QpEngine.fault)
    progress_errors: int = 0  # unexpected errors the progress thread survived
    gsi_mads_rcvd: int = 0  # MADs QP1 handed to the MAD handler (softrdma.soft.gsi)
    gsi_mads_sent: int = 0  # MADs QP1 handed to the send path
    gsi_handler_errors: int = 0  # exceptions the MAD handler raised (logged, survived)
    drops: dict[str, int] = field(default_factory=dict)
    # injected faults by direction and kind ("tx_loss", "rx_drop", "rx_injected"...;
    # softrdma.soft.faults): shown as fault_<key>
    faults: dict[str, int] = field(default_factory=dict)
    # (tracer, device) while drops are traced (softrdma.trace), else None; not a counter
    trace = None

    def drop(self, reason: Drop, count: int = 1) -> None:
        self.dropped_pkts += count
        key = reason.value
        self.drops[key] = self.drops.get(key, 0) + count
        if self.trace is not None:
            tracer, dev = self.trace
            tracer.emit(dev, "drop", None, f"dropped: {key}", reason=key)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("drops", "faults", "trace")}
        d.update({f"drop_{k}": v for k, v in sorted(self.drops.items())})
        d.update({f"fault_{k}": v for k, v in sorted(self.faults.items())})
        return d
