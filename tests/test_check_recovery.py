"""softrdma check's loss inference and recovery report, against the truth of a simulated
network.

softrdma's engines (built after rxe's requester, completer and responder) move WRITEs,
READs, atomics and SENDs over softrdma's simulated network with loss, duplication and
reordering, captured at once on the requester's device and on the responder's. Where a
capture sits on the path is then known exactly, and so is what the network lost: a
requester's own capture sees every request it sent (none can be lost before it) and every
response that reached it (none can be lost after it); a responder's capture the other way
round. The inference must place every loss on the side those facts allow, count the NAKs
the responder's own counter counted, and judge both captures clean with no option.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import tracemalloc

import pytest

from softrdma import enums as E
from softrdma.check import check_pcap, check_records
from softrdma.check.report import json_lines, text_lines
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair
from softrdma.soft.capture import PacketCapture
from softrdma.verbs_api.device import remove_device

from . import pcap_mutate as m
from .conftest import ROOT

PROFILES = {"loss": dict(loss=0.06), "dup": dict(loss=0.04, duplicate=0.1, reorder=0.1)}


@dataclasses.dataclass
class Run:
    requester: str  # capture on the requester's device
    responder: str  # capture on the responder's device
    naks_sent: int  # the responder's out_of_seq_request counter (one per NAK, as rxe's)
    requests_lost: int  # request packets the network lost (requester -> responder)
    responses_lost: int


def _run(tmp_path, kind: str, seed: int) -> Run:
    net = SimNetwork(seed=seed, **PROFILES[kind])
    a, b = connected_pair(net, "RC")
    lost = {"req": 0, "resp": 0}
    a_ip = a.device.ip_packed

    def observe(ev) -> None:
        if ev.kind == "send" and not ev.copies and ev.dst in net.devices:
            lost["req" if ev.src == a_ip else "resp"] += 1

    net.observers.append(observe)
    near, far = tmp_path / f"{kind}{seed}.req.pcap", tmp_path / f"{kind}{seed}.resp.pcap"
    a.device.capture = PacketCapture(str(near), clock=lambda: net.now)
    b.device.capture = PacketCapture(str(far), clock=lambda: net.now)
    try:
        for i in range(6):
            b.post_recv(b.sge(i * 4096, 4096), 100 + i)
        n = 0
        for i in range(3):
            a.post_send(E.IBV_WR_RDMA_WRITE, a.sge(0, 8192), i, remote_offset=8192)
            a.post_send(E.IBV_WR_RDMA_READ, a.sge(65536, 8192), 10 + i, remote_offset=0)
            a.post_send(E.IBV_WR_ATOMIC_FETCH_AND_ADD, a.sge(200000 + 8 * i, 8), 20 + i,
                        remote_offset=300000, compare_add=1)
            n += 3
        for i in range(6):
            a.post_send(E.IBV_WR_SEND, a.sge(0, 3000), 30 + i)
            n += 1
        net.run_until(lambda: a.ncomp() >= n, timeout=30)
        net.run(until=net.now + 0.05)
        assert a.ncomp() == n
        naks = b.device.counters.out_of_seq_request
    finally:
        a.device.capture.close()
        b.device.capture.close()
        for e in (a, b):
            e.close()
            with contextlib.suppress(Exception):
                remove_device(e.device.name)
    return Run(str(near), str(far), naks, lost["req"], lost["resp"])


def _rc(result):
    """The recovery of the requester's flow (the one that moved the data)."""
    return max((f for f in result.recovery if f.transport == "RC"),
               key=lambda f: f.good_bytes)


@pytest.mark.parametrize("kind,seed", [("loss", 0), ("loss", 3), ("loss", 7), ("dup", 1),
                                       ("dup", 5)])
def test_losses_are_placed_on_the_side_the_capture_point_allows(tmp_path, kind, seed):
    run = _run(tmp_path, kind, seed)
    assert run.requests_lost + run.responses_lost > 0  # the network did lose packets
    near, far = check_pcap(run.requester), check_pcap(run.responder)
    assert near.violations == [] and far.violations == [], (
        [(v.frame, v.rule, v.message) for v in near.violations + far.violations])
    n, f = _rc(near), _rc(far)
    # the requester's own capture: its requests cannot be lost before it, responses that
    # it captured reached it
    assert n.lost_before["requests"] == 0
    assert n.lost_after["responses"] == 0
    # the responder's: requests it captured reached it, its responses cannot be lost
    # before it
    assert f.lost_after["requests"] == 0
    assert f.lost_before["responses"] == 0
    # holes at the responder are requests the network lost (some losses leave no hole:
    # the last packet of a burst, resent after a timeout, fills nothing). With reordering
    # too, softrdma's datagrams carry no IPv4 ID (Linux sends ID 0 with DF) and a late
    # copy cannot always be told from a lost one: there only the placement is asserted
    if kind == "loss":
        assert f.lost_before["requests"] <= run.requests_lost
    if run.requests_lost:
        assert f.lost_before["requests"] + f.go_backs["timeout"] >= 1
    # every NAK the responder sent leaves its own device
    assert f.naks == run.naks_sent
    assert n.naks <= run.naks_sent


