"""softrdma.diagram: sequence diagrams from captures, simulated runs and event records.

Two kinds of checks. Text-level: the model each source builds (which packets are lost,
retransmitted, duplicated), the Mermaid text, well-formed SVG, the command line's exit
statuses, and docs/diagrams.md's example against the tool's output. And what a person
sees: the HTML opened in Debian's chromium (tests/browser.py), the arrows, labels and loss
marks as laid out, and the pixels of the loss marks in a screenshot of the SVG file.
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from softrdma.cli import main
from softrdma.diagram import Kind, SimRecorder, from_capture, from_events, render
from softrdma.diagram import svg as svg_mod
from softrdma.diagram.events import EventError
from softrdma.enums import IBV_WR_RDMA_WRITE
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair
from softrdma.wire.frames import encode_frame
from softrdma.wire.headers import AethType, make_syndrome
from softrdma.wire.opcodes import Opcode
from softrdma.wire.packet import build
from softrdma.wire.pcap import PcapWriter

from .browser import pixels_near, probe, screenshot
from .conftest import PCAPS, ROOT

SVG = "{http://www.w3.org/2000/svg}"
READ_BW = PCAPS / "read_bw.pcap"
LOSS_RED = (0xC6, 0x28, 0x28)


# -- sources ------------------------------------------------------------------------------

def lossy_write(seed: int = 3, **profile) -> tuple[SimRecorder, SimNetwork]:
    """An RC WRITE of 4 KiB (four packets at MTU 1024) on a lossy simulated link, seeded
    so that the last packet and then the first retransmission are lost."""
    net = SimNetwork(seed=seed, **(profile or {"loss": 0.2}))
    with SimRecorder(net, "RC WRITE over a lossy link") as rec:
        a, b = connected_pair(net, "RC")
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 4096), wr_id=1, remote_offset=0)
        assert net.run_until(lambda: len(a.cq) > 0)
        wcs = rec.poll(a)
        assert wcs[0].status == 0
    for ep in (a, b):
        ep.close()
    net.close()
    return rec, net


def test_a_simulated_loss_is_drawn_lost_and_its_psn_retransmitted():
    rec, net = lossy_write()
    d = rec.diagram
    assert len(d.arrows) == net.stats["sent"]
    lost = [a for a in d.arrows if a.kind == Kind.LOST]
    assert len(lost) == net.stats["lost"] == 2
    assert all(a.recv_time is None for a in lost)
    assert all(a.recv_time is not None and a.recv_time > a.send_time
               for a in d.arrows if a.kind != Kind.LOST)
    # the WRITE_LAST lost first is sent again; the retransmitted WRITE_FIRST is lost too
    retx = {a.psn for a in d.arrows if a.retransmit}
    assert {a.psn for a in lost} <= retx | {lost[0].psn}
    assert lost[0].opcode == "RC_RDMA_WRITE_LAST" and lost[0].ackreq
    assert lost[1].retransmit and lost[1].opcode == "RC_RDMA_WRITE_FIRST"
    texts = [(n.kind, n.text) for n in d.notes]
    assert texts.count(("state", "RTS")) == 2
    assert ("timer", "retransmit timer fired") in texts
    assert ("completion", "WC RDMA_WRITE SUCCESS wr_id 1") in texts


def test_network_duplicates_and_corruption_are_drawn_as_such():
    rec, net = lossy_write(seed=11, duplicate=0.3, corrupt=0.15)
    d = rec.diagram
    c = d.counts()
    assert net.stats["duplicated"] and net.stats["corrupted"]
    assert len(d.arrows) == net.stats["sent"] + net.stats["duplicated"]
    assert c["bad-icrc"] == net.stats["corrupted"]
    assert c["duplicate"] >= net.stats["duplicated"] - net.stats["corrupted"]
    bad = [a for a in d.arrows if a.kind == Kind.BAD_ICRC]
    assert all("icrc=BAD" in a.detail for a in bad)


def test_a_capture_marks_retransmissions_and_duplicate_responses(tmp_path):
    """A capture cannot see a loss, only its consequences: the same request PSN again
    (retransmission) and the responder's answer repeated (duplicate)."""
    ack = make_syndrome(AethType.ACK, 31)
    nak = make_syndrome(AethType.NAK, 0)  # PSN sequence error
    a, b = "10.0.0.1", "10.0.0.2"
    pkts = [  # (src, dst, packet)
        (a, b, build(Opcode.RC_RDMA_WRITE_FIRST, dest_qp=0x12, psn=5, va=0, rkey=1,
                     dma_len=2048, payload=b"x" * 1024)),
        (a, b, build(Opcode.RC_RDMA_WRITE_LAST, dest_qp=0x12, psn=6, ackreq=True,
                     payload=b"x" * 1024)),
        (b, a, build(Opcode.RC_ACKNOWLEDGE, dest_qp=0x11, psn=5, syndrome=nak, msn=0)),
        (a, b, build(Opcode.RC_RDMA_WRITE_LAST, dest_qp=0x12, psn=6, ackreq=True,
                     payload=b"x" * 1024)),
        (b, a, build(Opcode.RC_ACKNOWLEDGE, dest_qp=0x11, psn=6, syndrome=ack, msn=1)),
        (b, a, build(Opcode.RC_ACKNOWLEDGE, dest_qp=0x11, psn=6, syndrome=ack, msn=1)),
    ]
    path = tmp_path / "retx.pcap"
    with PcapWriter(path) as w:
        for i, (s, dst, p) in enumerate(pkts):
            w.write(encode_frame(p, src=s, dst=dst, sport=50000), ts=1.0 + i * 1e-4)
    d = from_capture(path)
    assert [a.kind.value for a in d.arrows] == ["normal", "normal", "normal",
                                                "retransmission", "normal", "duplicate"]
    assert d.arrows[2].is_nak and "NAK PSN_SEQ_ERROR" in d.arrows[2].label
    assert [ln.label for ln in d.lanes] == ["10.0.0.1 qpn 0x11", "10.0.0.2 qpn 0x12"]
    mmd = render(d, "mermaid")
    assert "P1->>P2: WRITE_LAST psn 6 A (retransmit)" in mmd
    assert "P2->>P1: ACK psn 6 msn 1 (duplicate)" in mmd


