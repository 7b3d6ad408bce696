"""No REQ, however malformed, stops a listening device or leaves rdma_cm inconsistent:
hostile CM requests (hypothesis-mutated fields of a real REQ from ucmatose.pcap, and
private data that is no cma header) are answered with a CONNECT_REQUEST the consumer can
accept or reject, or with a REJ, and the MAD handler never fails."""

from __future__ import annotations

import ipaddress

from hypothesis import HealthCheck, given, settings, strategies as st

from softrdma.cm.messages import REQ, build_cm, parse_cm
from softrdma.cm.qp1 import build_qp1
from softrdma.errors import PyverbsRDMAError
from softrdma.harness.replay import load_capture
from softrdma.rdmacm import RAI_PASSIVE, AddrInfo, CMEvent, CMEventChannel, CMID
from softrdma.rdmacm import enums as ce
from softrdma.verbs_api import QPCap, QPInitAttr, add_device, remove_device
from softrdma.verbs_api.enums import ibv_qp_type
from softrdma.wire.packet import parse

from .conftest import PCAPS

E = ce.rdma_cm_event_type
SERVER = "10.77.0.11"
_REQ = next(cp for cp in load_capture(str(PCAPS / "ucmatose.pcap")) if cp.pkt.dest_qp == 1)
REQ_MSG = parse_cm(_REQ.pkt.payload)
#: fields worth breaking, with their widths
FIELDS = {name: REQ.layout.offsets()[name][2] for name in (
    "service_id", "local_qpn", "responder_resources", "initiator_depth", "transport_type",
    "starting_psn", "retry_count", "path_mtu", "rnr_retry_count", "max_cm_retries", "srq",
    "extended_transport", "primary_local_gid", "primary_remote_gid", "primary_flow_label",
    "primary_hop_limit", "primary_local_ack_timeout", "primary_local_lid", "alt_local_lid",
    "local_cm_response_timeout", "remote_cm_response_timeout", "local_ca_guid")}


def mutated_req(changes: dict, private: bytes | None, comm_id: int) -> bytes:
    vals = {a: getattr(REQ_MSG, a) for a in REQ.attrs}
    for name, v in changes.items():
        bits = FIELDS[name]
        vals[name] = v.to_bytes(bits // 8, "big") if bits == 128 else v & ((1 << bits) - 1)
    vals["local_comm_id"] = comm_id
    pd = bytes(REQ_MSG.private_data) if private is None else private
    return build_cm(REQ, tid=REQ_MSG.tid, private_data=pd, **vals)


field_values = st.dictionaries(st.sampled_from(sorted(FIELDS)),
                               st.integers(min_value=0, max_value=(1 << 128) - 1), max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=field_values, private=st.none() | st.binary(max_size=92),
       accept=st.booleans())
def test_hostile_requests_never_break_the_listener(changes, private, accept):
    dev = add_device(SERVER, name="hostile", live=False, mtu=1500)
    sent = []
    ch = CMEventChannel()
    try:
        lid = CMID(ch)
        lid.bind_addr(AddrInfo(src=SERVER, src_service="7471", flags=RAI_PASSIVE))
        lid.listen()
        dev.transmit = lambda data, dst, sport: sent.append(parse(bytes(data)))
        mad = mutated_req(changes, private, 0x1234)
        dev.receive(bytes(build_qp1(mad)), ipaddress.ip_address("10.77.0.12").packed,
                    ipaddress.ip_address(SERVER).packed, sport=55410, verify_icrc=False)
        assert dev.counters.gsi_handler_errors == 0
        answers = [parse_cm(p.payload).name for p in sent if p.dest_qp == 1]
        if ch.channel.pending():
            ev = CMEvent(ch, 0)
            assert ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
            assert answers == []  # the MRA is delayed: nothing goes out yet
            c = CMID(ev, listen_id=lid)
            if accept:
                try:
                    c.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, cap=QPCap()))
                    c.accept()
                except PyverbsRDMAError:
                    pass  # e.g. a path MTU no QP takes: the error is the caller's to see
            else:
                c.reject(b"no")
            c.close()
        else:  # refused: a REJ (28: bad cma header or address; 8: no such service)
            assert answers == ["REJ"], answers
            rej = parse_cm(sent[-1].payload)
            assert rej.reason in (8, 10, 28) and rej.remote_comm_id == 0x1234
        assert dev.counters.gsi_handler_errors == 0 and dev.fatal is None
        lid.close()
    finally:
        ch.close()
        remove_device("hostile")
