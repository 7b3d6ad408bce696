"""Shared test helpers.

``require_tool`` is the only way a test may depend on an external program: locally a
missing tool skips with one line naming it; under CI (``CI=true``) it fails, so CI can never
silently skip a check.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PCAPS = ROOT / "pcaps" / "linux-rxe"
RXE_PCAPS = sorted(PCAPS.rglob("*.pcap"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (apt-get install {name}; scripts/setup installs it)"
        if IN_CI:
            pytest.fail(f"CI=true and a prerequisite is missing: {msg}")
        pytest.skip(msg)
    return path
