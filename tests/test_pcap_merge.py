"""Captures of one conversation taken at several points, merged by time
(softrdma.wire.pcapmerge, ``softrdma dissect A B``): the same packet is matched across
captures, the clock offset between them is found, and what one point saw and another did
not (a loss between them) is listed exactly.

The second capture point is made from a real rxe capture (the client's NIC), the way a
capture elsewhere would differ from it: frames missing, every timestamp on another clock,
and each packet seen later downstream of the first point and earlier upstream of it.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import random
import subprocess
import sys
import tracemalloc

import pytest
from softrdma.bench.capgen import long_capture
from softrdma.enums import IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair
from softrdma.wire.frames import decode_frame, encode_frame
from softrdma.wire.pcap import PcapRecord, PcapWriter
from softrdma.wire.pcapmerge import (
    MergeReport, estimate_offset, merge_captures, seen_not,
)

from . import pcap_mutate as m
from .conftest import PCAPS

CLIENT = "10.77.0.12"  # the capture's own host: write_bw.pcap was taken on its NIC
OFFSET = 3_217_000_000  # the second capture's clock is 3.217 s ahead


def _src(rec: PcapRecord) -> str:
    return decode_frame(rec.data, rec.linktype).src


def _second_point(records, drop, delay_ns, offset_ns=OFFSET):
    """The capture another point would have made of ``records``: frames ``drop`` (1-based
    indexes) never reach it, each frame is stamped ``offset_ns`` + ``delay_ns(rec)``
    later, and the frames are in the order of their new times, renumbered."""
    out = [dataclasses.replace(r, ts_ns=r.ts_ns + offset_ns + delay_ns(r))
           for r in records if r.index not in drop]
    out.sort(key=lambda r: r.ts_ns)
    return m.renumber(out)


def _files(*captures):
    return [io.BytesIO(m.to_bytes(c)) for c in captures]


def _merge(*captures, **kw):
    report = MergeReport()
    return list(merge_captures(_files(*captures), report, **kw)), report


def test_shifted_and_jittered_copy_is_matched_and_its_drops_located():
    """Point B = point A with frames dropped, its clock 3.217 s ahead and up to 20 us of
    timestamp jitter: the offset is found within the jitter, every frame of B is matched
    to A's, and exactly the dropped frames are listed as seen at A and not at B."""
    a = m.load(PCAPS / "write_bw.pcap")
    rnd = random.Random(28)
    drop = set(rnd.sample(range(1, len(a) + 1), 12))
    jitter = {r.index: rnd.randrange(0, 20_000) for r in a}
    b = _second_point(a, drop, lambda r: jitter[r.index])
    out, report = _merge(a, b)
    assert OFFSET <= report.offsets[1].offset_ns <= OFFSET + 20_000
    assert report.matched[1] == len(b) and report.only[1] == 0
    assert len(out) == len(a)
    assert {r.frames[0] for r in seen_not(out, 0, 1)} == drop
    assert list(seen_not(out, 1, 0)) == []
    assert [r.index for r in out] == list(range(1, len(a) + 1))
    assert [r.ts_ns for r in out] == sorted(r.ts_ns for r in out)
    # on capture 0's clock: A's own times, every frame of A once, in time order (the
    # real capture has frames out of order: tcpdump stamps them on several CPUs)
    by_time = sorted(a, key=lambda r: r.ts_ns)
    assert [(r.frames[0], r.ts_ns) for r in out] == [(r.index, r.ts_ns) for r in by_time]
    # B's frames: A's less the drops, in the order of their times at B
    kept = sorted((r for r in a if r.index not in drop), key=lambda r: r.ts_ns + jitter[r.index])
    for r in out:
        if r.frames[1] is not None:
            assert kept[r.frames[1] - 1].index == r.frames[0]


