"""The socket layer's protocol (softrdma.socket.conn) as a model checks it: two
connections over the simulated network (softrdma.harness.sim) with seeded loss,
duplication and reordering, messages both ways at once, few receive slots and a small
memory limit so credits and back-pressure are exercised. Whatever hypothesis picks:

* no deadlock: the run finishes before the virtual deadline, with nothing stuck;
* exactly once, in order: each side receives precisely the messages the other sent;
* no overrun: credits never go below zero, a side never sends a record the peer has no
  slot for (the peer's count of records received never exceeds the slots it granted);
* bounded memory: bytes held per connection stay within the limit plus one message.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from softrdma.harness.sim import SimNetwork
from softrdma.rdmacm import (
    RAI_PASSIVE, AddrInfo, CMEvent, CMEventChannel, CMID,
)
from softrdma.rdmacm import enums as ce
from softrdma.socket.conn import Connection, Hub, Options

E = ce.rdma_cm_event_type
A_IP, B_IP = "10.99.0.1", "10.99.0.2"


class Side:
    def __init__(self, conn: Connection, to_send: list[bytes]) -> None:
        self.conn = conn
        self.to_send = list(to_send)
        self.got: list[bytes] = []
        self.peak_held = 0


def next_event(net: SimNetwork, ch: CMEventChannel, timeout: float = 120.0) -> CMEvent:
    assert net.run_until(lambda: ch.channel.pending() > 0, timeout), "no CM event"
    return CMEvent(ch, 0)


def connect(net: SimNetwork, opts: Options, made: list
            ) -> tuple[Connection, Connection, list]:
    sch, cch = CMEventChannel(), CMEventChannel()
    made += [cch, sch]
    lid = CMID(sch)
    made.insert(0, lid)
    lid.bind_addr(AddrInfo(src=B_IP, src_service="7000", flags=RAI_PASSIVE))
    lid.listen()
    cid = CMID(cch)
    cid.resolve_addr(AddrInfo(src=A_IP, dst=B_IP, dst_service="7000"))
    assert CMEvent(cch, 0).event_type == E.RDMA_CM_EVENT_ADDR_RESOLVED
    cid.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT, opts.ack_timeout)
    cid.resolve_route()
    assert CMEvent(cch, 0).event_type == E.RDMA_CM_EVENT_ROUTE_RESOLVED
    ca = Connection(Hub(cid.context, None), cid, opts)
    cid.connect(ca.conn_param())
    ev = next_event(net, sch)
    assert ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
    child = CMID(ev, listen_id=lid)
    child.set_option(ce.RDMA_OPTION_ID, ce.RDMA_OPTION_ID_ACK_TIMEOUT, opts.ack_timeout)
    cb = Connection(Hub(child.context, None), child, opts)
    cb.save_conn_data(ev.private_data)
    child.accept(cb.conn_param())
    ev = next_event(net, cch)
    assert ev.event_type == E.RDMA_CM_EVENT_ESTABLISHED, ev.event_str()
    ca.save_conn_data(ev.private_data)
    ca.established = True
    ev = next_event(net, sch)
    assert ev.event_type == E.RDMA_CM_EVENT_ESTABLISHED, ev.event_str()
    cb.established = True
    return ca, cb, [lid, sch, cch]


def work(sides: list[Side]) -> None:
    for s in sides:
        c = s.conn
        c.hub.progress()
        while s.to_send and c.tx_backlog() < 2:
            c.queue_message(s.to_send.pop(0), more=False)
        while (m := c.take()) is not None:
            s.got.append(bytes(m.data))
        s.peak_held = max(s.peak_held, c.held)
        # no overrun, ever
        assert c.credits >= 0 and c.error is None, c.error
        assert c.received <= c.granted


messages = st.lists(st.sampled_from([0, 1, 100, 1000, 3000, 20000]), min_size=1, max_size=25)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), loss=st.sampled_from([0.0, 0.02, 0.08]),
       dup=st.sampled_from([0.0, 0.05]), reorder=st.sampled_from([0.0, 0.05]),
       a_sizes=messages, b_sizes=messages, slots=st.sampled_from([2, 3, 8]))
def test_credits_acks_and_reads_under_loss_duplication_and_reordering(
        seed, loss, dup, reorder, a_sizes, b_sizes, slots):
    opts = Options(slots=slots, inline_max=512, mem_limit=8192)
    with SimNetwork(seed=seed, loss=loss, duplicate=dup, reorder=reorder) as net:
        net.add_device(A_IP)
        net.add_device(B_IP)
        made: list = []
        try:
            run(net, opts, a_sizes, b_sizes, made)
        finally:
            for c in made:
                c.close()


def run(net: SimNetwork, opts: Options, a_sizes: list[int], b_sizes: list[int],
        made: list) -> None:
    if True:
        ca, cb, closers = connect(net, opts, made)
        a_msgs = [bytes([i % 251]) * n for i, n in enumerate(a_sizes)]
        b_msgs = [bytes([(i * 7) % 251]) * n for i, n in enumerate(b_sizes)]
        sides = [Side(ca, a_msgs), Side(cb, b_msgs)]

        def done() -> bool:
            work(sides)
            return sides[0].got == b_msgs and sides[1].got == a_msgs and \
                ca.idle_tx() and cb.idle_tx()
        end = net.now + 900.0
        while not done():
            assert net.step(), "deadlock: nothing left to happen and the run is not over"
            assert net.now < end, "no progress within 900 virtual seconds"
        # exactly once, in order (done() compared the lists); memory stayed bounded
        for s in sides:
            assert s.peak_held <= opts.mem_limit + 20000
        ca.release()
        cb.release()
