"""docs/cm.md's rdma_cm example must run: its python block in a fresh interpreter, each
``# text`` line right after a ``print(...)`` line being what that print must produce."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .conftest import ROOT

DOC = ROOT / "docs" / "cm.md"


def test_cm_doc_example_runs_and_prints_what_it_says():
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    lines = block.splitlines()
    expected = [b.strip()[2:] for a, b in zip(lines, lines[1:])
                if a.strip().startswith("print(") and b.strip().startswith("# ")]
    assert expected, "the example shows no output"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                       timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == expected
