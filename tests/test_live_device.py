"""The embedded default device is alive, as an rxe device is: a verbs program that only
calls verbs gets its completions, across threads, processes and transports.

The programs in ``tests/programs/`` are written as rdma-core's pyverbs tests are, with
only their imports naming softrdma; they run as real processes, with a clean environment.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from softrdma.errors import PyverbsRDMAError
from softrdma.soft.device import SoftDevice
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import (
    CQ, QP, SRQ, CompChannel, Context, QPCap, QPInitAttr, RecvWR, SGE, SrqInitAttr, SrqAttr,
    add_device, remove_device,
)
from softrdma.verbs_api.enums import (
    IBV_EVENT_SRQ_LIMIT_REACHED, IBV_QPT_RC, IBV_SRQ_LIMIT, IBV_SEND_INLINE, IBV_SEND_SIGNALED,
    IBV_SEND_SOLICITED, IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM, IBV_WC_SUCCESS,
    IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
)

from .conftest import ROOT, wait_until as _wait

PROGRAMS = ROOT / "tests" / "programs"
CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=2, max_recv_sge=2,
            max_inline_data=64)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user who has set nothing: no SOFTRDMA_* and no venv on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    env["PATH"] = "/usr/bin:/bin"
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- unmodified programs in real processes ---------------------------------------------------
def test_pyverbs_style_program_gets_completions_and_exits_by_itself():
    p = subprocess.Popen([sys.executable, str(PROGRAMS / "rc_ops.py")], env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert out.startswith("OK softrdma0 "), out + err
    assert "Traceback" not in err and "Exception" not in err


def test_process_exits_promptly_with_no_close():
    """The program prints OK with its context, PD, CQs and QPs still open, then returns
    from main: the interpreter must not hang on the progress thread (hang detection only:
    the bound is far above the few milliseconds an exit takes)."""
    p = subprocess.Popen([sys.executable, str(PROGRAMS / "rc_ops.py")], env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("OK"), line + p.stderr.read()
        rc = p.wait(timeout=15)
    finally:
        p.kill()
    assert rc == 0


@pytest.mark.parametrize("kind", ["rc", "ud"])
def test_two_programs_on_one_host_each_on_the_first_device(kind):
    port = str(_free_port())
    srv = subprocess.Popen([sys.executable, str(PROGRAMS / "two_procs.py"), "server", port,
                            kind], env=clean_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        cli = subprocess.run([sys.executable, str(PROGRAMS / "two_procs.py"), "client", port,
                              kind], env=clean_env(), capture_output=True, text=True,
                             timeout=60)
        sout, serr = srv.communicate(timeout=60)
    finally:
        srv.kill()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert srv.returncode == 0, sout + serr
    gids = {cli.stdout.split()[1], sout.split()[1]}
    assert len(gids) == 2, "the two default devices must have different addresses"
    assert all(g.startswith("0000:0000:0000:0000:0000:ffff:7f00:") for g in gids)


def test_readme_programs_run_as_written():
    """README's programs run as written: the first, pyverbs-shaped one on the live default
    device prints a successful status and the written bytes; the simulated one too."""
    text = (ROOT / "README.md").read_text()
    blocks = text.split("## A first program", 1)[1].split("```python\n")[1:]
    codes = [b.split("```", 1)[0] for b in blocks[:2]]
    outs = []
    for code in codes:
        p = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 0, p.stdout + p.stderr
        outs.append(p.stdout)
    assert outs[0].strip() == "0 b'hello, RDMA'"
    assert "IBV_WC_SUCCESS" in outs[1] and outs[1].strip().endswith("b'hello, RDMA'")


def test_manual_mode_moves_nothing_until_progress():
    code = r"""
from softrdma.verbs_api import Context, get_device_list, get_soft_device
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import QPCap
from softrdma.verbs_api.enums import IBV_WR_RDMA_WRITE
ctx = Context(name=get_device_list()[0].name.decode())
dev = get_soft_device()
assert dev.udp is None and dev.progress_thread is None, "manual: no socket, no thread"
cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
a, b = Endpoint(ctx, "RC", 4096, cap, 16), Endpoint(ctx, "RC", 4096, cap, 16)
connect(a, b, 1, 2); connect(b, a, 2, 1)
a.mr.write(b"x" * 64, 64)
a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 64), 1, remote_offset=0)
assert len(a.cq) == 0 and b.mr.read(64, 0) == bytes(64), "nothing moved by itself"
while dev.progress():
    pass
