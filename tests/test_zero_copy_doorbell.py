"""Zero copy meets doorbell batching: a packet that holds a view of an MR (a payload of at
least ZERO_COPY_MIN bytes) leaves within the device-lock hold that computed its ICRC, so a
post never defers it to a later flush, where the application may already have reused the
buffer (docs/wire.md, "Zero copy"); small packets, copied into the packet, still wait."""

from __future__ import annotations

from softrdma.verbs_api import SendWR
from softrdma.enums import IBV_WR_RDMA_WRITE
from softrdma.wire.iov import ZERO_COPY_MIN

from .conftest import wait_until
from .test_doorbell import SIGNALED, _Driver, _pair

SIZE = 4096
assert SIZE >= ZERO_COPY_MIN


def test_a_post_of_views_is_sent_before_post_send_returns(udp_devices):
    """A polling program (whose posts to a busy QP may defer) posts 4 KiB WRITEs: each
    leaves before its post_send returns (nothing pending, no deferral), while a 64-byte
    WRITE after them, copied into its packet, is deferred as before; all land."""
    da, db, a, b = _pair(udp_devices, 10, sender_thread=False)
    assert da.zero_copy
    a.cq.poll(1)  # the program polls: its next posts to a busy QP may wait
    deferred = da.lock.deferrals
    for i in range(4):
        a.mr.write(bytes([i + 1]) * SIZE, SIZE, i * SIZE)
        wr = SendWR(i, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(i * SIZE, SIZE)],
                    send_flags=SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + i * SIZE)
        a.qp.post_send(wr)
        assert da.udp.pending == 0, i
        a.mr.write(b"\xee" * SIZE, SIZE, i * SIZE)  # the buffer reused at once (against
        # the verbs rules): what left is what the ICRC was computed over
    assert da.lock.deferrals == deferred
    wr = SendWR(9, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(5 * SIZE, 64)], send_flags=SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 5 * SIZE)
    a.mr.write(b"\x09" * 64, 64, 5 * SIZE)
    a.qp.post_send(wr)
    assert da.udp.pending == 1 and da.lock.deferrals == deferred + 1
    driver = _Driver(db)
    try:
        assert wait_until(lambda: (da.poll(0.005), len(a.cq))[1] >= 5)
        for i in range(4):
            assert b.mr.read(SIZE, i * SIZE) == bytes([i + 1]) * SIZE, i
        assert b.mr.read(64, 5 * SIZE) == b"\x09" * 64
    finally:
        driver.close()
