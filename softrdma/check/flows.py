"""Walk each flow through the rule modules, packet by packet, in frame order.

The order of the calls is the order of the protocol: a request is classified (new, late,
resent, duplicated) before the atomic bookkeeping sees it; a response is matched to its
READ or atomic before it is allowed to acknowledge anything. Flows are independent, so the
packets of all of them are fed as the capture gives them, one at a time.
"""

from __future__ import annotations

from ..wire.opcodes import Transport
from . import a19, atomics, reads, responses, sequence
from .conversation import Flow
from .decode import Packet
from .recovery import FlowRecovery
from .rules import Sink
from .state import FlowState

__all__ = ["FlowWalk"]


class FlowWalk:
    """The rules of one flow; feed it its packets (:meth:`request`, :meth:`response`), then
    :meth:`end`. ``lossy_capture``: the capture itself may have missed packets (pcap drops),
    so what only a complete capture could prove is not judged (docs/check.md)."""

    def __init__(self, flow: Flow, lossy_capture: bool = False) -> None:
        self.flow = flow
        self.st = FlowState(flow, flow.transport == Transport.RC, flow.mtu_req, flow.mtu_resp,
                            FlowRecovery(flow.label, flow.transport.name),
                            lossy_capture=lossy_capture)

    @property
    def recovery(self) -> FlowRecovery:
        return self.st.rec

    @property
    def mtu(self) -> int | None:
        return self.st.mtu_req or self.st.mtu_resp

    def request(self, p: Packet, sink: Sink) -> None:
        st = self.st
        kind = sequence.on_request(st, p, sink)
        if kind == sequence.NEW:
            responses.note_request(st, st.unwrap(p.psn))
        atomics.on_request(st, p, kind)
        a19.on_request(st, p, kind, sink)

    def response(self, p: Packet, sink: Sink) -> None:
        st = self.st
        if responses.is_duplicate(st, p):
            return
        valid = a19.on_response(st, p, sink)  # ATOMIC WRITE / FLUSH answers look like READs'
        if valid is None:
            valid = reads.on_response(st, p, sink) and atomics.on_response(st, p, sink)
        responses.on_response(st, p, valid, sink)

    def responder_request(self, frame: int) -> None:
        """The responder's end sent a request of its own (for the ACK-COVER heuristic)."""
        self.st.responder_last_request = frame

    def end(self, sink: Sink) -> None:
        sequence.at_end(self.st, sink)
        responses.at_end(self.st, sink)
        atomics.at_end(self.st, sink)
