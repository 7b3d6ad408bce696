"""``softrdma dissect`` as a tshark user expects it (issue 31, point 5), and the README's
command table and guide links.

What is expected is computed here without softrdma's decoder: frame numbers, timestamps
and BTH fields are read from the pcap bytes by the small reader below (classic pcap,
Ethernet, IPv4, UDP to 4791, then the BTH's first 12 bytes); opcode names are the strings
of Wireshark's ``OpCodeMap`` (epan/dissectors/packet-infiniband.c, as Debian's tshark
4.0 prints them), written out below as the spec. Where tshark is installed, it is asked
too: same frames for the same filter, same opcode names.
"""

from __future__ import annotations

import datetime
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import PCAPS, ROOT, require_tool

WITH_OOB = PCAPS / "with-oob" / "write_bw.pcap"  # TCP exchange frames before the RoCE ones
UCMATOSE = PCAPS / "ucmatose.pcap"  # several QPs: QP1 (CM), two RC connections
READ_BW = PCAPS / "read_bw.pcap"


def run(*args, env=None):
    """``softrdma dissect ARGS`` as a user runs it: a process."""
    return subprocess.run([sys.executable, "-m", "softrdma", "dissect", *map(str, args)],
                          capture_output=True, text=True, timeout=60,
                          env=None if env is None else {**os.environ, **env})


@pytest.fixture
def dissect(capsys):
    """``softrdma dissect ARGS`` through the same entry point, in this process (many
    filters, one interpreter start): returns (status, stdout, stderr)."""
    from softrdma.cli import main

    def call(*args):
        try:
            rc = main(["dissect", *map(str, args)])
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)
    return call


# ------------------------------------------------------------ an independent reader

def read_frames(path: Path) -> list[dict]:
    """Every frame of a classic microsecond pcap of Ethernet frames: its number (from 1),
    its time in microseconds, and for RoCEv2 frames (IPv4, UDP to 4791) the BTH's opcode,
    destination QP and PSN."""
    data = path.read_bytes()
    magic, *_rest, linktype = struct.unpack("<IHHiIII", data[:24])
    assert magic == 0xA1B2C3D4 and linktype == 1, "the reader takes classic us Ethernet pcaps"
    frames, off, n = [], 24, 0
    while off < len(data):
        sec, usec, incl, _orig = struct.unpack_from("<IIII", data, off)
        pkt = data[off + 16:off + 16 + incl]
        off += 16 + incl
        n += 1
        f = {"number": n, "us": sec * 1_000_000 + usec}
        if pkt[12:14] == b"\x08\x00" and pkt[23] == 17:  # IPv4, UDP
            ihl = (pkt[14] & 0x0F) * 4
            udp = 14 + ihl
            if struct.unpack_from(">H", pkt, udp + 2)[0] == 4791:
                bth = pkt[udp + 8:udp + 20]
                f["opcode"] = bth[0]
                f["qp"] = int.from_bytes(bth[5:8], "big")
                f["psn"] = int.from_bytes(bth[9:12], "big") & 0xFFFFFF
        frames.append(f)
    return frames


def roce(frames: list[dict]) -> list[dict]:
    return [f for f in frames if "opcode" in f]


def secs(us: int) -> str:
    return f"{us // 1_000_000}.{us % 1_000_000:06d}"


def numbers(stdout: str) -> list[int]:
    """The frame numbers of dissect's text lines (the first column)."""
    return [int(ln.split()[0]) for ln in stdout.splitlines()]


# ------------------------------------------------------------ -r FILE

def test_r_reads_the_file_as_the_positional_argument_does():
    """``-r FILE`` is tshark's way to name the capture; it prints what ``FILE`` alone
    prints (both are accepted)."""
    a, b = run("-r", READ_BW), run(READ_BW)
    assert a.returncode == 0 and b.returncode == 0, a.stderr
    assert a.stdout == b.stdout and len(a.stdout.splitlines()) == len(roce(read_frames(READ_BW)))


