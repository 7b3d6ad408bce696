"""The device's timer structure (SoftDevice.timer_changed / next_deadline / fire_timers): a
heap with one live entry per owner, refiled lazily when a timer moves later. These pin its
behaviour with fake owners (anything with ``deadline``, ``closed`` and ``on_timer``) and with
real QP engines; no timing is asserted, only which timers fire and when (virtual time)."""

from __future__ import annotations

import gc
import random
import weakref

from softrdma.enums import IBV_WR_RDMA_WRITE
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair
from softrdma.soft.device import SoftDevice


class Owner:
    """A timer owner as the device sees a QP engine."""

    def __init__(self, dev: SoftDevice, name: str = "") -> None:
        self.dev = dev
        self.name = name
        self.deadline: float | None = None
        self.closed = False
        self.fired: list[float] = []
        self.rearm: float | None = None  # on_timer re-arms at this time if set

    def arm(self, at: float | None) -> None:
        self.deadline = at
        self.dev.timer_changed(self)

    def on_timer(self, now: float) -> None:
        self.fired.append(now)
        self.deadline = self.rearm
        self.rearm = None
        self.dev.timer_changed(self)

    def __repr__(self) -> str:
        return f"Owner({self.name})"


def _dev() -> SoftDevice:
    return SoftDevice("timers", "127.0.0.1")


def test_armed_timer_fires_once_at_its_deadline_not_before():
    d = _dev()
    o = Owner(d)
    o.arm(5.0)
    assert d.next_deadline() == 5.0 and o in d.timer_qps
    assert d.fire_timers(4.999) == 0 and o.fired == []
    assert d.fire_timers(5.0) == 1 and o.fired == [5.0]
    assert d.next_deadline() is None and o not in d.timer_qps
    assert d.fire_timers(100.0) == 0 and o.fired == [5.0]


def test_rearming_earlier_and_later_moves_the_next_deadline_both_ways():
    d = _dev()
    o = Owner(d)
    o.arm(10.0)
    o.arm(3.0)  # earlier
    assert d.next_deadline() == 3.0
    o.arm(7.0)  # later: the early entry is refiled when it reaches the top
    assert d.next_deadline() == 7.0
    assert d.fire_timers(3.0) == 0 and d.fire_timers(6.9) == 0 and o.fired == []
    assert d.fire_timers(7.0) == 1 and o.fired == [7.0]
    assert d.next_deadline() is None


def test_next_deadline_after_one_qps_timer_moves_later_is_the_others():
    d = _dev()
    a, b = Owner(d, "a"), Owner(d, "b")
    a.arm(1.0)
    b.arm(2.0)
    assert d.next_deadline() == 1.0
    a.arm(3.0)  # a's timer pushed out (an ACK arrived): b is now first
    assert d.next_deadline() == 2.0
    assert d.fire_timers(2.5) == 1 and b.fired == [2.5] and a.fired == []
    assert d.next_deadline() == 3.0
    assert d.fire_timers(3.0) == 1 and a.fired == [3.0]


def test_cancelling_removes_the_timer_and_it_never_fires():
    d = _dev()
    a, b = Owner(d, "a"), Owner(d, "b")
    a.arm(1.0)
    b.arm(2.0)
    a.arm(None)
    assert a not in d.timer_qps and d.next_deadline() == 2.0
    assert d.fire_timers(10.0) == 1 and a.fired == [] and b.fired == [10.0]
    a.arm(4.0)  # armed again after a cancel
    assert d.next_deadline() == 4.0 and d.fire_timers(4.0) == 1 and a.fired == [4.0]


def test_a_closed_owner_never_fires_and_does_not_hold_the_next_deadline():
    d = _dev()
    a, b = Owner(d, "a"), Owner(d, "b")
    a.arm(1.0)
    b.arm(2.0)
    a.closed = True  # closed with its timer still set, without telling the device
    assert d.next_deadline() == 2.0
    assert d.fire_timers(5.0) == 1 and a.fired == [] and b.fired == [5.0]
    assert a not in d.timer_qps
    a.arm(3.0)  # a closed owner's timer is not filed at all
    assert a not in d.timer_qps and d.next_deadline() is None


def test_on_timer_rearming_fires_again_at_a_later_call_only():
    d = _dev()
    o = Owner(d)
    o.arm(1.0)
    o.rearm = 1.0  # re-armed for a deadline that is already due
    assert d.fire_timers(1.0) == 1 and o.fired == [1.0]
    assert d.next_deadline() == 1.0
    assert d.fire_timers(1.0) == 1 and o.fired == [1.0, 1.0]
    assert d.next_deadline() is None


def test_owner_still_holding_a_later_timer_after_on_timer_stays_filed():
    """A QP whose RNR timer fired keeps its retransmit timer: on_timer that does not touch
    the deadline (or leaves a later one) must not lose it."""
    d = _dev()

    class Two(Owner):
        def on_timer(self, now: float) -> None:
            self.fired.append(now)
            self.deadline = 9.0  # set without telling the device

    o = Two(d)
    o.arm(1.0)
    assert d.fire_timers(1.0) == 1
    assert o in d.timer_qps and d.next_deadline() == 9.0
    assert d.fire_timers(9.0) == 1 and o.fired == [1.0, 9.0]


