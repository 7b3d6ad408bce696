"""``softrdma exec``: unmodified C programs linked against Debian's libibverbs, served by
softrdma through the preload library (softrdma.exec, issue 27). Real binaries only:
ibverbs-utils' ``ibv_devices`` and Debian's compiled pyverbs (python3-pyverbs), each in a
process of its own, against what softrdma's own tools say about the same device."""

from __future__ import annotations

import os
import subprocess
import sys

from softrdma.exec.build import library_path

IP = "127.0.0.78"  # the tests' own device address: no other test's default device


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _softrdma_devices() -> str:
    r = _run(sys.executable, "-m", "softrdma", "devices", env={"SOFTRDMA_IP": IP})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_ibv_devices_lists_the_soft_device_as_softrdma_devices_does():
    """Debian's /usr/bin/ibv_devices, unchanged, under ``softrdma exec``: its
    ibv_get_device_list / ibv_get_device_name / ibv_get_device_guid calls are answered by
    softrdma, so it prints what ``softrdma devices`` prints for the same address (name
    and node GUID in the same byte order) -- without it, the machine has no RDMA device
    and the tool says so."""
    r = _run(sys.executable, "-m", "softrdma", "exec", "--addr", IP, "--", "ibv_devices")
    assert r.returncode == 0, r.stderr
    assert r.stdout == _softrdma_devices()
    assert "softrdma0" in r.stdout and "00007ffffe00004e" in r.stdout  # 127.0.0.78
    bare = _run("ibv_devices")  # the same binary without softrdma: no device at all
    assert "softrdma0" not in bare.stdout


def test_compiled_pyverbs_sees_the_device_by_its_name():
    """Debian's pyverbs (Cython, linked against libibverbs) reads the name from
    ``struct ibv_device`` itself, not through ibv_get_device_name: the structure handed
    out has the installed header's layout, so the name is where pyverbs looks."""
    code = "import pyverbs.device as d; print([x.name.decode() for x in d.get_device_list()])"
    r = _run(sys.executable, "-m", "softrdma", "exec", "--addr", IP, "--", "/usr/bin/python3",
             "-X", "faulthandler", "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['softrdma0']"


def test_the_library_is_built_once_and_printed_for_other_launchers():
    """The preload library is cached (a second request does not rebuild it), and
    ``--print-env`` gives the variables a launcher of its own (mpirun, a test runner)
    sets: the library first in LD_PRELOAD, the path softrdma is imported from."""
    lib = library_path()
    before = lib.stat().st_mtime_ns
    assert library_path() == lib and lib.stat().st_mtime_ns == before
    r = _run(sys.executable, "-m", "softrdma", "exec", "--print-env",
             env={"LD_PRELOAD": "/lib/other.so"})
    assert r.returncode == 0, r.stderr
    lines = dict(line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())
    assert lines["LD_PRELOAD"].strip("'").split() == [str(lib), "/lib/other.so"]
    assert "SOFTRDMA_EXEC_PATH" in lines
    env = {k: v.strip("'") for k, v in lines.items()}
    r2 = _run("ibv_devices", env={**env, "SOFTRDMA_IP": IP})
    assert r2.stdout == _softrdma_devices()


def test_no_program_is_a_one_line_error():
    r = _run(sys.executable, "-m", "softrdma", "exec")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].endswith(
        "no program given (softrdma exec -- PROGRAM [ARGS])"), r.stderr
