"""The capture tools take the name of a capture shipped with softrdma (softrdma.data) where
they take a file: ``softrdma dissect linux-rxe/rc_pingpong.pcap`` runs from any directory,
as from an installed softrdma with no checkout. Each tool runs in an empty directory, and
what it says must be what it says of the checkout's own copy of the capture (pcaps/), given
by its absolute path; a name that is neither a file nor a shipped capture stays "no such
file", one line, status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = "linux-rxe/rc_pingpong.pcap"
CHECKOUT_COPY = ROOT / "pcaps" / NAME


def _softrdma(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "softrdma", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [
    ["dissect", "{}"],
    ["dissect", "-r", "{}", "-Y", "opcode == RC_ACKNOWLEDGE"],
    ["check", "{}"],
    ["replay", "{}"],
], ids=["dissect", "dissect-r", "check", "replay"])
@pytest.mark.parametrize("spelling", [NAME, "pcaps/" + NAME], ids=["name", "checkout-path"])
def test_a_shipped_name_is_the_capture(tmp_path, argv, spelling):
    assert CHECKOUT_COPY.is_file()
    by_name = _softrdma(tmp_path, *[a.format(spelling) for a in argv])
    by_path = _softrdma(tmp_path, *[a.format(CHECKOUT_COPY) for a in argv])
    assert by_path.returncode == 0, by_path.stderr
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == by_path.stdout
    assert by_name.stdout.strip()


def test_diagram_draws_a_shipped_capture(tmp_path):
    r = _softrdma(tmp_path, "diagram", NAME, "-o", "d.svg")
    assert r.returncode == 0, r.stderr
    ref = _softrdma(tmp_path, "diagram", str(CHECKOUT_COPY), "-o", "ref.svg")
    assert ref.returncode == 0, ref.stderr
    assert (tmp_path / "d.svg").read_text() == (tmp_path / "ref.svg").read_text()
    assert "<svg" in (tmp_path / "d.svg").read_text()


@pytest.mark.parametrize("tool", ["dissect", "check", "replay", "diagram"])
def test_neither_a_file_nor_a_shipped_capture_is_no_such_file(tmp_path, tool):
    r = _softrdma(tmp_path, tool, "linux-rxe/no_such_capture.pcap")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"softrdma {tool}: linux-rxe/no_such_capture.pcap: no such file"], r.stderr


@pytest.mark.parametrize("tool", ["dissect", "check", "replay", "diagram"])
def test_help_says_a_shipped_name_is_taken(tool):
    r = _softrdma(ROOT, tool, "--help")
    assert r.returncode == 0
    assert "shipped with softrdma" in " ".join(r.stdout.split())