def test_offset_is_the_middle_of_the_interval_the_two_directions_bound():
    """A at the client's NIC, B at the server's: client packets reach B 50..80 us after A,
    server packets reach A 50..80 us after B. The offset lies in [greatest d of server
    packets, least d of client packets] (d = t_B - t_A) and the estimate is its middle,
    so it is off by at most half the delays' spread."""
    a = m.load(PCAPS / "read_bw.pcap")
    rnd = random.Random(5)
    delay = {r.index: rnd.randrange(50_000, 80_001) * (1 if _src(r) == CLIENT else -1)
             for r in a}
    b = _second_point(a, set(), lambda r: delay[r.index])
    _, report = _merge(a, b)
    est = report.offsets[1]
    fwd = min(d for i, d in delay.items() if d > 0)
    rev = max(d for i, d in delay.items() if d < 0)
    assert est.bounded and est.low_ns == OFFSET + rev and est.high_ns == OFFSET + fwd
    assert est.offset_ns == OFFSET + (fwd + rev) // 2
    assert abs(est.offset_ns - OFFSET) <= 15_000
    assert report.matched == [len(a), len(a)]


def test_estimate_offset_from_direction_spreads():
    """Two directions' spreads of d: the lower one bounds the offset from below, the
    upper one from above; one direction alone is not bounded."""
    e = estimate_offset({"ab": (100, 180, 3), "ba": (20, 60, 4)})
    assert (e.low_ns, e.high_ns, e.offset_ns, e.matched, e.bounded) == (60, 100, 80, 7, True)
    one = estimate_offset({"ab": (100, 180, 3)})
    assert not one.bounded and one.offset_ns == 140
    assert estimate_offset({}).matched == 0


def test_network_duplicates_are_matched_in_order():
    """A packet the network duplicated is two packets at every point that saw it: A's
    first copy is matched to B's first, its second to B's second (B sees the client's
    packets 30 us after A, so both of A's copies wait when B's first comes)."""
    a = m.load(PCAPS / "send_bw.pcap")
    assert _src(a[9]) == CLIENT
    a = m.insert(a, 10, a[9], ts_ns=a[9].ts_ns + 2_000)  # frame 11 = a copy of frame 10
    b = _second_point(a, set(), lambda r: 30_000 if _src(r) == CLIENT else -30_000)
    out, report = _merge(a, b)
    assert len(out) == len(a) and report.only == [0, 0]
    dup = [r for r in out if r.frames[0] in (10, 11)]
    assert [(r.frames[0], r.frames[1]) for r in dup] == [(10, 10), (11, 11)]


def test_a_retransmission_is_not_its_original():
    """The original of a packet lost between A and B and its retransmission 1 ms later
    (a new IPv4 ID, so a new ICRC, as rxe sends it) are two packets: B's copy is matched
    to the retransmission, and the original is the one B never saw."""
    a = m.load(PCAPS / "write_bw.pcap")
    orig = a[4]
    f = decode_frame(orig.data, orig.linktype)
    data = encode_frame(bytes(f.payload), src=f.ip_src, dst=f.ip_dst, sport=f.sport,
                        dport=f.dport, ip_id=(f.ip_id + 1000) & 0xFFFF, ttl=f.ttl,
                        eth_src=f.eth_src, eth_dst=f.eth_dst)
    resent = PcapRecord(0, orig.ts_ns + 1_000_000, orig.linktype, data, len(data))
    after = max(r.index for r in a if r.ts_ns <= resent.ts_ns)
    a = m.insert(a, after, resent, ts_ns=resent.ts_ns)
    b = _second_point(a, {5}, lambda r: 40_000)
    out, _ = _merge(a, b)
    assert [r.frames[0] for r in seen_not(out, 0, 1)] == [5]
    assert next(r for r in out if r.frames[0] == after + 1).seen == (0, 1)


