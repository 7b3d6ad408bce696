"""Descriptors are finite: a device must keep working in a process that already has many
open (numbers above 1,024, which ``select`` cannot watch) and when the process runs out
(``ulimit -n``): the source-port sockets form a pool bounded by the limit, and a socket that
cannot be had degrades to sending from port 4791 instead of failing.

Both run in a child process so the limits and descriptors they use never leak into the
test session.
"""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT

_COMMON = r"""
import os, resource, time
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import Context, QPCap, add_device
from softrdma.verbs_api.enums import IBV_WR_RDMA_WRITE
CAP = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)

def wait(cond, timeout=30):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)

def pairs(n, ca, cb):
    out = []
    for i in range(n):
        a, b = Endpoint(ca, "RC", 4096, CAP, 8), Endpoint(cb, "RC", 4096, CAP, 8)
        connect(a, b, 1, 2); connect(b, a, 2, 1)
        out.append((a, b))
    return out

def nfds():
    return len(os.listdir("/proc/self/fd"))
"""

_HIGH_FDS = _COMMON + r"""
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
hold = [os.pipe() for _ in range(600)]          # 1,200 descriptors: the next ones are > 1024
add_device("127.0.12.1", name="hi-a"); add_device("127.0.12.2", name="hi-b")
ca, cb = Context(name="hi-a"), Context(name="hi-b")
assert ca.device.udp.fileno() > 1024, ca.device.udp.fileno()
((a, b),) = pairs(1, ca, cb)
a.mr.write(b"x" * 100, 100)
a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 100), 1, remote_offset=0)
wait(lambda: len(a.cq) == 1)
assert a.cq.poll_all()[0].status == 0 and b.mr.read(100, 0) == b"x" * 100
assert ca.device.progress_thread.is_alive() and cb.device.progress_thread.is_alive()
print("OK")
"""

_EXHAUST = r"""
LIMIT = 300
resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
add_device("127.0.12.11", name="ex-a"); add_device("127.0.12.12", name="ex-b")
ca, cb = Context(name="ex-a"), Context(name="ex-b")
ps = pairs(400, ca, cb)                        # 400 paths: 400 source ports per direction
for i, (a, b) in enumerate(ps):
    a.mr.write(bytes([i % 256]) * 64, 64)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 64), i, remote_offset=0)
wait(lambda: all(len(a.cq) == 1 for a, _ in ps))
assert all(a.cq.poll_all()[0].status == 0 for a, _ in ps)
assert all(b.mr.read(64, 0) == bytes([i % 256]) * 64 for i, (_, b) in enumerate(ps))
c1, c2 = ca.device.counters, cb.device.counters
pooled = c1.sport_evicted + c2.sport_evicted + c1.sport_fallback + c2.sport_fallback
assert pooled > 0, "the pool never filled: the test proves nothing"
assert len(ca.device.udp.tx) <= LIMIT // 8 and nfds() < LIMIT // 2
open(os.devnull).close()  # the process can still open files
assert ca.device.progress_thread.is_alive() and cb.device.progress_thread.is_alive()
import threading; t = threading.Thread(target=lambda: None); t.start(); t.join()
print("OK", pooled)
"""


def _run(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and p.stdout.startswith("OK"), p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return p.stdout


def test_device_works_when_its_descriptors_are_numbered_above_1024():
    _run(_HIGH_FDS)


def test_descriptor_exhaustion_degrades_to_port_4791_and_nothing_fails():
    _run(_COMMON + _EXHAUST)


def test_a_socket_that_cannot_be_had_falls_back_to_port_4791(monkeypatch):
    """socket() itself failing with EMFILE (not only bind) sends from the main socket,
    re-stamped for port 4791, and is retried later (it is not remembered as busy)."""
    import errno as _errno

    from softrdma.soft import udp as udp_mod
    from softrdma.harness.testing import Endpoint, connect
    from softrdma.verbs_api import Context, QPCap, add_device, remove_device
    from softrdma.verbs_api.enums import IBV_WR_RDMA_WRITE

    add_device("127.0.12.21", name="fb-a")
    add_device("127.0.12.22", name="fb-b")
    try:
        with Context(name="fb-a") as ca, Context(name="fb-b") as cb:
            cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
            a, b = Endpoint(ca, "RC", 4096, cap, 8), Endpoint(cb, "RC", 4096, cap, 8)
            connect(a, b, 1, 2)
            connect(b, a, 2, 1)
            real = udp_mod.socket.socket

            def no_fds(*args, **kw):
                raise OSError(_errno.EMFILE, "Too many open files")
            monkeypatch.setattr(udp_mod.socket, "socket", no_fds)
            a.mr.write(b"y" * 32, 32)
            a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 32), 1, remote_offset=0)
            import time
            end = time.monotonic() + 10
            while len(a.cq) < 1 and time.monotonic() < end:
                time.sleep(0.001)
            monkeypatch.setattr(udp_mod.socket, "socket", real)
            assert a.cq.poll_all()[0].status == 0 and b.mr.read(32, 0) == b"y" * 32
            assert ca.device.counters.sport_fallback >= 1
            assert not ca.device.udp.busy_ports  # transient: tried again next time
    finally:
        remove_device("fb-a")
        remove_device("fb-b")


def test_the_default_descriptor_limit_is_raised_for_the_pool_and_a_chosen_one_kept(monkeypatch):
    """At the default soft limit (1,024) the pool would hold 128 sockets and 1,000 streaming
    QPs would open and close a socket per packet: the soft limit is raised towards the hard
    one, as far as the pool wants. A soft limit someone chose (any other value) is kept."""
    from softrdma.soft import udp as udp_mod

    calls = []
    limits = {"now": (1024, 1 << 20)}
    monkeypatch.setattr(udp_mod.resource, "getrlimit", lambda _r: limits["now"])

    def setrlimit(_r, value):
        calls.append(value)
        limits["now"] = value
    monkeypatch.setattr(udp_mod.resource, "setrlimit", setrlimit)
    want = udp_mod.TX_POOL * udp_mod.TX_POOL_SHARE
    assert udp_mod._descriptor_limit() == want and calls == [(want, 1 << 20)]
    assert udp_mod.TX_POOL >= 1000  # 1,000 QPs' source ports fit the pool
    limits["now"] = (1024, 4000)  # the hard limit caps the raise
    assert udp_mod._descriptor_limit() == 4000 and calls[-1] == (4000, 4000)
    calls.clear()
    limits["now"] = (300, 1 << 20)  # `ulimit -n 300`: respected
    assert udp_mod._descriptor_limit() == 300 and calls == []
    limits["now"] = (1024, 1024)  # nothing to raise to
    assert udp_mod._descriptor_limit() == 1024 and calls == []
