"""Replay of the CM exchange on QP1: softrdma's rdma_cm answers the captured REQ.

A conversation on QP1 carries the connection manager's MADs. softrdma stands in for the
*passive* side (the one that received the REQ, or the SIDR_REQ of a UD service): a manual
device takes its address, a listener is bound to the port the REQ's service ID names,
and each message of the active side is fed to it in capture order:

* the REQ (as captured, ICRC checked): softrdma's CM raises CONNECT_REQUEST, the replay
  accepts with what the captured REP shows the application chose (responder resources,
  initiator depth, RNR retry count, private data), and softrdma's REP is compared with the
  captured REP;
* the RTU, rewritten to name softrdma's comm ID: the connection must become ESTABLISHED;
* a DREQ, rewritten likewise: DISCONNECTED, and softrdma's DREP is compared with the
  captured one; where the captured passive side disconnects first, softrdma disconnects
  at that point and its DREQ is compared, and the active side's DREP is fed back;
* a SIDR_REQ: softrdma's SIDR_REP (QP number and Q_Key of a UD QP) against the captured.

Messages are compared field by field, as tests/test_cm_capture_conformance.py does, except
the fields each host draws at random or that name the host: comm IDs, starting PSNs, QP
numbers, the CA GUID and the flow label (which follows the random source port). Those are
compared by their relations instead: the REP and DREP name the active side's comm ID, a
reply carries its request's transaction ID, the SIDR_REP its request ID. The BTH, DETH and
UDP source port of each MAD are compared too.

The active side (the one that sent the REQ) is not replayed: softrdma would draw its own
comm ID, PSN and port, and every message of the passive side names them.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from ..cm.cma import PortSpace, split_service_id
from ..cm.messages import build_cm, parse_cm
from ..cm.qp1 import build_qp1
from ..wire.packet import parse
from .replay import CapturedPacket, FrameVerdict, ReplayError, ReplayResult
from .replayloss import Evidence

__all__ = ["CM_RANDOM", "is_passive", "replay_cm"]

#: fields a host draws at random or that name it (compared by relation, not value)
CM_RANDOM = frozenset({"local_comm_id", "remote_comm_id", "local_ca_guid", "local_qpn",
                       "starting_psn", "primary_flow_label", "remote_qpn", "request_id",
                       "qpn"})
#: BTH, DETH and UDP fields of a MAD's packet that must be the captured ones
_FRAMING = ("opcode", "pkey", "qkey", "src_qp", "dest_qp", "ackreq", "payload_len")
_WAIT = 2.0  # seconds to wait for an event softrdma's CM should raise at once


def _mads(packets: list[CapturedPacket]) -> list[tuple[CapturedPacket, Any]]:
    out = []
    for c in packets:
        try:
            out.append((c, parse_cm(bytes(c.pkt.payload))))
        except Exception:  # not a CM MAD (or garbled): nothing to feed or compare
            out.append((c, None))
    return out


def is_passive(packets: list[CapturedPacket], ip: str) -> bool | None:
    """Whether the endpoint at ``ip`` received the conversation's first REQ/SIDR_REQ
    (None: the capture shows none)."""
    me = ipaddress.ip_address(ip).packed
    for c, m in _mads(packets):
        if m is not None and m.name in ("REQ", "SIDR_REQ"):
            return c.dst == me
    return None


def _rewrite(msg: Any, tid: int | None = None, **fields: Any) -> bytes:
    vals = {a: getattr(msg, a) for a in msg.type.attrs}
    vals.update(fields)
    return build_cm(msg.type, tid=msg.tid if tid is None else tid,
                    private_data=bytes(msg.private_data), **vals)


class _Side:
    """The manual device in place of the passive side, and what its CM sends."""

    def __init__(self, ip: str, name: str) -> None:
        from ..rdmacm import CMEventChannel
        from ..verbs_api import add_device
        self.dev = add_device(ip, name=name, live=False, mtu=1500)
        self.name = name
        self.ch = CMEventChannel()
        self.sent: list[tuple[Any, bytes, int]] = []  # (packet, bytes, UDP sport)
        self.all: list[tuple[bytes, int]] = []  # everything sent, in order

    def start(self) -> None:
        def transmit(data: bytes, dst: bytes, sport: int, tos: int = 0) -> None:
            self.sent.append((parse(bytes(data)), bytes(data), sport))
            self.all.append((bytes(data), sport))
        self.dev.transmit = transmit

    def take(self) -> list[tuple[Any, Any, int]]:
        """The MADs sent since the last call: (packet, message, sport)."""
        out = []
        for p, _, sport in self.sent:
            if p.dest_qp == 1:
                try:
                    out.append((p, parse_cm(bytes(p.payload)), sport))
                except Exception:
                    continue
        self.sent.clear()
        return out

    def feed(self, c: CapturedPacket, mad: bytes | None = None) -> None:
        if mad is None:
            self.dev.receive(c.roce, c.src, c.dst, ip_id=c.ip_id, sport=c.sport)
        else:
            self.dev.receive(bytes(build_qp1(mad, psn=c.pkt.psn)), c.src, c.dst,
                             sport=c.sport, verify_icrc=False)

    def event(self, want: int) -> Any:
        """The next event if it is ``want``, else None."""
        from ..rdmacm import CMEvent
        try:
            ev = CMEvent(self.ch, _WAIT)
        except Exception:
            return None
        return ev if ev.event_type == want else None

    def close(self) -> None:
        from ..verbs_api import remove_device
        try:
            self.ch.close()
        finally:
            remove_device(self.name)


def _holds(theirs: Any, ours: Any, rel: Any) -> tuple[bool, bool]:
    """Whether a relation holds in the captured message and in softrdma's."""
    return bool(rel(theirs)), bool(rel(ours))


