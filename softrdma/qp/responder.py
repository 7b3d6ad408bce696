"""The responder: executes incoming requests and answers them (rxe_resp.c).

For each request packet, in rxe's order: PSN check (RC: a packet ahead of the expected PSN
gets one NAK "PSN sequence error" naming the expected PSN, then silence until it arrives,
except that a go-back of the requester still lacking it is NAK'd again, where rxe waits for
the requester's timer; behind it is a duplicate), opcode sequence, opcode allowed by the QP's access flags,
resources (a receive WQE for sends and write-with-immediate, else an RNR NAK; responder
resources for reads and atomics), lengths, the rkey and range, then execution. Sends land
in the receive WQE's buffers, writes in the MR the rkey names, reads are answered with
READ RESPONSE packets, atomics with an ATOMIC ACKNOWLEDGE carrying the original value.
ACKs go out for packets that asked for one (AckReq), with the MSN.

ATOMIC WRITE and FLUSH (IBTA 1.5 annex A19, rxe since Linux 6.2) are answered as rxe answers
them, with a zero-length RDMA READ RESPONSE ONLY (rxe's ``send_read_response_ack``). An
ATOMIC WRITE places its 8 bytes at an 8-byte aligned address in one store, after everything
before it (the responder executes in PSN order, so every earlier WRITE is placed), and
keeps a responder resource so that a duplicate is answered, not executed again. A FLUSH
checks the QP's and the MR's FLUSH access bits for its placement type, then makes the range
(selectivity level 0) or the whole MR (level 1) global or persistent; in a soft device
whose memory is the process's own, placement is already global when the FLUSH runs (every
earlier WRITE has been copied into the MR), and persistence is what the MR's buffer can
give: an MR over an ``mmap.mmap`` (the only kind that may carry IBV_ACCESS_FLUSH_PERSISTENT,
as rxe accepts it only for pmem pages) is ``msync``ed over the range (docs/verbs.md).

Duplicates are never executed twice: a duplicate send or write is ACKed again, a duplicate
read is replayed from the requested PSN, a duplicate atomic is answered with the value
saved when it first executed.

One departure from rxe, against reflection (docs/security.md): rxe re-ACKs every duplicate
send or write, so anyone who can spoof the peer's address turns the QP into a 1:1 reflector
towards the peer. softrdma re-ACKs duplicates 1:1 only within ``DUP_ACK_WINDOW`` PSNs behind
the expected one, where a go-back-N retransmission lands (rxe's requester keeps at most 128
PSNs unacknowledged); a duplicate further behind is ACKed at most once per
``DUP_ACK_INTERVAL`` seconds per QP and otherwise counted as ``duplicate_ack_limited``. Every
such ACK is the same packet (it names the expected PSN - 1), so a requester that really is
that far behind still learns everything from the first one.

A READ's response leaves in batches, as rxe's responder task sends it: rxe builds one
READ RESPONSE packet per pass of ``rxe_responder`` and keeps the READ under way in
``qp->resp.res``; its task runs at most ``RXE_MAX_ITERATIONS`` passes before it yields to
other work and is rescheduled. Here one call sends at most :data:`READ_RESPONSE_BATCH`
packets; if more remain, the READ stays in :attr:`Responder.res` and the device is asked
for another pass (``DeviceServices.schedule_responder``), which it gives after what is
queued has left and the other QPs have had theirs (:meth:`Responder.resume`). A request
that arrives meanwhile waits, as it waits in rxe's ``req_pkts`` (``get_req`` goes back to
the READ before it looks at the next packet): up to :data:`HELD_REQUESTS_MAX` of them are
held and executed in order once the response is complete; more are dropped
(``request_queue_full``) and come back as the requester's retries. So what one READ makes
a device hold is a batch of packets and the held requests, whatever its length (up to the
2 GiB a READ may ask for), and a long READ never keeps the device from its other work.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

from .memory import Access, AccessError
from .mw import invalidate_rkey
from ..enums import (
    ibv_access_flags as A, ibv_placement_type as PLT, ibv_qp_state as S, ibv_qp_type as T,
    ibv_selectivity_level as SEL, ibv_wc_flags as WCF, ibv_wc_status as WCS,
)
from ..completion import WC, WC_RECV, WC_RECV_RDMA_WITH_IMM
from ..wire.headers import (
    AETH_ACK_UNLIMITED, AETH_TYPE_MASK, AethType, NakCode, aeth_value, feth_plt, feth_sel,
    make_syndrome,
)
from ..wire.opcodes import BTH_SIZE, OPCODE_LIST, Opcode as O, Transport
from ..wire.iov import ZERO_COPY_MIN
from ..wire.packet import build, build_iov, parse
from .dma import NoSpace, scatter
from .params import RXE_MAX_UNACKED_PSNS
from .psn import psn_add, psn_diff
from ..counters import Drop

if TYPE_CHECKING:  # pragma: no cover
    from .engine import QpEngine

__all__ = ["Responder", "RespResource", "READ_RESPONSE_BATCH", "HELD_REQUESTS_MAX"]

_U64 = struct.Struct("<Q")
DUP_ACK_WINDOW = 256  # duplicates this close behind the expected PSN are re-ACKed 1:1 (rxe)
DUP_ACK_INTERVAL = 0.001  # further behind: at most one re-ACK per QP per this many seconds
#: READ RESPONSE packets one pass of the responder sends before it yields (module doc).
#: rxe's task yields after RXE_MAX_ITERATIONS = 1024 passes of one packet each; softrdma
#: takes the smaller bound rxe puts on a QP's packets in flight, RXE_INFLIGHT_SKBS_PER_QP_HIGH
#: = 64: at MTU 4096 that is 256 KiB per batch (a sixteenth of the 4 MiB socket buffers of
#: softrdma.soft.udp, so a batch never fills one), 4 to 5 GSO trains, and a pass of about a
#: millisecond (a one-batch 256 KiB READ takes 1.2 ms through both engines), which is what
#: another QP waits per busy QP. Batches of 256 and 1,024 measured no faster, and another
#: QP's median round trip grew with them (docs/architecture.md, "Long READs").
READ_RESPONSE_BATCH = 64
#: Requests held while a READ's response is under way (rxe's req_pkts). A requester keeps at
#: most RXE_MAX_UNACKED_PSNS PSNs unacknowledged, and a READ's PSNs count, so after a long
#: READ no more than that many request packets can arrive before its response is complete.
HELD_REQUESTS_MAX = RXE_MAX_UNACKED_PSNS
# plain ints for per-packet flag tests (IntFlag arithmetic is a Python call per use)
_R_READ, _R_WRITE, _R_ATOMIC = (int(A.IBV_ACCESS_REMOTE_READ), int(A.IBV_ACCESS_REMOTE_WRITE),
                                int(A.IBV_ACCESS_REMOTE_ATOMIC))
_R_FLUSH_GLOBAL, _R_FLUSH_PERSISTENT = (int(A.IBV_ACCESS_FLUSH_GLOBAL),
                                        int(A.IBV_ACCESS_FLUSH_PERSISTENT))
_PLT_GLOBAL, _PLT_PERSISTENT = int(PLT.IBV_FLUSH_GLOBAL), int(PLT.IBV_FLUSH_PERSISTENT)
_WC_GRH, _WC_IMM, _WC_INV = int(WCF.IBV_WC_GRH), int(WCF.IBV_WC_WITH_IMM), int(WCF.IBV_WC_WITH_INV)
_SEND_CONT = {O.RC_SEND_FIRST, O.RC_SEND_MIDDLE}
_WRITE_CONT = {O.RC_RDMA_WRITE_FIRST, O.RC_RDMA_WRITE_MIDDLE}
_SEND_NEXT = {O.RC_SEND_MIDDLE, O.RC_SEND_LAST, O.RC_SEND_LAST_WITH_IMMEDIATE,
              O.RC_SEND_LAST_WITH_INVALIDATE}
_WRITE_NEXT = {O.RC_RDMA_WRITE_MIDDLE, O.RC_RDMA_WRITE_LAST, O.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE}
_UC_BITS = int(Transport.UC)  # a UC opcode is its RC counterpart with the UC transport bits
# plain names for the members tested per packet (an Enum member lookup costs each time)
_RC_QP, _UC_QP, _UD_QP, _ERR = T.IBV_QPT_RC, T.IBV_QPT_UC, T.IBV_QPT_UD, S.IBV_QPS_ERR
_RESET = S.IBV_QPS_RESET
_RC_OR_UC = (_RC_QP, _UC_QP)
_SUCCESS = WCS.IBV_WC_SUCCESS
_SEL_MR = int(SEL.IBV_FLUSH_MR)


class RespResource:
    """A responder resource (rxe ``resp_res``): what is needed to replay a read or an
    atomic without executing it again."""

    __slots__ = ("in_use", "is_read", "opcode", "first_psn", "last_psn", "cur_psn", "va_org",
                 "va", "resid", "length", "rkey", "orig", "replay", "new")

    def __init__(self) -> None:
        self.in_use = False
        self.is_read = False
        self.opcode = -1  # the request it answers (READ, an atomic, ATOMIC WRITE or FLUSH)
        self.first_psn = self.last_psn = self.cur_psn = 0
        self.va_org = self.va = self.resid = self.length = self.rkey = 0
        self.orig = 0
        self.replay = False
        self.new = True


class RespErr(enum.Enum):
    """The responder's error states, rxe's ``RESPST_ERR_*``. What each leads to is decided
    in one place, :meth:`Responder._error` with the table ``_NAK_OF``."""

    MISSING_OPCODE_FIRST = "missing_first"  # RC: a MIDDLE/LAST with no FIRST
    UC_MISSING_FIRST = "uc_missing_first"  # UC: the same, dropped until the next FIRST
    MISSING_OPCODE_LAST_C = "missing_last_c"  # RC: a new message while one is open
    MISSING_OPCODE_LAST_D1E = "missing_last_d1e"  # UC: the same, the open message is lost
    UNSUPPORTED_OPCODE = "unsupported_opcode"  # an operation the QP's access flags forbid
    TOO_MANY_RDMA_ATM_REQ = "too_many_rd_atomic"  # more reads/atomics than max_dest_rd_atomic
    RNR = "rnr"  # no receive WQE for a send
    LENGTH = "length"  # payload longer than the buffer or the MTU rules allow
    RKEY_VIOLATION = "rkey"  # the rkey does not grant this access to this range
    MALFORMED_WQE = "malformed_wqe"  # the receive WQE cannot take the data
    MISALIGNED_ATOMIC = "misaligned_atomic"  # an atomic not on an 8-byte boundary


class _Err(Exception):
    """Raised by the checks to leave the request with one :class:`RespErr`."""

    def __init__(self, kind: RespErr) -> None:
        self.kind = kind


_INV_REQ = (NakCode.INVALID_REQUEST, WCS.IBV_WC_REM_INV_REQ_ERR)
# RC: the NAK each error sends and the status it completes with (rxe's classes A and C).
_NAK_OF = {
    RespErr.MISSING_OPCODE_FIRST: _INV_REQ,
    RespErr.MISSING_OPCODE_LAST_C: _INV_REQ,
    RespErr.UNSUPPORTED_OPCODE: _INV_REQ,
    RespErr.TOO_MANY_RDMA_ATM_REQ: _INV_REQ,
    RespErr.MISALIGNED_ATOMIC: _INV_REQ,
    RespErr.LENGTH: _INV_REQ,
    RespErr.RKEY_VIOLATION: (NakCode.REMOTE_ACCESS_ERROR, WCS.IBV_WC_REM_ACCESS_ERR),
    RespErr.MALFORMED_WQE: (NakCode.REMOTE_OPERATIONAL_ERROR, WCS.IBV_WC_LOC_QP_OP_ERR),
}


# The decisions the per-packet path (on_request) and the train path (expects_middle,
# take_middles) share: one function each, so the two cannot disagree.

def _op_seq_error(prev: int, op: int, rc: bool) -> RespErr | None:
    """rxe's check_op_seq for a connected QP: may ``op`` follow ``prev``, the last opcode
    executed (-1 at a message boundary)? None if so, else the error. UC opcodes are
    judged in RC numbering (the same tables)."""
    if not rc:
        op -= _UC_BITS
        if prev >= 0:
            prev -= _UC_BITS
    if prev in _SEND_CONT:
        ok = op in _SEND_NEXT
    elif prev in _WRITE_CONT:
        ok = op in _WRITE_NEXT
    else:
        if op in _SEND_NEXT or op in _WRITE_NEXT:  # a MIDDLE or LAST with no FIRST
            return RespErr.MISSING_OPCODE_FIRST if rc else RespErr.UC_MISSING_FIRST
        return None
    if ok:
        return None
    return RespErr.MISSING_OPCODE_LAST_C if rc else RespErr.MISSING_OPCODE_LAST_D1E


def _op_allowed(info: Any, access: int, feth: int = 0) -> bool:
    """rxe's check_qp_attr_access: the QP's access flags allow the operation. An ATOMIC
    WRITE needs REMOTE_WRITE; a FLUSH the FLUSH_GLOBAL / FLUSH_PERSISTENT bit of each
    placement type its FETH (``feth``) asks for."""
    if (info.read and not access & _R_READ) or \
            ((info.write or info.atomic_write) and not access & _R_WRITE) or \
            (info.atomic and not access & _R_ATOMIC):
        return False
    if info.flush:
        return not _flush_access(feth) & ~access
    return True


def _flush_access(feth: int) -> int:
    """The access bits a FLUSH needs, of the QP and of the MR: one per placement type."""
    plt = feth_plt(feth)
    return (_R_FLUSH_GLOBAL if plt & _PLT_GLOBAL else 0) | \
        (_R_FLUSH_PERSISTENT if plt & _PLT_PERSISTENT else 0)


def _write_fits(resid: int, n: int, pad: int, mtu: int) -> bool:
    """rxe's write length rule (check_rkey): with more than an MTU of the message left, a
    packet carries a full MTU and no pad; else exactly the rest, with rxe's pad."""
    if resid > mtu:
        return n == mtu and not pad
    return n == resid and pad == (-resid) & 3


