"""``softrdma demo``: the stack end to end on loopback, no configuration.

Two soft devices on 127.0.0.1 and 127.0.0.2 (each on a real UDP socket, port 4791, with its
progress thread) connect an RC QP pair and run every RC operation: SEND, SEND with
immediate, RDMA WRITE, RDMA WRITE with immediate, RDMA READ, FETCH_AND_ADD and
COMPARE_AND_SWAP, checking the data. Every packet is captured to a pcap, which is then
dissected, so you see the RoCEv2 traffic the verbs produced. ``--diagram run.html`` also
draws it: the capture as a sequence diagram, with the QPs going to RTS and every
completion the demo polled as notes on the lanes (docs/diagrams.md).
"""

from __future__ import annotations

import argparse
import os
import secrets
import struct
import tempfile
import time
from typing import Any

from ..enums import (
    IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
)
from ..diagram import Lane, Note, format_for, write
from ..diagram.capture import from_capture
from ..diagram.describe import completion_text
from ..harness.testing import Endpoint, connect
from ..verbs_api import Context, QPCap
from ..wire.dissect import DissectStats, dissect_records, format_record
from ..wire.pcap import read_pcap
from .argtypes import int_range, ip_address
from .common import ToolError, UsageError, add_fault_option, open_device

__all__ = ["add_parser", "run"]

#: the demo's regions are 0x20000 apart in each 1 MiB MR (WRITE at 0x20000, WRITE with
#: immediate at 0x40000, READ into 0x60000, atomics at 0x80000/0x90000)
MAX_SIZE = 0x20000
IMM_SEND = 100  # bytes of the SEND with immediate (fewer when --size is smaller)

#: the help page's text (the module docstring is for readers of the code)
DESCRIPTION = (
    "The stack end to end on loopback, no configuration. Two soft devices on 127.0.0.1 and "
    "127.0.0.2 (each on a real UDP socket, port 4791, with its progress thread) connect an "
    "RC QP pair and run every RC operation: SEND, SEND with immediate, RDMA WRITE, RDMA "
    "WRITE with immediate, RDMA READ, FETCH_AND_ADD and COMPARE_AND_SWAP, checking the "
    "data. Every packet is captured to a pcap, which is then dissected, so you see the "
    "RoCEv2 traffic the verbs produced. --diagram run.html also draws it: the capture as a "
    "sequence diagram, with the QPs going to RTS and every completion the demo polled as "
    "notes on the lanes (docs/diagrams.md).")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run every RC operation between two soft devices on loopback",
                       description=DESCRIPTION)
    p.add_argument("--addrs", nargs=2, type=ip_address, default=["127.0.0.1", "127.0.0.2"],
                   metavar="IP", help="the two devices' addresses, two different local IPs "
                                      "(127.0.0.1 127.0.0.2)")
    p.add_argument("--pcap", help="where to keep the capture (default: a temporary file)")
    p.add_argument("--size", type=int_range(1, MAX_SIZE), default=10000,
                   help=f"message size, 1..{MAX_SIZE} (10000: several MTUs)")
    p.add_argument("--diagram", metavar="FILE",
                   help="also draw the run as a sequence diagram: .html, .svg or .mmd "
                        "(Mermaid)")
    add_fault_option(p)
    p.set_defaults(func=run)


#: what the diagram notes on the lanes besides the packets: (wall-clock time, endpoint,
#: text, kind); wall-clock, because the capture stamps its packets with ``time.time()``
Notes = list[tuple[float, Endpoint, str, str]]


