"""softrdma exec's data-path fast paths keep the verbs' semantics (not their speed): a C
program (tests/programs/exec_speed_paths.c, built here against Debian's headers) spinning
on ``ibv_poll_cq`` -- the path ``SOFTRDMA_EXEC_FAST_POLL`` switches, which answers an
empty CQ without the device lock -- sees 0 and an untouched array on an empty CQ, every
completion of a batch once and in order when it polls a few at a time, a completion the
progress thread took while the program slept on its first poll after; post lists with a
bad WR in the middle stop there (EINVAL, ``bad_wr`` at it, the WRs before it posted and
completed, none after). Both ways of the switch."""

from __future__ import annotations

import os
import subprocess

import pytest

from .exec_pair import compile_program, exec_argv

pytestmark = pytest.mark.usefixtures("exec_library")
CHECKS = ["empty_poll", "batch", "bad_send_wr", "bad_recv_wr", "idle_arrival", "teardown"]


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return compile_program(tmp_path_factory.mktemp("speed"), "exec_speed_paths")


@pytest.mark.parametrize("fast, addr", [("1", "127.0.3.61"), ("0", "127.0.3.62")])
def test_speed_paths_program(program, fast, addr):
    """Every check of the program passes, with the fast poll on and off."""
    env = {**os.environ, "SOFTRDMA_EXEC_FAST_POLL": fast}
    r = subprocess.run(exec_argv(addr, program), capture_output=True, text=True, timeout=120,
                       env=env)
    oks = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert r.returncode == 0 and oks == CHECKS, r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_fast_poll_switch_selects_the_path():
    """SOFTRDMA_EXEC_FAST_POLL=0 gives a CQ record the soft CQ's own poll; unset, the
    empty-first one (so the test above ran both paths)."""
    code = ("import softrdma.exec.queues as q; print(q.FAST_POLL)")
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "SOFTRDMA_EXEC_FAST_POLL": value}
        out = subprocess.run([os.sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == want
