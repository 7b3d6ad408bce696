"""Telling retransmissions and duplicates apart, from the packets alone.

One rule serves every source, so a capture and a simulated run mark the same packets:

* a **request** (SEND, WRITE, READ request, atomic...) whose PSN its sender already sent
  to the same QP is a *retransmission*: the requester went back (a timeout, a NAK
  PSN_SEQ_ERROR, an RNR NAK) and sent it again, rxe's ``req_retry``;
* a **response** (ACK, READ response, atomic ACK) that repeats an earlier one field for
  field (opcode, PSN, syndrome, MSN) is a *duplicate*: the responder answered a duplicate
  request again (rxe's ``duplicate_request``), or the network delivered one copy twice.

Neither needs any state beyond "what has this sender said before", which is why it works
on any capture, from any implementation.
"""

from __future__ import annotations

from typing import Hashable

from .model import Arrow, Kind

__all__ = ["Marker"]

#: response opcodes: what the responder sends back (the rest are requests)
_RESPONSE_WORDS = ("ACK", "RESPONSE")


class Marker:
    """Feed packets in the order they were sent; :meth:`kind` says how each one is new,
    :meth:`mark` sets it on the arrow."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()

    def kind(self, a: Arrow) -> Kind:
        """NORMAL, RETRANSMISSION or DUPLICATE for ``a`` (other kinds are the caller's)."""
        response = any(w in a.short_opcode for w in _RESPONSE_WORDS)
        if response:
            key: Hashable = ("rsp", a.src, a.dst, a.opcode, a.psn, a.aeth, a.msn)
        else:
            key = ("req", a.src, a.dst, a.psn)
        if key in self._seen:
            return Kind.DUPLICATE if response else Kind.RETRANSMISSION
        self._seen.add(key)
        return Kind.NORMAL

    def mark(self, a: Arrow) -> None:
        """Set ``a.retransmit`` and, for an arrow still NORMAL, its kind. A fate the source
        knew (lost, bad ICRC, a network duplicate) stays the kind drawn."""
        k = self.kind(a)
        a.retransmit = k == Kind.RETRANSMISSION
        if a.kind == Kind.NORMAL:
            a.kind = k