def _compare(c: CapturedPacket, theirs: Any, ours: tuple[Any, Any, int] | None,
             relations: dict[str, tuple[Any, Any]]) -> FrameVerdict:
    """The verdict on the captured MAD ``theirs`` (frame ``c``) against softrdma's.
    ``relations``: name -> (holds in the capture, holds in softrdma's), checked beside
    the fields (the random IDs are compared by what they must equal)."""
    if ours is None:
        return FrameVerdict(c.index, "cm", "different", c,
                            reason=f"softrdma's CM sent no {theirs.name}")
    p, m, sport = ours
    if m.name != theirs.name:
        return FrameVerdict(c.index, "cm", "different", c, (bytes(p.buf), sport),
                            f"softrdma's CM sent a {m.name}, the capture a {theirs.name}")
    diffs = [(a, getattr(theirs, a), getattr(m, a)) for a in theirs.type.attrs
             if a not in CM_RANDOM and getattr(theirs, a) != getattr(m, a)]
    if bytes(m.private_data) != bytes(theirs.private_data):
        diffs.append(("private_data", f"{len(bytes(theirs.private_data))} bytes",
                      "differs"))
    diffs += [(k, e, g) for k, (e, g) in relations.items() if e != g]
    diffs += [(f, getattr(c.pkt, f), getattr(p, f)) for f in _FRAMING
              if getattr(c.pkt, f) != getattr(p, f)]
    if sport != c.sport:
        diffs.append(("udp_sport", c.sport, sport))
    return FrameVerdict(c.index, "cm", "identical" if not diffs else "different", c,
                        (bytes(p.buf), sport),
                        "; ".join(f"{k}: expected {e!r}, got {g!r}" for k, e, g in diffs),
                        fields=diffs)