def test_three_points_each_with_its_clock():
    """Three points (a NIC, the bridge, the other NIC): each capture's offset to the
    first is found, and each one's drops are located against the first."""
    a = m.load(PCAPS / "read_bw.pcap")
    drop_b, drop_c = {3, 40, 41}, {7, 100}
    b = _second_point(a, drop_b, lambda r: 10_000, offset_ns=-1_500_000_000)
    c = _second_point(a, drop_c, lambda r: 20_000, offset_ns=OFFSET)
    out, report = _merge(a, b, c)
    assert abs(report.offsets[1].offset_ns - (-1_500_000_000 + 10_000)) <= 1
    assert abs(report.offsets[2].offset_ns - (OFFSET + 20_000)) <= 1
    assert {r.frames[0] for r in seen_not(out, 0, 1)} == drop_b
    assert {r.frames[0] for r in seen_not(out, 0, 2)} == drop_c
    assert report.missed[(1, 2)] == len(drop_c - drop_b)


def test_captures_with_nothing_in_common_are_interleaved_unmatched():
    """Two captures of different conversations: no offset can be found (0 is used, and
    the report says so), and every packet is seen by its own point only."""
    a, b = m.load(PCAPS / "write_bw.pcap"), m.load(PCAPS / "send_bw.pcap")
    out, report = _merge(a, b)
    assert report.offsets[1].matched == 0 and "no packet in common" in report.offsets[1].text()
    assert len(out) == len(a) + len(b) and report.only == [len(a), len(b)]
    assert [r.ts_ns for r in out] == sorted(r.ts_ns for r in out)


def _write(path, items, offset_ns):
    with PcapWriter(path, nanosecond=True) as w:
        for ts, frame in items:
            w.write(frame, ts_ns=ts + offset_ns)


def test_merge_memory_does_not_grow_with_the_captures(tmp_path):
    """Past the calibration frames, merging holds only a tolerance window of packets:
    its peak for two 20,000-frame captures is within 256 KiB of its peak for two of
    2,000 (keeping the frames would add tens of MiB)."""
    def peak(n):
        items = list(long_capture(n))
        pa, pb = tmp_path / f"a{n}.pcap", tmp_path / f"b{n}.pcap"
        _write(pa, items, 0)
        _write(pb, items, OFFSET)
        del items
        tracemalloc.start()
        try:
            for _ in merge_captures([pa, pb], calibrate=500):
                pass
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    grow = peak(20_000) - peak(2_000)
    assert grow < 256 * 1024, grow


def test_dissect_two_captures_shows_the_points_and_what_only_one_saw(tmp_path):
    """``softrdma dissect A B``: a column of the points that saw each packet (``A-`` for
    the dropped frames, ``AB`` for the others), then what each point alone saw, and the
    same in JSON (``points``, ``point_frames``, and a last ``merge`` object)."""
    a = m.load(PCAPS / "write_bw.pcap")
    drop = {2, 9, 100}
    b = _second_point(a, drop, lambda r: 25_000)
    pa, pb = tmp_path / "a.pcap", tmp_path / "b.pcap"
    pa.write_bytes(m.to_bytes(a))
    pb.write_bytes(m.to_bytes(b))
    cmd = [sys.executable, "-m", "softrdma", "dissect", str(pa), str(pb)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    frames = [ln for ln in r.stdout.splitlines() if not ln.startswith("#")]
    by_time = sorted(a, key=lambda r: r.ts_ns)  # the merged stream's order (A's clock)
    assert len(frames) == len(a)
    for i, (ln, rec) in enumerate(zip(frames, by_time), 1):
        assert ln.split()[:2] == ["A-" if rec.index in drop else "AB", str(i)]
    merged_no = {rec.index: i for i, rec in enumerate(by_time, 1)}
    listed = ", ".join(f"{merged_no[k]} (A #{k})" for k in sorted(drop, key=merged_no.get))
    assert f"# only at A: 3 packet(s): {listed}" in r.stdout
    assert "# only at B: 0 packet(s)" in r.stdout
    j = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60)
    lines = [json.loads(ln) for ln in j.stdout.splitlines()]
    assert lines[1]["points"] == ["A"] and lines[1]["point_frames"] == [2, None]
    assert lines[-1]["merge"]["only"] == [3, 0]


