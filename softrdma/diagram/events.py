"""Diagrams from event records: a list of dicts, such as a JSON-lines trace read back.

    import json
    from softrdma.diagram import from_events
    d = from_events(json.loads(line) for line in open("run.jsonl"))

Every record has ``event`` (what happened) and ``t`` (seconds, any origin). The keys each
event reads, with the lane it lands on (a lane is an address and a QP number):

========================= ==================================================================
``event``                 keys
========================= ==================================================================
``send`` (``tx``)         ``src`` (or ``ip``): sender's address; ``qpn``: sender's QP;
                          ``dst``: receiver's address; ``dest_qp``: receiver's QP;
                          ``psn``; ``opcode`` (a name such as ``RC_SEND_ONLY``, or the
                          number); optional ``ackreq``, ``syndrome`` (the AETH byte) or
                          ``aeth`` (text), ``msn``, ``len``, ``id`` (to pair the receive)
``recv`` (``rx``)         ``dst`` (or ``ip``) and ``qpn``: the receiver; ``src`` and
                          ``src_qp``: the sender; ``psn``, ``opcode``, optional ``id``:
                          the arrival of the matching ``send`` (same ``id``, else the
                          earliest unmatched send to this QP with that PSN and opcode); a
                          receive with no send becomes an arrow of its own
``drop`` (``lost``)       like ``recv``: the matching send never arrived (drawn with an X)
``state``                 ``ip``, ``qpn``, ``state`` (``RTS``, ``IBV_QPS_ERR``, or the number)
``completion`` (``wc``)   ``ip``, ``qpn``, optional ``opcode``, ``status``, ``wr_id``
``timer``                 ``ip``, ``qpn``, optional ``which`` (``retransmit``, ``rnr``)
anything else             ``ip``, ``qpn``, ``text`` (or ``msg``): a note; without them,
                          skipped and counted in the diagram's remarks
========================= ==================================================================

A send whose receive is not in the records (a one-sided trace) is drawn level, as a
capture draws it; only a ``drop`` record makes a packet lost. Retransmissions and
duplicates are marked by the same rule as for captures (:mod:`.marks`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..enums import ibv_qp_state
from ..wire.headers import aeth_syndrome_name
from ..wire.opcodes import lookup
from .marks import Marker
from .model import Arrow, Diagram, Kind, Lane, Note

__all__ = ["from_events", "from_trace", "EventError"]

_SEND = {"send", "tx"}
_RECV = {"recv", "rx"}
_DROP = {"drop", "lost"}


class EventError(ValueError):
    """A record without the keys its event needs (the message names the record)."""


def _opcode_name(v: Any) -> str:
    if isinstance(v, int):
        return lookup(v).name
    return str(v)


def _state(v: Any) -> str:
    if isinstance(v, int):
        return ibv_qp_state(v).name.removeprefix("IBV_QPS_")
    return str(v).removeprefix("IBV_QPS_")


def from_events(records: Iterable[Mapping[str, Any]], title: str = "trace") -> Diagram:
    d = Diagram(title)
    marker = Marker()
    pending: list[Arrow] = []  # sends not yet received or dropped
    by_id: dict[Any, Arrow] = {}
    skipped = 0
    for n, r in enumerate(records, 1):
        try:
            ev, t = r["event"], float(r["t"])
            if ev in _SEND:
                src = d.lane(r.get("src", r.get("ip")), r.get("qpn"))
                dst = d.lane(r["dst"], r.get("dest_qp"))
                syn = r.get("syndrome")
                a = Arrow(src, dst, t, None, _opcode_name(r["opcode"]), int(r["psn"]),
                          ackreq=bool(r.get("ackreq", False)),
                          aeth=aeth_syndrome_name(syn) if syn is not None else r.get("aeth"),
                          msn=r.get("msn"), length=int(r.get("len", 0)),
                          detail=str(r.get("line", "")))
                marker.mark(a)
                d.arrows.append(a)
                pending.append(a)
                if "id" in r:
                    by_id[r["id"]] = a
            elif ev in _RECV or ev in _DROP:
                dst = Lane(r.get("dst", r.get("ip")), r.get("qpn"))
                a = by_id.pop(r["id"], None) if "id" in r else None
                if a is None:
                    op = _opcode_name(r["opcode"])
                    a = next((x for x in pending if x.dst == dst and x.psn == int(r["psn"])
                              and x.opcode == op), None)
                if a is not None:
                    pending.remove(a)
                    if ev in _DROP:
                        a.kind = Kind.LOST
                    else:
                        a.recv_time = t
                elif ev in _RECV:  # only the receiving side was traced
                    src = d.lane(r.get("src"), r.get("src_qp"))
                    d.lane(dst.ip, dst.qpn)
                    a = Arrow(src, dst, t, t, _opcode_name(r["opcode"]), int(r["psn"]),
                              ackreq=bool(r.get("ackreq", False)), msn=r.get("msn"))
                    marker.mark(a)
                    d.arrows.append(a)
            elif ev == "state":
                d.notes.append(Note(d.lane(r["ip"], r["qpn"]), t, _state(r["state"]), "state"))
            elif ev in ("completion", "wc"):
                text = " ".join(str(x) for x in ("WC", r.get("opcode", ""), r.get("status", ""),
                                                  f"wr_id {r['wr_id']}" if "wr_id" in r else "")
                                if x != "")
                d.notes.append(Note(d.lane(r["ip"], r["qpn"]), t, text, "completion"))
            elif ev == "timer":
                which = r.get("which", "")
                d.notes.append(Note(d.lane(r["ip"], r["qpn"]), t,
                                    f"{which} timer fired".strip(), "timer"))
            elif "ip" in r and ("text" in r or "msg" in r):
                d.notes.append(Note(d.lane(r["ip"], r.get("qpn")), t,
                                    str(r.get("text", r.get("msg")))))
            else:
                skipped += 1
        except KeyError as e:
            raise EventError(f"record {n} ({r.get('event', '?')}): no {e.args[0]!r}") from None
    for a in pending:  # a one-sided trace: drawn level, like a capture
        if a.kind != Kind.LOST:
            a.recv_time = a.send_time
    if skipped:
        d.remarks.append(f"{skipped} records of other events are not drawn")
    return d


def from_trace(records: Iterable[Mapping[str, Any]], title: str = "trace") -> Diagram:
    """A diagram from softrdma's own trace (``softrdma.trace`` records, e.g. a JSON-lines
    file written with ``--trace-format json``; docs/trace.md): packets sent and received
    become arrows, the simulated network's losses their X, QP states, completions and
    timers notes, retransmission decisions notes on the requester's lane."""
    return from_events(_events_of_trace(records), title)


