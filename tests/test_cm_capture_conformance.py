"""softrdma's rdma_cm against a real one: ``pcaps/linux-rxe/ucmatose.pcap`` (Linux 6.1 rxe,
``ucmatose -c 2 -C 5``) replayed with softrdma standing in for either side.

A manual device takes the captured side's address (MTU 1500, as the lab's NIC); the
captured peer's messages are fed to it and what softrdma sends back is compared with what
the captured side sent, field by field. Fields Linux draws at random (comm IDs, starting
PSNs, the ephemeral port) or that name the host (QPN, CA GUID) are compared by their
relations: the REP names the REQ's comm ID, a TID is the comm ID byte-swapped, the flow
label is ``(sport*31 + dport) & 0xFFFFF``, data PSNs start where the other side's CM
message said. Everything else must be the capture's value exactly."""

from __future__ import annotations

import ipaddress

import pytest

from softrdma.cm.cma import CmaHeader
from softrdma.cm.messages import build_cm, parse_cm
from softrdma.cm.qp1 import QP1_UDP_SPORT, build_qp1
from softrdma.harness.replay import load_capture
from softrdma.rdmacm import (
    RAI_PASSIVE, AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam,
)
from softrdma.rdmacm import enums as ce
from softrdma.rdmacm.addr import flow_label
from softrdma.verbs_api import QPCap, QPInitAttr, add_device, remove_device
from softrdma.verbs_api.enums import ibv_qp_type
from softrdma.wire.packet import parse

from .conftest import PCAPS

E = ce.rdma_cm_event_type
CAP = PCAPS / "ucmatose.pcap"
SERVER, CLIENT = "10.77.0.11", "10.77.0.12"
#: the fields of each message whose value is the capture's, whatever host sends it
RANDOM = {"local_comm_id", "remote_comm_id", "local_ca_guid", "local_qpn", "starting_psn",
          "primary_flow_label", "remote_qpn", "private_data"}


def captured_cm():
    """[(CapturedPacket, CMMessage)] for the CM frames of the capture, in order."""
    return [(cp, parse_cm(cp.pkt.payload)) for cp in load_capture(str(CAP))
            if cp.pkt.dest_qp == 1]


class Side:
    """A manual device standing in for one captured host: what it sends is kept."""

    def __init__(self, ip: str, name: str) -> None:
        self.dev = add_device(ip, name=name, live=False, mtu=1500)
        self.ip = ip
        self.name = name
        self.sent: list[tuple[object, bytes, int]] = []  # (packet, dst ip, UDP sport)
        self.ch = CMEventChannel()

    def start(self) -> None:
        """After the first id opened the device: catch its transmissions."""
        self.dev.transmit = lambda data, dst, sport: self.sent.append(
            (parse(bytes(data)), bytes(dst), sport))

    def cm_sent(self):
        return [(p, parse_cm(p.payload)) for p, _, _ in self.sent if p.dest_qp == 1]

    def feed(self, cp, mad: bytes | None = None) -> None:
        """Deliver a captured CM frame, as captured or with its MAD rewritten."""
        if mad is None:
            self.dev.receive(cp.roce, cp.src, cp.dst, ip_id=cp.ip_id, sport=cp.sport)
        else:
            self.dev.receive(bytes(build_qp1(mad, psn=cp.pkt.psn)), cp.src, cp.dst,
                             sport=cp.sport, verify_icrc=False)

    def event(self, want: int) -> CMEvent:
        ev = CMEvent(self.ch, 5.0)
        assert ev.event_type == want, (ev.event_str(), ev.status)
        return ev

    def close(self) -> None:
        self.ch.close()
        remove_device(self.name)


def same_fields(ours, theirs, skip=RANDOM) -> list[str]:
    """The fields (by name) where two messages of one type differ, minus ``skip``."""
    assert ours.name == theirs.name
    return [f"{a}: ours {getattr(ours, a)!r} != captured {getattr(theirs, a)!r}"
            for a in ours.type.attrs if a not in skip and getattr(ours, a) != getattr(theirs, a)]


def rewrite(msg, **fields) -> bytes:
    vals = {a: getattr(msg, a) for a in msg.type.attrs}
    vals.update(fields)
    return build_cm(msg.type, tid=msg.tid, private_data=bytes(msg.private_data), **vals)


def check_framing(side: Side, captured_pkt) -> None:
    """BTH/DETH/UDP of our QP1 packets as rxe's: P_Key, Q_Key, QPs, AckReq, sport."""
    for p, _, sport in side.sent:
        if p.dest_qp != 1:
            continue
        assert sport == QP1_UDP_SPORT == captured_pkt.sport
        for f in ("opcode", "pkey", "qkey", "src_qp", "ackreq", "payload_len"):
            assert getattr(p, f) == getattr(captured_pkt.pkt, f), f