def replay_cm(packets: list[CapturedPacket], ip: str, *, device_name: str) -> ReplayResult:
    """softrdma's rdma_cm as the passive side at ``ip`` of the QP1 conversation ``packets``
    (see the module doc). Every MAD the captured side sent gets a verdict."""
    from ..rdmacm import (
        RAI_PASSIVE, AddrInfo, CMID, ConnParam, RDMA_PS_TCP, RDMA_PS_UDP,
    )
    from ..rdmacm import enums as ce
    from ..verbs_api import QPCap, QPInitAttr
    from ..verbs_api.enums import ibv_qp_type

    E = ce.rdma_cm_event_type
    me = ipaddress.ip_address(ip).packed
    mads = _mads(packets)
    first = next(((c, m) for c, m in mads if m is not None and m.name in ("REQ", "SIDR_REQ")
                  and c.dst == me), None)
    if first is None:
        raise ReplayError("QP1: no REQ or SIDR_REQ to this endpoint in the capture: "
                          "softrdma's CM only answers one (the passive side)")
    ps, port = split_service_id(first[1].service_id)
    if ps not in (PortSpace.TCP, PortSpace.UDP):
        raise ReplayError(f"QP1: service ID {first[1].service_id:#x} is not rdma_cm's TCP "
                          "or UDP port space")
    res = ReplayResult(expected=[c for c in packets if c.src == me], evidence=Evidence())
    verdicts: dict[int, FrameVerdict] = {}
    side = _Side(ip, device_name)
    conns: dict[int, dict[str, Any]] = {}  # the active side's comm/request ID -> state
    try:
        lid = CMID(side.ch, port_space=RDMA_PS_UDP if ps == PortSpace.UDP else RDMA_PS_TCP)
        lid.bind_addr(AddrInfo(src=ip, src_service=str(port), flags=RAI_PASSIVE))
        lid.listen()
        side.start()

        reqs = [m for c2, m in mads if m is not None and c2.dst == me
                and m.name in ("REQ", "SIDR_REQ")]
        reps = [m for c2, m in mads if m is not None and c2.src == me
                and m.name in ("REP", "SIDR_REP")]

        def reply_of(req: Any) -> Any:
            """The captured side's reply to ``req`` (what its application accepted with):
            the one naming it, else the one in its place in order."""
            for m2 in reps:
                if m2.name == "REP" and m2.remote_comm_id == getattr(req, "local_comm_id", -1):
                    return m2
                if m2.name == "SIDR_REP" and m2.request_id == getattr(req, "request_id", -1):
                    return m2
            k = next((i for i, r in enumerate(reqs) if r is req), len(reps))
            return reps[k] if k < len(reps) else None

        for c, m in mads:
            if m is None:
                if c.src == me:
                    verdicts[c.index] = FrameVerdict(c.index, "cm", "not judged", c,
                                                     reason="not a CM MAD softrdma parses")
                continue
            if c.dst == me:
                _from_active(side, c, m, conns, reply_of, res, lid, CMID, ConnParam, E,
                             QPInitAttr, QPCap, ibv_qp_type)
                continue
            verdicts[c.index] = _from_passive(side, c, m, conns, E)
        res.verdicts = [verdicts.get(c.index) or FrameVerdict(
            c.index, "cm", "not judged", c, reason="not a MAD of the CM exchange")
            for c in res.expected]
        res.sent = [b for b, _ in side.all]
        res.sports = [sp for _, sp in side.all]
        res.mismatches = [f"cm (frame {v.frame}): {v.reason}" for v in res.verdicts
                          if v.status == "different"] + res.failures
        for st in conns.values():
            cid = st.get("cid")
            if cid is not None:
                try:
                    cid.close()
                except Exception:
                    pass
        lid.close()
        return res
    finally:
        side.close()


def _from_active(side: _Side, c: CapturedPacket, m: Any, conns: dict[int, dict[str, Any]],
                 reply_of: Any, res: ReplayResult, lid: Any, CMID: Any, ConnParam: Any,
                 E: Any, QPInitAttr: Any, QPCap: Any, ibv_qp_type: Any) -> None:
    """A message of the active side's reaches softrdma (rewritten to name its IDs)."""
    if m.name in ("REQ", "SIDR_REQ"):
        key = m.local_comm_id if m.name == "REQ" else m.request_id
        if key in conns:  # a retransmitted REQ: the CM answers it itself
            side.feed(c)
            conns[key]["replies"] = conns[key].get("replies", []) + side.take()
            return
        side.feed(c)
        ev = side.event(E.RDMA_CM_EVENT_CONNECT_REQUEST)
        st: dict[str, Any] = {"req": m, "replies": []}
        conns[key] = st
        if ev is None:
            res.failures.append(f"frame {c.index}: softrdma's CM raised no "
                                f"CONNECT_REQUEST for the {m.name}")
            return
        cid = CMID(ev, listen_id=lid)
        st["cid"] = cid
        rep = reply_of(m)
        if m.name == "REQ":
            cid.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC,
                                     cap=QPCap(max_send_wr=8, max_recv_wr=8)))
            param = None
            if rep is not None:  # what the application accepted with
                param = ConnParam(resources=rep.responder_resources,
                                  depth=rep.initiator_depth, rnr_retry=rep.rnr_retry_count,
                                  flow_control=rep.flow_control, srq=rep.srq)
            cid.accept(param)
        else:
            cid.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_UD,
                                     cap=QPCap(max_send_wr=8, max_recv_wr=8)))
            cid.accept()
        st["replies"] = side.take()
        return
    st = next((s for s in conns.values() if s.get("ours") is not None
               and s["req"].name == "REQ"
               and s["req"].local_comm_id == getattr(m, "local_comm_id", None)), None)
    if st is None:
        res.notes.append(f"frame {c.index}: a {m.name} for no connection softrdma accepted")
        return
    ours = st["ours"]
    if m.name == "RTU":
        side.feed(c, _rewrite(m, remote_comm_id=ours.local_comm_id))
        if side.event(E.RDMA_CM_EVENT_ESTABLISHED) is None:
            res.failures.append(f"frame {c.index}: the RTU did not establish softrdma's "
                                "connection")
    elif m.name == "DREQ":
        st["their_dreq"] = m
        side.feed(c, _rewrite(m, remote_comm_id=ours.local_comm_id,
                              remote_qpn=st["cid"].qpn))
        if side.event(E.RDMA_CM_EVENT_DISCONNECTED) is None:
            res.failures.append(f"frame {c.index}: the DREQ did not disconnect softrdma's "
                                "connection")
        st["cid"].disconnect()  # the application's answer: rdma_disconnect sends the DREP
        st["replies"] = side.take()
    elif m.name == "DREP":
        dreq = st.get("our_dreq")
        if dreq is not None:
            side.feed(c, _rewrite(m, tid=dreq.tid, remote_comm_id=dreq.local_comm_id))
            side.event(E.RDMA_CM_EVENT_DISCONNECTED)
    else:
        side.feed(c, _rewrite(m, remote_comm_id=ours.local_comm_id))
        side.take()