class Responder:
    __slots__ = ("qp", "psn", "ack_psn", "msn", "opcode", "sent_psn_nak", "nak_top", "drop_msg",
                 "wqe", "wqe_offset", "va", "rkey", "resid", "length", "resources", "res_head",
                 "status", "syndrome", "goto_error", "far_dup_ack_at", "duplicates", "res",
                 "held", "budget", "owed_psn", "owed_msn")

    def __init__(self, qp: "QpEngine") -> None:
        self.qp = qp  # the QP engine (rxe: struct rxe_qp)
        self.resources: list[RespResource] = []
        # requests that arrived while a READ's response was under way, with their IP header
        self.held: deque[tuple[Any, bytes]] = deque()
        self.budget = READ_RESPONSE_BATCH  # READ RESPONSE packets this pass may still send
        self.owed_psn = -1  # the PSN of an ACK held back to coalesce (owe_ack), else -1
        self.owed_msn = 0
        self.reset()

    def reset(self) -> None:
        self.psn = 0  # next PSN expected
        self.ack_psn = 0
        self.msn = 0
        self.opcode = -1
        self.sent_psn_nak = False
        self.nak_top = 0  # the highest PSN received since that NAK (while sent_psn_nak)
        self.drop_msg = False
        self.wqe = None  # the receive WQE being filled by a multi-packet send
        self.wqe_offset = 0
        self.va = self.rkey = self.resid = self.length = 0
        self.res_head = 0
        for r in self.resources:
            r.__init__()
        self.status = _SUCCESS
        self.syndrome = AETH_ACK_UNLIMITED
        self.goto_error = False
        self.far_dup_ack_at = float("-inf")  # when a far-behind duplicate was last re-ACKed
        # duplicate requests seen by this QP: a peer retransmitting means an ACK of ours
        # was lost (rsocket's close lingers until they stop)
        self.duplicates = 0
        self.res: RespResource | None = None  # the READ whose response is under way (rxe)
        self.held.clear()

    def set_resources(self, n: int) -> None:
        self.resources = [RespResource() for _ in range(n)]
        self.res_head = 0
        self.res = None
        self.held.clear()

    def drop_pending(self) -> None:
        """The QP went to ERR: the rest of the READ under way is not sent, and the requests
        held behind it are dropped (rxe drains ``req_pkts`` in the error state)."""
        self.res = None
        self.held.clear()

    def resume(self) -> None:
        """The device's next pass for this responder (asked for with
        ``schedule_responder``): the next batch of the READ under way; once its response
        is complete, the requests held meanwhile, in their order of arrival, each taken as
        :meth:`on_request` takes a packet, until one starts a READ longer than a batch
        (rxe_responder: ``get_req`` returns to ``read_reply`` while ``resp.res`` is set)."""
        if self.qp.state == _ERR:
            self.drop_pending()
            return
        self.budget = READ_RESPONSE_BATCH  # one pass's, shared by everything it sends
        if self.res is not None:
            self._read_reply(self.res)
        held = self.held
        while held and self.res is None:
            if self.budget <= 0:  # a held READ may not add its batch to this pass's
                self.qp.device.schedule_responder(self.qp)
                return
            pkt, ip_header = held.popleft()
            self.on_request(pkt, ip_header, self.budget)

    def _hold(self, pkt: Any, ip_header: bytes) -> None:
        """A request arrived while a READ's response is under way: it waits (module doc)."""
        dev = self.qp.device
        if len(self.held) >= HELD_REQUESTS_MAX:
            dev.counters.drop(Drop.REQUEST_QUEUE_FULL)
            return
        if type(pkt.buf) is not bytes:  # a view of a buffer the receive path reuses
            pkt = parse(bytes(pkt.buf))
        self.held.append((pkt, ip_header))
        if dev.trace is not None:
            self.qp.trace("ack", f"request PSN {pkt.psn} waits: a READ's response is under way "
                                 f"({len(self.held)} held)", psn=pkt.psn, held=len(self.held))

    # -- sending ACKs and responses --------------------------------------------------------
    def _send(self, opcode: int, psn: int, syndrome: int = AETH_ACK_UNLIMITED,
              payload: bytes | memoryview = b"", orig: int = 0) -> None:
        self.send_owed_ack()  # an owed ACK goes first: the requester sees PSNs in order
        qp = self.qp
        pkt = build(opcode, psn=psn, dest_qp=qp.attr.dest_qp_num, syndrome=syndrome,
                    msn=self.msn, orig=orig, payload=payload)
        qp.device.send_packet(qp, pkt, qp.dst_ip, qp.tos)

    def _send_read_response(self, opcode: int, psn: int, data: Any) -> None:
        """One READ RESPONSE packet carrying ``data``, a view of the MR: with zero copy
        (and at least ZERO_COPY_MIN bytes) the packet is a list of buffers holding the view
        itself (softrdma.wire.iov), read when the packet leaves, not copied here."""
        qp = self.qp
        if len(data) < ZERO_COPY_MIN or not getattr(qp.device, "zero_copy", False):
            self._send(opcode, psn, payload=data)
            return
        pkt = build_iov(opcode, psn=psn, dest_qp=qp.attr.dest_qp_num, msn=self.msn,
                        syndrome=AETH_ACK_UNLIMITED, payload=data)
        qp.device.send_packet(qp, pkt, qp.dst_ip, qp.tos)

    def send_ack(self, syndrome: int, psn: int) -> None:
        if self.qp.device.trace is not None:
            self._trace_ack(syndrome, psn)
        self._send(O.RC_ACKNOWLEDGE, psn, syndrome)

    def owe_ack(self, psn: int) -> bool:
        """A request asked for an ACK (AckReq): hold it back if the device lets ACKs
        coalesce (``defer_until_sent``: over real sockets, softrdma.soft.lock), to send one
        ACK, for the last such PSN, once the datagram (or train) it came in has been
        handled. Anything else this responder sends first sends the owed ACK, so PSNs
        leave in order. An ACK for a PSN acknowledges every earlier one (IBTA's ACK
        coalescing; rxe's completer completes the send/write WQEs before it), and carries
        the MSN of that PSN. Returns False if the caller must send the ACK now."""
        owed = self.owed_psn >= 0
        self.owed_psn = psn
        self.owed_msn = self.msn
        if owed:
            return True  # the device already holds our send_owed_ack: the PSN moved on
        defer = getattr(self.qp.device, "defer_until_sent", None)
        if defer is not None and defer(self.qp, self.send_owed_ack):
            return True
        self.owed_psn = -1
        return False

    def send_owed_ack(self) -> None:
        """Send the ACK :meth:`owe_ack` held back, if any (not for a QP destroyed or
        reset meanwhile: the requester's retry covers it, as a lost ACK)."""
        psn = self.owed_psn
        if psn < 0:
            return
        self.owed_psn = -1
        qp = self.qp
        if qp.closed or qp.state == _RESET:
            return
        if qp.device.trace is not None:
            qp.trace("ack", f"ACK PSN {psn} MSN {self.owed_msn} (coalesced)", psn=psn,
                     msn=self.owed_msn, syndrome=AETH_ACK_UNLIMITED)
        pkt = build(O.RC_ACKNOWLEDGE, psn=psn, dest_qp=qp.attr.dest_qp_num,
                    syndrome=AETH_ACK_UNLIMITED, msn=self.owed_msn)
        qp.device.send_packet(qp, pkt, qp.dst_ip, qp.tos)

    def _trace_ack(self, syndrome: int, psn: int) -> None:
        kind = syndrome & AETH_TYPE_MASK
        if kind == int(AethType.ACK):
            what = f"ACK PSN {psn} MSN {self.msn}"
        elif kind == int(AethType.RNR_NAK):
            what = f"RNR NAK PSN {psn}: no receive WQE (min_rnr_timer {aeth_value(syndrome)})"
        else:
            try:
                code = NakCode(syndrome).name
            except ValueError:
                code = f"0x{syndrome:02x}"
            what = f"NAK {code} PSN {psn}"
        self.qp.trace("ack", what, psn=psn, msn=self.msn, syndrome=syndrome)

    # -- the state machine ---------------------------------------------------------------
    def on_request(self, pkt: Any, ip_header: bytes, budget: int = READ_RESPONSE_BATCH) -> None:
        """rxe_responder for one request packet, from check_psn to the ACK. ``budget``:
        the READ RESPONSE packets a READ it starts may send now (a packet from the
        network is a pass of its own; :meth:`resume` hands on what its pass has left)."""
        self.budget = budget
        qp = self.qp
        if qp.state == _ERR:
            return
        if self.res is not None:  # rxe's get_req: the READ's response comes first
            self._hold(pkt, ip_header)
            return
        self.syndrome = AETH_ACK_UNLIMITED
        rc = qp.qp_type == _RC_QP
        info = pkt.info
        dev = self.qp.device
        # check_psn
        if rc:
            diff = psn_diff(pkt.psn, self.psn)
            if diff > 0:
                if not self.sent_psn_nak:
                    # rxe counts RXE_CNT_OUT_OF_SEQ_REQ once per NAK, not per packet
                    dev.counters.out_of_seq_request += 1
                    if dev.trace is not None:
                        self.qp.trace("ack", f"PSN {pkt.psn} arrived, {self.psn} expected: "
                                             "a gap (one NAK, later packets dropped)",
                                      psn=pkt.psn, expected=self.psn)
                    self.sent_psn_nak = True
                    self.nak_top = pkt.psn
                    self.send_ack(NakCode.PSN_SEQ_ERROR, self.psn)
                elif psn_diff(self.nak_top, pkt.psn) >= 2 and diff <= RXE_MAX_UNACKED_PSNS:
                    # The requester went back (a PSN well below one seen since the NAK:
                    # not two neighbours swapped, nor one bad PSN) and its resend of the
                    # expected PSN was lost: say so again, once per go-back, or only its
                    # retransmit timer would. rxe stays silent here.
                    dev.counters.out_of_seq_request += 1
                    if dev.trace is not None:
                        self.qp.trace("ack", f"PSN {pkt.psn} arrived again, {self.psn} still "
                                             "expected: the resend of the NAK'd PSN was lost "
                                             "(NAK again)", psn=pkt.psn, expected=self.psn)
                    self.nak_top = pkt.psn
                    self.send_ack(NakCode.PSN_SEQ_ERROR, self.psn)
                else:
                    if psn_diff(pkt.psn, self.nak_top) > 0:
                        self.nak_top = pkt.psn
                    dev.counters.drop(Drop.PSN_OUT_OF_SEQ)  # the silent drops that follow
                return
            if diff < 0:
                dev.counters.duplicate_request += 1
                self.duplicates += 1
                if dev.trace is not None:
                    self.qp.trace("ack", f"duplicate request PSN {pkt.psn} (expected "
                                         f"{self.psn}): answered, not executed again",
                                  psn=pkt.psn, duplicate=True)
                self._duplicate(pkt)
                return
            self.sent_psn_nak = False
        elif qp.qp_type == _UC_QP:
            if self.drop_msg or pkt.psn != self.psn:
                if not info.first:
                    self.drop_msg = True
                    dev.counters.drop(Drop.UC_OUT_OF_SEQ)
                    return
                self.drop_msg = False
                self._abandon_wqe()
        try:
            self._check_op_seq(pkt, rc)
            if not self._check_op_valid(pkt, rc):
                return
            if not self._check_resource(pkt):
                return
            self._check_length(pkt)
            self._check_rkey(pkt)
            self._execute(pkt, ip_header)
        except _Err as e:
            self._error(pkt, e.kind, rc)
        if self.goto_error:
            self.goto_error = False
            qp.to_error()

    def expects_middle(self, op: int) -> bool:
        """Whether :meth:`on_request` would execute a MIDDLE of opcode ``op`` that carries
        PSN ``self.psn``, a full MTU of payload, no pad and no AckReq, without a question:
        no error, NAK, ACK or drop for the opcode sequence, the access flags or a UC
        message being dropped. The receive path asks this before it hands a run of such
        packets to :meth:`take_middles`, which checks what remains (receive buffers, the
        rkey and the write length) as it goes. The decisions are on_request's own
        (:func:`_op_seq_error`, :func:`_op_allowed`)."""
        qp = self.qp
        qpt = qp.qp_type
        if qp.state == _ERR or qpt not in _RC_OR_UC or self.res is not None:
            return False
        rc = qpt == _RC_QP
        if not rc and self.drop_msg:
            return False  # UC: the rest of a damaged message is dropped
        return _op_seq_error(self.opcode, op, rc) is None and \
            _op_allowed(OPCODE_LIST[op], int(qp.attr.qp_access_flags))

    def take_middles(self, packets: list, mtu: int) -> int:
        """Execute a run of MIDDLE packets of the message under way, already checked by
        the receive path (softrdma.soft.rx.receive_train): same QP and opcode, one that
        :meth:`expects_middle` accepts, PSNs from ``self.psn`` on, a full MTU of payload
        each, no pad, no AckReq. What :meth:`on_request` would do packet by packet,
        without parsing each: the rkey range is resolved once for the whole message
        remainder (the check rxe repeats per packet, on the same range or a part of it).
        Stops at the first packet these shortcuts do not cover (a write longer than what
        is left, receive buffers that run out, an access error) and returns how many it
        executed; the caller hands the rest to the per-packet path, which decides exactly
        as before."""
        qp = self.qp
        if not packets or qp.state == _ERR or self.res is not None:
            return 0
        op = packets[0][0]
        keys = qp.device.keys
        end = BTH_SIZE + mtu
        done = 0
        if op in (O.RC_RDMA_WRITE_MIDDLE, O.UC_RDMA_WRITE_MIDDLE):
            resid = self.resid
            count = 0  # the packets on_request's length rule lets through
            while count < len(packets) and _write_fits(resid - count * mtu, mtu, 0, mtu):
                count += 1
            if count <= 0:
                return 0
            try:
                dst = keys.resolve(self.rkey, qp.pd, self.va, resid, Access.REMOTE_WRITE,
                                   remote=True, qp=qp)
            except AccessError:
                return 0
            for k in range(count):
                dst[k * mtu:(k + 1) * mtu] = packets[k][BTH_SIZE:end]
            self.va += count * mtu
            self.resid -= count * mtu
            done = count
        else:  # SEND MIDDLE: into the receive WQE taken by the FIRST
            wqe = self.wqe
            if wqe is None:
                return 0
            pd = qp.pd
            sges = wqe.sges
            for p in packets:
                try:
                    scatter(keys, pd, sges, self.wqe_offset, p[BTH_SIZE:end])
                except (NoSpace, AccessError):
                    break
                self.wqe_offset += mtu
                done += 1
        if done:
            # what on_request's start and its RC PSN check set, then _execute's ending
            self.syndrome = AETH_ACK_UNLIMITED
            self.sent_psn_nak = False
            self._executed(psn_add(self.psn, done - 1), op)
        return done

    def _executed(self, psn: int, opcode: int) -> None:
        """A request up to PSN ``psn`` (of ``opcode``) executed: the next one is expected."""
        self.psn = psn_add(psn, 1)
        self.ack_psn = self.psn
        self.opcode = opcode
        self.status = _SUCCESS

    def _check_op_seq(self, pkt: Any, rc: bool) -> None:
        if self.qp.qp_type == _UD_QP:
            return
        err = _op_seq_error(self.opcode, pkt.opcode, rc)
        if err is not None:
            if err is RespErr.UC_MISSING_FIRST:
                self.drop_msg = True  # dropped until the next FIRST
            raise _Err(err)

    def _check_op_valid(self, pkt: Any, rc: bool) -> bool:
        qp = self.qp
        if qp.qp_type == _UD_QP or _op_allowed(pkt.info, int(qp.attr.qp_access_flags),
                                               pkt.feth or 0):
            return True
        if rc:
            raise _Err(RespErr.UNSUPPORTED_OPCODE)
        self.drop_msg = True  # UC (a WRITE is the only operation it can be refused)
        qp.device.counters.drop(Drop.UC_WRITE_NOT_ALLOWED)
        return False

    def _check_resource(self, pkt: Any) -> bool:
        info = pkt.info
        qp = self.qp
        if info.read or info.atomic or info.atomic_write:
            if qp.attr.max_dest_rd_atomic > 0 and self.resources:
                return True
            raise _Err(RespErr.TOO_MANY_RDMA_ATM_REQ)
        if info.consumes_rwqe:
            if qp.srq is not None:
                wqe = qp.srq.take() if not qp.srq.closed else None
            else:
                wqe = qp.rq[0] if qp.rq else None
            if wqe is None:
                raise _Err(RespErr.RNR)
            self.wqe = wqe
            self.wqe_offset = 0
        return True

    def _check_length(self, pkt: Any) -> None:
        info = pkt.info
        if self.qp.qp_type == _UD_QP:
            return
        mtu = self.qp.mtu()
        n = pkt.payload_len
        if info.first and info.last:
            bad = n > mtu
        elif info.first or info.middle:
            bad = n != mtu
        elif info.last:
            bad = n == 0 or n > mtu
        else:
            bad = False
        if info.atomic_write and n != 8:
            bad = True  # IBTA A19.4.2: its payload is exactly the 8 bytes it stores
        if bad and (info.send or info.write or info.atomic_write):
            raise _Err(RespErr.LENGTH)
        if pkt.dma_len is not None and pkt.dma_len > (1 << 31):  # any RETH (C9-94)
            raise _Err(RespErr.LENGTH)

    def _check_rkey(self, pkt: Any) -> None:
        info = pkt.info
        if info.write or info.read:
            if pkt.va is not None:  # RETH: the first packet of a write, or a read
                self.va, self.rkey = pkt.va, pkt.rkey
                self.resid = self.length = pkt.dma_len
            need = Access.REMOTE_READ if info.read else Access.REMOTE_WRITE
            if pkt.va is not None and pkt.dma_len == 0:
                return  # a zero-byte RDMA needs no valid rkey (C9-88)
            try:
                self.qp.device.keys.resolve(self.rkey, self.qp.pd, self.va, self.resid, need,
                                            remote=True, qp=self.qp)
            except AccessError:
                raise _Err(RespErr.RKEY_VIOLATION) from None
            if info.write and not _write_fits(self.resid, pkt.payload_len, pkt.pad,
                                              self.qp.mtu()):
                raise _Err(RespErr.LENGTH)
        elif info.atomic_write:
            # the RETH names the 8 bytes; the write length rule holds as for a WRITE
            self.va, self.rkey = pkt.va, pkt.rkey
            self.resid = self.length = pkt.dma_len
            try:
                self.qp.device.keys.resolve(self.rkey, self.qp.pd, self.va, self.resid,
                                            Access.REMOTE_WRITE, remote=True, qp=self.qp)
            except AccessError:
                raise _Err(RespErr.RKEY_VIOLATION) from None
            if not _write_fits(self.resid, pkt.payload_len, pkt.pad, self.qp.mtu()):
                raise _Err(RespErr.LENGTH)
        elif info.flush:
            self.va, self.rkey = pkt.va, pkt.rkey
            self.resid = self.length = pkt.dma_len
            # level MR flushes the whole region: no range to check (rxe: "FLUSH MR may not
            # set va or resid"); a range must lie inside it
            n = 0 if feth_sel(pkt.feth) == _SEL_MR else self.resid
            try:
                self.qp.device.keys.resolve(self.rkey, self.qp.pd, self.va, n,
                                            _flush_access(pkt.feth), remote=True, qp=self.qp)
            except AccessError:
                raise _Err(RespErr.RKEY_VIOLATION) from None
        elif info.atomic:
            self.va, self.rkey, self.resid = pkt.va, pkt.rkey, 8
            try:
                self.qp.device.keys.resolve(self.rkey, self.qp.pd, self.va, 8,
                                            Access.REMOTE_ATOMIC, remote=True, qp=self.qp)
            except AccessError:
                raise _Err(RespErr.RKEY_VIOLATION) from None

    # -- execution -------------------------------------------------------------------------
    def _execute(self, pkt: Any, ip_header: bytes) -> None:
        info = pkt.info
        qp = self.qp
        keys = self.qp.device.keys
        if info.send:
            try:
                if qp.qp_type == _UD_QP:
                    grh = ip_header if len(ip_header) == 40 else bytes(20) + ip_header[:20]
                    scatter(keys, qp.pd, self.wqe.sges, 0, grh)
                    self.wqe_offset = 40
                scatter(keys, qp.pd, self.wqe.sges, self.wqe_offset, pkt.payload)
                self.wqe_offset += pkt.payload_len
            except NoSpace:
                raise _Err(RespErr.LENGTH) from None
            except AccessError:
                raise _Err(RespErr.MALFORMED_WQE) from None
        elif info.write:
            n = pkt.payload_len
            if n:
                try:
                    keys.resolve(self.rkey, qp.pd, self.va, n, Access.REMOTE_WRITE, remote=True,
                                 qp=qp)[:] = pkt.payload
                except AccessError:
                    raise _Err(RespErr.RKEY_VIOLATION) from None
            self.va += n
            self.resid -= n
        elif info.read:
            self.msn += 1  # C9-148: a read counts as a message when it is accepted
            res = self._prepare_res(pkt, read=True)
            self._read_reply(res)
            return
        elif info.atomic:
            self._atomic_reply(pkt)
            return
        elif info.atomic_write:
            self._atomic_write_reply(pkt)
            return
        elif info.flush:
            self._process_flush(pkt)
            return
        if info.with_inv:
            if not invalidate_rkey(self.qp.device.keys, qp.pd, pkt.ieth_rkey):
                self.status = WCS.IBV_WC_REM_INV_REQ_ERR
                self.goto_error = True
                self._complete(pkt)
                return
        if info.last:
            self.msn += 1
        self._executed(pkt.psn, pkt.opcode)
        if info.completes:
            self._complete(pkt)
        elif qp.qp_type == _RC_QP:
            self._acknowledge(pkt)

    def _complete(self, pkt: Any) -> None:
        """do_complete: post the receive completion, then ACK (RC)."""
        qp = self.qp
        wqe = self.wqe
        if wqe is not None:
            info = pkt.info if pkt is not None else None
            wc = WC(wr_id=wqe.wr_id, status=self.status, qp_num=qp.qp_num)
            if self.status == _SUCCESS and info is not None:
                self.qp.device.counters.rdma_recvs += 1
                if info.with_imm and info.write:
                    wc.opcode = WC_RECV_RDMA_WITH_IMM
                    wc.byte_len = self.length
                else:
                    wc.opcode = WC_RECV
                    wc.byte_len = self.wqe_offset
                flags = _WC_GRH
                if info.with_imm:
                    flags |= _WC_IMM
                    wc.imm_data = pkt.imm
                if info.with_inv:
                    flags |= _WC_INV
                    wc.invalidated_rkey = pkt.ieth_rkey
                    wc.imm_data = pkt.ieth_rkey
                if pkt.src_qp is not None:
                    wc.src_qp = pkt.src_qp
                wc.wc_flags = flags
            else:
                wc.opcode = WC_RECV
            if qp.srq is None and qp.rq and qp.rq[0] is wqe:
                qp.rq.popleft()
            self.wqe = None
            self.wqe_offset = 0
            if not qp.recv_cq.push(wc, solicited=bool(pkt.se) if pkt is not None else True):
                self.goto_error = True  # RESPST_ERR_CQ_OVERFLOW (class G)
        if pkt is not None and qp.qp_type == _RC_QP:
            self._acknowledge(pkt)

    def _acknowledge(self, pkt: Any) -> None:
        if self.syndrome != AETH_ACK_UNLIMITED:
            self.send_ack(self.syndrome, pkt.psn)
        elif pkt.ackreq:
            if not self.owe_ack(pkt.psn):
                self.send_ack(AETH_ACK_UNLIMITED, pkt.psn)

    def _abandon_wqe(self) -> None:
        """UC class D1: a new message starts; the half-filled receive is reused from scratch."""
        self.wqe_offset = 0
        if self.qp.srq is None:
            self.wqe = None
        self.opcode = -1

    # -- reads and atomics -------------------------------------------------------------------
    def _prepare_res(self, pkt: Any, read: bool) -> RespResource:
        res = self.resources[self.res_head]
        self.res_head = (self.res_head + 1) % len(self.resources)
        res.__init__()
        res.in_use = True
        res.is_read = read
        res.opcode = pkt.opcode
        # every kind records its PSN: rxe 6.12's rxe_prepare_res leaves a FLUSH's PSN range
        # unset, so its duplicate lookup misses and the duplicate is dropped (docs/verbs.md)
        res.first_psn = res.cur_psn = pkt.psn
        if read:
            mtu = self.qp.mtu()
            res.va = res.va_org = self.va
            res.resid = res.length = self.resid
            res.rkey = self.rkey
            npkts = max(1, -(-pkt.dma_len // mtu))
            res.last_psn = psn_add(pkt.psn, npkts - 1)
        else:
            res.last_psn = pkt.psn
        return res

    def _read_reply(self, res: RespResource) -> None:
        """Send the read response packets for ``res`` from ``res.cur_psn`` on, at most
        :data:`READ_RESPONSE_BATCH` of them; if more remain, ``res`` is the READ under way
        (``self.res``) and the device is asked for another pass (:meth:`resume`)."""
        mtu = self.qp.mtu()
        keys = self.qp.device.keys
        qp = self.qp
        while True:
            if res.new:
                op = O.RC_RDMA_READ_RESPONSE_ONLY if res.resid <= mtu else O.RC_RDMA_READ_RESPONSE_FIRST
            else:
                op = O.RC_RDMA_READ_RESPONSE_MIDDLE if res.resid > mtu else O.RC_RDMA_READ_RESPONSE_LAST
            res.new = False
            n = min(res.resid, mtu)
            try:
                data = keys.resolve(res.rkey, qp.pd, res.va, n, Access.REMOTE_READ, remote=True,
                                    qp=qp) if n else b""
            except AccessError:
                # the MR or window went away while the read was in progress
                self._error(None, RespErr.RKEY_VIOLATION, True, psn=res.cur_psn)
                self.goto_error = False
                self.res = None
                qp.to_error()
                return
            self._send_read_response(op, res.cur_psn, data)
            res.va += n
            res.resid -= n
            res.cur_psn = psn_add(res.cur_psn, 1)
            self.budget -= 1
            if res.resid <= 0:
                break
            if self.budget <= 0:  # rxe's task yields: the rest on the device's next pass
                if self.res is None and qp.device.trace is not None:
                    qp.trace("ack", f"READ response paused at PSN {res.cur_psn} ({res.resid} "
                                    f"bytes left): {READ_RESPONSE_BATCH} packets per pass",
                             psn=res.cur_psn, resid=res.resid)
                self.res = res
                qp.device.schedule_responder(qp)
                return
        self.res = None
        if not res.replay:
            self.opcode = -1
        if psn_diff(res.cur_psn, self.psn) >= 0:
            self.psn = res.cur_psn

    def _atomic_reply(self, pkt: Any) -> None:
        qp = self.qp
        if self.va & 7:
            raise _Err(RespErr.MISALIGNED_ATOMIC)
        res = self._prepare_res(pkt, read=False)
        mem = self.qp.device.keys.resolve(self.rkey, qp.pd, self.va, 8, Access.REMOTE_ATOMIC,
                                          remote=True, qp=qp)
        (value,) = _U64.unpack(mem)
        res.orig = value
        if pkt.opcode == O.RC_COMPARE_SWAP:
            if value == pkt.compare:
                value = pkt.swap_add
        else:
            value = (value + pkt.swap_add) & 0xFFFFFFFFFFFFFFFF
        mem[:] = _U64.pack(value)
        self.msn += 1
        self._executed(pkt.psn, pkt.opcode)
        self._send(O.RC_ATOMIC_ACKNOWLEDGE, pkt.psn, orig=res.orig)

    def _send_read_response_ack(self, psn: int) -> None:
        """rxe's send_read_response_ack: how ATOMIC WRITE and FLUSH are answered, a READ
        RESPONSE ONLY with no payload whose AETH carries the ACK and the MSN."""
        if self.qp.device.trace is not None:
            self.qp.trace("ack", f"READ RESPONSE ONLY (no data) PSN {psn} MSN {self.msn}",
                          psn=psn, msn=self.msn, syndrome=AETH_ACK_UNLIMITED)
        self._send(O.RC_RDMA_READ_RESPONSE_ONLY, psn)

    def _atomic_write_reply(self, pkt: Any) -> None:
        """atomic_write_reply: store the 8 payload bytes at the aligned address in one step
        (IBTA A19.4.2; rxe's rxe_mr_do_atomic_write), keeping a resource for replay."""
        qp = self.qp
        try:  # oA19-28: the 8 bytes must still be inside a valid MR
            mem = qp.device.keys.resolve(self.rkey, qp.pd, self.va, 8, Access.REMOTE_WRITE,
                                         remote=True, qp=qp)
        except AccessError:
            raise _Err(RespErr.RKEY_VIOLATION) from None
        if self.va & 7:
            raise _Err(RespErr.MISALIGNED_ATOMIC)
        self._prepare_res(pkt, read=False)
        mem[:] = pkt.payload[:8]  # one slice assignment under the device lock: atomic
        self.resid = 0
        self.msn += 1
        self._executed(pkt.psn, pkt.opcode)
        self._send_read_response_ack(pkt.psn)

    def _process_flush(self, pkt: Any) -> None:
        """process_flush: every earlier request has been executed (PSN order), so the data
        is placed; make it persistent if asked (oA19-14: answered once executed)."""
        qp = self.qp
        self._prepare_res(pkt, read=False)
        if feth_plt(pkt.feth) & _PLT_PERSISTENT:
            entry = qp.device.keys.get(self.rkey)
            mr = entry.mr if entry is not None and entry.mr is not None else entry
            if mr is None or mr.persist is None:
                raise _Err(RespErr.RKEY_VIOLATION)
            if feth_sel(pkt.feth) == _SEL_MR:
                mr.persist(0, mr.length)
            else:
                mr.persist(self.va - mr.iova, self.resid)
        self.msn += 1
        self._executed(pkt.psn, pkt.opcode)
        self._send_read_response_ack(pkt.psn)

    def _find_resource(self, psn: int) -> RespResource | None:
        for r in self.resources:
            if not r.in_use:
                continue
            if psn_diff(psn, r.first_psn) >= 0 and psn_diff(psn, r.last_psn) <= 0:
                return r
        return None

    def _duplicate(self, pkt: Any) -> None:
        info = pkt.info
        if info.send or info.write:
            # C9-105: acknowledge again, execute nothing; but not 1:1 for packets that are
            # too far behind to be a retransmission (see the module doc)
            if psn_diff(self.psn, pkt.psn) > DUP_ACK_WINDOW:
                now = self.qp.device.now
                if now - self.far_dup_ack_at < DUP_ACK_INTERVAL:
                    self.qp.device.counters.drop(Drop.DUPLICATE_ACK_LIMITED)
                    return
                self.far_dup_ack_at = now
            self.send_ack(AETH_ACK_UNLIMITED, psn_add(self.ack_psn, -1))
            return
        res = self._find_resource(pkt.psn)
        if res is None:
            self.qp.device.counters.drop(Drop.DUPLICATE_WITHOUT_RESOURCE)
            return
        if info.read:
            if not res.is_read:
                return
            iova, resid = pkt.va, pkt.dma_len
            if iova < res.va_org or resid > res.length or iova + resid > res.va_org + res.length \
                    or pkt.rkey != res.rkey:
                self.qp.device.counters.drop(Drop.DUPLICATE_READ_MISMATCH)
                return
            res.cur_psn = pkt.psn
            res.new = pkt.psn == res.first_psn
            res.replay = True
            res.va_org = res.va = iova
            res.resid = resid
            self._read_reply(res)
            return
        if info.atomic and not res.is_read:
            res.replay = True
            self._send(O.RC_ATOMIC_ACKNOWLEDGE, pkt.psn, orig=res.orig)
        elif (info.atomic_write or info.flush) and res.opcode == pkt.opcode:
            res.replay = True  # oA19-15: answered again, not executed again
            self._send_read_response_ack(pkt.psn)

    # -- errors (rxe's error classes) -------------------------------------------------------
    def _error(self, pkt: Any, kind: RespErr, rc: bool, psn: int | None = None) -> None:
        """Leave an error state as rxe does: RC NAKs (``_NAK_OF``) and moves to ERR; UC and
        UD mostly drop, completing an SRQ's receive in error when one was taken."""
        qp = self.qp
        dev = self.qp.device
        if kind is RespErr.UC_MISSING_FIRST:
            dev.counters.drop(Drop.UC_MISSING_FIRST)
        elif kind is RespErr.RNR:
            if rc:
                dev.counters.send_rnr_err += 1
                self.send_ack(make_syndrome(AethType.RNR_NAK, qp.attr.min_rnr_timer), pkt.psn)
            else:
                self.drop_msg = True
                dev.counters.drop(Drop.NO_RECEIVE_WQE)
        elif kind is RespErr.MISSING_OPCODE_LAST_D1E:
            if qp.srq is not None:
                self.drop_msg = True
                if self.wqe is not None:
                    self.status = WCS.IBV_WC_REM_INV_REQ_ERR
                    self._complete(pkt)
                return
            self._abandon_wqe()
            dev.counters.drop(Drop.UC_MISSING_LAST)
        elif rc or kind not in (RespErr.RKEY_VIOLATION, RespErr.LENGTH):
            self._class_ac(pkt, *_NAK_OF[kind], psn)
        elif qp.srq is not None and self.wqe is not None:  # UC/UD with an SRQ's WQE taken
            if kind is RespErr.RKEY_VIOLATION:
                self.drop_msg = True
                dev.counters.drop(Drop.RKEY_VIOLATION)
            self.status = _NAK_OF[kind][1]
            self._complete(pkt)
        else:  # UC/UD: drop the rest of the message
            self.drop_msg = True
            dev.counters.drop(Drop.RKEY_VIOLATION if kind is RespErr.RKEY_VIOLATION
                              else Drop.LENGTH)

    def _class_ac(self, pkt: Any, syndrome: int, status: int, psn: int | None) -> None:
        """Classes A and C: NAK the request, complete the receive WQE in error (if one was
        taken), and take the QP to ERR."""
        self.syndrome = syndrome
        self.status = status
        self.goto_error = True
        if pkt is None:
            if self.qp.qp_type == _RC_QP:
                self.send_ack(syndrome, psn if psn is not None else self.psn)
            return
        if self.wqe is not None:
            self._complete(pkt)
        elif self.qp.qp_type == _RC_QP:
            self._acknowledge(pkt)