assert len(a.cq) == 1 and b.mr.read(64, 0) == b"x" * 64
print("manual ok")
"""
    p = subprocess.run([sys.executable, "-c", code], env=clean_env(SOFTRDMA_PROGRESS="manual"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "manual ok" in p.stdout, p.stdout + p.stderr


# -- addresses -------------------------------------------------------------------------------
def test_auto_addressed_device_takes_the_next_free_loopback_address():
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.9.1", 4791))  # "another softrdma process" on the first address
    dev = SoftDevice("t-auto", "127.0.9.1", live=True, auto_address=True)
    try:
        dev.open()
        assert dev.ip == "127.0.9.2"
        assert dev.gid_table[1] == bytes(10) + b"\xff\xff" + bytes([127, 0, 9, 2])
        assert dev.udp is not None and dev.progress_thread.is_alive()
        dev.release()
        assert dev.udp is None and dev.progress_thread is None
    finally:
        dev.detach()
        holder.close()


def test_pinned_address_in_use_is_a_clear_error():
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.9.5", 4791))
    add_device("127.0.9.5", name="t-pinned")
    try:
        with pytest.raises(PyverbsRDMAError) as ei:
            Context(name="t-pinned")
        assert ei.value.error_code == errno.EADDRINUSE
        assert "127.0.9.5" in str(ei.value) and "in use" in str(ei.value)
    finally:
        remove_device("t-pinned")
        holder.close()


# -- every transport and operation, with nothing but verbs calls ----------------------------
@pytest.fixture
def live():
    """A live device of this test's own; closed and removed afterwards."""
    made = []

    def make(ip: str, name: str):
        d = add_device(ip, name=name)
        made.append(name)
        return d

    yield make
    for n in made:
        remove_device(n)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_close_leaves_no_thread_and_no_descriptor(live):
    threads0, fds0 = set(threading.enumerate()), _fds()
    live("127.0.9.10", "t-close")
    ctx = Context(name="t-close")
    dev = ctx.device
    assert dev.progress_thread is not None and dev.progress_thread.is_alive()
    a, b = Endpoint(ctx, "RC", 1 << 16, CAP, 64), Endpoint(ctx, "RC", 1 << 16, CAP, 64)
    connect(a, b, 1, 2)
    connect(b, a, 2, 1)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 8192), 1, remote_offset=0)
    assert _wait(lambda: len(a.cq) == 1)
    ctx.close()
    assert dev.udp is None and dev.progress_thread is None
    assert _wait(lambda: set(threading.enumerate()) <= threads0)
    assert _fds() <= fds0


def test_rc_send_with_imm_inline_and_write_with_imm_over_two_live_devices(live):
    live("127.0.9.21", "t-a")
    live("127.0.9.22", "t-b")
    with Context(name="t-a") as ca, Context(name="t-b") as cb:
        a, b = Endpoint(ca, "RC", 1 << 16, CAP, 64), Endpoint(cb, "RC", 1 << 16, CAP, 64)
        connect(a, b, 7, 9)
        connect(b, a, 9, 7)
        a.mr.write(b"inline!", 7)
        b.post_recv(b.sge(0, 256), 1)
        b.post_recv(b.sge(256, 256), 2)
        a.post_send(IBV_WR_SEND_WITH_IMM, a.sge(0, 7), 3, imm=0x12345678,
                    flags=IBV_SEND_SIGNALED | IBV_SEND_INLINE)
        a.post_send(IBV_WR_RDMA_WRITE_WITH_IMM, a.sge(0, 7), 4, remote_offset=4096, imm=7)
        assert _wait(lambda: len(a.cq) == 2 and len(b.cq) == 2)
        assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS] * 2
        w1, w2 = b.cq.poll_all()
        assert (w1.opcode, w1.imm_data, w1.byte_len) == (IBV_WC_RECV, 0x12345678, 7)
        assert (w2.opcode, w2.imm_data) == (IBV_WC_RECV_RDMA_WITH_IMM, 7)
        assert b.mr.read(7, 0) == b"inline!" and b.mr.read(7, 4096) == b"inline!"


def test_ud_with_address_handles_on_a_live_device(live):
    live("127.0.9.31", "t-ud")
    with Context(name="t-ud") as ctx:
        a, b = Endpoint(ctx, "UD", 1 << 16, CAP, 64), Endpoint(ctx, "UD", 1 << 16, CAP, 64)
        connect(a, b, 1, 2)
        connect(b, a, 2, 1)
        a.mr.write(b"datagram", 8)
        b.post_recv(b.sge(0, 256), 1)
        a.post_send(IBV_WR_SEND, a.sge(0, 8), 2)
        assert _wait(lambda: len(b.cq) == 1 and len(a.cq) == 1)
        (wc,) = b.cq.poll_all()
        assert wc.status == IBV_WC_SUCCESS and wc.byte_len == 40 + 8 and wc.src_qp == a.qp.qp_num
        assert b.mr.read(8, 40) == b"datagram"


