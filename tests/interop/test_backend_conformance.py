"""The verbs conformance suite (tests/conformance) run INSIDE lab guest 0, against a device
of the guest, and every one of its tests must pass.

Which device is a parameter (``GUEST_DEVICES``):

- ``soft``: softrdma's own soft device inside the guest (``Context()``), in a network
  namespace of its own (``unshare -n``), because kernel rxe's UDP 4791 socket in the
  guest's main namespace would take the port. This checks the runner's mechanics (the
  repository and its .venv seen read-only through the guest's 9p root, pytest with no
  cache and its report written to the lab's writable directory) without the ibverbs
  backend.
- ``rxe0``: the guest's kernel rxe device through libibverbs
  (``SOFTRDMA_BACKEND=ibverbs SOFTRDMA_CONFORMANCE_DEVICE=rxe0 SOFTRDMA_CONFORMANCE_GID=1``),
  the evidence that the ibverbs backend behaves as the soft one. It is in the list as soon
  as the backend (``softrdma/ibverbs/``) is in the tree.

The guest writes a JUnit XML report into ``lab.dir``; the host parses it and fails naming
every test that did not pass. The number of tests that ran must equal the number the host
collects, so a collection problem in the guest cannot pass as success.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "tests" / "conformance"
PYTHON = ROOT / ".venv" / "bin" / "python"

#: device -> the environment the suite runs with in the guest, and a command prefix.
DEVICES = {
    "soft": ({"SOFTRDMA_IP": "127.0.0.1"},
             "unshare -n sh -c 'ip link set lo up && exec \"$0\" \"$@\"'"),
    "rxe0": ({"SOFTRDMA_BACKEND": "ibverbs", "SOFTRDMA_CONFORMANCE_DEVICE": "rxe0",
              "SOFTRDMA_CONFORMANCE_GID": "1"}, ""),
}
GUEST_DEVICES = ["soft"] + (["rxe0"] if (ROOT / "softrdma" / "ibverbs").is_dir() else [])
#: the kernel rxe runs go to 6.12 as well: where the two kernels' rxe differ shows here
#: (DIFFERENCES in tests/conformance/conftest.py); the soft device's run is the guest's
#: softrdma, whatever the kernel
ON_BOTH_KERNELS = pytest.mark.kernels("6.1", "6.12")
#: the ibverbs backend's own device tests (tests/hw: every verb and opcode on the device,
#: the memory and lifetime rules, pyverbs beside it); collected only where a device is
HW_TESTS = ROOT / "tests" / "hw"
HW_ENV = {"SOFTRDMA_IBV_DEVICE": "rxe0"}


def host_collected(suite: Path = SUITE, env: dict[str, str] | None = None) -> list[str]:
    """The test ids the host collects from the suite (what the guest must run)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--collect-only", str(suite)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return [ln for ln in p.stdout.splitlines() if "::" in ln]


def junit_outcomes(xml_text: str) -> dict[str, str]:
    """test name -> "passed", "failed", "error" or "skipped", from a JUnit XML report."""
    out = {}
    for tc in ET.fromstring(xml_text).iter("testcase"):
        name = f"{tc.get('classname', '')}::{tc.get('name')}"
        kinds = {child.tag for child in tc}
        out[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
    return out


def failure_text(xml_text: str, limit: int = 6) -> str:
    parts = []
    for tc in ET.fromstring(xml_text).iter("testcase"):
        for child in tc:
            if child.tag in ("failure", "error") and len(parts) < limit:
                msg = (child.get("message") or "")[:300]
                parts.append(f"{tc.get('name')}: {msg}")
    return "\n".join(parts)


def run_in_guest(lab, name: str, suite: Path, env: dict[str, str], prefix: str,
                 collect_env: dict[str, str] | None = None) -> None:
    """Run ``suite`` with pytest in guest 0; every test must pass, and as many must run as
    the host collects."""
    report = lab.dir / f"{name}.xml"
    report.unlink(missing_ok=True)
    envs = " ".join(f"{k}={v}" for k, v in {**env, "PYTHONDONTWRITEBYTECODE": "1",
                                             "CI": "true"}.items())
    cmd = (f"cd /tmp && env {envs} {prefix} timeout 1500 {PYTHON} -m pytest -q "
           f"-p no:cacheprovider -o addopts= --junitxml={report} {suite} 2>&1 | tail -5")
    r = lab.guest(0, cmd, timeout=1560)
    assert report.exists(), f"no report from the guest (rc {r.rc}):\n{r.stdout}\n{r.stderr}"
    xml_text = report.read_text()
    outcomes = junit_outcomes(xml_text)
    bad = sorted(n for n, o in outcomes.items() if o != "passed")
    assert not bad, (f"{len(bad)} of {len(outcomes)} tests of {suite.name} did not pass in "
                     f"the guest ({name}): {bad}\n{failure_text(xml_text)}\n{r.stdout}")
    expected = host_collected(suite, collect_env)
    assert len(outcomes) == len(expected) > 10, (len(outcomes), len(expected), r.stdout)


@pytest.mark.parametrize("device", [pytest.param(d, marks=ON_BOTH_KERNELS) if d == "rxe0" else d
                                    for d in GUEST_DEVICES])
def test_conformance_suite_in_the_guest(lab, device):
    env, prefix = DEVICES[device]
    run_in_guest(lab, f"conformance-{device}", SUITE, env, prefix)


@ON_BOTH_KERNELS
def test_ibverbs_device_tests_in_the_guest(lab):
    """tests/hw on rxe0: the backend's own tests, which no host without a device collects."""
    run_in_guest(lab, "hw-rxe0", HW_TESTS, HW_ENV, "", collect_env=HW_ENV)


def test_junit_parsing_sees_failures_and_skips():
    """The parser the runner trusts: a failure, an error and a skip are all reported."""
    xml_text = ("<testsuites><testsuite>"
                "<testcase classname='a' name='ok'/>"
                "<testcase classname='a' name='bad'><failure message='boom'/></testcase>"
                "<testcase classname='a' name='err'><error message='oops'/></testcase>"
                "<testcase classname='a' name='skip'><skipped message='why'/></testcase>"
                "</testsuite></testsuites>")
    assert junit_outcomes(xml_text) == {"a::ok": "passed", "a::bad": "failed",
                                        "a::err": "error", "a::skip": "skipped"}
    assert "bad: boom" in failure_text(xml_text) and "err: oops" in failure_text(xml_text)