def test_events_become_arrows_notes_and_losses():
    recs = [
        {"event": "state", "t": 0.0, "ip": "10.0.0.1", "qpn": 0x11, "state": "IBV_QPS_RTS"},
        {"event": "send", "t": 1.0, "ip": "10.0.0.1", "qpn": 0x11, "dst": "10.0.0.2",
         "dest_qp": 0x12, "psn": 7, "opcode": "RC_SEND_ONLY", "ackreq": True, "id": 1},
        {"event": "drop", "t": 1.5, "ip": "10.0.0.2", "qpn": 0x12, "id": 1},
        {"event": "timer", "t": 2.0, "ip": "10.0.0.1", "qpn": 0x11, "which": "retransmit"},
        {"event": "send", "t": 2.0, "ip": "10.0.0.1", "qpn": 0x11, "dst": "10.0.0.2",
         "dest_qp": 0x12, "psn": 7, "opcode": 0x04},
        {"event": "recv", "t": 2.1, "ip": "10.0.0.2", "qpn": 0x12, "psn": 7,
         "opcode": "RC_SEND_ONLY"},
        {"event": "send", "t": 2.2, "ip": "10.0.0.2", "qpn": 0x12, "dst": "10.0.0.1",
         "dest_qp": 0x11, "psn": 7, "opcode": "RC_ACKNOWLEDGE", "syndrome": 0x1F, "msn": 1},
        {"event": "completion", "t": 2.5, "ip": "10.0.0.1", "qpn": 0x11, "opcode": "SEND",
         "status": "SUCCESS", "wr_id": 9},
        {"event": "debug", "t": 3.0},
    ]
    d = from_events(recs)
    assert [a.kind for a in d.arrows] == [Kind.LOST, Kind.RETRANSMISSION, Kind.NORMAL]
    assert d.arrows[1].recv_time == 2.1 and d.arrows[2].recv_time == 2.2  # one-sided: level
    assert [n.text for n in d.notes] == ["RTS", "retransmit timer fired",
                                         "WC SEND SUCCESS wr_id 9"]
    assert d.remarks == ["1 records of other events are not drawn"]
    assert "P1-xP2: SEND_ONLY psn 7 A (lost)" in render(d, "mermaid")
    with pytest.raises(EventError, match="record 1 .send.: no 'psn'"):
        from_events([{"event": "send", "t": 0, "ip": "a", "dst": "b", "opcode": 4}])


