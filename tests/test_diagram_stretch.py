"""softrdma diagram for a stretch of a long capture, with marks beside the arrows.

Guards: ``--frames A-B`` / ``--time T0-T1`` draw exactly the frames of the stretch (their
numbers and times taken from the capture here, not from the tool) and read the capture
only up to the stretch's end (a file object that counts the bytes read; a generator that
fails if pulled past it); :func:`softrdma.diagram.annotate` draws each mark inside the
arrow of its frame in SVG, in the HTML table's row of that frame and as a Mermaid note right
after that frame's arrow, with a summary block; ``--recovery`` takes the marks from the
checker's recovery report (``CheckResult.recovery``, stubbed here until the checker has
one), a loss before the capture point marked at the frame where its gap shows.
"""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from softrdma.cli import main
from softrdma.diagram import Mark, Stretch, annotate, from_capture, recovery_marks, render
from softrdma.diagram.capture import load
from softrdma.wire.frames import decode_frame
from softrdma.wire.pcap import PcapWriter, read_pcap

from . import pcap_mutate as m
from .conftest import PCAPS

SVG = "{http://www.w3.org/2000/svg}"
PINGPONG = PCAPS / "rc_pingpong.pcap"  # 66 frames, rxe's go-backs at 35-40 and 58-64


def roce_frames(records) -> list[int]:
    return [r.index for r in records
            if (f := decode_frame(r.data, r.linktype)) is not None and f.is_roce]


def long_capture(copies: int) -> bytes:
    """rc_pingpong.pcap's frames ``copies`` times over, one after the other in time."""
    recs = m.load(PINGPONG)
    span = recs[-1].ts_ns - recs[0].ts_ns + 1000
    out = io.BytesIO()
    with PcapWriter(out, close=False, nanosecond=True) as w:
        for c in range(copies):
            for r in recs:
                w.write(r.data, ts_ns=r.ts_ns + c * span)
    return out.getvalue()


