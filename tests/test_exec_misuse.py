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


def test_closing_a_context_with_live_objects_destroys_them_as_closing_uverbs_does(tmp_path):
    """tests/programs/exec_close_live.c closes a context that still holds a PD, an MR, a
    memory window, an AH, an SRQ, a CQ on a channel with an event not acknowledged, and an
    RC QP connected to a QP of a second context. As when Linux closes the uverbs file:
    every object goes (no descriptor of the context stays open), the peer's next SEND
    completes with IBV_WC_RETRY_EXC_ERR (timeout 14, retry_cnt 3: about 0.27 s, allowed
    60 s), each stale pointer afterwards -- the data path's inlines through
    ``qp->context->ops`` included -- is EINVAL and never a crash, and a context opened
    after works."""
    exe = _compile(tmp_path, "exec_close_live")
    r = subprocess.run(_exec("127.0.3.22", exe), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    oks = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert oks == ["connected", "closed", "descriptors", "stale", "peer", "device"], \
        r.stdout + r.stderr
    assert "Traceback" not in r.stderr


#: a Python host under exec: it opens a context, leaves a PD, a channel, a CQ on it and an
#: MR in it, closes the context and says whether softrdma's records are as before
_RECORDS_PROBE = """
import ctypes
from ctypes import c_void_p, c_int
lib = ctypes.CDLL(None, use_errno=True)
def fn(name, res, *args):
    f = getattr(lib, name); f.restype = res; f.argtypes = args; return f
devs = fn("ibv_get_device_list", ctypes.POINTER(c_void_p), c_void_p)(None)
from softrdma.exec.shim import handles  # the library's own, loaded by that first call
before = handles.count()
ctx = fn("ibv_open_device", c_void_p, c_void_p)(devs[0])
pd = fn("ibv_alloc_pd", c_void_p, c_void_p)(ctx)
ch = fn("ibv_create_comp_channel", c_void_p, c_void_p)(ctx)
cq = fn("ibv_create_cq", c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int)(
    ctx, 4, None, ch, 0)
buf = ctypes.create_string_buffer(64)
mr = fn("ibv_reg_mr", c_void_p, c_void_p, c_void_p, ctypes.c_size_t, c_int)(pd, buf, 64, 1)
assert pd and ch and cq and mr
alive = handles.count()
assert fn("ibv_close_device", c_int, c_void_p)(ctx) == 0
print(sorted(set(alive) - set(before)), handles.count() == before)
"""


def test_closing_a_context_forgets_the_exec_records_of_its_objects(tmp_path):
    """The records softrdma exec keeps for each structure it handed out (shim.handles)
    go with the context: after ibv_close_device of a context left with a PD, a channel,
    a CQ and an MR, the records are exactly those from before it was opened (seen from a
    Python host, whose interpreter runs the library)."""
    r = subprocess.run(_exec("127.0.3.23", "/usr/bin/python3", "-c", _RECORDS_PROBE),
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "['comp_channel', 'context', 'cq', 'mr', 'pd'] True", \
        r.stdout + r.stderr