def test_many_owners_fire_in_deadline_order_each_once():
    d = _dev()
    rng = random.Random(18)
    owners = [Owner(d, str(i)) for i in range(5000)]
    want = {}
    for o in owners:
        for _ in range(rng.randrange(1, 4)):  # re-armed a few times, earlier or later
            o.arm(rng.uniform(0, 100))
        if rng.random() < 0.2:
            o.arm(None)
        else:
            want[o] = o.deadline
    order: list[Owner] = []
    for o in owners:
        o.on_timer = (lambda now, o=o: (order.append(o), Owner.on_timer(o, now)))
    t = 0.0
    while d.next_deadline() is not None:
        nd = d.next_deadline()
        assert nd == min(o.deadline for o in want if not o.fired)
        t = nd
        d.fire_timers(t)
    assert {o: o.fired for o in owners if o.fired} == {o: [at] for o, at in want.items()}
    assert [want[o] for o in order] == sorted(want.values())
    assert len(d.timer_qps) == 0


def test_stale_entries_are_compacted_and_do_not_keep_closed_qps_alive():
    d = _dev()
    keep = Owner(d, "keep")
    keep.arm(1e9)
    refs = []
    for i in range(1000):
        o = Owner(d, str(i))
        o.arm(1e6 + i)  # far off
        o.arm(None)  # cancelled, as destroy() does
        refs.append(weakref.ref(o))
        del o
    for _ in range(200):  # an ACK-driven retransmit timer, pushed earlier and later
        keep.arm(keep.deadline - 1)
    gc.collect()
    assert d.timers.heap_size <= 2 * len(d.timer_qps) + 66
    assert sum(r() is not None for r in refs) <= 66
    assert d.next_deadline() == keep.deadline


def test_rc_retransmit_timer_on_real_qps_fires_at_its_deadline():
    """A lost request: the retransmit timer fires at exactly the deadline armed when the
    request went out (post time + the QP's timeout), the request is resent and completes,
    and no timer is left afterwards."""
    net = SimNetwork(seed=3)
    a, b = connected_pair(net, "RC")
    dev = a.device
    sends: list[float] = []
    net.observers.append(lambda ev: sends.append(ev.time) if ev.kind == "send" and
                         ev.src == dev.ip_packed else None)
    a.mr.write(b"y" * 64, 64)
    net.profile.loss = 1.0  # the first transmission is lost
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 64), 1, remote_offset=0)
    net.profile.loss = 0.0
    qp = dev.qps[a.qp.qp_num]
    armed = qp.retrans_at
    assert armed is not None and armed > net.now and dev.next_deadline() == armed
    assert qp in dev.timer_qps
    net.run_until(lambda: a.ncomp() > 0, timeout=60)
    assert a.cq.poll_all()[0].status == 0 and b.mr.read(64, 0) == b"y" * 64
    assert sends[1] == armed  # the resend: at the deadline, not before, not later
    assert qp.retrans_at is None and qp not in dev.timer_qps


def test_a_destroyed_qp_with_its_retransmit_timer_armed_leaves_the_timers():
    net = SimNetwork(seed=4)
    a, b = connected_pair(net, "RC")
    dev = a.device
    net.profile.loss = 1.0
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 64), 1, remote_offset=0)
    qp = dev.qps[a.qp.qp_num]
    assert qp in dev.timer_qps and dev.next_deadline() == qp.retrans_at
    a.qp.close()
    assert qp not in dev.timer_qps and dev.next_deadline() is None
    assert dev.fire_timers(net.now + 1e6) == 0


def test_the_timer_heap_stands_alone_and_tells_on_change_each_new_deadline():
    """DeviceTimers needs no device: owners file themselves; ``on_change`` (the progress
    thread's wake-up) hears every deadline armed or moved, not a cancellation."""
    from softrdma.soft.timers import DeviceTimers

    class Solo:
        def __init__(self, t: DeviceTimers) -> None:
            self.t, self.deadline, self.closed, self.fired = t, None, False, []

        def arm(self, at: float | None) -> None:
            self.deadline = at
            self.t.changed(self)

        def on_timer(self, now: float) -> None:
            self.fired.append(now)
            self.deadline = None

    t = DeviceTimers()
    heard: list[float] = []
    t.on_change = heard.append
    a, b = Solo(t), Solo(t)
    a.arm(2.0), b.arm(1.0), a.arm(0.5), b.arm(None)
    assert heard == [2.0, 1.0, 0.5] and list(t.owners) == [a]
    assert t.next_deadline() == 0.5 and t.fire(0.4) == 0
    assert t.fire(0.5) == 1 and a.fired == [0.5] and b.fired == []
    assert t.next_deadline() is None and not t.owners
