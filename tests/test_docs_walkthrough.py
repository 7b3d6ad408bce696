"""docs/walkthrough-rc-pingpong.md must run: its python blocks, in order, as one program,
in a fresh interpreter (so the default device is new). Each
``# text`` line right after a ``print(...)`` line is the output that print must produce."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .conftest import ROOT

DOC = ROOT / "docs" / "walkthrough-rc-pingpong.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def _expected_output(blocks: list[str]) -> list[str]:
    out = []
    for block in blocks:
        lines = block.splitlines()
        for a, b in zip(lines, lines[1:]):
            if a.strip().startswith("print(") and b.strip().startswith("# "):
                out.append(b.strip()[2:])
    return out


def test_walkthrough_has_the_pingpong_values():
    text = DOC.read_text()
    for needle in ("attr.path_mtu = IBV_MTU_1024", "attr.max_dest_rd_atomic = 1",
                   "attr.min_rnr_timer = 12", "hop_limit=1", "attr.timeout = 14",
                   "attr.retry_cnt = 7", "attr.rnr_retry = 7", "attr.max_rd_atomic = 1",
                   "attr.pkey_index = 0", "attr.port_num = 1", "attr.qp_access_flags = 0",
                   "67.1 ms", "0.64 ms"):
        assert needle in text, needle


def test_walkthrough_code_runs():
    blocks = _blocks()
    assert len(blocks) >= 8
    expected = _expected_output(blocks)
    assert len(expected) >= 3
    proc = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "SOFTRDMA_IP"},
                               "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.splitlines()
    for line in expected:
        assert line in printed, (line, printed)
