"""Rules about RDMA READ responses: which PSNs, which opcodes, how many bytes (9.4.3).

A READ request at PSN q for L bytes takes n = ceil(L / MTU) PSNs (at least one); its
responses are ONLY (n = 1), or FIRST at q, MIDDLE..., LAST at q + n - 1, and the one at
offset k carries min(MTU, L - k * MTU) bytes. When the requester re-reads from offset k
(after losing responses), the answer may start there with FIRST/ONLY (a new READ, as the
spec describes it) or, as rxe's responder does for a duplicate READ (rxe_resp.c,
``rdatm_res_state_replay``), go on with MIDDLE/LAST; both are accepted at a restart.

A hole in a READ's responses is responses lost before the capture point; a response to a
READ the capture never carried means the capture missed the request (nothing lost on the
path reaches a responder), an observation rather than a fault.
"""

from __future__ import annotations

from ..wire.opcodes import Opcode
from .decode import Packet
from .rules import Sink
from .state import FlowState

__all__ = ["on_response"]

_FIRST, _MIDDLE, _LAST, _ONLY = (Opcode.RC_RDMA_READ_RESPONSE_FIRST,
                                 Opcode.RC_RDMA_READ_RESPONSE_MIDDLE,
                                 Opcode.RC_RDMA_READ_RESPONSE_LAST,
                                 Opcode.RC_RDMA_READ_RESPONSE_ONLY)


def _expected(k: int, n: int, restart: bool) -> set[int]:
    last = k == n - 1
    if n == 1:
        return {_ONLY}
    ops = {_LAST} if last else ({_FIRST} if k == 0 else {_MIDDLE})
    if restart:
        ops.add(_ONLY if last else _FIRST)
    return {int(o) for o in ops}


def on_response(st: FlowState, p: Packet, sink: Sink) -> bool:
    """Judge a READ response; False if it answers no READ (so it acknowledges nothing)."""
    if not p.info.read or st.first is None:
        return True
    label = st.flow.label
    a = st.unwrap(p.psn)
    r = st.find_read(a)
    if r is None:
        if a < st.first:
            return False  # answers a READ from before the capture
        carried = a in st.reqs or (st.top is not None and st.first <= a <= st.top
                                   and a not in st.missing)
        if not carried and st.lossy_capture:
            st.rec.add("not-captured", p.frame, p.ts, p.psn, 1,
                       f"{p.info.name} at PSN {p.psn} answers a READ the capture never "
                       "carried (the capture missed it)", "responses")
            return False
        why = "" if carried else (" (none captured; if the capture dropped packets: "
                                  "--lossy)")
        sink.add("READ-RESP-PSN", p.frame, f"{p.info.name} at PSN {p.psn}, but no READ "
                                           f"request covers that PSN{why}", label)
        return False
    k = a - r.psn
    if k > r.hi + 1 and not r.restarts:
        st.rec.add("lost-before", p.frame, p.ts, (r.psn + r.hi + 1) & 0xFFFFFF, k - r.hi - 1,
                   f"{k - r.hi - 1} READ response(s) before PSN {p.psn} never captured (lost "
                   "before the capture point)", "responses")
        st.rec.open(r.psn + r.hi + 1, p.ts)
    if k > r.hi:
        r.hi = k
    if k < (1 << 20) and r.captured(k):
        st.rec.resent(p.bth.payload_len)
    else:
        st.rec.good(p.bth.payload_len)
    if k == r.accepted and not st.blocked(r.psn):
        r.accepted += 1  # a requester takes READ responses in PSN order only
        if r.n is not None and r.accepted >= r.n:
            st.open_answers.discard(r.psn)
    if r.n is None:
        return True  # MTU unknown: nothing more to judge
    want = _expected(k, r.n, k in r.restarts)
    if p.bth.opcode not in want:
        names = " or ".join(sorted(Opcode(o).name for o in want))
        sink.add("READ-RESP-OPCODE", p.frame, f"{p.info.name} at offset {k} of {r.n} of the "
                                              f"READ of frame {r.frame}, expected {names}",
                 label)
    mtu = st.mtu_resp or st.mtu_req
    if mtu is not None:
        size = min(mtu, r.length - k * mtu)
        if p.bth.payload_len != size:
            sink.add("READ-RESP-LEN", p.frame, f"{p.info.name} carries {p.bth.payload_len} "
                                               f"bytes, expected {size} (offset {k} of the "
                                               f"{r.length}-byte READ of frame {r.frame})",
                     label)
    return True
