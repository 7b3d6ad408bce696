"""Walk one flow through the rule modules, packet by packet, in frame order.

The order of the calls is the order of the protocol: a request is classified (new or
resent) before the NAK and atomic bookkeeping sees it; a response is matched to its READ or
atomic before it is allowed to acknowledge anything.
"""

from __future__ import annotations

from ..wire.opcodes import Transport
from . import atomics, reads, responses, sequence
from .conversation import Flow, infer_mtu
from .rules import Sink
from .state import FlowState

__all__ = ["walk"]


def walk(flow: Flow, sink: Sink, mtu: int | None = None, lossy: bool = False) -> FlowState:
    """Check one flow; ``mtu`` overrides the inferred path MTU; ``lossy``: the capture may
    have been taken behind a lossy hop (docs/check.md, "Where to capture")."""
    flow.mtu_req = mtu or infer_mtu(flow.requests)
    flow.mtu_resp = mtu or infer_mtu([p for p in flow.responses if p.info.read])
    st = FlowState(flow, flow.transport == Transport.RC, flow.mtu_req, flow.mtu_resp, lossy)
    for p, is_request in flow.events():
        if is_request:
            kind = sequence.on_request(st, p, sink)
            atomics.on_request(st, p, kind)
            responses.on_request(st, p, kind, sink)
        else:
            valid = reads.on_response(st, p, sink) and atomics.on_response(st, p, sink)
            responses.on_response(st, p, valid, sink)
    sequence.at_end(st, sink)
    responses.at_end(st, flow.responder_requests, sink)
    atomics.at_end(st, sink)
    return st
