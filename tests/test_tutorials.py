"""The numbered tutorials (docs/tutorials/NN-*.md) are doctests: every ``>>>`` line runs
and must print what the page shows, so the pages cannot drift from the code.

Each page runs in a fresh interpreter: the pages open the default device, switch tracing
on and off and add devices, and a page must not depend on what an earlier one left
behind (or break because of it). Pages need at least a few examples, so an emptied page
fails instead of passing vacuously."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT

TUTORIALS = ROOT / "docs" / "tutorials"
PAGES = sorted(TUTORIALS.glob("[0-9][0-9]-*.md"))
MIN_EXAMPLES = 8

RUN = """
import doctest, json, sys
r = doctest.testfile(sys.argv[1], module_relative=False, report=True,
                     optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
print(json.dumps({"failed": r.failed, "attempted": r.attempted}))
"""


def _env() -> dict:
    # no inherited tracing or pinned addresses: the page decides
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_the_tutorials_are_numbered_without_gaps_and_listed_in_the_index():
    numbers = [int(p.name[:2]) for p in PAGES]
    assert numbers == list(range(1, len(PAGES) + 1)), numbers
    index = (TUTORIALS / "index.md").read_text()
    linked = re.findall(r"\]\((\d\d-[^)]+\.md)\)", index)
    assert linked == [p.name for p in PAGES]


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_tutorial_runs_as_shown(page):
    r = subprocess.run([sys.executable, "-c", RUN, str(page)], capture_output=True,
                       text=True, timeout=300, env=_env(), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    *report, last = r.stdout.splitlines() or [""]
    result = json.loads(last)
    assert result["failed"] == 0, "\n".join(report)
    assert result["attempted"] >= MIN_EXAMPLES, f"only {result['attempted']} examples"
