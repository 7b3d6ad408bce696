"""``softrdma bench capture``: the long captures it makes are consistent RoCEv2 (each
flow's PSNs and MSNs continue across the tiles, every ICRC and IP checksum right, judged
clean by ``softrdma check``), and the bench prints every line it promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import defaultdict

from softrdma.bench.capgen import DEFAULT_TEMPLATES, load_tile, long_capture
from softrdma.bench.caploss import LossStats
from softrdma.bench.capture import measure
from softrdma.check import check_pcap
from softrdma.wire.frames import decode_frame, ip_checksum
from softrdma.wire.headers import NakCode
from softrdma.wire.packet import parse
from softrdma.wire.pcap import PcapWriter, read_pcap

from . import pcap_mutate as m
from .conftest import PCAPS, require_tool


def _make(tmp_path, n, templates=DEFAULT_TEMPLATES):
    path = tmp_path / "long.pcap"
    with PcapWriter(path, nanosecond=True) as w:
        for ts, frame in long_capture(n, templates):
            w.write(frame, ts_ns=ts)
    return path


def test_made_capture_continues_every_flow_across_tiles(tmp_path):
    """3,000 frames from write_bw, read_bw and send_bw tiled about six times each: per
    flow, each packet's PSN, MSN and timestamp continue from the previous (checked against
    the template's own steps), every ICRC and IPv4 header checksum is right, and the
    checker finds the capture clean."""
    path = _make(tmp_path, 3_000)
    templates = {load_tile(t).frames[0].sport: m.load(t) for t in DEFAULT_TEMPLATES}
    flows, times = defaultdict(list), defaultdict(list)
    for rec in read_pcap(path):
        f = decode_frame(rec.data, rec.linktype)
        assert f.icrc() == parse(f.payload).icrc, rec.index
        hdr = bytearray(f.ip_packet[:20])
        hdr[10:12] = b"\0\0"
        assert ip_checksum(hdr) == int.from_bytes(f.ip_packet[10:12], "big"), rec.index
        flows[f.sport].append(parse(bytes(f.payload)))
        times[f.sport].append(rec.ts_ns)
    assert sum(map(len, flows.values())) == 3_000
    for sport, pkts in flows.items():
        tpl = [m.packet(r) for r in templates[sport]]
        n = len(tpl)
        assert len(pkts) > 2 * n  # at least two whole tiles of each flow
        psn_span = max(p.psn for p in tpl) - min(p.psn for p in tpl) + 1
        msn_span = max(p.msn or 0 for p in tpl)
        ts = times[sport]
        periods = {ts[k] - ts[k - n] for k in range(n, len(ts))}
        duration = templates[sport][-1].ts_ns - templates[sport][0].ts_ns
        assert len(periods) == 1 and periods.pop() > duration  # tile after tile
        for k, p in enumerate(pkts):
            t = tpl[k % n]
            assert p.opcode == t.opcode and bytes(p.payload) == bytes(t.payload)
            assert p.psn == (t.psn + (k // n) * psn_span) % (1 << 24)
            if t.msn is not None:
                assert p.msn == t.msn + (k // n) * msn_span
    assert check_pcap(path).violations == []


def test_psns_wrap_modulo_2_24(tmp_path):
    """A template whose PSNs end just below 2**24: its later tiles' PSNs wrap to 0 as on
    the wire, and the checker still finds the capture clean."""
    recs = m.load(PCAPS / "send_bw.pcap")
    base = min(m.packet(r).psn for r in recs)
    start = (1 << 24) - 70  # the tile spans 60 PSNs: the second copy wraps
    for i in range(1, len(recs) + 1):
        recs = m.edit(recs, i, psn=m.packet(recs[i - 1]).psn - base + start)
    tpl = tmp_path / "near_wrap.pcap"
    tpl.write_bytes(m.to_bytes(recs))
    path = _make(tmp_path, 3 * len(recs), [tpl])
    psns = [m.packet(r).psn for r in read_pcap(path)]
    assert 0 in psns and max(psns) == (1 << 24) - 1
    assert check_pcap(path).violations == []


def test_measure_reports_the_child_s_own_peak_memory():
    """measure() reports the peak RSS of the process it ran: a child that fills 200 MiB
    peaks at least 190 MiB above one that does not (GNU time measures it)."""
    require_tool("time")
    small = measure("small", [sys.executable, "-c", "pass"])
    big = measure("big", [sys.executable, "-c", "b = b'x' * (200 << 20)"])
    assert small.returncode == big.returncode == 0
    assert big.max_rss_bytes - small.max_rss_bytes >= 190 * 2**20


def test_bench_prints_every_line(tmp_path):
    """``softrdma bench capture --packets 600`` prints the capture made, then one line per
    tool with seconds, packets/s and peak RSS; tshark's lines say "not installed" when it
    is absent. ``--make`` writes the capture alone."""
    r = subprocess.run([sys.executable, "-m", "softrdma", "bench", "capture", "--packets", "600"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("capture: 600 packets made from write_bw, read_bw, send_bw")
    tools = {ln[:22].strip(): ln[22:] for ln in lines[1:]}
    assert list(tools) == ["python (imports only)", "read_pcap", "softrdma dissect",
                           "softrdma check", "tshark -r F", "tshark -r F -V"]
    assert "peak RSS" in tools["python (imports only)"]
    for name in ("read_pcap", "softrdma dissect", "softrdma check", "tshark -r F",
                 "tshark -r F -V"):
        if name.startswith("tshark") and shutil.which("tshark") is None:
            assert tools[name].strip() == "not installed"
        else:
            assert " s " in tools[name] and "pkts/s" in tools[name] and "MiB" in tools[name]
            assert "exit status" not in tools[name]
    out = tmp_path / "made.pcap"
    r = subprocess.run([sys.executable, "-m", "softrdma", "bench", "capture", "--make", str(out),
                        "--packets", "500"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and sum(1 for _ in read_pcap(out)) == 500


def test_losses_are_repaired_by_one_nak_and_a_go_back(tmp_path):
    """``loss_every=40`` on write_bw and send_bw flows: per loss, one NAK "PSN sequence
    error" whose PSN the requester had sent (lost after the capture point) and whose MSN
    counts the messages ended before it; the next request goes back to that PSN and
    resends the same bytes from the BTH on, under a new IPv4 ID; every ICRC is right and
    the checker finds the capture clean."""
    path = tmp_path / "lossy.pcap"
    stats = LossStats()
    templates = DEFAULT_TEMPLATES[0], DEFAULT_TEMPLATES[2]  # write_bw, send_bw
    with PcapWriter(path, nanosecond=True) as w:
        for ts, frame in long_capture(4_000, templates, loss_every=40, losses=stats):
            w.write(frame, ts_ns=ts)
    sent = defaultdict(dict)  # flow -> PSN -> (IP ID, RoCE bytes but the ICRC)
    ends = defaultdict(set)  # flow -> PSNs of the last packets of messages
    after_nak = {}
    naks = 0
    for rec in read_pcap(path):
        f = decode_frame(rec.data, rec.linktype)
        p = parse(bytes(f.payload))
        assert f.icrc() == p.icrc, rec.index
        flow = f.sport
        if p.info.is_request:
            if flow in after_nak:
                assert p.psn == after_nak.pop(flow), rec.index  # go-back to the NAK'd PSN
                ip_id, roce = sent[flow][p.psn]
                assert bytes(f.payload)[:-4] == roce and f.ip_id != ip_id
            sent[flow].setdefault(p.psn, (f.ip_id, bytes(f.payload)[:-4]))
            if p.info.last:
                ends[flow].add(p.psn)
        elif p.syndrome == NakCode.PSN_SEQ_ERROR:
            naks += 1
            assert p.psn in sent[flow]
            assert p.msn == sum(1 for e in ends[flow] if e < p.psn)
            after_nak[flow] = p.psn
    assert naks == stats.naks == stats.lost >= 4_000 // 40 // 2
    assert check_pcap(path).violations == []