def test_dissect_names_the_capture_that_cannot_be_read(tmp_path):
    """With several files, a file that is cut short is named in the one-line error (exit
    status 2), not the file that happens to be opened last."""
    bad = tmp_path / "cut.pcap"
    bad.write_bytes((PCAPS / "write_bw.pcap").read_bytes()[:100])  # record 1 cut short
    r = subprocess.run([sys.executable, "-m", "softrdma", "dissect", str(bad),
                        str(PCAPS / "send_bw.pcap")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"softrdma dissect: {bad}: record 1: data truncated")


def _sim_captures(seed: int):
    """Each device's own capture of an RC conversation on softrdma's simulated network
    with 2 % loss and 2 % duplication each way (4 RDMA WRITEs and 4 READs of 64 KiB):
    what each device sent (at its send time) and received (at its arrival time), each
    packet sent under a new IPv4 ID as Linux does. The network's own record of what it
    lost and duplicated comes back with the captures."""
    with SimNetwork(seed=seed, loss=0.02, duplicate=0.02, delay=50e-6) as net:
        a, b = connected_pair(net, "RC")
        pts = (a.device.ip_packed, b.device.ip_packed)
        caps = {p: [] for p in pts}
        ids = {p: itertools.count(1) for p in pts}
        id_of = {}
        lost = {p: [] for p in pts}  # the sender's frame numbers of packets the link lost
        dups = {p: 0 for p in pts}  # extra copies the link made of the packets p sent

        def watch(ev):
            if ev.kind == "send":
                ip_id = next(ids[ev.src])
                caps[ev.src].append((ev.time, ev.src, ev.dst, ev.sport, bytes(ev.data), ip_id))
                for c in ev.copies:
                    id_of[c.seq] = ip_id
                if not ev.copies:
                    lost[ev.src].append(len(caps[ev.src]))
                dups[ev.src] += max(0, len(ev.copies) - 1)
            elif ev.kind == "deliver":
                caps[ev.dst].append((ev.time, ev.src, ev.dst, ev.sport, bytes(ev.data),
                                     id_of.pop(ev.seq)))
        net.observers.append(watch)
        for i in range(4):
            a.post_send(IBV_WR_RDMA_WRITE, a.sge(i * 65536, 65536), wr_id=i,
                        remote_offset=i * 65536)
            a.post_send(IBV_WR_RDMA_READ, a.sge((i + 4) * 65536, 65536), wr_id=4 + i,
                        remote_offset=i * 65536)
        net.run_until(lambda: a.ncomp() >= 8, timeout=600)
    files = []
    for p, clock in zip(pts, (0.0, OFFSET / 1e9)):
        f = io.BytesIO()
        with PcapWriter(f, close=False, nanosecond=True) as w:
            for t, src, dst, sport, data, ip_id in caps[p]:
                w.write(encode_frame(data, src=src, dst=dst, sport=sport, ip_id=ip_id),
                        ts=1_800_000_000 + t + clock)
        f.seek(0)
        files.append(f)
    return pts, files, lost, dups


def test_simulated_network_losses_are_located_exactly():
    """Each host's NIC on softrdma's simulated network (50 us one way, 2 % loss and 2 %
    duplication): the merge finds B's clock 3.217 s ahead (the link is symmetric: the
    middle of the interval is exact), lists as seen at A and not at B exactly the
    packets A sent that the network lost, and the others it lists are the extra copies
    the network made of B's packets; the same the other way."""
    pts, files, lost, dups = _sim_captures(seed=4)
    assert all(lost.values()) and all(dups.values())  # the seed loses and duplicates both ways
    report = MergeReport()
    out = list(merge_captures(files, report))
    assert abs(report.offsets[1].offset_ns - OFFSET) <= 1_000
    for i, j in ((0, 1), (1, 0)):
        missing = list(seen_not(out, i, j))
        own = [r for r in missing if decode_frame(r.data, r.linktype).ip_src == pts[i]]
        assert sorted(r.frames[i] for r in own) == lost[pts[i]]
        assert len(missing) - len(own) == dups[pts[j]]


def test_a_drifting_clock_is_followed(tmp_path):
    """B's clock runs 1 % fast (a 50 ppm drift over five minutes, squeezed into the
    1.6 s of 20,000 tiled frames): its offset grows by 16 ms, more than three times the
    matching tolerance calibrated on the first 500 frames; followed block by block, every
    frame is still matched and the last offset is the drifted one."""
    items = list(long_capture(20_000))
    t0 = items[0][0]
    server = decode_frame(items[0][1]).ip_dst
    pa, pb = tmp_path / "a.pcap", tmp_path / "b.pcap"
    _write(pa, items, 0)
    with PcapWriter(pb, nanosecond=True) as w:
        for ts, frame in items:
            toward = decode_frame(frame).ip_dst == server
            w.write(frame, ts_ns=OFFSET + t0 + (ts - t0) * 101 // 100
                    + (30_000 if toward else -30_000))
    report = MergeReport()
    n = sum(1 for _ in merge_captures([pa, pb], report, calibrate=500))
    drift = (items[-1][0] - t0) // 100
    assert drift > 3 * report.tolerance_ns
    assert n == len(items) and report.matched == [len(items), len(items)]
    assert abs(report.final_offsets[1] - (OFFSET + drift)) < drift // 10


LOSSY = PCAPS / "lossy"  # the lab's real lossy runs, three capture points each


def test_real_lossy_runs_locate_exactly_what_netem_dropped_at_the_receiver():
    """Every lab run (two kernel rxe guests, netem on each guest's egress and/or on its
    ifb0 ingress): merging the two guests' own captures matches every frame the other
    also saw, finds guest 1's clock ahead of guest 0's within the agent's measured offset
    and its uncertainty, and the packets one guest sent that the other never got are
    exactly as many as the receiver's ingress netem dropped (its counters, read in the
    same run; egress drops are in no capture); the bridge saw each of them."""
    runs = json.loads((LOSSY / "counters.json").read_text())["runs"]
    assert len(runs) >= 10
    for run in runs:
        caps = run["captures"]
        g0, g1, br = (LOSSY / caps[p]["file"] for p in ("g0", "g1", "bridge"))
        report = MergeReport()
        out = list(merge_captures([g0, g1], report))
        agent = caps["g1"]["clock_offset_s"] - caps["g0"]["clock_offset_s"]
        unc = caps["g1"]["clock_offset_uncertainty_s"] + caps["g0"]["clock_offset_uncertainty_s"]
        assert abs(report.offsets[1].offset_ns / 1e9 - agent) <= unc, run["run"]
        ip = {0: run["server"]["ip"], 1: run["client"]["ip"]}
        for sender, receiver in ((1, 0), (0, 1)):
            q = run["qdisc"].get(f"g{receiver}", {}).get("ingress") or {}
            dropped = (q.get("after") or {}).get("drops", 0) - (q.get("before") or {}).get("drops", 0)
            lost = [r for r in seen_not(out, sender, receiver)
                    if decode_frame(r.data, r.linktype).src == ip[sender]]
            assert len(lost) == dropped, (run["run"], sender, receiver)
        three = list(merge_captures([br, g0, g1]))
        for sender, receiver in ((1, 0), (0, 1)):
            assert all(r.frames[0] is not None for r in seen_not(three, 1 + sender, 1 + receiver)
                       if decode_frame(r.data, r.linktype).src == ip[sender]), run["run"]
