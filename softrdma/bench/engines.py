"""``softrdma bench engines``: the protocol engines alone: RC WRITE and SEND over the in-memory simulated
link (no sockets, no loss), in one process. Prints messages/s and MB/s per case, with
bare ``zlib.crc32`` over the same bytes in the same run as the baseline (the one cost a
software RoCE stack cannot avoid per byte)."""

from __future__ import annotations

import time
import zlib

from ..enums import IBV_SEND_SIGNALED, IBV_WR_RDMA_WRITE, IBV_WR_SEND
from ..harness.sim import SimNetwork
from ..harness.testing import connected_pair
from ..verbs_api import QPCap

__all__ = ["run_engine_bench"]


def _run_case(opcode: int, size: int, seconds: float) -> tuple[float, float]:
    net = SimNetwork(seed=0, delay=0.0)
    cap = QPCap(max_send_wr=512, max_recv_wr=512, max_send_sge=1, max_recv_sge=1)
    a, b = connected_pair(net, "RC", mr_size=max(1 << 20, 2 * size), cap=cap, cqe=8192,
                          mtu=9000 if size > 4096 else 1500)
    batch = 64 if size <= 4096 else 8
    msgs = 0
    t0 = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for i in range(batch):
            if opcode == IBV_WR_SEND:
                b.post_recv(b.sge(0, size), wr_id=i)
            flags = IBV_SEND_SIGNALED if i == batch - 1 else 0
            a.post_send(opcode, a.sge(0, size), wr_id=i, flags=flags,
                        remote_offset=0 if opcode == IBV_WR_RDMA_WRITE else None)
        net.run()
        wcs = a.cq.poll_all()
        if opcode == IBV_WR_SEND:
            b.cq.poll_all()
        if not wcs or wcs[-1].status != 0:
            raise RuntimeError(f"benchmark transfer failed: {wcs[-1:]}")
        msgs += batch
    a.close()
    b.close()
    return msgs / elapsed, msgs * size / elapsed / 1e6


def run_engine_bench(seconds: float = 2.0) -> dict[str, tuple[float, float]]:
    out = {}
    data = bytes(65536)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.5:
        zlib.crc32(data)
        n += 1
    crc_mbs = n * len(data) / (time.perf_counter() - t0) / 1e6
    print(f"softrdma engine benchmark: RC over the in-memory link, one process, {seconds:.1f} s per row")
    print(f"{'case':<22}{'msgs/s':>12}{'MB/s':>10}")
    for name, op, size in (("RC WRITE 64 B", IBV_WR_RDMA_WRITE, 64),
                           ("RC WRITE 64 KiB", IBV_WR_RDMA_WRITE, 65536),
                           ("RC SEND 64 B", IBV_WR_SEND, 64),
                           ("RC SEND 64 KiB", IBV_WR_SEND, 65536)):
        r = _run_case(op, size, seconds)
        out[name] = r
        print(f"{name:<22}{r[0]:>12,.0f}{r[1]:>10.1f}")
    print(f"{'baseline: zlib.crc32':<22}{'':>12}{crc_mbs:>10.1f}  (one pass over the bytes)")
    print("64 KiB cases use a 9000-byte link MTU (path MTU 1024 either way: IBV_MTU_1024)")
    return out
