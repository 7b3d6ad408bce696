"""`softrdma bench qps`: it runs, measures what it says, and prints the targets."""

from __future__ import annotations

import subprocess
import sys

from softrdma.bench.qps import run_qp_bench
from softrdma.verbs_api import get_device_list

from .conftest import ROOT


def test_run_qp_bench_small():
    before = {d.name for d in get_device_list()}
    r = run_qp_bench(n=300, sample=50, quiet=True)
    assert 0 < r["create_seconds"] < 10
    # a QP is at least its Python objects (a few hundred bytes), and far below 20 kB
    assert 500 < r["bytes_per_qp"] < 20_000
    assert abs(r["traced_bytes"] / 300 - r["bytes_per_qp"]) < 1
    assert r["bytes_per_rts_qp"] > 500
    assert {d.name for d in get_device_list()} == before  # its device is removed again


def test_cli_bench_qps_prints_numbers_and_targets():
    proc = subprocess.run([sys.executable, "-m", "softrdma", "bench", "qps",
                           "--qps", "500"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "create 500 QPs: time" in out and "< 0.5 s" in out  # the target, scaled to 500
    assert "Python memory (tracemalloc)" in out and "< 10 MB" in out
    assert "per idle QP" in out and "reported 255/255" in out
    assert "softrdma/verbs_api/soft_qp.py" in out  # where the memory goes (the soft QP)


def test_cli_bench_rejects_a_bad_count():
    proc = subprocess.run([sys.executable, "-m", "softrdma", "bench", "qps",
                           "--qps", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--qps" in proc.stderr
