"""What a misbehaving or dying peer can make a ``softrdma.socket`` endpoint spend (issue 26,
points 4 to 6), over real UDP on 127.0.46.x:

* a receiver SIGKILLed while its sender waits for credits in ``send()``: the sender gets
  ConnectionResetError within the documented bound (the keepalive runs in every wait);
* a sender in an endless run (``more=True`` for ever) against ``Receiver(mem_limit)``:
  memory stays bounded, and the sender is refused before it sends past the receiver's
  advertised run limit;
* announced giant messages (NORMAL records forged to announce 1 GiB): the receiver
  allocates nothing, its ``recv`` is not stalled, and both sides get a clear error;
* no reference cycle keeps the buffers of a sender that left (checked with the
  collector disabled).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import weakref

import pytest

from softrdma import socket as rsock
from softrdma.socket import Options, Receiver
from softrdma.socket.record import Record, RecordType
from softrdma.verbs_api import add_device, remove_device

from .conftest import ROOT

ENV = dict(os.environ, PYTHONPATH=str(ROOT))
OPTS = Options()
#: a vanished peer shows after a keepalive's silence plus RC's (retry + 1) transmissions,
#: 4.096 us x 2^ack_timeout apart (docs/socket.md, "Failures": ~2.9 s)
RESET_BOUND = OPTS.keepalive + (OPTS.retry + 1) * 4.096e-6 * (1 << OPTS.ack_timeout)
MiB = 1 << 20


@pytest.fixture
def dev():
    """Devices for this process's ends, removed after the test."""
    made = []

    def make(ip: str, name: str):
        made.append(name)
        return add_device(ip, name=name)
    yield make
    for name in made:
        for _ in range(100):
            try:
                remove_device(name)
                break
            except Exception:
                time.sleep(0.05)


def test_a_sender_blocked_on_credits_notices_its_receiver_killed(dev):
    """Guards issue 26 point 4: the keepalive probe ran only in ``recv``, so a sender
    waiting for credits in ``send()`` when its receiver was SIGKILLed stayed blocked for
    ever. Now every wait on the hub runs it: ConnectionResetError within the bound."""
    code = ("import sys, time; from softrdma import socket as r; "
            "from softrdma.verbs_api import add_device; add_device('127.0.46.1'); "
            "srv = r.create_server(('127.0.46.1', 9460)); print('READY', flush=True); "
            "c, _ = srv.accept(); print('ACCEPTED', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=ENV, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "READY"
        dev("127.0.46.2", "lim-tx")
        s = rsock.socket()
        s.settimeout(60)  # far beyond the bound: a TimeoutError would be the bug
        s.bind(("127.0.46.2", 0))
        s.connect(("127.0.46.1", 9460))
        assert p.stdout.readline().strip() == "ACCEPTED"
        outcome: dict = {}
        blocked = threading.Event()

        def sender() -> None:
            try:
                for i in range(10_000):
                    if i == 2 * OPTS.slots:  # credits spent and the backlog full
                        blocked.set()
                    s.send(b"x" * 100)
            except BaseException as e:
                outcome["error"], outcome["at"] = e, time.monotonic()
        t = threading.Thread(target=sender, daemon=True)
        t.start()
        assert blocked.wait(30)
        time.sleep(1.5)  # the receiver never reads: the sender waits for credits
        assert t.is_alive() and not outcome
        killed = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        t.join(2 * RESET_BOUND + 5)
        assert not t.is_alive(), "send() still blocked after the receiver died"
        assert isinstance(outcome["error"], ConnectionResetError), outcome
        assert outcome["at"] - killed < 2 * RESET_BOUND + 1, (outcome["at"] - killed)
        s.close()
    finally:
        p.kill()
        p.wait(10)
