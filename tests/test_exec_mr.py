"""ibv_reg_mr under softrdma exec answers about the program's memory as the kernel does.

On Linux the kernel pins the pages of a registration (``ib_umem_get``), so a bad address
fails there, with EFAULT, before any MR exists; softrdma reads the program's bytes in
place and asks /proc/self/maps instead (softrdma/exec/pages.py). Without that check an
unmapped or read-only buffer would register, and the first packet that touched it would
kill the whole program with SIGSEGV inside the device. The program is ours
(tests/programs/exec_mr_checks.c), built against Debian's headers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import require_tool

PROGRAMS = Path(__file__).parent / "programs"


def test_reg_mr_refuses_memory_the_kernel_would_not_pin(tmp_path):
    gcc = require_tool("gcc")
    exe = tmp_path / "exec_mr_checks"
    subprocess.run([gcc, "-O1", "-Wall", "-o", str(exe), str(PROGRAMS / "exec_mr_checks.c"),
                    "-libverbs"], check=True, capture_output=True, text=True)
    r = subprocess.run([sys.executable, "-m", "softrdma", "exec", "--addr", "127.0.0.79", "--",
                        str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    oks = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert oks == ["unmapped", "past_the_mapping", "within_the_mapping",
                   "read_only_for_writing", "read_only_for_reading", "iova_offset",
                   "iova_same_offset", "access_before_pages"], r.stdout + r.stderr
    assert "Traceback" not in r.stderr