# -- text renderers -------------------------------------------------------------------------

def test_mermaid_of_a_capture_has_one_arrow_per_packet():
    d = from_capture(READ_BW)
    text = render(d, "mermaid")
    lines = text.splitlines()
    assert lines[0] == "sequenceDiagram"
    assert lines[1:3] == ["    participant P1 as 10.77.0.12 qpn 0x19",
                          "    participant P2 as 10.77.0.11 qpn 0x19"]
    arrows = [ln for ln in lines if re.match(r"    P\d(->>|-x)P\d: ", ln)]
    assert len(arrows) == len(d.arrows) == 180
    assert sum("READ_REQUEST" in ln and ln.startswith("    P1->>P2") for ln in arrows) == 20
    assert not any("-x" in ln for ln in arrows)  # one capture point: nothing seen lost


def test_mermaid_of_a_lossy_run_marks_each_loss_with_x():
    rec, net = lossy_write()
    text = render(rec.diagram, "mermaid")
    assert text.count("-xP") == net.stats["lost"] == 2
    assert "Note over P1: retransmit timer fired" in text


@pytest.mark.parametrize("source", ["capture", "sim"])
def test_svg_is_well_formed_and_names_its_namespace(source):
    d = from_capture(READ_BW) if source == "capture" else lossy_write()[0].diagram
    root = ET.fromstring(render(d, "svg"))
    assert root.tag == f"{SVG}svg"
    groups = [g for g in root.iter(f"{SVG}g") if "arrow" in g.get("class", "").split()]
    assert len(groups) == len(d.arrows)
    marks = [p for p in root.iter(f"{SVG}path") if p.get("class") == "loss-mark"]
    assert len(marks) == d.counts()["lost"]
    # self-contained: nothing fetched from elsewhere
    text = render(d, "svg") + render(d, "html")
    assert not re.search(r"(src|href)=\"(https?:|//)|@import|<script|<link", text)


# -- the command line -------------------------------------------------------------------------

def run_cli(args, capsys) -> tuple[int, str, str]:
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("suffix,check", [
    (".html", lambda t: t.startswith("<!DOCTYPE html>") and "<svg" in t),
    (".svg", lambda t: ET.fromstring(t).tag == f"{SVG}svg"),
    (".mmd", lambda t: t.startswith("sequenceDiagram\n")),
])
def test_cli_writes_the_format_its_suffix_names(tmp_path, capsys, suffix, check):
    out = tmp_path / f"run{suffix}"
    rc, stdout, err = run_cli(["diagram", str(READ_BW), "-o", str(out)], capsys)
    assert rc == 0 and err == ""
    assert check(out.read_text())
    assert "180 packets between 2 endpoints" in stdout


def test_cli_filters_conversations_and_says_what_it_cut(tmp_path, capsys):
    srq = str(PCAPS / "srq_pingpong.pcap")
    rc, out, _ = run_cli(["diagram", srq, "--list"], capsys)
    assert rc == 0 and len(out.splitlines()) == 4
    rc, out, _ = run_cli(["diagram", srq, "--conversation", "3"], capsys)
    assert rc == 0 and "participant P1 as 10.77.0.12 qpn 0x16" in out
    assert out.count("->>") == 4
    rc, out2, _ = run_cli(["diagram", srq, "--qpn", "0x16"], capsys)
    assert out2 == out
    rc, out, err = run_cli(["diagram", str(READ_BW), "--max-packets", "10"], capsys)
    assert rc == 0 and out.count("->>") == 10
    assert "showing the first 10 of 180 packets: 170 packets from frame 11 on left out" in err
    assert "%% showing the first 10 of 180" in out


