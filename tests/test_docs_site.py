"""The documentation site (mkdocs.yml) builds in strict mode: no broken link or anchor, no
page left out of the nav, every ``::: module`` reference resolved; and the built site has
the tutorials and the API reference pages, with the API actually rendered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import IN_CI, ROOT

TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("[0-9][0-9]-*.md"))
REFERENCE = {  # page -> an object its ::: directive must have rendered
    "verbs_api": "softrdma.verbs_api.qp.QP",
    "trace": "softrdma.trace.enable",
    "sim": "softrdma.harness.sim.SimNetwork",
    "testing": "softrdma.harness.testing.connected_pair",
    "stepper": "softrdma.harness.stepper.Stepper",
    "replay": "softrdma.harness.replay",
    "socket": "softrdma.socket.Receiver",
    "rdmacm": "softrdma.rdmacm.cmid.CMID",
    "check": "softrdma.check",
}


def _mkdocs() -> str:
    exe = Path(sys.executable).parent / "mkdocs"
    if not exe.exists():
        msg = "mkdocs is not installed (pip install -e '.[docs]'; scripts/setup does it)"
        if IN_CI:
            pytest.fail(f"CI=true and a prerequisite is missing: {msg}")
        pytest.skip(msg)
    return str(exe)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([_mkdocs(), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_the_site_builds_strict_with_the_tutorials(site):
    assert TUTORIALS
    assert (site / "index.html").exists() and (site / "tutorials" / "index.html").exists()
    for page in TUTORIALS:
        html = (site / "tutorials" / page.stem / "index.html").read_text()
        assert "softrdma" in html and "&gt;&gt;&gt;" in html, page.name


def test_the_guides_are_in_the_site(site):
    for page in (ROOT / "docs").glob("*.md"):
        if page.stem != "index":
            assert (site / page.stem / "index.html").exists(), page.name


@pytest.mark.parametrize("page,obj", sorted(REFERENCE.items()))
def test_the_api_reference_is_rendered(site, page, obj):
    html = (site / "reference" / page / "index.html").read_text()
    assert f'id="{obj}"' in html, f"{obj} missing from reference/{page}"