def _from_passive(side: _Side, c: CapturedPacket, m: Any, conns: dict[int, dict[str, Any]],
                  E: Any) -> FrameVerdict:
    """A message the captured passive side sent: softrdma's counterpart compared with it."""
    def pick(st: dict[str, Any], name: str) -> tuple[Any, Any, int] | None:
        for i, r in enumerate(st.get("replies", [])):
            if r[1].name == name:
                return st["replies"].pop(i)
        return None

    if m.name in ("REP", "REJ", "MRA"):
        st = next((s for s in conns.values() if s["req"].name == "REQ"
                   and s["req"].local_comm_id == m.remote_comm_id), None) or next(
            (s for s in conns.values() if s["req"].name == "REQ" and not s.get("answered")),
            None)  # (a REP that names no REQ is judged against the first unanswered one)
        if st is not None:
            st["answered"] = True
        if st is None:
            return FrameVerdict(c.index, "cm", "not judged", c,
                                reason=f"a {m.name} to a REQ the capture does not show")
        ours = pick(st, m.name) or (st["replies"].pop(0) if st["replies"] else None)
        req = st["req"]
        if ours is not None and ours[1].name == "REP":
            st["ours"] = ours[1]
        rel = {} if ours is None or ours[1].name != m.name else {
            "remote_comm_id is the REQ's local_comm_id": _holds(
                m, ours[1], lambda x: x.remote_comm_id == req.local_comm_id),
            "tid is the REQ's": _holds(m, ours[1], lambda x: x.tid == req.tid)}
        return _compare(c, m, ours, rel)
    if m.name == "SIDR_REP":
        st = next((s for s in conns.values() if s["req"].name == "SIDR_REQ"
                   and s["req"].request_id == m.request_id), None) or next(
            (s for s in conns.values() if s["req"].name == "SIDR_REQ"
             and not s.get("answered")), None)
        if st is not None:
            st["answered"] = True
        if st is None:
            return FrameVerdict(c.index, "cm", "not judged", c,
                                reason="a SIDR_REP to a SIDR_REQ the capture does not show")
        ours = pick(st, "SIDR_REP")
        req = st["req"]
        rel = {} if ours is None else {
            "request_id is the SIDR_REQ's": _holds(
                m, ours[1], lambda x: x.request_id == req.request_id),
            "tid is the SIDR_REQ's": _holds(m, ours[1], lambda x: x.tid == req.tid)}
        return _compare(c, m, ours, rel)
    st = next((s for s in conns.values() if s.get("ours") is not None
               and s["req"].local_comm_id == getattr(m, "remote_comm_id", None)), None)
    if st is None:
        return FrameVerdict(c.index, "cm", "not judged", c,
                            reason=f"a {m.name} for a connection softrdma did not accept")
    if m.name == "DREQ":  # the captured side disconnects first: so does softrdma
        try:
            st["cid"].disconnect()
        except Exception as e:
            return FrameVerdict(c.index, "cm", "different", c,
                                reason=f"softrdma could not disconnect: {e}")
        st["replies"] = st.get("replies", []) + side.take()
        ours = pick(st, "DREQ")
        if ours is not None:
            st["our_dreq"] = ours[1]
        rel = {} if ours is None else {
            "remote_comm_id is the REQ's local_comm_id": _holds(
                m, ours[1], lambda x: x.remote_comm_id == st["req"].local_comm_id)}
        return _compare(c, m, ours, rel)
    if m.name == "DREP":
        ours = pick(st, "DREP")
        dreq = next((x for x in [st.get("their_dreq")] if x is not None), None)
        rel = {} if ours is None else {
            "remote_comm_id is the REQ's local_comm_id": _holds(
                m, ours[1], lambda x: x.remote_comm_id == st["req"].local_comm_id)}
        if dreq is not None and ours is not None:
            rel["tid is the DREQ's"] = _holds(m, ours[1], lambda x: x.tid == dreq.tid)
        return _compare(c, m, ours, rel)
    return FrameVerdict(c.index, "cm", "not judged", c,
                        reason=f"softrdma's CM replay does not compare a {m.name}")