@pytest.mark.parametrize("args,needle", [
    (["diagram", "/nonexistent.pcap"], "/nonexistent.pcap: no such file"),
    (["diagram", "README.md"], "not a pcap or pcapng file"),
    (["diagram", str(READ_BW), "-o", "x.txt"], "the suffix names no format"),
    (["diagram", str(READ_BW), "--conversation", "2"], "no conversation 2: the capture has 1"),
    (["diagram", str(READ_BW), "--qpn", "0x99"], "no conversation has an end with qpn 0x99"),
    (["diagram", str(READ_BW), "--conversation", "0"], "--conversation"),
    (["diagram", str(READ_BW), "--format", "png"], "--format"),
    (["demo", "--diagram", "x.txt"], "--diagram"),
])
def test_cli_bad_input_is_one_line_and_status_2(capsys, args, needle):
    try:
        rc = main(args)
    except SystemExit as e:  # argparse refuses the option while parsing
        rc = e.code
    _, err = capsys.readouterr()
    assert rc == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_demo_draws_its_run(tmp_path):
    out = tmp_path / "demo.mmd"
    r = subprocess.run([sys.executable, "-m", "softrdma", "demo", "--addrs", "127.0.0.61",
                        "127.0.0.62", "--size", "2000", "--diagram", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"diagram: {out}" in r.stdout
    text = out.read_text()
    assert "participant P1 as 127.0.0.61 qpn" in text
    assert text.count("Note over P1: RTS") == 1 and text.count("Note over P2: RTS") == 1
    for wc in ("SEND", "RDMA_WRITE", "RDMA_READ", "FETCH_ADD", "COMP_SWAP"):
        assert f"WC {wc} SUCCESS" in text
    assert "READ_REQUEST" in text and "ATOMIC_ACK" in text


# -- the documentation's example ----------------------------------------------------------------

DOC = ROOT / "docs" / "diagrams.md"
DOC_EXAMPLE = ["diagram", "pcaps/linux-rxe/rping.pcap", "--conversation", "2",
               "--max-packets", "12"]


def test_the_docs_mermaid_example_is_what_the_tool_draws(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, out, _ = run_cli(DOC_EXAMPLE, capsys)
    assert rc == 0
    m = re.search(r"```mermaid\n(.*?)```", DOC.read_text(), re.S)
    assert m, "docs/diagrams.md has no mermaid block"
    assert m.group(1) == out, ("docs/diagrams.md's example drifted from `softrdma "
                               + " ".join(DOC_EXAMPLE) + "`: paste the new output")


# -- in a real browser --------------------------------------------------------------------------

def _boxes_overlap(a, b) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def _assert_readable(seen: dict, d) -> None:
    """What any rendered diagram must show: one SVG with a size, every arrow drawn with a
    visible shaft and a laid-out label saying what the model says, lane headers, and no
    label on top of another label or a note."""
    assert seen["svgs"] and all(s["isSVG"] and s["w"] > 300 and s["h"] > 200
                                for s in seen["svgs"])
    assert len(seen["arrows"]) == len(d.arrows)
    for got, want in zip(seen["arrows"], d.arrows):
        assert got["shaft_len"] > 20
        assert got["label_box"][2] > 50 and got["label_box"][3] >= 10, got
        assert got["label"].startswith(want.label)
        assert got["tooltip"] == want.detail
    assert [ln["text"] for ln in seen["lanes"]] == [ln.label for ln in d.lanes]
    assert all(ln["w"] > 50 for ln in seen["lanes"])
    boxes = [a["label_box"] for a in seen["arrows"]] + [n["box"] for n in seen["notes"]]
    clashes = [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes))
               if _boxes_overlap(boxes[i], boxes[j])]
    assert not clashes, f"overlapping labels/notes: {clashes[:5]}"


def test_browser_shows_the_lossy_write(tmp_path):
    rec, net = lossy_write()
    d = rec.diagram
    seen = probe(render(d, "html"), tmp_path)
    _assert_readable(seen, d)
    assert seen["table_rows"] == len(d.arrows)
    lost = [a for a in seen["arrows"] if a["kind"] == "lost"]
    assert len(lost) == 2
    for a in lost:
        m = a["mark"]
        # the X sits where the shaft ends, part-way across, drawn red and big enough to see
        assert abs(m["cx"] - a["x2"]) < 1 and abs(m["cy"] - a["y2"]) < 1
        assert a["x1"] < m["cx"] < a["x1"] + 0.9 * (d_lane_gap(seen))
        assert m["w"] >= 10 and m["h"] >= 10
        assert m["stroke"] == "rgb(198, 40, 40)" and a["stroke"] == "rgb(198, 40, 40)"
    retx = [a for a in seen["arrows"] if a["kind"] == "retransmission"]
    assert retx and all(a["dash"] not in ("none", "") for a in retx)
    assert all("retransmit" in a["label"] for a in retx)
    # every PSN lost is sent again, and the browser shows it as a retransmission
    shown = {a["psn"] for a in seen["arrows"] if "retransmit" in a["label"]}
    assert {a["psn"] for a in lost} <= shown
    notes = [n["text"] for n in seen["notes"]]
    assert "retransmit timer fired" in notes and "WC RDMA_WRITE SUCCESS wr_id 1" in notes

    # the standalone SVG, as a person opening the .svg file sees it: red X pixels where
    # the file puts each mark, and none at the heads of the arrows that arrived
    svg_file = tmp_path / "run.svg"
    svg_file.write_text(render(d, "svg"))
    marks = loss_marks(svg_file.read_text())
    img = screenshot(svg_file, 1000, 900)
    assert len(marks) == 2
    for cx, cy in marks:
        assert pixels_near(img, cx, cy, 6, LOSS_RED) >= 15
    for x1, y1, x2, y2 in arrived_ends(svg_file.read_text()):
        head_x = x2 - 5 if x2 > x1 else x2 + 5
        assert pixels_near(img, head_x, y2, 2, LOSS_RED) == 0


def loss_marks(svg_text: str) -> list[tuple[float, float]]:
    """The centre of every loss mark, from the file: the X's first stroke's midpoint."""
    out = []
    for p in ET.fromstring(svg_text).iter():
        if p.get("class") == "loss-mark":
            n = [float(x) for x in re.findall(r"[\d.]+", p.get("d"))]
            out.append(((n[0] + n[2]) / 2, (n[1] + n[3]) / 2))
    return out


def arrived_ends(svg_text: str) -> list[tuple[float, float, float, float]]:
    return [tuple(float(ln.get(k)) for k in ("x1", "y1", "x2", "y2"))
            for g in ET.fromstring(svg_text).iter(f"{SVG}g")
            if g.get("data-kind") not in (None, "lost")
            for ln in g.iter(f"{SVG}line")]


def d_lane_gap(seen: dict) -> float:
    xs = [ln["x"] for ln in seen["lanes"]]
    return abs(xs[1] - xs[0])


def test_a_broken_svg_namespace_fails_the_pixel_check(tmp_path, monkeypatch):
    """The check above must be able to fail: with a wrong namespace the browser shows no
    picture (the file is XML of unknown elements), so the red marks are not there."""
    rec, _ = lossy_write()
    monkeypatch.setattr(svg_mod, "SVG_NS", "http://www.w3.org/2000/svgX")
    bad = tmp_path / "broken.svg"
    bad.write_text(render(rec.diagram, "svg"))
    marks = loss_marks(bad.read_text())  # still well-formed XML, the marks where they were
    assert len(marks) == 2
    img = screenshot(bad, 1000, 900)
    for cx, cy in marks:
        assert pixels_near(img, cx, cy, 6, LOSS_RED) == 0


def test_browser_shows_an_rdma_read_from_a_capture(tmp_path, capsys):
    out = tmp_path / "read.html"
    assert main(["diagram", str(READ_BW), "-o", str(out)]) == 0
    d = from_capture(READ_BW)
    seen = probe(out.read_text(), tmp_path)
    _assert_readable(seen, d)
    assert seen["table_rows"] == 180
    reqs = [a for a in seen["arrows"] if a["opcode"] == "RC_RDMA_READ_REQUEST"]
    rsps = [a for a in seen["arrows"] if "READ_RESPONSE" in a["opcode"]]
    assert len(reqs) == 20 and len(rsps) == 160
    # requests go right to the responder in blue, responses come back left in green; one
    # capture point: every arrow level
    assert all(a["x2"] > a["x1"] and a["stroke"] == "rgb(31, 78, 156)" for a in reqs)
    assert all(a["x2"] < a["x1"] and a["stroke"] == "rgb(46, 125, 50)" for a in rsps)
    assert all(a["y1"] == a["y2"] for a in seen["arrows"])
    # time flows down: frame order is top to bottom
    ys = [a["y1"] for a in seen["arrows"]]
    assert ys == sorted(ys) and len(set(ys)) == len(ys)
    firsts = [a["label"] for a in rsps if a["opcode"].endswith("RESPONSE_FIRST")]
    assert firsts[0] == "READ_RESPONSE_FIRST psn 4602267 msn 1"

