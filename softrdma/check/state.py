"""What the checker knows about one flow (a requester and its responder) at a point in the
capture. The rule modules read and update it as :class:`softrdma.check.flows.FlowWalk`
feeds the flow's packets in frame order; it holds no rule of its own.

PSNs are *unwrapped* here: the 24-bit PSN of the wire becomes an integer that keeps growing
past 2^24 (:meth:`FlowState.unwrap`), so that "before" and "after" are plain comparisons and
a capture may run through any number of wraps.

Everything is bounded: requests are remembered in a window of :data:`WINDOW` PSNs behind the
newest (a go-back never reaches further: rxe's requester has at most 2^23 PSNs in flight and
far fewer in practice), READs and atomics likewise, so a capture of any length is walked in
bounded memory.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..qp.psn import psn_diff
from .conversation import Flow
from .recovery import FlowRecovery

__all__ = ["Req", "Read", "Atomic", "Nak", "Gap", "FlowState", "read_packets", "WINDOW"]

#: requests remembered behind the newest PSN (retransmissions and answers reach no further)
WINDOW = 1 << 15


class Req:
    """A request as first captured at its PSN (resends are compared with it)."""

    __slots__ = ("frame", "ts", "opcode", "kind", "first", "last", "n", "payload_len",
                 "dma_len", "va", "rkey", "key", "crc", "ip_id", "seen_frame", "seen_ts", "small",
                 "seen_resp", "seen_ip_id")

    def __init__(self, frame: int, ts: float, opcode: int, kind: str | None, first: bool,
                 last: bool, n: int | None, payload_len: int, dma_len: int, va: int,
                 rkey: int, key: tuple, crc: int, ip_id: int, small: bytes | None) -> None:
        self.frame, self.ts, self.opcode, self.kind = frame, ts, opcode, kind
        self.first, self.last, self.n = first, last, n
        self.payload_len, self.dma_len, self.va, self.rkey = payload_len, dma_len, va, rkey
        self.key, self.crc, self.ip_id, self.small = key, crc, ip_id, small
        self.seen_frame = frame  # the last frame that carried this PSN (resends included)
        self.seen_ts = ts
        self.seen_resp = 0  # responses captured before its last capture
        self.seen_ip_id = ip_id  # the IPv4 ID of its last capture


@dataclass
class Read:
    """A READ request (first transmission) and what came back for it."""

    psn: int  # unwrapped
    n: int | None  # PSNs (response packets) it takes; None if the MTU is unknown
    va: int
    rkey: int
    length: int
    frame: int
    restarts: set[int] = field(default_factory=set)  # offsets a re-READ started from
    accepted: int = 0  # responses accepted in order so far (the requester drops the rest)
    hi: int = -1  # the highest response offset captured
    got: bytearray = field(default_factory=bytearray)  # offsets captured (one flag each)

    def captured(self, k: int) -> bool:
        """Response ``k`` was captured before; notes that it is now."""
        if k >= len(self.got):
            self.got.extend(bytes(k + 1 - len(self.got)))
        seen = bool(self.got[k])
        self.got[k] = 1
        return seen


@dataclass
class Atomic:
    psn: int  # unwrapped
    frame: int
    orig: int | None = None  # the original value of the first ATOMIC ACKNOWLEDGE
    ack_frame: int = 0
    answered: bool = False
    resent: bool = False  # the requester sent it again (its answers may be replays)


@dataclass
class Nak:
    """A NAK that obliges the requester to resend (PSN sequence error or RNR)."""

    frame: int
    ts: float
    psn: int  # unwrapped
    rnr_timer: int | None  # the RNR NAK's timer code; None for a sequence error
    new_after: int = 0  # new requests seen after it (in flight when it was sent)
    due: int | None = None  # where the resend is due (a later ACK may move it on)

    def __post_init__(self) -> None:
        if self.due is None:
            self.due = self.psn


def read_packets(length: int, mtu: int) -> int:
    """PSNs a READ of ``length`` bytes takes: one per response packet, at least one
    (rxe_req.c: a zero-length READ still gets one response)."""
    return max(1, -(-length // mtu))


@dataclass
class Gap:
    """PSNs (unwrapped) missing from the requester's packets: lost before the capture
    point, or late."""

    frame: int
    ts: float
    start: int
    end: int  # first PSN after the hole
    ip_id: int = 0  # IP ID of the packet that showed the hole


@dataclass
class FlowState:
    flow: Flow
    rc: bool
    mtu_req: int | None
    mtu_resp: int | None
    rec: FlowRecovery
    lossy_capture: bool = False  # the capture itself may have missed packets
    # PSN unwrapping
    ref_psn: int | None = None  # a wire PSN ...
    ref_abs: int = 0  # ... and its unwrapped value
    # requester side
    first: int | None = None  # first request PSN of the capture (unwrapped)
    next: int | None = None  # PSN the next new request must carry
    top: int | None = None  # last PSN taken so far (a READ takes several)
    reqs: dict[int, Req] = field(default_factory=dict)  # PSN -> first capture, windowed
    read_end: dict[int, int] = field(default_factory=dict)  # last PSN of a READ -> its PSN
    missing: set[int] = field(default_factory=set)  # PSNs of holes not filled yet
    late: set[int] = field(default_factory=set)  # PSNs counted lost whose packet may still
    # turn up late (then: reordered)
    in_order: int | None = None  # the PSN a responder that got every captured request
    # would expect next (rxe takes requests in PSN order only); known from its first answer
    gaps: deque = field(default_factory=deque)  # Gap, oldest first
    reads: deque = field(default_factory=lambda: deque(maxlen=4096))
    last_read: Read | None = None
    atomics: OrderedDict = field(default_factory=OrderedDict)  # PSN -> Atomic
    a19: OrderedDict = field(default_factory=OrderedDict)  # PSN -> ATOMIC WRITE / FLUSH
    retry_next: int | None = None  # PSN that continues the go-back burst in progress
    last_resend_ts: float | None = None  # when a resend was last captured
    last_resend_frame: int = 0  # ... and in which frame
    last_go_back_ts: float | None = None  # when a go-back last started
    last_req_ts: float | None = None
    max_ip_id: int | None = None  # the newest IPv4 ID of the requester's packets
    # rxe numbers the IPv4 packets it sends (a per-destination counter, never 0 in
    # practice); softrdma sends IP ID 0, and k for segment k of a train (softrdma.wire.
    # trains). A request with ID 0 says the IDs are not a counter: ignore them from then on
    numbered: bool = True
    pending_after: dict = field(default_factory=dict)  # NAK'd PSN -> (event, NAK frame):
    # a loss after the capture point, unless an ACK shows the packet was only late
    n_req: int = 0  # requests and responses captured so far
    n_resp: int = 0
    need_ack: dict[int, int] = field(default_factory=dict)  # AckReq PSN -> frame
    wmsg: list | None = None  # [first PSN, RETH length, bytes so far] of a WRITE running
    # responder side
    acked: int | None = None  # every PSN up to this one is acknowledged
    acked_frame: int = 0
    known_acked: int | None = None  # acknowledged as far as the requester evidently knew
    open_answers: set[int] = field(default_factory=set)  # PSNs of unanswered READs/atomics
    ends: list[int] = field(default_factory=list)  # message ends after msn_upto, sorted
    msn_done: int = 0  # messages that end at or before msn_upto
    msn_upto: int | None = None
    msn_base: int | None = None  # MSN before the capture's first message
    msn_pending: list = field(default_factory=list)  # (frame, MSN, done, upto) before base
    msn_shift: tuple | None = None  # (frame, base) of a disagreeing response, to confirm
    nak: Nak | None = None
    last_seq_nak: tuple | None = None  # (PSN, frame, time) of the last PSN NAK (NAK-ONCE)
    suspect: tuple | None = None  # (frame, NAK'd PSN, NAK frame) of a go-back past a NAK
    fatal: Nak | None = None  # a NAK the requester's QP does not survive
    ack_beyond: tuple | None = None  # (frame, PSN, text) of an ACK past the newest request
    violation_later: tuple | None = None  # (rule, frame, text) found out after the fact
    implied: int | None = None  # PSN of a READ/atomic an ACK beyond it left unanswered
    rtt: float | None = None  # shortest request -> ACK time seen at the capture point
    last_resp: dict = field(default_factory=dict)  # opcode, PSN -> (ip_id, ts, bytes hash)
    last_resp_ts: float | None = None
    responder_last_request: int = 0  # the responder end's newest own request frame

    @property
    def mtu(self) -> int | None:
        return self.mtu_req or self.mtu_resp

    def unwrap(self, psn: int) -> int:
        """The unwrapped value of a wire PSN, relative to the newest one seen."""
        if self.ref_psn is None:
            self.ref_psn, self.ref_abs = psn, psn
            return psn
        a = self.ref_abs + psn_diff(psn, self.ref_psn)
        if a > self.ref_abs:
            self.ref_psn, self.ref_abs = psn, a
        return a

    def blocked(self, apsn: int) -> bool:
        """A READ or atomic before ``apsn`` is still unanswered: a requester treats an ACK
        at ``apsn`` as an implied NAK for it (rxe_comp.c check_psn) and completes nothing."""
        return any(q < apsn for q in self.open_answers)

    def find_read(self, apsn: int) -> Read | None:
        """The READ whose PSN range holds ``apsn``: the one found last time (responses come
        in runs), else the most recent of those remembered."""
        last = self.last_read
        if last is not None and 0 <= apsn - last.psn < (last.n or 1):
            return last
        for r in reversed(self.reads):
            if 0 <= apsn - r.psn < (r.n or 1):
                self.last_read = r
                return r
            if r.psn + (r.n or 1) + WINDOW < apsn:
                break
        return None

    def seen(self, apsn: int) -> bool:
        """``apsn`` lies in the PSN range the capture has seen requests for."""
        return (self.first is not None and self.top is not None
                and self.first <= apsn <= self.top)

    def add_missing(self, psns: range) -> None:
        self.missing.update(psns)

    def add_end(self, apsn: int) -> None:
        """A message ends at ``apsn`` (the MSN counts it once acknowledged)."""
        if self.msn_upto is not None and apsn <= self.msn_upto:
            self.msn_done += 1  # captured only after its acknowledgement: the capture
            return              # missed it (counted anyway; see responses._msn)
        bisect.insort(self.ends, apsn)

    def prune(self) -> None:
        """Forget requests far behind the newest (bounded memory)."""
        if self.top is None or len(self.reqs) < 2 * WINDOW:
            return
        floor = self.top - WINDOW
        self.reqs = {k: v for k, v in self.reqs.items() if k >= floor}
        self.read_end = {k: v for k, v in self.read_end.items() if k >= floor}
        self.missing = {k for k in self.missing if k >= floor}
        self.late = {k for k in self.late if k >= floor}
        self.need_ack = {k: v for k, v in self.need_ack.items() if k >= floor}
        while self.gaps and self.gaps[0].end < floor:
            self.gaps.popleft()
        while len(self.atomics) > WINDOW:
            self.atomics.popitem(last=False)
        while len(self.a19) > WINDOW:
            self.a19.popitem(last=False)
        self.open_answers = {q for q in self.open_answers if q >= floor}
