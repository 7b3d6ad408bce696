"""The busy-poll window (softrdma.readiness.busy_poll_window / BusyPoll) and the wait of
``softrdma perf``'s loops built on it (Perf.wait_one): how long a waiter polls a CQ before
it sleeps is derived from the turnarounds it measured, and a program that posts and then
waits gets its completion whether the peer answers within the window or long after it.

No timing assertions: the derivation is checked on given inputs, the waits with fake CQs
whose answer comes after a given number of polls or a given delay, and the real tool
with a peer stopped (SIGSTOP) for longer than any window, both ways of the switch
``SOFTRDMA_BUSY_POLL``."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from softrdma.readiness import SPIN_FACTOR, SPIN_MAX, SPIN_MIN, BusyPoll, busy_poll_window
from softrdma.tools.perf.resources import Perf

ROOT = Path(__file__).resolve().parent.parent
_ports = itertools.count(23700)
_ips = (f"127.0.3.{i}" for i in itertools.count(100))


# -- the derivation --------------------------------------------------------------------------

def test_no_history_polls_for_the_fixed_window_of_before():
    """Before any wait was measured, the window is the old fixed one (2 ms)."""
    assert busy_poll_window([]) == SPIN_MAX == 0.002


def test_window_is_a_multiple_of_the_90th_percentile():
    """Answers in 100 us, nine in ten, and the rest in 150 us: poll for 2 x 150 us; one
    outlier of 20 (1.9 ms) is past the percentile and does not move it."""
    waits = [100e-6] * 9 + [150e-6]
    assert busy_poll_window(waits) == pytest.approx(SPIN_FACTOR * 150e-6)
    assert busy_poll_window(waits, factor=3.0) == pytest.approx(450e-6)
    assert busy_poll_window([100e-6] * 19 + [1.9e-3]) == pytest.approx(SPIN_FACTOR * 100e-6)


def test_window_never_below_the_cost_of_a_wake_up():
    """Answers in 1 us would give 2 us of polling: less than a sleep and a wake-up cost,
    so the floor (50 us) is polled."""
    assert busy_poll_window([1e-6] * 5) == SPIN_MIN
    assert busy_poll_window([1e-6], floor=10e-6) == 10e-6


def test_window_capped_and_a_slow_peer_is_not_spun_for():
    """Answers in 400 us: 2 x 400 us, under the 2 ms cap; in 1.5 ms: capped at 2 ms;
    typically later than the cap (a slow peer, 10 ms): spinning would only take a CPU from
    it, so the window drops to the floor."""
    assert busy_poll_window([400e-6] * 3) == pytest.approx(800e-6)
    assert busy_poll_window([1.5e-3] * 3) == SPIN_MAX
    assert busy_poll_window([10e-3] * 3) == SPIN_MIN
    assert busy_poll_window([10e-3] * 3, floor=1e-4, ceiling=5e-3) == 1e-4


def test_busy_poll_adapts_to_the_recent_turnarounds_only():
    """BusyPoll keeps the last ``history`` waits: fast answers shrink the window, a late
    one among them widens it (to the cap), and once a slow peer's waits are half the
    history they decide it; older ones are forgotten."""
    b = BusyPoll(adaptive=True, history=4)
    assert b.window() == SPIN_MAX
    for _ in range(4):
        b.record(100e-6)
    assert b.window() == pytest.approx(SPIN_FACTOR * 100e-6)
    b.record(20e-3)
    assert b.window() == SPIN_MAX  # one late answer of 4: spin as long as allowed
    b.record(20e-3)
    assert b.window() == SPIN_MIN  # median of 2 fast, 2 slow: 10 ms, a slow peer
    for _ in range(4):
        b.record(200e-6)
    assert b.window() == pytest.approx(SPIN_FACTOR * 200e-6)  # fast again: the slow ones are gone
    assert b.waits == [200e-6] * 4


def test_switch_off_keeps_the_fixed_window():
    """adaptive=False (SOFTRDMA_BUSY_POLL=0's default) ignores what it is told."""
    b = BusyPoll(adaptive=False)
    for _ in range(20):
        b.record(100e-6)
    assert b.window() == SPIN_MAX


@pytest.mark.parametrize("value, adaptive", [("0", False), ("1", True), (None, True)])
def test_environment_switch(value, adaptive):
    """SOFTRDMA_BUSY_POLL=0 selects the fixed window for every BusyPoll of the process;
    unset or 1, the derived one."""
    env = {k: v for k, v in os.environ.items() if k != "SOFTRDMA_BUSY_POLL"}
    if value is not None:
        env["SOFTRDMA_BUSY_POLL"] = value
    code = ("from softrdma.readiness import BusyPoll\n"
            "b = BusyPoll()\n"
            "[b.record(1e-4) for _ in range(8)]\n"
            "print(b.window())")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert float(out) == (pytest.approx(SPIN_FACTOR * 1e-4) if adaptive else SPIN_MAX)


# -- Perf.wait_one with fake CQs ------------------------------------------------------------

class _CQ:
    """A CQ whose one completion appears after ``misses`` empty polls, or once
    ``ready`` is set (a peer that answers from another thread)."""

    def __init__(self, misses: int = 0, ready: threading.Event | None = None) -> None:
        self.misses = misses
        self.ready = ready
        self.polls = 0

    def poll(self, n: int):
        self.polls += 1
        if self.ready is not None and not self.ready.is_set():
            return 0, []
        if self.polls <= self.misses:
            return 0, []
        return 1, [SimpleNamespace(status=0, wr_id=7)]


def _waiter(adaptive: bool = True):
    """What Perf.wait_one uses of a Perf: its windows, idle() (counted) and the role."""
    w = SimpleNamespace(busy={}, server=False, sleeps=0)

    def idle(timeout: float = 0.05) -> None:
        w.sleeps += 1
        time.sleep(0.001)  # the device's wait, shortened: the fake CQ has no socket

    w.idle = idle
    w.bad_completion = lambda wc, where: AssertionError(f"bad completion at {where}")
    w.adaptive = adaptive
    return w


def test_wait_one_answer_at_once_records_nothing():
    """A completion already there is returned from the first poll: no window is made."""
    w = _waiter()
    cq = _CQ()
    assert Perf.wait_one(w, cq).wr_id == 7
    assert cq.polls == 1 and w.busy == {}


def test_wait_one_fast_peer_is_polled_for_and_sets_the_window():
    """An answer after a few empty polls is polled for (no sleep while within the
    window) and its wait is recorded: the CQ's window becomes a multiple of it, at most
    the fixed one."""
    w = _waiter()
    cq = _CQ(misses=5)
    assert Perf.wait_one(w, cq).wr_id == 7
    assert cq.polls == 6
    busy = w.busy[id(cq)]
    assert SPIN_MIN <= busy.window() <= SPIN_MAX
    assert len(busy.waits) == 1


@pytest.mark.parametrize("adaptive", [True, False])
def test_wait_one_slow_peer_sleeps_and_still_gets_its_completion(adaptive, monkeypatch):
    """A peer that answers 30 ms later -- far beyond any window (at most 2 ms) -- is not
    spun for all that time: the waiter sleeps (idle) and still returns the completion when
    it comes; after a few such waits the window drops to the floor (a slow peer), and it
    still gets every completion. The same with the switch off (a fixed 2 ms window)."""
    monkeypatch.setattr("softrdma.readiness.BUSY_POLL", adaptive)
    w = _waiter()
    for k in range(3):
        ready = threading.Event()
        cq = _CQ(ready=ready)
        w.busy = {id(cq): w.busy.popitem()[1]} if w.busy else {}
        timer = threading.Timer(0.03, ready.set)
        timer.start()
        try:
            before = w.sleeps
            assert Perf.wait_one(w, cq).wr_id == 7
        finally:
            timer.cancel()
        assert w.sleeps > before  # it slept at least once for this answer
    (busy,) = w.busy.values()
    assert busy.window() == (SPIN_MIN if adaptive else SPIN_MAX)


# -- the real tool, with a peer stopped for longer than any window ---------------------------

def _stutter(pid: int, stop: threading.Event) -> None:
    """Stop the process for 20 ms every 60 ms (a peer that loses its CPU), until told."""
    while not stop.wait(0.04):
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.02)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return