def test_recovery_report_text_and_json(tmp_path):
    """The text paragraph, the per-event lines (in frame order, limited to a stretch) and
    the JSON summary say the same numbers."""
    run = _run(tmp_path, "loss", 3)
    result = check_pcap(run.responder)
    fr = _rc(result)
    assert fr.naks >= 1
    frames = [e.frame for e in fr.events]
    assert frames == sorted(frames)
    text = list(text_lines(result, events=True))
    assert any(line.startswith("  recovery: ") and f"{fr.naks} NAK(s)" in line
               for line in text)
    lo, hi = frames[0], frames[len(frames) // 2]
    listed = [line for line in text_lines(result, events=True, frames=(lo, hi))
              if line.startswith("    frame ")]
    assert listed and all(lo <= int(line.split()[1].rstrip(":")) <= hi for line in listed)
    objs = [json.loads(x) for x in json_lines(result, events=True)]
    summary = next(o["summary"] for o in objs if "summary" in o
                   and o["summary"]["label"] == fr.label)
    assert summary["recovery"]["naks"] == fr.naks
    assert summary["recovery"]["lost_before_capture"] == dict(fr.lost_before)
    events = [o["event"] for o in objs if "event" in o]
    assert len(events) == len(fr.events)
    assert objs[-1]["result"]["flows_with_recovery"] >= 1


def test_goodput_and_time_lost_are_consistent(tmp_path):
    run = _run(tmp_path, "dup", 1)
    fr = _rc(check_pcap(run.requester))
    assert fr.duration > 0 and 0 < fr.time_lost <= fr.duration + 1e-9
    assert abs(fr.goodput - fr.good_bytes / fr.duration) < 1e-6 * fr.goodput
    # the capture moved 3 x 8 KiB WRITEs, 3 x 8 KiB READs, 6 x 3000-byte SENDs (and
    # 3 x 8-byte atomics, which carry no payload): each byte counted once
    assert fr.good_bytes == 3 * 8192 + 3 * 8192 + 6 * 3000


def test_a_clean_capture_reports_no_recovery():
    result = check_pcap(ROOT / "pcaps" / "linux-rxe" / "write_bw.pcap")
    (fr,) = result.recovery
    assert not fr.eventful and fr.text().startswith("no loss; goodput ")
    assert fr.good_bytes == 20 * 8192


def _tiled(times: int) -> bytes:
    """write_bw.pcap repeated ``times`` times, its PSNs and MSNs moved on each time as one
    long conversation would (ICRCs recomputed), timestamps advancing."""
    base = m.load(ROOT / "pcaps" / "linux-rxe" / "write_bw.pcap")
    pk = [m.packet(r) for r in base]
    req = [p.psn for p in pk if p.info.is_request]
    span = (max(req) - min(req) + 1) & 0xFFFFFF
    msns = [p.msn for p in pk if p.msn is not None]
    msn_span = max(msns) - min(msns) + 1 if msns else 0
    dt = base[-1].ts_ns - base[0].ts_ns + 1000
    out = []
    for k in range(times):
        for r, p in zip(base, pk):
            fields = {"psn": (p.psn + k * span) & 0xFFFFFF}
            if p.msn is not None:
                fields["msn"] = (p.msn + k * msn_span) & 0xFFFFFF
            out.append(m.edit([r], 1, ts_ns=r.ts_ns + k * dt, **fields)[0])
    return m.to_bytes(m.renumber(out))


def test_checking_streams_in_bounded_memory(monkeypatch):
    """check_pcap reads a capture as a stream (twice): ten times the capture, about the
    same peak memory (packets are not kept; each flow remembers a window of PSNs, made
    small here so that both captures outgrow it)."""
    from softrdma.check import state

    monkeypatch.setattr(state, "WINDOW", 256)
    small, big = io.BytesIO(_tiled(5)), io.BytesIO(_tiled(100))  # 900 and 18,000 packets
    peaks = []
    for f in (small, big):
        tracemalloc.start()
        result = check_pcap(f)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert result.violations == []
    assert result.packets == 100 * 180
    # (kept whole, the 18,000 packets' requests alone would take several MiB)
    assert peaks[1] < peaks[0] + 1024 * 1024, peaks


def test_check_records_takes_an_iterator():
    recs = m.load(ROOT / "pcaps" / "linux-rxe" / "read_bw.pcap")
    assert check_records(iter(recs)).packets == len(recs) == check_records(recs).packets
