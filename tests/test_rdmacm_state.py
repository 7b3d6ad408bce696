"""The rdma_cm id's state machine (softrdma.rdmacm.state) against Linux's cma.c.

The transitions are written out here a second time, straight from the ``cma_comp_exch``
call sites (and the few direct assignments) of drivers/infiniband/core/cma.c, not read
back from the code; the table must be exactly these. Then: every state is reachable from
IDLE, a step is refused with EINVAL in every state it does not start from, and real ids
(two soft devices talking over loopback UDP) walk the paths, each step recorded.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from ipaddress import ip_address

import pytest

from softrdma.errors import PyverbsRDMAError
from softrdma.rdmacm import (
    RAI_PASSIVE, AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam, RdmaCmId,
)
from softrdma.rdmacm import enums as ce
from softrdma.rdmacm.addr import AUTO_DEVICES_ENV, route_source
from softrdma.rdmacm.state import TRANSITIONS, next_state
from softrdma.verbs_api import QPCap, QPInitAttr, add_device, remove_device
from softrdma.verbs_api.device import unregister_device
from softrdma.verbs_api.enums import ibv_qp_type

E = ce.rdma_cm_event_type
S_IP, C_IP = "127.0.8.31", "127.0.8.32"
ALL = ["IDLE", "ADDR_QUERY", "ADDR_RESOLVED", "ROUTE_QUERY", "ROUTE_RESOLVED", "CONNECT",
       "DISCONNECT", "ADDR_BOUND", "LISTEN", "DEVICE_REMOVAL", "DESTROYING"]

#: cma.c, read call site by call site: (function, from, to) for each cma_comp_exch, and
#: the direct assignments of a new connection's id, device removal and destroy.
CMA_C = {
    "bind_addr": [("rdma_bind_addr_dst", "IDLE", "ADDR_BOUND")],
    "bind_addr_failed": [("rdma_bind_addr_dst err1", "ADDR_BOUND", "IDLE")],
    "resolve_addr": [("resolve_prepare_src", "ADDR_BOUND", "ADDR_QUERY")],
    "resolve_addr_failed": [("rdma_resolve_addr err", "ADDR_QUERY", "ADDR_BOUND")],
    "addr_resolved": [("addr_handler", "ADDR_QUERY", "ADDR_RESOLVED")],
    "addr_error": [("addr_handler status", "ADDR_RESOLVED", "ADDR_BOUND")],
    "resolve_route": [("rdma_resolve_route", "ADDR_RESOLVED", "ROUTE_QUERY")],
    "resolve_route_failed": [("rdma_resolve_route err", "ROUTE_QUERY", "ADDR_RESOLVED")],
    "route_resolved": [("cma_init_resolve_route_work", "ROUTE_QUERY", "ROUTE_RESOLVED")],
    "route_error": [("cma_query_handler fail", "ROUTE_QUERY", "ADDR_RESOLVED")],
    "set_ib_path": [("rdma_set_ib_path", "ADDR_RESOLVED", "ROUTE_RESOLVED")],
    "set_ib_path_failed": [("rdma_set_ib_path err", "ROUTE_RESOLVED", "ADDR_RESOLVED")],
    "listen": [("rdma_listen", "ADDR_BOUND", "LISTEN")],
    "listen_failed": [("rdma_listen err", "LISTEN", "ADDR_BOUND")],
    "connect": [("rdma_connect_locked", "ROUTE_RESOLVED", "CONNECT")],
    "connect_failed": [("rdma_connect_locked err_state", "CONNECT", "ROUTE_RESOLVED")],
    "conn_request": [("cma_ib_new_conn_id / cma_ib_new_udp_id", "IDLE", "CONNECT")],
    "disconnected": [("cma_ib_handler DREQ/DREP", "CONNECT", "DISCONNECT")],
    # cma_send_device_removal_put: any state but DESTROYING and DEVICE_REMOVAL
    "device_removal": [("cma_send_device_removal_put", s, "DEVICE_REMOVAL")
                       for s in ["IDLE", "ADDR_QUERY", "ADDR_RESOLVED", "ROUTE_QUERY",
                                 "ROUTE_RESOLVED", "CONNECT", "DISCONNECT", "ADDR_BOUND",
                                 "LISTEN"]],
    # destroy_id_handler_unlock: whatever the state was (rdma_destroy_id is called once)
    "destroy": [("destroy_id_handler_unlock", s, "DESTROYING")
                for s in ["IDLE", "ADDR_QUERY", "ADDR_RESOLVED", "ROUTE_QUERY",
                          "ROUTE_RESOLVED", "CONNECT", "DISCONNECT", "ADDR_BOUND", "LISTEN",
                          "DEVICE_REMOVAL"]],
}


def test_state_values_are_cma_priv_h():
    assert [s.name for s in sorted(ce.RdmaCmState)] == ALL
    assert [int(s) for s in sorted(ce.RdmaCmState)] == list(range(11))


def test_the_table_is_cma_c_row_for_row():
    assert set(TRANSITIONS) == set(CMA_C)
    for step, rows in CMA_C.items():
        want = {frm: to for _, frm, to in rows}
        got = {frm.name: to.name for frm, to in TRANSITIONS[step].items()}
        assert got == want, step


def test_every_state_is_reachable_from_idle():
    seen, todo = {"IDLE"}, deque(["IDLE"])
    while todo:
        s = todo.popleft()
        for rows in TRANSITIONS.values():
            for frm, to in rows.items():
                if frm.name == s and to.name not in seen:
                    seen.add(to.name)
                    todo.append(to.name)
    assert seen == set(ALL)


def test_a_step_from_any_other_state_is_einval():
    for step, rows in TRANSITIONS.items():
        for s in ce.RdmaCmState:
            if s in rows:
                assert next_state(step, s) == rows[s]
                continue
            with pytest.raises(PyverbsRDMAError) as ei:
                next_state(step, s, "rdma_x")
            assert ei.value.error_code == errno.EINVAL
            assert s.name in str(ei.value) and "rdma_x" in str(ei.value)


# ---- real ids ------------------------------------------------------------------------------

@pytest.fixture
def devices():
    add_device(S_IP, name="rst-s")
    add_device(C_IP, name="rst-c")
    try:
        yield
    finally:
        for name in ("rst-s", "rst-c"):
            for _ in range(50):
                try:
                    remove_device(name)
                    break
                except PyverbsRDMAError:
                    time.sleep(0.02)


@pytest.fixture
def steps(monkeypatch):
    """Every step an id takes, as (id, step, from, to)."""
    log: list[tuple[RdmaCmId, str, str, str]] = []
    move = RdmaCmId._move

    def spy(self: RdmaCmId, step: str, what: str = "") -> None:
        before = self.state
        move(self, step, what)
        log.append((self, step, before.name, self.state.name))

    monkeypatch.setattr(RdmaCmId, "_move", spy)
    return log


def of(log, cid):
    return [(step, frm, to) for c, step, frm, to in log if c is cid]


def expect(ch: CMEventChannel, want: int, timeout: float = 5.0) -> CMEvent:
    ev = CMEvent(ch, timeout)
    assert ev.event_type == want, (ev.event_str(), ev.status)
    return ev


def rc() -> QPInitAttr:
    return QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, cap=QPCap(max_send_wr=4, max_recv_wr=4))


def test_a_connection_walks_cma_c_paths_on_both_sides(devices, steps):
    sch, cch = CMEventChannel(), CMEventChannel()
    listener = CMID(sch)
    listener.bind_addr(AddrInfo(src=S_IP, src_service="7501", flags=RAI_PASSIVE))
    listener.listen()
    assert of(steps, listener.id) == [("bind_addr", "IDLE", "ADDR_BOUND"),
                                      ("listen", "ADDR_BOUND", "LISTEN")]
    client = CMID(cch)
    client.resolve_addr(AddrInfo(src=C_IP, dst=S_IP, dst_service="7501"))
    expect(cch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
    client.resolve_route()
    expect(cch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
    client.create_qp(rc())
    client.connect(ConnParam())
    req = expect(sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
    server = CMID(req, listen_id=listener)
    assert of(steps, server.id) == [("conn_request", "IDLE", "CONNECT")]
    server.create_qp(rc())
    server.accept()
    expect(cch, E.RDMA_CM_EVENT_ESTABLISHED)
    expect(sch, E.RDMA_CM_EVENT_ESTABLISHED)
    assert server.id.state == client.id.state == ce.RdmaCmState.CONNECT  # no ESTABLISHED
    client.disconnect()
    expect(sch, E.RDMA_CM_EVENT_DISCONNECTED)
    server.disconnect()
    expect(cch, E.RDMA_CM_EVENT_DISCONNECTED)
    assert of(steps, client.id) == [
        ("bind_addr", "IDLE", "ADDR_BOUND"), ("resolve_addr", "ADDR_BOUND", "ADDR_QUERY"),
        ("addr_resolved", "ADDR_QUERY", "ADDR_RESOLVED"),
        ("resolve_route", "ADDR_RESOLVED", "ROUTE_QUERY"),
        ("route_resolved", "ROUTE_QUERY", "ROUTE_RESOLVED"),
        ("connect", "ROUTE_RESOLVED", "CONNECT"), ("disconnected", "CONNECT", "DISCONNECT")]
    assert of(steps, server.id)[-1] == ("disconnected", "CONNECT", "DISCONNECT")
    ids = (client.id, server.id, listener.id)
    for c in (client, server, listener):
        c.close()
    for cid, was in zip(ids, ("DISCONNECT", "DISCONNECT", "LISTEN")):
        assert of(steps, cid)[-1] == ("destroy", was, "DESTROYING")
    sch.close()
    cch.close()


def test_failures_go_back_as_cma_c_undoes_them(devices, steps, monkeypatch):
    ch = CMEventChannel()
    # bind to an address no device holds: back to IDLE
    a = CMID(ch)
    with pytest.raises(PyverbsRDMAError) as ei:
        a.bind_addr(AddrInfo(src="192.0.2.7", flags=RAI_PASSIVE))
    assert ei.value.error_code == errno.ENODEV
    assert of(steps, a.id) == [("bind_addr", "IDLE", "ADDR_BOUND"),
                               ("bind_addr_failed", "ADDR_BOUND", "IDLE")]
    # two REUSEADDR ids on one port, both listening: the second goes back to ADDR_BOUND
    first, second = CMID(ch), CMID(ch)
    for x in (first, second):
        x.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_REUSEADDR, 1)
        x.bind_addr(AddrInfo(src=S_IP, src_service="7502", flags=RAI_PASSIVE))
    first.listen()
    with pytest.raises(PyverbsRDMAError) as ei:
        second.listen()
    assert ei.value.error_code == errno.EADDRINUSE
    assert of(steps, second.id)[-2:] == [("listen", "ADDR_BOUND", "LISTEN"),
                                         ("listen_failed", "LISTEN", "ADDR_BOUND")]
    # a destination no device reaches: ADDR_ERROR, through ADDR_RESOLVED back to ADDR_BOUND.
    # 192.0.2.9 is routed through this host's eth0 (192.0.2.2): by default its route's
    # source gets an interface device (docs/cm.md, "Interface devices"; below), so
    # interface devices are switched off here, leaving the route's source without one
    monkeypatch.setenv(AUTO_DEVICES_ENV, "0")
    c = CMID(ch)
    c.resolve_addr(AddrInfo(dst="192.0.2.9", dst_service="7502"))  # no device on the way
    ev = expect(ch, E.RDMA_CM_EVENT_ADDR_ERROR)
    assert ev.status == -errno.ENETUNREACH
    assert of(steps, c.id)[1:] == [("resolve_addr", "ADDR_BOUND", "ADDR_QUERY"),
                                   ("addr_resolved", "ADDR_QUERY", "ADDR_RESOLVED"),
                                   ("addr_error", "ADDR_RESOLVED", "ADDR_BOUND")]
    monkeypatch.delenv(AUTO_DEVICES_ENV)
    # a REQ that cannot be sent: back to ROUTE_RESOLVED
    d = CMID(ch)
    d.resolve_addr(AddrInfo(src=C_IP, dst=S_IP, dst_service="7502"))
    expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
    d.resolve_route()
    expect(ch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
    d.create_qp(rc())

    def refuse(*a, **kw):
        raise PyverbsRDMAError("no MAD buffer", errno.ENOMEM)

    monkeypatch.setattr(d.id.cdev.service, "connect", refuse)
    with pytest.raises(PyverbsRDMAError) as ei:
        d.connect(ConnParam())
    assert ei.value.error_code == errno.ENOMEM
    assert of(steps, d.id)[-2:] == [("connect", "ROUTE_RESOLVED", "CONNECT"),
                                    ("connect_failed", "CONNECT", "ROUTE_RESOLVED")]
    for x in (a, first, second, c, d):
        x.close()
    ch.close()


def test_the_route_source_of_a_remote_destination_gets_an_interface_device(steps,
                                                                          monkeypatch):
    """The rule that changed the expectation above: with interface devices on (the
    default), the destination 192.0.2.9 resolves on ``softrdma-<route's source>``, a
    device made for the address eth0 holds (192.0.2.2 on this machine), as rping without
    -I finds rxe's device on its netdev; with no route (an isolated runner) it is
    ADDR_ERROR -ENETUNREACH, as on Linux. The device is this test's to forget."""
    monkeypatch.setenv(AUTO_DEVICES_ENV, "1")
    dst = ip_address("192.0.2.9")
    src = route_source(dst)
    ch = CMEventChannel()
    c = CMID(ch)
    try:
        c.resolve_addr(AddrInfo(dst=str(dst), dst_service="7504"))
        if src is None or src.is_loopback:
            assert expect(ch, E.RDMA_CM_EVENT_ADDR_ERROR).status == -errno.ENETUNREACH
            return
        expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
        assert c.id.cdev.device.name == f"softrdma-{src}"
        assert c.id.cdev.ip == str(src)
        assert of(steps, c.id)[1:] == [("resolve_addr", "ADDR_BOUND", "ADDR_QUERY"),
                                       ("addr_resolved", "ADDR_QUERY", "ADDR_RESOLVED")]
    finally:
        c.close()
        ch.close()
        unregister_device(f"softrdma-{src}")


