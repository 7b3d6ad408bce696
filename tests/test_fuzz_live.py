"""``softrdma fuzz`` as a user runs it: a real subprocess, live devices on loopback, mutated
frames from pcaps/ over real UDP, then the survival checks. A short run must pass; each
deliberately broken invariant (--self-test) must make it fail with one line naming the
check, so the checks are known to be able to fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from softrdma.tools.fuzz import default_pcap_dir, load_seeds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fuzz(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "softrdma", "fuzz", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_seeds_cover_every_capture_and_transport():
    seeds, nfiles = load_seeds(default_pcap_dir())
    assert nfiles >= 20 and len(seeds) > 1000
    ops = {s[0] for s in seeds}
    # RC requests and responses, UC and UD sends, atomics and their ACKs
    assert {0x00, 0x04, 0x06, 0x0A, 0x0C, 0x0D, 0x11, 0x12, 0x13, 0x14, 0x20, 0x22, 0x64} <= ops


def test_fuzz_short_run_survives():
    r = _fuzz("--seconds", "6", "--seed", "7", "--addrs", "127.0.14.1", "127.0.14.2")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    m = re.search(r"sent: (\d+) frames in ([\d.]+) s \((\d+) frames/s\)", out)
    assert m and int(m.group(1)) > 2000, out
    # the devices really processed them: both counted drops by reason, and the frames
    # reached the deep paths (PSN, rkey and length checks), not just the header checks
    for dev in ("127.0.14.1", "127.0.14.2"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"softrdma-fuzz-{dev}:"))
        assert "drops by reason:" in line and "no_qp" in line and "malformed_" in line, line
        assert re.search(r"received (\d+)", line) and int(
            re.search(r"received (\d+)", line).group(1)) > 1000, line
    assert re.search(r"\b(rkey_violation|length|psn_out_of_seq|uc_out_of_seq)\b", out), out
    for check in ("progress threads alive", "no exception in any thread", "threads flat",
                  "descriptors flat", "allocated memory blocks flat", "RSS flat",
                  "memory outside permitted ranges unchanged", "RC pair works",
                  "UC pair works", "UD pair works", "SRQ pair works"):
        assert re.search(rf"^  ok   {check}", out, re.M), (check, out)
    assert "FAIL" not in out
    assert out.rstrip().endswith("checks passed")


@pytest.mark.parametrize("what,check", [
    ("sentinel", "memory outside permitted ranges unchanged"),
    ("leak", "allocated memory blocks flat"),
])
def test_fuzz_checks_can_fail(what, check):
    r = _fuzz("--seconds", "2", "--seed", "3", "--addrs", "127.0.14.5", "127.0.14.6",
              "--self-test", what)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"softrdma fuzz: FAILED: {check}:"), r.stderr
    assert re.search(rf"^  FAIL {check}", r.stdout, re.M), r.stdout


def test_fuzz_bad_options_one_line():
    r = _fuzz("--seconds", "1", "--addrs", "10.1.2.3", "127.0.14.9")
    assert r.returncode == 1
    assert r.stderr.strip() == ("softrdma fuzz: '10.1.2.3' is not an IPv4 loopback address "
                                "(127.x.y.z)"), r.stderr