@pytest.mark.parametrize("args", [("-r", READ_BW, READ_BW), ()])
def test_r_and_a_file_or_neither_is_one_usage_line(args):
    """Both ``-r FILE`` and ``FILE``, or no file at all: one line naming ``softrdma
    dissect``, status 2, nothing on stdout."""
    r = run(*args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("softrdma dissect: "), r.stderr
    assert "-r FILE" in lines[0] and "Traceback" not in r.stderr


# ------------------------------------------------------------ the time column

def test_frames_are_numbered_as_in_the_file_and_timed_from_its_first_frame():
    """The capture starts with TCP frames (the tools' out-of-band exchange): the RoCE
    frames keep their numbers in the file (from 1, as tshark's), and the time column is
    seconds since the file's first frame (tshark's default ``-t r``), in microseconds."""
    frames = read_frames(WITH_OOB)
    first = frames[0]["us"]
    want = [(f["number"], secs(f["us"] - first)) for f in roce(frames)]
    r = run("-r", WITH_OOB)
    assert r.returncode == 0, r.stderr
    got = [(int(ln.split()[0]), ln.split()[1]) for ln in r.stdout.splitlines()]
    assert got == want
    assert got[0][0] > 1 and got[0][1] != "0.000000"  # the TCP frames came first


def test_time_formats_d_dd_e_and_utc():
    """``-t d``: since the previous frame of the file; ``-t dd``: since the previous frame
    shown (with a filter that hides every other one); ``-t e``: epoch seconds; ``-t ud``:
    UTC date and time."""
    frames = read_frames(WITH_OOB)
    by_no = {f["number"]: f for f in frames}
    rc = roce(frames)
    r = run("-r", WITH_OOB, "-t", "d")
    assert [ln.split()[1] for ln in r.stdout.splitlines()] == \
        [secs(f["us"] - by_no[f["number"] - 1]["us"]) for f in rc]
    e = run("-r", WITH_OOB, "-t", "e")
    assert [ln.split()[1] for ln in e.stdout.splitlines()] == [secs(f["us"]) for f in rc]
    u = run("-r", WITH_OOB, "-t", "ud")

    def utc(us):
        t = datetime.datetime.fromtimestamp(us // 1_000_000, datetime.timezone.utc)
        return f"{t:%Y-%m-%d} {t:%H:%M:%S}.{us % 1_000_000:06d}"
    assert [" ".join(ln.split()[1:3]) for ln in u.stdout.splitlines()] == [utc(f["us"]) for f in rc]
    odd = [f for f in rc if f["number"] % 2]
    dd = run("-r", WITH_OOB, "-t", "dd", "-Y", " || ".join(f"frame == {f['number']}" for f in odd))
    assert [ln.split()[1] for ln in dd.stdout.splitlines()] == \
        ["0.000000"] + [secs(b["us"] - a["us"]) for a, b in zip(odd, odd[1:])]


def test_absolute_time_is_local_time_as_in_tshark():
    """``-t a`` is the local time of day (here a zone 5:30 ahead of UTC, set through TZ in
    the child's environment), ``-t ad`` with the date."""
    rc = roce(read_frames(READ_BW))
    zone = datetime.timezone(datetime.timedelta(hours=5, minutes=30))

    def local(us, date):
        t = datetime.datetime.fromtimestamp(us // 1_000_000, zone)
        return (f"{t:%Y-%m-%d} " if date else "") + f"{t:%H:%M:%S}.{us % 1_000_000:06d}"
    env = {"TZ": "IST-5:30"}
    a = run("-r", READ_BW, "-t", "a", env=env)
    assert [ln.split()[1] for ln in a.stdout.splitlines()] == [local(f["us"], False) for f in rc]
    ad = run("-r", READ_BW, "-t", "ad", env=env)
    assert [" ".join(ln.split()[1:3]) for ln in ad.stdout.splitlines()] == \
        [local(f["us"], True) for f in rc]


# ------------------------------------------------------------ -Y display filters

def _expected(path: Path, keep) -> list[int]:
    return [f["number"] for f in roce(read_frames(path)) if keep(f)]


def _filter_cases():
    """(capture, filter, the frames it keeps by the independent reader, the same filter
    in Wireshark's language or None where softrdma's is wider: opcode names, aliases)."""
    uc = UCMATOSE
    rb = read_frames(READ_BW)
    lo, hi = rb[10]["psn"], rb[40]["psn"]
    Q, O, P, F = ("infiniband.bth.destqp", "infiniband.bth.opcode", "infiniband.bth.psn",
                  "frame.number")
    return [
        (uc, f"{Q} == 0x21", lambda f: f["qp"] == 0x21, f"{Q} == 0x21"),
        (uc, "qp == 1", lambda f: f["qp"] == 1, f"{Q} == 1"),
        (uc, "bth.destqp != 0x000001", lambda f: f["qp"] != 1, f"{Q} != 0x000001"),
        (uc, "qp > 1 && qp <= 0x21", lambda f: 1 < f["qp"] <= 0x21, f"{Q} > 1 && {Q} <= 0x21"),
        (uc, 'opcode == "RC Send Only"', lambda f: f["opcode"] == 0x04, None),
        (uc, f"{O} == 17", lambda f: f["opcode"] == 0x11, f"{O} == 17"),
        (uc, "opcode == rc_acknowledge or opcode == UD_SEND_ONLY",
         lambda f: f["opcode"] in (0x11, 0x64), None),
        (uc, "!(opcode == RC_ACKNOWLEDGE)", lambda f: f["opcode"] != 0x11, None),
        (uc, "not qp == 1 and not opcode eq 17", lambda f: f["qp"] != 1 and f["opcode"] != 17,
         f"not {Q} == 1 and not {O} eq 17"),
        (READ_BW, f"psn >= {lo} && psn <= {hi}", lambda f: lo <= f["psn"] <= hi,
         f"{P} >= {lo} && {P} <= {hi}"),
        (READ_BW, f"{P} lt {lo} || {P} gt {hi}", lambda f: not lo <= f["psn"] <= hi,
         f"{P} lt {lo} || {P} gt {hi}"),
        (READ_BW, f"{F} >= 10 && {F} < 20", lambda f: 10 <= f["number"] < 20,
         f"{F} >= 10 && {F} < 20 && infiniband"),
        (WITH_OOB, "frame <= 50", lambda f: f["number"] <= 50, f"{F} <= 50 && infiniband"),
        (uc, "qp == 1 || opcode == 17 && frame > 30",  # && binds tighter than ||
         lambda f: f["qp"] == 1 or (f["opcode"] == 17 and f["number"] > 30),
         f"{Q} == 1 || {O} == 17 && {F} > 30"),
        (uc, "(qp == 1 || opcode == 17) && frame > 30",
         lambda f: (f["qp"] == 1 or f["opcode"] == 17) and f["number"] > 30,
         f"({Q} == 1 || {O} == 17) && {F} > 30"),
        (uc, "psn", lambda f: True, P),  # a field alone: the frame has it
    ]


@pytest.mark.parametrize("path,expr,keep,_ws", _filter_cases(),
                         ids=[c[1] for c in _filter_cases()])
def test_display_filter_keeps_exactly_the_matching_frames(dissect, path, expr, keep, _ws):
    """``-Y EXPR`` prints the frames the filter matches, by QP, opcode (number, softrdma's
    or Wireshark's name), PSN range and frame range, with ``&&``/``||``/``!``, their
    words, parentheses and Wireshark's precedence; the frames expected are found by the
    independent reader."""
    want = _expected(path, keep)
    assert want, "a filter case that keeps nothing proves little"
    r = dissect("-r", path, "-Y", expr)
    assert r.returncode == 0, r.stderr
    assert numbers(r.stdout) == want
    assert f"{len(want)} shown" in r.stderr


def test_display_filter_applies_to_json_too():
    """With ``--json`` the filter picks the objects printed."""
    import json
    want = _expected(UCMATOSE, lambda f: f["qp"] == 0x22)
    r = run("-r", UCMATOSE, "--json", "-q", "-Y", "qp == 0x22")
    assert [json.loads(ln)["index"] for ln in r.stdout.splitlines()] == want


def test_filters_agree_with_tshark(dissect):
    """The same filters in Wireshark's language, given to tshark: the same frames
    (``&& infiniband`` where a frame-number filter would also keep tshark's TCP frames)."""
    exe = require_tool("tshark")
    for path, expr, _, ws in _filter_cases():
        if ws is None:
            continue
        t = subprocess.run([exe, "-r", str(path), "-Y", ws, "-T", "fields", "-e", "frame.number"],
                           capture_output=True, text=True, timeout=60)
        assert t.returncode == 0, (ws, t.stderr)
        r = dissect("-r", path, "-Y", expr)
        assert numbers(r.stdout) == [int(x) for x in t.stdout.split()], (expr, ws)


@pytest.mark.parametrize("expr,position", [
    ("qp ==", 6),                  # no value
    ("qp == == 3", 7),             # an operator where a value goes
    ("(qp == 1", 9),               # unclosed parenthesis
    ("qp == 1)", 8),               # a stray one
    ("qp == 1 psn == 2", 9),       # two tests, no && or ||
    ("ttl == 3", 1),               # unknown field
    ("opcode == RC_SEND_NEVER", 11),  # no such opcode
    ("psn == banana", 8),          # not a number
    ("qp == 1 &&", 11),            # nothing after &&
    ("qp # 1", 4),                 # a character the language does not have
    ('opcode == "RC Send', 11),    # unterminated string
    ("", 1),                       # empty
])
def test_a_bad_filter_is_one_line_naming_the_position(dissect, expr, position):
    """A filter that does not parse: status 2, one line on stderr naming ``softrdma
    dissect``, ``-Y`` and the (1-based) position where it goes wrong; no output (the
    process's view: the test below)."""
    r = dissect("-r", READ_BW, "-Y", expr)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("softrdma dissect: ") and "-Y" in lines[0]
    assert f"position {position}:" in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_a_bad_filter_in_a_process():
    """The same from a process: one line, status 2, no traceback."""
    r = run("-r", READ_BW, "-Y", "qp == == 3")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "position 7:" in r.stderr
    assert r.stderr.startswith("softrdma dissect: ")


def test_filter_module_unit():
    """The parser alone: precedence, ``!`` binding tightest, word operators, hex and octal
    numbers, and a missing field making any comparison false (as in Wireshark)."""
    from softrdma.wire.dfilter import FilterError, compile_filter
    rec = {"index": 5, "qpn": 0x11, "opcode": 0x04, "psn": 8}
    assert compile_filter("qp == 0x11 && psn == 010").matches(rec)  # 010 octal = 8
    assert compile_filter("!qp == 1 || psn < 0").matches(rec)
    assert not compile_filter("!(qp == 0x11) || psn < 0").matches(rec)
    assert compile_filter('opcode == "rc send only" and frame ge 5').matches(rec)
    err = {"index": 7}  # a frame that did not decode
    assert not compile_filter("qp != 1").matches(err)
    assert not compile_filter("qp == 1").matches(err)
    assert compile_filter("!(qp == 1)").matches(err)
    assert compile_filter("frame == 7").matches(err)
    with pytest.raises(FilterError) as e:
        compile_filter("qp == 0x")
    assert e.value.position == 7


# ------------------------------------------------------------ Wireshark's opcode names

#: Wireshark's OpCodeMap (packet-infiniband.c), as tshark 4.0 prints it in the Info column
#: (its strings end in a space, dropped here). The last three are not in Wireshark's table
#: (tshark 4.0: "Unknown OpCode"); softrdma names them in its style.
WIRESHARK_SPEC = {
    0x00: "RC Send First", 0x01: "RC Send Middle", 0x02: "RC Send Last",
    0x03: "RC Send Last Immediate", 0x04: "RC Send Only", 0x05: "RC Send Only Immediate",
    0x06: "RC RDMA Write First", 0x07: "RC RDMA Write Middle", 0x08: "RC RDMA Write Last",
    0x09: "RC RDMA Write Last Immediate", 0x0A: "RC RDMA Write Only",
    0x0B: "RC RDMA Write Only Immediate", 0x0C: "RC RDMA Read Request",
    0x0D: "RC RDMA Read Response First", 0x0E: "RC RDMA Read Response Middle",
    0x0F: "RC RDMA Read Response Last", 0x10: "RC RDMA Read Response Only",
    0x11: "RC Acknowledge", 0x12: "RC Atomic Acknowledge", 0x13: "RC Compare Swap",
    0x14: "RC Fetch Add", 0x16: "RC Send Last Invalidate", 0x17: "RC Send Only Invalidate",
    0x20: "UC Send First", 0x21: "UC Send Middle", 0x22: "UC Send Last",
    0x23: "UC Send Last Immediate", 0x24: "UC Send Only", 0x25: "UC Send Only Immediate",
    0x26: "UC RDMA Write First", 0x27: "UC RDMA Write Middle", 0x28: "UC RDMA Write Last",
    0x29: "UC RDMA Write Last Immediate", 0x2A: "UC RDMA Write Only",
    0x2B: "UC RDMA Write Only Immediate",
    0x64: "UD Send Only", 0x65: "UD Send Only Immediate",
}
NOT_IN_WIRESHARK = {0x1C: "RC Flush", 0x1D: "RC Atomic Write", 0x81: "CNP"}


def _every_opcode_capture(path: Path) -> list[int]:
    """A capture with one frame of every opcode softrdma knows; returns the opcodes."""
    from softrdma.wire.frames import encode_frame
    from softrdma.wire.opcodes import OPCODES
    from softrdma.wire.packet import build
    from softrdma.wire.pcap import PcapWriter
    ops = sorted(OPCODES)
    with PcapWriter(path) as w:
        for i, op in enumerate(ops):
            pkt = build(op, dest_qp=0x13, psn=i, qkey=0x11111111, src_qp=0x12,
                        payload=b"" if op == 0x81 else b"x" * 64)
            w.write(encode_frame(pkt, src="10.0.0.1", dst="10.0.0.2", sport=0xC000), ts=float(i))
    return ops


def test_wireshark_names_for_every_opcode(tmp_path):
    """``--wireshark-names`` prints Wireshark's name of every opcode softrdma knows, and
    ``-Y`` takes those names; the spec above covers every one of them."""
    p = tmp_path / "all.pcap"
    ops = _every_opcode_capture(p)
    spec = {**WIRESHARK_SPEC, **NOT_IN_WIRESHARK}
    assert set(ops) == set(spec), "an opcode softrdma knows has no name in the spec"
    r = run("-r", p, "--wireshark-names")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(ops)
    for op, ln in zip(ops, lines):
        assert f"  {spec[op]}  " in ln, (hex(op), ln)
    from softrdma.wire.dfilter import opcode_by_name
    assert {op: opcode_by_name(name) for op, name in spec.items()} == {op: op for op in spec}
    odd = [name for i, (op, name) in enumerate(sorted(spec.items())) if i % 2]
    f = run("-r", p, "-q", "-Y", " || ".join(f'opcode == "{name}"' for name in odd))
    assert numbers(f.stdout) == [ops.index(op) + 1 for op, name in sorted(spec.items())
                                 if name in odd]


def test_wireshark_names_agree_with_tshark(tmp_path):
    """tshark's Info column names every opcode it knows as the spec and ``softrdma dissect
    --wireshark-names`` do."""
    exe = require_tool("tshark")
    p = tmp_path / "all.pcap"
    ops = _every_opcode_capture(p)
    t = subprocess.run([exe, "-r", str(p), "-T", "fields", "-e", "_ws.col.Info"],
                       capture_output=True, text=True, timeout=60)
    infos = t.stdout.splitlines()
    lines = run("-r", p, "--wireshark-names").stdout.splitlines()
    assert len(infos) == len(ops) == len(lines)
    for op, info, line in zip(ops, infos, lines):
        name = info.split("QP=")[0].strip()  # "UC RDMA Write FirstQP=...": no space there
        if op in WIRESHARK_SPEC:
            assert name == WIRESHARK_SPEC[op] and f"  {name}  " in line, (hex(op), info, line)
        else:
            assert name == "Unknown OpCode", (hex(op), info)


def test_help_is_plain_and_tells_the_tshark_options():
    """``softrdma dissect --help``: plain text (no reStructuredText markup, no issue
    numbers) that names -r, -Y with its fields, -t and --wireshark-names."""
    r = subprocess.run([sys.executable, "-m", "softrdma", "dissect", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for bad in ("``", ":mod:", ":func:", ":class:", "issue "):
        assert bad not in r.stdout.lower(), bad
    for want in ("-r FILE", "-Y FILTER", "-t FORMAT", "--wireshark-names",
                 "infiniband.bth.destqp", "infiniband.bth.opcode", "infiniband.bth.psn",
                 "frame.number"):
        assert want in r.stdout, want


# ------------------------------------------------------------ README

def _readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Command line", 1)[1].split("\n## ", 1)[0]
    return "\n".join(ln for ln in section.splitlines() if ln.startswith("|"))


def _subcommands(parser) -> dict:
    import argparse
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    return {}


def test_readme_table_lists_every_subcommand():
    """Each subcommand of the parser (and of ``softrdma bench``) has a row in the README's
    command table (its first column names ``softrdma NAME``)."""
    from softrdma.cli import build_parser
    firsts = [row.split("|")[1] for row in _readme_table().splitlines()[2:]]
    subs = _subcommands(build_parser())
    assert "run" in subs and "bench" in subs
    missing = [name for name in subs
               if name != "bench" and not any(f"softrdma {name}" in c for c in firsts)]
    missing += [f"bench {b}" for b in _subcommands(subs["bench"])
                if not any(f"softrdma bench {b}" in c for c in firsts)]
    assert not missing, f"README's command table lacks {missing}"


def test_readme_links_every_guide():
    """Every page of docs/ is a Markdown link in the README."""
    text = (ROOT / "README.md").read_text()
    targets = set(re.findall(r"\]\((docs/[^)#]+)", text))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - targets == set()
    assert all((ROOT / t).exists() for t in targets)
