"""``softrdma exec``: C programs that misuse the libraries, or are misused, behave as on
Linux. Each test runs a real binary under ``softrdma exec`` (Debian's, or a small program
of tests/programs/ compiled here against the installed headers):

* the blocking waits (``ibv_get_cq_event``, ``ibv_get_async_event``,
  ``rdma_get_cm_event``) end with EINTR on a signal handled without SA_RESTART and go on
  with SA_RESTART, as the ``read()`` of a uverbs or rdma_cm file does;
* ``ibv_close_device`` with objects still alive destroys them all, as closing the uverbs
  file does, and later calls with their stale pointers are EINVAL, never a crash;
* a program killed in the middle of an rdma_cm transfer leaves its peer an error in
  bounded time, a working device and no leaked descriptor.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from softrdma.exec.build import library_path

from .conftest import require_tool

SOFT = [sys.executable, "-m", "softrdma"]
PROGRAMS = Path(__file__).parent / "programs"


def _exec(addr: str, *argv: str) -> list[str]:
    return SOFT + ["exec", "--addr", addr, "--", *argv]


@pytest.fixture(scope="module", autouse=True)
def _library_built():
    """Build the preload library once, before two launchers would build it at once."""
    library_path()


def _compile(tmp_path: Path, name: str, *libs: str) -> str:
    gcc = require_tool("gcc")
    exe = tmp_path / name
    r = subprocess.run([gcc, "-O1", "-Wall", "-o", str(exe), str(PROGRAMS / f"{name}.c"),
                        "-libverbs", *libs], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(exe)


@pytest.mark.parametrize("mode,expected", [
    ("norestart", ["EINTR cq_event", "OK cq_event", "EINTR async_event", "OK async_event",
                   "EINTR cm_event", "OK cm_event"]),
    ("restart", ["RESTARTED cq_event", "RESTARTED async_event", "RESTARTED cm_event"]),
])
def test_a_signal_ends_a_blocking_wait_with_eintr_unless_sa_restart(tmp_path, mode, expected):
    """tests/programs/exec_eintr.c blocks in ibv_get_cq_event, ibv_get_async_event and
    rdma_get_cm_event with an alarm(1) pending. On Linux each is a blocking read() of the
    uverbs or rdma_cm file: without SA_RESTART the handler's signal fails the call with
    EINTR (how a program stops waiting), and the event made afterwards is then returned by
    the same call; with SA_RESTART the kernel restarts the read and the call returns the
    event a thread makes 0.3 s after the handler ran. (Python's own waits retry after
    EINTR, PEP 475: without the libc read the first case hangs, bounded here by the
    timeout.)"""
    exe = _compile(tmp_path, "exec_eintr", "-lrdmacm", "-lpthread")
    r = subprocess.run(_exec("127.0.3.21", exe, mode, "127.0.3.21"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:-1] == expected, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