def test_srq_and_completion_channel_block_until_the_thread_delivers(live):
    """The main thread blocks in get_cq_event while the peer device's progress thread
    receives: nothing but the device moves the packets."""
    live("127.0.9.41", "t-s1")
    live("127.0.9.42", "t-s2")
    with Context(name="t-s1") as ca, Context(name="t-s2") as cb:
        ch = CompChannel(cb)
        rcq = CQ(cb, 64, None, ch, 0)
        a = Endpoint(ca, "RC", 1 << 16, CAP, 64)
        b = Endpoint(cb, "RC", 1 << 16, CAP, 64)
        srq = SRQ(b.pd, SrqInitAttr(SrqAttr(max_wr=16, max_sge=1)))
        b.qp.close()
        b.qp = QP(b.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=b.cq, rcq=rcq, srq=srq, cap=CAP))
        connect(a, b, 3, 4)
        connect(b, a, 4, 3)
        srq.post_recv(RecvWR(5, 1, [SGE(b.mr.buf, 1024, b.mr.lkey)]))
        rcq.req_notify()
        a.mr.write(b"to the srq", 10)
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 6, flags=IBV_SEND_SIGNALED | IBV_SEND_SOLICITED)
        assert ch.get_cq_event(rcq, timeout=10) is rcq
        rcq.ack_events(1)
        (wc,) = rcq.poll_all()
        assert wc.wr_id == 5 and wc.byte_len == 10 and b.mr.read(10, 0) == b"to the srq"
        # asyncio: a second message, awaited on the channel's fd; taking one of the two
        # receives leaves fewer than the armed limit: an async event, raised in the thread
        srq.post_recv(RecvWR(7, 1, [SGE(b.mr.buf + 1024, 1024, b.mr.lkey)]))
        srq.post_recv(RecvWR(9, 1, [SGE(b.mr.buf + 2048, 1024, b.mr.lkey)]))
        srq.modify(SrqAttr(srq_limit=2), IBV_SRQ_LIMIT)
        rcq.req_notify()
        a.post_send(IBV_WR_SEND, a.sge(0, 10), 8)

        async def wait() -> object:
            return await asyncio.wait_for(ch.wait_async(), 10)

        assert asyncio.run(wait()) is rcq
        rcq.ack_events(1)
        assert rcq.poll_all()[0].wr_id == 7
        ev = cb.get_async_event(block=False)
        assert ev is not None and ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED


def test_sleeping_program_gets_retransmission_done_by_the_device(live):
    """A WRITE to a peer that is not listening yet: the sender's retransmit timer fires in
    the progress thread while the program sleeps, and the retry succeeds once the peer is
    ready. rxe's timer for timeout=8 is 4.096 us * 2^8 ~ 1 ms."""
    live("127.0.9.51", "t-r1")
    live("127.0.9.52", "t-r2")
    with Context(name="t-r1") as ca, Context(name="t-r2") as cb:
        a, b = Endpoint(ca, "RC", 1 << 16, CAP, 64), Endpoint(cb, "RC", 1 << 16, CAP, 64)
        connect(a, b, 1, 2, timeout=8)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 100), 1, remote_offset=0)  # b is in RESET
        time.sleep(0.05)
        assert len(a.cq) == 0
        connect(b, a, 2, 1)
        assert _wait(lambda: len(a.cq) == 1)
        assert a.cq.poll_all()[0].status == IBV_WC_SUCCESS
        # the one-packet WRITE went out at least twice: the first copy was dropped by b
        assert ca.device.counters.sent_pkts >= 2
        assert cb.device.counters.drops.get("qp_not_ready", 0) >= 1


def test_a_failed_progress_loop_wakes_every_waiter(live):
    live("127.0.9.61", "t-fail")
    with Context(name="t-fail") as ctx:
        ch = CompChannel(ctx)
        cq = CQ(ctx, 16, None, ch, 0)
        dev = ctx.device
        dead = RuntimeError("selector broke")

        def boom(*a, **k):
            raise dead
        dev.progress_thread._sel.select = boom
        dev.progress_thread._wake()
        result = {}

        def waiter():
            try:
                ch.get_cq_event(cq)
            except PyverbsRDMAError as e:
                result["err"] = e

        t = threading.Thread(target=waiter)
        t.start()
        t.join(10)
        assert not t.is_alive(), "a waiter on a dead device must not block forever"
        assert result["err"].error_code == errno.EIO and "t-fail" in str(result["err"])
        assert dev.fatal is dead
        with pytest.raises(PyverbsRDMAError) as ei:
            cq.poll()
        assert ei.value.error_code == errno.EIO


def test_the_progress_thread_leaves_the_socket_to_a_polling_application(udp_devices,
                                                                        monkeypatch):
    """After an application's CQ poll the progress thread does not read the socket for
    POLL_GRACE (made long here): a packet that arrives meanwhile waits for the
    application's next poll, which reads it on its own thread (no hand-off)."""
    from softrdma.soft import progress
    monkeypatch.setattr(progress, "POLL_GRACE", 30.0)
    da = udp_devices("127.0.17.9", "sb-a")  # live: each with its progress thread
    db = udp_devices("127.0.17.10", "sb-b")
    a = Endpoint(Context(name=da.name), "RC", 1 << 16, CAP, 64)
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 64)
    connect(a, b, 100, 200, timeout=18)
    connect(b, a, 200, 100, timeout=18)
    db.poll_nowait()  # the application polls b's device ...
    time.sleep(2 * progress.MAX_SLEEP)  # ... and b's thread re-plans its wait
    before = db.counters.rcvd_pkts
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 64), 1, remote_offset=4096)
    time.sleep(0.3)  # ample for a thread that reads in milliseconds
    assert db.counters.rcvd_pkts == before  # the thread stood back
    db.poll_nowait()  # the application's next poll reads it
    assert db.counters.rcvd_pkts == before + 1
    assert _wait(lambda: len(a.cq) == 1)
    a.close(), b.close()