def _events_of_trace(records: Iterable[Mapping[str, Any]]) -> Iterable[dict[str, Any]]:
    for r in records:
        kind, t, ip, qpn = r.get("kind"), r.get("t", 0.0), r.get("ip"), r.get("qpn")
        if kind == "packet":
            base = {"t": t, "psn": r["psn"], "opcode": r["opcode"]}
            if r.get("dir") == "tx":
                yield {**base, "event": "send", "ip": ip, "qpn": qpn, "dst": r.get("peer"),
                       "dest_qp": r.get("dest_qp"), "ackreq": r.get("ackreq", False),
                       "syndrome": r.get("syndrome"), "msn": r.get("msn"),
                       "len": r.get("len", 0),
                       "line": str(r.get("msg", "")).removeprefix("tx ").strip()}
            else:
                yield {**base, "event": "recv", "ip": ip, "qpn": qpn, "src": r.get("peer")}
        elif kind == "drop" and r.get("reason") == "sim_loss":
            yield {"event": "drop", "t": t, "dst": r.get("peer"), "qpn": r.get("dest_qp"),
                   "psn": r["psn"], "opcode": r["opcode"]}
        elif kind == "qp" and "new" in r:
            yield {"event": "state", "t": t, "ip": ip, "qpn": qpn, "state": r["new"]}
        elif kind == "cq":
            yield {"event": "completion", "t": t, "ip": ip, "qpn": qpn,
                   "opcode": r.get("opcode", ""), "status": r.get("status", ""),
                   "wr_id": r.get("wr_id")}
        elif kind == "timer" and r.get("action") == "fire":
            yield {"event": "timer", "t": t, "ip": ip, "qpn": qpn, "which": r.get("timer")}
        elif kind == "retry" and qpn is not None:
            yield {"event": "note", "t": t, "ip": ip, "qpn": qpn, "text": r.get("msg", "")}