def test_calls_in_the_wrong_state_are_einval_and_change_nothing(devices):
    ch = CMEventChannel()
    cid = CMID(ch)
    S = ce.RdmaCmState

    def refused(call, *args, code=errno.EINVAL):
        before = cid.id.state if cid.id is not None else None
        with pytest.raises(PyverbsRDMAError) as ei:
            call(*args)
        assert ei.value.error_code == code, call
        if code == errno.EINVAL:
            assert cid.id.state == before

    refused(cid.resolve_route)  # IDLE
    refused(cid.connect, ConnParam())
    cid.bind_addr(AddrInfo(src=C_IP, flags=RAI_PASSIVE))
    refused(cid.bind_addr, AddrInfo(src=C_IP, flags=RAI_PASSIVE))  # ADDR_BOUND
    refused(cid.resolve_route)
    cid.resolve_addr(AddrInfo(src=C_IP, dst=S_IP, dst_service="7503"))
    expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
    assert cid.id.state == S.ADDR_RESOLVED
    # cma.c: resolve_prepare_src finds no ADDR_BOUND, and an ADDR_RESOLVED id cannot bind
    refused(cid.resolve_addr, AddrInfo(src=C_IP, dst=S_IP, dst_service="7503"))
    refused(cid.listen)
    refused(cid.connect, ConnParam())
    cid.resolve_route()
    expect(ch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
    refused(cid.resolve_route)  # ROUTE_RESOLVED
    refused(cid.accept)
    core = cid.id
    cid.close()
    assert core.state == S.DESTROYING
    with pytest.raises(PyverbsRDMAError) as ei:
        core.resolve_route()
    assert ei.value.error_code == errno.EBADF
    ch.close()