def rc_attr() -> QPInitAttr:
    return QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, cap=QPCap(max_send_wr=8, max_recv_wr=8))


@pytest.fixture
def cm():
    frames = captured_cm()
    assert [m.name for _, m in frames] == ["REQ", "REQ", "REP", "REP", "RTU", "RTU", "DREQ",
                                           "DREQ", "DREP", "DREP"]
    return frames


def test_softrdma_as_the_active_side(cm):
    """softrdma is ucmatose's client (10.77.0.12): its REQ, RTU and DREP against rxe's."""
    (req_cp, req), (rep_cp, rep), (rtu_cp, rtu) = cm[0], cm[2], cm[4]
    (dreq_cp, dreq), (_, drep) = cm[6], cm[8]
    side = Side(CLIENT, "cap-client")
    try:
        cid = CMID(side.ch)
        cid.resolve_addr(AddrInfo(src=CLIENT, dst=SERVER, dst_service="7471"))
        side.event(E.RDMA_CM_EVENT_ADDR_RESOLVED)
        side.start()
        cid.resolve_route()
        side.event(E.RDMA_CM_EVENT_ROUTE_RESOLVED)
        cid.create_qp(rc_attr())
        cid.connect(ConnParam(resources=1, depth=1, retry=5, rnr_retry=0))  # ucmatose's
        (ours,) = [m for _, m in side.cm_sent()]
        assert same_fields(ours, req) == []
        hdr, cap_hdr = CmaHeader.unpack(ours.private_data), CmaHeader.unpack(req.private_data)
        assert (hdr.src, hdr.dst) == (cap_hdr.src, cap_hdr.dst)
        assert ours.private_data[36:] == req.private_data[36:]  # no user data: zeros
        assert ours.primary_flow_label == flow_label(hdr.sport, 7471)
        assert req.primary_flow_label == flow_label(cap_hdr.sport, 7471)  # and rxe's
        assert ours.local_qpn == cid.qpn and ours.starting_psn == cid.id.seq_num
        assert ours.local_ca_guid == int.from_bytes(side.dev.node_guid, "big")
        assert ours.tid & 0xFFFFFFFF == int.from_bytes(ours.local_comm_id.to_bytes(4, "big"),
                                                       "little")
        check_framing(side, req_cp)

        # rxe's REP, addressed to our comm ID: we answer with an RTU, QP to RTS
        side.sent.clear()
        side.feed(rep_cp, rewrite(rep, remote_comm_id=ours.local_comm_id))
        side.event(E.RDMA_CM_EVENT_ESTABLISHED)
        (our_rtu,) = [m for _, m in side.cm_sent()]
        assert same_fields(our_rtu, rtu) == []
        assert (our_rtu.local_comm_id, our_rtu.remote_comm_id) == (ours.local_comm_id,
                                                                   rep.local_comm_id)
        assert our_rtu.tid == ours.tid and rtu.tid == req.tid  # the REQ's transaction
        a = cid.qp.attr
        # the capture's client data starts at the REP's PSN; its receive side at the REQ's
        assert (a.sq_psn, a.rq_psn, a.dest_qp_num) == (rep.starting_psn, ours.starting_psn,
                                                       rep.local_qpn)
        assert (a.path_mtu, a.timeout, a.retry_cnt, a.rnr_retry) == (req.path_mtu, 19,
                                                                      req.retry_count,
                                                                      rep.rnr_retry_count)
        check_framing(side, rtu_cp)

        # rxe's DREQ (the server disconnects first in the capture): DISCONNECTED, DREP
        side.sent.clear()
        side.feed(dreq_cp, rewrite(dreq, remote_comm_id=ours.local_comm_id,
                                   remote_qpn=cid.qpn))
        side.event(E.RDMA_CM_EVENT_DISCONNECTED)
        cid.disconnect()
        (our_drep,) = [m for _, m in side.cm_sent()]
        assert same_fields(our_drep, drep) == []
        assert our_drep.tid == dreq.tid and drep.tid == dreq.tid  # the DREQ's transaction
        assert (our_drep.local_comm_id, our_drep.remote_comm_id) == (ours.local_comm_id,
                                                                     dreq.local_comm_id)
        cid.close()
    finally:
        side.close()