def _wait(ep: Any, n: int, notes: Notes, timeout: float = 10.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while len(ep.cq) < n:
        if time.monotonic() > deadline:
            raise ToolError(f"timed out waiting for {n} completions on {ep.device.name}")
        time.sleep(0.0005)
    wcs = ep.cq.poll(n)[1]
    now = time.time()
    notes.extend((now, ep, completion_text(wc), "completion") for wc in wcs)
    return wcs


def _draw(path: str, pcap: str, notes: Notes) -> None:
    """The capture as a diagram, with the demo's notes on the lanes of their QPs."""
    d = from_capture(pcap)
    d.title = (f"softrdma demo: every RC operation, {len(d.arrows)} packets captured on "
               f"{notes[0][1].device.ip}" if notes else "softrdma demo")
    for t, ep, text, kind in notes:
        lane = Lane(ep.device.ip, ep.qp.qp_num)
        if lane in d.lanes:
            d.notes.append(Note(lane, t, text, kind))
    try:
        write(d, path)
    except OSError as e:
        raise ToolError(f"cannot write the diagram {path}: {e.strerror}") from None


def run(a: argparse.Namespace) -> int:
    if a.addrs[0] == a.addrs[1]:
        raise UsageError(f"argument --addrs: the two devices need two different addresses, not "
                       f"{a.addrs[0]} twice")
    if a.diagram and format_for(a.diagram) is None:
        raise UsageError(f"argument --diagram: {a.diagram}: the suffix names no format (.html, "
                         f".svg or .mmd)")
    if a.pcap:
        # the capture is the first device's ({name} in the path is its name, as for
        # SOFTRDMA_PCAP); it must be writable before any device is up
        pcap = a.pcap.replace("{name}", f"softrdma-{a.addrs[0]}")
        try:
            with open(pcap, "ab"):
                pass
        except OSError as e:
            raise ToolError(f"cannot write the capture {pcap}: {e.strerror}") from None
    else:
        pcap = os.path.join(tempfile.mkdtemp(prefix="softrdma-demo-"), "demo.pcap")
    os.environ.pop("SOFTRDMA_PCAP", None)
    devs = []
    for ip in a.addrs:
        d = open_device(None, ip)
        d.detach()  # re-attach in threaded mode: the demo's devices progress on their own
        d.attach_udp(thread=True, capture=pcap if not devs else None)
        devs.append(d)
    print(f"devices: {devs[0].name} ({devs[0].ip}) and {devs[1].name} ({devs[1].ip}), "
          f"UDP 4791, active MTU {128 << int(devs[0].active_mtu)}")
    cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
    a_ep = Endpoint(Context(name=devs[0].name), "RC", 1 << 20, cap, 256)
    b_ep = Endpoint(Context(name=devs[1].name), "RC", 1 << 20, cap, 256)
    ok = True
    notes: Notes = []
    try:
        # random initial PSNs, as every softrdma tool uses (docs/security.md)
        psn_a, psn_b = secrets.randbits(24), secrets.randbits(24)
        connect(a_ep, b_ep, psn_a, psn_b)
        connect(b_ep, a_ep, psn_b, psn_a)
        notes += [(time.time(), ep, "RTS", "state") for ep in (a_ep, b_ep)]
        print(f"RC QP 0x{a_ep.qp.qp_num:06x} on {devs[0].ip} <-> QP 0x{b_ep.qp.qp_num:06x} on "
              f"{devs[1].ip}, both RTS (path MTU 1024, timeout 14, retry 7/7)")
        n = a.size
        pattern = bytes((i * 31 + 7) & 0xFF for i in range(n))
        a_ep.mr.write(pattern, n, 0)
        steps = []

        def check(name: str, cond: bool, detail: str = "") -> None:
            nonlocal ok
            ok &= cond
            steps.append(f"  {'ok ' if cond else 'BAD'}  {name:<28}{detail}")

        b_ep.post_recv(b_ep.sge(0, n), wr_id=1)
        a_ep.post_send(IBV_WR_SEND, a_ep.sge(0, n), wr_id=10)
        wa, wb = _wait(a_ep, 1, notes), _wait(b_ep, 1, notes)
        check("SEND", wb[0].status == 0 and b_ep.mr.read(n, 0) == pattern,
              f"{wb[0].byte_len} bytes received")
        b_ep.post_recv(b_ep.sge(0, n), wr_id=2)
        a_ep.post_send(IBV_WR_SEND_WITH_IMM, a_ep.sge(0, min(n, IMM_SEND)), wr_id=11,
                       imm=0xC0FFEE)
        _wait(a_ep, 1, notes)
        wb = _wait(b_ep, 1, notes)
        check("SEND with immediate", wb[0].imm_data == 0xC0FFEE, f"imm 0x{wb[0].imm_data:x}")
        a_ep.post_send(IBV_WR_RDMA_WRITE, a_ep.sge(0, n), wr_id=12, remote_offset=0x20000)
        _wait(a_ep, 1, notes)
        check("RDMA WRITE", b_ep.mr.read(n, 0x20000) == pattern, f"{n} bytes at the peer's 0x20000")
        b_ep.post_recv(b_ep.sge(0, 16), wr_id=3)
        a_ep.post_send(IBV_WR_RDMA_WRITE_WITH_IMM, a_ep.sge(0, n), wr_id=13,
                       remote_offset=0x40000, imm=7)
        _wait(a_ep, 1, notes)
        wb = _wait(b_ep, 1, notes)
        check("RDMA WRITE with immediate", wb[0].byte_len == n and b_ep.mr.read(n, 0x40000) == pattern,
              "the receiver got IBV_WC_RECV_RDMA_WITH_IMM")
        a_ep.post_send(IBV_WR_RDMA_READ, a_ep.sge(0x60000, n), wr_id=14, remote_offset=0x20000)
        _wait(a_ep, 1, notes)
        check("RDMA READ", a_ep.mr.read(n, 0x60000) == pattern, f"{n} bytes read back")
        b_ep.mr.write(struct.pack("<Q", 40), 8, 0x80000)
        a_ep.post_send(IBV_WR_ATOMIC_FETCH_AND_ADD, a_ep.sge(0x90000, 8), wr_id=15,
                       remote_offset=0x80000, compare_add=2)
        _wait(a_ep, 1, notes)
        orig = struct.unpack("<Q", a_ep.mr.read(8, 0x90000))[0]
        now = struct.unpack("<Q", b_ep.mr.read(8, 0x80000))[0]
        check("FETCH_AND_ADD", (orig, now) == (40, 42), f"returned {orig}, memory now {now}")
        a_ep.post_send(IBV_WR_ATOMIC_CMP_AND_SWP, a_ep.sge(0x90008, 8), wr_id=16,
                       remote_offset=0x80000, compare_add=42, swap=1000)
        wa = _wait(a_ep, 1, notes)
        now = struct.unpack("<Q", b_ep.mr.read(8, 0x80000))[0]
        check("COMPARE_AND_SWAP", now == 1000 and wa[0].status == 0,
              f"42 == 42, swapped in {now}")
        print("operations:")
        print("\n".join(steps))
        for d in devs:
            c = d.counters
            print(f"{d.name}: sent {c.sent_pkts} packets, received {c.rcvd_pkts}, retries "
                  f"{c.completer_retry_err}, dropped {c.dropped_pkts}")
            if c.faults:  # --fault / SOFTRDMA_FAULTS: what was injected, and where
                print("  injected faults: " + ", ".join(f"{k} {v}" for k, v in
                                                          sorted(c.faults.items())))
    except ToolError:
        raise
    finally:
        a_ep.close()
        b_ep.close()
        for d in devs:
            d.detach()
    stats = DissectStats()
    print(f"capture: {pcap}")
    for rec in dissect_records(read_pcap(pcap), stats):
        line = format_record(rec) if "error" not in rec else str(rec)
        print("  " + line)
        ok &= rec.get("icrc_ok", False)
    print(f"  {stats.summary()}")
    if a.diagram:
        _draw(a.diagram, pcap, notes)
        print(f"diagram: {a.diagram}")
    print("demo: " + ("all operations verified" if ok else "FAILED"))
    return 0 if ok else 1
