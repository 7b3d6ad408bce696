"""A C program that waits by spinning on ``ibv_poll_cq`` does not hold a CPU under
``softrdma exec`` once its CQ has stayed empty past the busy-poll window
(``softrdma.exec.queues.empty_first_poll``, ``SOFTRDMA_EXEC_POLL_YIELD``).

Why it matters: librdmacm's mckey waits for its messages this way; on a 2-core machine the
spinning receiver took a CPU from the lab's kernel-rxe guest (software-emulated), whose
send task then reached none of mckey's 50 SENDs before mckey destroyed its QP, in every
attempt of a CI run. On a real NIC a spinning poll costs only its own CPU; a software
device shares the CPU with its peers."""

from __future__ import annotations

import os
import subprocess

import pytest

from .exec_pair import compile_program, exec_argv

pytestmark = pytest.mark.usefixtures("exec_library")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return compile_program(tmp_path_factory.mktemp("spin"), "exec_poll_spin")


def _spin(program: str, addr: str, switch: str) -> tuple[float, float, int]:
    env = {**os.environ, "SOFTRDMA_EXEC_POLL_YIELD": switch}
    r = subprocess.run(exec_argv(addr, program, "2"), capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.startswith("CPU "), r.stdout + r.stderr
    f = r.stdout.split()
    return float(f[1]), float(f[3]), int(f[5])


def test_a_program_spinning_on_an_empty_cq_leaves_the_cpu(program):
    """Two seconds of polling an empty CQ cost under a quarter of a CPU (spinning costs
    all of one: about 1.0 on a quiet machine with the switch off), and every poll still
    answers 0 (the program checks each)."""
    cpu, wall, polls = _spin(program, "127.0.3.71", "1")
    assert wall >= 2.0
    assert cpu < 0.25 * wall, (cpu, wall, polls)
    # it kept polling: a wait is at most POLL_YIELD_SLICE (1 ms), so hundreds a second
    assert polls > 500, polls


def test_the_switch_restores_answering_at_once(program):
    """SOFTRDMA_EXEC_POLL_YIELD=0: every empty poll answers at once (many more polls in the
    same time than with the switch on: far more than the 2,000 a 1 ms wait allows)."""
    cpu, wall, polls = _spin(program, "127.0.3.72", "0")
    assert polls > 20_000, (cpu, wall, polls)
