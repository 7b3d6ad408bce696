"""What the checker knows about one flow (a requester and its responder) at a point in the
capture. The rule modules read and update it as :func:`softrdma.check.flows.walk` replays
the flow's packets in frame order; it holds no rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from ..qp.psn import psn_diff
from .conversation import Flow
from .decode import Packet

__all__ = ["Read", "Atomic", "Nak", "Gap", "FlowState", "read_packets"]


@dataclass
class Read:
    """A READ request (first transmission) and what came back for it."""

    psn: int
    n: int | None  # PSNs (response packets) it takes; None if the MTU is unknown
    va: int
    rkey: int
    length: int
    frame: int
    restarts: set[int] = field(default_factory=set)  # offsets a re-READ started from
    accepted: int = 0  # responses accepted in order so far (the requester drops the rest)


@dataclass
class Atomic:
    psn: int
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
    psn: int
    rnr_timer: int | None  # the RNR NAK's timer code; None for a sequence error
    new_after: int = 0  # new requests seen after it (in flight when it was sent)


def read_packets(length: int, mtu: int) -> int:
    """PSNs a READ of ``length`` bytes takes: one per response packet, at least one
    (rxe_req.c: a zero-length READ still gets one response)."""
    return max(1, -(-length // mtu))


@dataclass
class Gap:
    """PSNs a request skipped; with ``lossy``, reported only if they are never resent."""

    frame: int
    expected: int
    seen: int
    missing: set[int]


@dataclass
class FlowState:
    flow: Flow
    rc: bool
    mtu_req: int | None
    mtu_resp: int | None
    lossy: bool = False  # the capture point may be behind a lossy hop (docs/check.md)
    gaps: list[Gap] = field(default_factory=list)
    # requester side
    first_psn: int | None = None  # first request PSN of the capture
    next_psn: int | None = None  # PSN the next new request must carry
    max_psn: int | None = None  # last PSN taken so far (a READ takes several)
    in_msg: str | None = "?"  # "send"/"write" inside a message, None between, "?" unknown
    msg_bytes: int = 0
    msg_len: int | None = None  # RETH length of the WRITE in progress
    sent: dict[int, Packet] = field(default_factory=dict)  # PSN -> first transmission
    reads: list[Read] = field(default_factory=list)
    last_read: Read | None = None
    atomics: dict[int, Atomic] = field(default_factory=dict)
    msg_ends: list[int] = field(default_factory=list)  # PSNs at which a message completes
    missing: set[int] = field(default_factory=set)  # PSNs a reported gap skipped
    retry_next: int | None = None  # PSN that continues the go-back burst in progress
    need_ack: dict[int, int] = field(default_factory=dict)  # AckReq PSN -> frame
    # responder side
    acked: int | None = None  # every PSN up to this one is acknowledged
    acked_frame: int = 0
    sure: int | None = None  # acknowledged up to here while no READ/atomic before was open
    sure_frame: int = 0
    open_answers: set[int] = field(default_factory=set)  # PSNs of unanswered READs/atomics
    msn_idx: int = 0  # msg_ends[:msn_idx] end at or before the last response's PSN
    msn_log: list[tuple[int, int, int, int]] = field(default_factory=list)  # frame, MSN,
    # messages completed up to its PSN, that PSN
    nak: Nak | None = None
    fatal: Nak | None = None  # a NAK the requester's QP does not survive

    @property
    def mtu(self) -> int | None:
        return self.mtu_req or self.mtu_resp

    def blocked(self, psn: int) -> bool:
        """A READ or atomic before ``psn`` is still unanswered: a requester treats an ACK
        at ``psn`` as an implied NAK for it (rxe_comp.c check_psn) and completes nothing."""
        return any(psn_diff(q, psn) < 0 for q in self.open_answers)

    def find_read(self, psn: int) -> Read | None:
        """The READ whose PSN range holds ``psn``: the one found last time (responses come in
        runs), else the most recent of the last 512."""
        last = self.last_read
        if last is not None and 0 <= psn_diff(psn, last.psn) < (last.n or 1):
            return last
        for r in islice(reversed(self.reads), 512):
            if 0 <= psn_diff(psn, r.psn) < (r.n or 1):
                self.last_read = r
                return r
        return None

    def seen(self, psn: int) -> bool:
        """``psn`` lies in the PSN range the capture has seen requests for."""
        if self.first_psn is None or self.max_psn is None:
            return False
        return psn_diff(psn, self.first_psn) >= 0 and psn_diff(psn, self.max_psn) <= 0