@pytest.mark.parametrize("switch", ["1", "0"])
def test_send_lat_completes_with_a_stuttering_peer(switch):
    """softrdma perf send --lat --check between two processes, the server stopped for
    20 ms at a time throughout: every round trip completes and the data checks, with the
    derived window and with the fixed one (SOFTRDMA_BUSY_POLL=0)."""
    env = {**os.environ, "SOFTRDMA_BUSY_POLL": switch}
    srv_ip, cli_ip, port = next(_ips), next(_ips), str(next(_ports))
    base = [sys.executable, "-m", "softrdma", "perf", "send", "--lat", "-s", "64", "-n", "300",
            "--check", "-p", port]
    srv = subprocess.Popen(base + ["--addr", srv_ip], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    stop = threading.Event()
    t = threading.Thread(target=_stutter, args=(srv.pid, stop), daemon=True)
    try:
        time.sleep(0.5)  # let the server start listening before it is stopped
        t.start()
        cli = subprocess.run(base + ["--addr", cli_ip, srv_ip], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=60)
        stop.set()
        t.join()
        os.kill(srv.pid, signal.SIGCONT)
        sout, serr = srv.communicate(timeout=30)
    finally:
        stop.set()
        if srv.poll() is None:
            os.kill(srv.pid, signal.SIGCONT)
            srv.kill()
            srv.wait()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert srv.returncode == 0, sout + serr
    assert "300 x 64 B messages received intact" in cli.stdout + cli.stderr + sout + serr