class CountingFile(io.BytesIO):
    """A capture in memory that counts the bytes handed out."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.consumed = 0

    def read(self, n: int | None = -1) -> bytes:
        b = super().read(n)
        self.consumed += len(b)
        return b


def arrows(svg_text: str) -> dict[int, ET.Element]:
    root = ET.fromstring(svg_text)
    return {int(g.get("data-frame")): g for g in root.iter(f"{SVG}g")
            if "arrow" in (g.get("class") or "").split() and g.get("data-frame")}


# ---------------------------------------------------------------- the stretch

def test_a_frame_stretch_draws_its_frames_and_reads_no_further():
    data = long_capture(200)  # 13200 frames
    f = CountingFile(data)
    cap = load(f, Stretch.parse_frames("30-45"))
    d = from_capture(cap)
    assert sorted(a.frame for a in d.arrows) == list(range(30, 46))
    # reading stopped at frame 46 (the first past the end): a pcap record is a 16-byte
    # header and the frame; rc_pingpong's frames are at most 1100 bytes
    assert f.consumed < 24 + 46 * (16 + 1100)
    assert f.consumed < len(data) / 100
    assert "frames 30-45" in d.title


def test_a_stretch_pulls_nothing_past_its_end():
    """Stretch.select stops pulling records once one lies past the end."""
    recs = m.load(PINGPONG)

    def source():
        for r in recs:
            if r.index > 21:
                raise AssertionError(f"read frame {r.index} for a stretch ending at 20")
            yield r
    assert [r.index for r in Stretch.parse_frames("10-20").select(source())] == \
        list(range(10, 21))
    assert [r.index for r in Stretch.parse_frames("10-20").prefix(source())] == \
        list(range(1, 21))


def test_a_time_stretch_draws_the_packets_of_those_seconds(tmp_path, capsys):
    recs = m.load(PINGPONG)
    t0 = recs[0].timestamp
    want = [r.index for r in recs if 0.07 <= r.timestamp - t0 <= 0.08]
    assert 0 < len(want) < len(recs)
    out = tmp_path / "t.svg"
    assert main(["diagram", str(PINGPONG), "--time", "0.07-0.08", "-o", str(out)]) == 0
    svg_text = out.read_text()
    assert sorted(arrows(svg_text)) == want
    assert "seconds 0.07-0.08" in ET.fromstring(svg_text).find(f"{SVG}title").text


def test_frames_and_time_together_draw_what_both_allow(tmp_path):
    recs = m.load(PINGPONG)
    t0 = recs[0].timestamp
    want = [r.index for r in recs if 0.07 <= r.timestamp - t0 <= 0.08 and r.index <= 50]
    out = tmp_path / "t.svg"
    assert main(["diagram", str(PINGPONG), "--time", "0.07-0.08", "--frames", "1-50",
                 "-o", str(out)]) == 0
    assert sorted(arrows(out.read_text())) == want


@pytest.mark.parametrize("args", [["--frames", "45-30"], ["--frames", "0-3"],
                                  ["--frames", "x"], ["--time", "1-0.5"]])
def test_a_bad_stretch_is_a_usage_error(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["diagram", str(PINGPONG), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {args[0]}: '{args[1]}'" in err and len(err.splitlines()) == 1


def test_a_stretch_with_no_packets_says_so(capsys):
    assert main(["diagram", str(PINGPONG), "--frames", "500-600"]) == 2
    assert "no RoCE packets" in capsys.readouterr().err


# ---------------------------------------------------------------- marks

def _marked():
    d = from_capture(load(PINGPONG, Stretch.parse_frames("30-45")))
    return annotate(d, [Mark(35, "timeout", "go-back after a 1 ms silence"),
                        Mark(35, "go-back", "resends PSN 13095510-13095513"),
                        Mark(38, "duplicate", "answers a duplicate"),
                        Mark(60, "nak", "outside the stretch")], heading="recovery")


def test_marks_are_drawn_in_their_arrow_in_svg():
    svg_text = render(_marked(), "svg")
    by_frame = arrows(svg_text)
    marked = {f: [t.text for t in g.iter(f"{SVG}text") if t.get("class") == "mark"]
              for f, g in by_frame.items()}
    assert marked.pop(35) == ["\u2691 timeout: go-back after a 1 ms silence",
                              "\u2691 go-back: resends PSN 13095510-13095513"]
    assert marked.pop(38) == ["\u2691 duplicate: answers a duplicate"]
    assert all(v == [] for v in marked.values())
    # beside its arrow: the marks lie under the arrow's shaft and above the next arrow's
    g35, g36 = by_frame[35], by_frame[36]
    y35 = float(g35.find(f"{SVG}line").get("y1"))
    y36 = float(g36.find(f"{SVG}line").get("y1"))
    ys = [float(t.get("y")) for t in g35.iter(f"{SVG}text") if t.get("class") == "mark"]
    label36 = float(next(t for t in g36.iter(f"{SVG}text") if t.get("class") == "label")
                    .get("y"))
    assert all(y35 < y < label36 - 10 < y36 for y in ys)
    summary = " | ".join(t.text for g in ET.fromstring(svg_text).iter(f"{SVG}g")
                         if g.get("class") == "summary" for t in g)
    assert ("recovery: timeout \u00d71, go-back \u00d71, duplicate \u00d71, nak \u00d71 "
            "(1 at frames not drawn)") in summary
    assert "frame 60 (not drawn): nak: outside the stretch" in summary


def test_marks_follow_their_arrow_in_mermaid():
    lines = render(_marked(), "mermaid").splitlines()
    arrow_lines = [i for i, ln in enumerate(lines) if "->>" in ln or "-x" in ln]
    # the arrows are in frame order (one capture point): frame 35 is the 6th of 30-45
    at35 = arrow_lines[35 - 30]
    assert "SEND_FIRST psn 13095510" in lines[at35]
    assert lines[at35 + 1].strip().startswith("Note over")
    assert "timeout: go-back after a 1 ms silence<br/>" in lines[at35 + 1]
    assert sum("Note over" in ln for ln in lines) == 2
    assert any(ln.startswith("    %% recovery: ") for ln in lines)


def test_marks_are_in_their_row_of_the_html_table():
    page = render(_marked(), "html")
    rows = {r.split("</td>")[0].split(">")[-1]: r for r in page.split("<tr")[1:]}
    assert "timeout: go-back after a 1 ms silence" in rows["35"]
    assert "answers a duplicate" in rows["38"]
    assert "answers a duplicate" not in rows["37"]
    assert "frame 60 (not drawn)" in page


def test_marks_as_a_dict_of_texts():
    d = annotate(from_capture(load(PINGPONG, Stretch.parse_frames("1-10"))),
                 {4: ["a", "b"]})
    assert {a.frame: a.marks for a in d.arrows if a.marks} == {4: [("note", "a"),
                                                                   ("note", "b")]}


# ---------------------------------------------------------------- from the recovery report

def Event(frame, kind, psn, count=1, text=""):  # noqa: N802 (the checker's RecoveryEvent)
    return SimpleNamespace(frame=frame, ts=0.0, kind=kind, psn=psn, count=count, text=text)


def test_recovery_marks_from_a_report():
    result = SimpleNamespace(recovery=[SimpleNamespace(label="flow", events=[
        Event(41, "lost-before", 100, 2), Event(42, "nak", 124, text="NAK PSN 124"),
        Event(50, "lost-after", 7)])])
    assert recovery_marks(result) == [
        Mark(41, "lost-before", "2 packets lost before the capture point (PSN 100-101)"),
        Mark(42, "nak", "NAK PSN 124"),
        Mark(50, "lost-after", "1 packet lost after the capture point (PSN 7)")]
    assert recovery_marks(SimpleNamespace(violations=[])) == []  # no report: no marks


def test_cli_recovery_marks_the_gap_frame_and_checks_only_up_to_the_stretch(
        tmp_path, monkeypatch):
    """``--recovery``: the checker judges the capture up to the stretch's end (its history
    counts; nothing after it is read) and its events become marks at their frames."""
    import softrdma.check as check
    seen: list[int] = []

    def fake_check(records, **kw):
        seen.extend(r.index for r in records)
        return SimpleNamespace(violations=[SimpleNamespace(frame=37, rule="RULE",
                                                           message="a violation")],
                               recovery=[SimpleNamespace(label="f", events=[
                                   Event(36, "lost-before", 13095511, 2)])])
    monkeypatch.setattr(check, "check_records", fake_check)
    out = tmp_path / "r.svg"
    assert main(["diagram", str(PINGPONG), "--frames", "30-45", "--recovery",
                 "-o", str(out)]) == 0
    assert seen == list(range(1, 46))
    marks = {f: [t.text for t in g.iter(f"{SVG}text") if t.get("class") == "mark"]
             for f, g in arrows(out.read_text()).items()}
    assert marks[36] == ["\u2691 lost-before: 2 packets lost before the capture point "
                         "(PSN 13095511-13095512)"]
    assert marks[37] == ["\u2691 violation: RULE: a violation"]
    assert sum(map(len, marks.values())) == 2


def test_cli_recovery_without_a_report_draws_the_stretch(tmp_path):
    """Today's checker (no ``recovery`` yet) and a clean capture: no marks, no failure."""
    out = tmp_path / "r.svg"
    assert main(["diagram", str(PINGPONG), "--frames", "30-45", "--recovery",
                 "-o", str(out)]) == 0
    assert sorted(arrows(out.read_text())) == list(range(30, 46))


def test_the_whole_capture_is_read_without_a_stretch():
    recs = list(read_pcap(PINGPONG))
    d = from_capture(load(PINGPONG))
    assert sorted(a.frame for a in d.arrows) == roce_frames(recs)


def test_a_stretch_of_a_trace_is_refused(tmp_path, capsys):
    trace = tmp_path / "run.jsonl"
    trace.write_text('{"event": "x"}\n')
    assert main(["diagram", str(trace), "--frames", "1-2"]) == 2
    assert "are for captures" in capsys.readouterr().err
