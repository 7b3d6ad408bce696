"""Rules about RDMA READ responses: which PSNs, which opcodes, how many bytes (9.4.3).

A READ request at PSN q for L bytes takes n = ceil(L / MTU) PSNs (at least one); its
responses are ONLY (n = 1), or FIRST at q, MIDDLE..., LAST at q + n - 1, and the one at
offset k carries min(MTU, L - k * MTU) bytes. When the requester re-reads from offset k
(after losing responses), the answer may start there with FIRST/ONLY (a new READ, as the
spec describes it) or, as rxe's responder does for a duplicate READ (rxe_resp.c,
``rdatm_res_state_replay``), go on with MIDDLE/LAST; both are accepted at a restart.
"""

from __future__ import annotations

from ..qp.psn import psn_diff
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
    if not p.info.read or st.first_psn is None:
        return True
    label = st.flow.label
    r = st.find_read(p.psn)
    if r is None:
        if psn_diff(p.psn, st.first_psn) < 0:
            return False  # answers a READ from before the capture
        sink.add("READ-RESP-PSN", p.frame, f"{p.info.name} at PSN {p.psn}, but no READ "
                                           "request covers that PSN", label)
        return False
    k = psn_diff(p.psn, r.psn)
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