def test_softrdma_as_the_passive_side(cm):
    """softrdma is ucmatose's server (10.77.0.11): both captured REQs, unchanged, get
    REPs like rxe's; RTUs establish; its DREQs match rxe's."""
    reqs, reps, rtus = cm[0:2], cm[2:4], cm[4:6]
    dreqs, dreps = cm[6:8], cm[8:10]
    side = Side(SERVER, "cap-server")
    try:
        lid = CMID(side.ch)
        lid.bind_addr(AddrInfo(src=SERVER, src_service="7471", flags=RAI_PASSIVE))
        lid.listen()
        side.start()
        conns = []
        for (req_cp, req), (rep_cp, rep) in zip(reqs, reps):
            side.sent.clear()
            side.feed(req_cp)  # the capture's own bytes, ICRC checked
            ev = side.event(E.RDMA_CM_EVENT_CONNECT_REQUEST)
            conn = ev.param
            assert (conn.responder_resources, conn.initiator_depth, conn.retry_count,
                    conn.rnr_retry_count, conn.qp_num) == (req.initiator_depth,
                                                           req.responder_resources,
                                                           req.retry_count,
                                                           req.rnr_retry_count, req.local_qpn)
            c = CMID(ev, listen_id=lid)
            c.create_qp(rc_attr())
            c.accept()  # ucmatose's server: accept(NULL)
            (ours,) = [m for _, m in side.cm_sent()]
            assert same_fields(ours, rep) == []
            assert ours.remote_comm_id == req.local_comm_id == rep.remote_comm_id
            assert ours.tid == req.tid == rep.tid  # the REQ's transaction
            assert (ours.local_qpn, ours.starting_psn) == (c.qpn, c.id.seq_num)
            assert ours.private_data == rep.private_data  # none: zeros
            check_framing(side, rep_cp)
            conns.append((c, ours))
        for (c, ours), (rtu_cp, rtu) in zip(conns, rtus):
            side.feed(rtu_cp, rewrite(rtu, remote_comm_id=ours.local_comm_id))
            side.event(E.RDMA_CM_EVENT_ESTABLISHED)
        for (c, ours), (req_cp, req) in zip(conns, reqs):
            a = c.qp.attr
            # the capture's server data starts at the REQ's PSN (frame 7: 12373315)
            assert (a.sq_psn, a.rq_psn, a.dest_qp_num) == (req.starting_psn, ours.starting_psn,
                                                           req.local_qpn)
            assert (a.timeout, a.retry_cnt, a.rnr_retry, a.path_mtu) == (
                req.primary_local_ack_timeout, req.retry_count, req.rnr_retry_count,
                req.path_mtu)
            assert a.ah_attr.gr.flow_label == req.primary_flow_label
        for (c, ours), (dreq_cp, dreq), (drep_cp, drep), (req_cp, req) in zip(
                conns, dreqs, dreps, reqs):
            side.sent.clear()
            c.disconnect()
            (our_dreq,) = [m for _, m in side.cm_sent()]
            assert same_fields(our_dreq, dreq) == []
            assert (our_dreq.remote_comm_id, our_dreq.remote_qpn) == (req.local_comm_id,
                                                                      req.local_qpn)
            assert our_dreq.tid & 0xFFFFFFFF == int.from_bytes(
                our_dreq.local_comm_id.to_bytes(4, "big"), "little")
            check_framing(side, dreq_cp)
            side.feed(drep_cp, _drep_for(drep, our_dreq))
            side.event(E.RDMA_CM_EVENT_DISCONNECTED)
        for c, _ in conns:
            c.close()
        lid.close()
    finally:
        side.close()


def _drep_for(drep, our_dreq) -> bytes:
    """The captured DREP, answering our DREQ (its TID and our comm ID)."""
    vals = {a: getattr(drep, a) for a in drep.type.attrs}
    vals["remote_comm_id"] = our_dreq.local_comm_id
    return build_cm(drep.type, tid=our_dreq.tid, private_data=bytes(drep.private_data),
                    **vals)


def test_the_capture_holds_what_the_comparison_relies_on(cm):
    """The relations used above hold in the capture itself (so they are rxe's, not ours)."""
    (req_cp, req), (_, rep), (_, rtu) = cm[0], cm[2], cm[4]
    assert ipaddress.ip_address(req_cp.src) == ipaddress.ip_address(CLIENT)
    assert rep.remote_comm_id == req.local_comm_id and rtu.remote_comm_id == rep.local_comm_id
    assert rep.tid == req.tid == rtu.tid
    assert req.tid & 0xFFFFFFFF == int.from_bytes(req.local_comm_id.to_bytes(4, "big"),
                                                  "little")
