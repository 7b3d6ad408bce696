"""The rxe lab works however the interpreter was started.

A fresh machine runs the tests as ``.venv/bin/python -m pytest`` with the virtual
environment not activated, so ``.venv/bin`` (where virtme-ng puts ``vng`` and the
``virtme-run`` that ``vng`` calls by name) is not on PATH. This once made every interop test
fail on a new machine while passing on the one that built it. These tests run the lab's own
boot command from a scrubbed environment, with ``--dry-run`` so nothing boots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from softrdma.harness import lab

from .conftest import IN_CI, ROOT

CLEAN_PATH = "/usr/bin:/bin"  # no venv, not even sbin: the poorest PATH a CI shell might have

_PROBE = r"""
import json, subprocess, sys
from softrdma.harness import lab
kernel = lab._kernel()
out = {"missing": lab.missing_prerequisites(), "kernel": kernel}
if kernel:
    p = subprocess.run(lab.vng_command(kernel, "--dry-run", "--exec", "true"),
                       capture_output=True, text=True, env=lab.tool_env(), timeout=60)
    out.update(rc=p.returncode, stdout=p.stdout, stderr=p.stderr)
print(json.dumps(out))
"""


def _require_lab_tools() -> None:
    miss = lab.missing_prerequisites()
    if miss:
        msg = "rxe lab prerequisites missing: " + ", ".join(miss)
        if IN_CI:
            pytest.fail("CI=true and " + msg)
        pytest.skip(msg)


def test_tool_path_puts_this_interpreters_bin_first(monkeypatch):
    monkeypatch.setenv("PATH", CLEAN_PATH)
    parts = lab.tool_path().split(os.pathsep)
    assert parts[0] == str(Path(sys.executable).parent)
    assert "/usr/sbin" in parts and "/usr/bin" in parts
    assert len(parts) == len(set(parts))


def test_lab_boot_command_resolves_from_a_clean_environment():
    _require_lab_tools()
    env = {"PATH": CLEAN_PATH, "HOME": os.environ.get("HOME", "/root"),
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["missing"] == []
    assert out["rc"] == 0, out["stderr"]
    assert "not found" not in out["stdout"] + out["stderr"]
    # vng printed the qemu command virtme-run built: the whole chain ran
    assert "qemu-system-x86_64" in out["stdout"] and out["kernel"] in out["stdout"]
