"""``softrdma exec``: unmodified C programs linked against Debian's libibverbs, served by
softrdma through the preload library (softrdma.exec, issue 27). Real binaries only:
ibverbs-utils' ``ibv_devices`` and Debian's compiled pyverbs (python3-pyverbs), each in a
process of its own, against what softrdma's own tools say about the same device."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

from softrdma.exec.build import library_path

IP = "127.0.0.78"  # the tests' own device address: no other test's default device


def _run(*argv: str, env: dict[str, str] | None = None,
         cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=cwd)


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


def test_compiled_pyverbs_sees_the_device_by_its_name(tmp_path):
    """Debian's pyverbs (Cython, linked against libibverbs) reads the name from
    ``struct ibv_device`` itself, not through ibv_get_device_name: the structure handed
    out has the installed header's layout, so the name is where pyverbs looks."""
    code = "import pyverbs.device as d; print([x.name.decode() for x in d.get_device_list()])"
    # from a directory of its own: pyverbs' get_device_list also calls
    # ibv_get_device_index, which once fell through to the real libibverbs and crashed
    # on softrdma's device structure (how much depended on the heap, so on the cwd)
    r = _run(sys.executable, "-m", "softrdma", "exec", "--addr", IP, "--", "/usr/bin/python3",
             "-X", "faulthandler", "-c", code, cwd=str(tmp_path))
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


def _fields(text: str) -> dict[str, str]:
    """``key: value`` lines of a devinfo listing, values normalized (hex and decimal
    numbers as ints, the rest as written)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        value = value.strip()
        if not sep or not value:
            continue
        word = value.split()[0]
        try:
            value = str(int(word, 16 if word.startswith("0x") else 10))
        except ValueError:
            pass
        out[key.strip()] = value
    return out


def test_ibv_devinfo_says_what_softrdma_devinfo_says():
    """Debian's /usr/bin/ibv_devinfo -v, unchanged: ibv_open_device, ibv_query_device
    (reached through ibv_query_device_ex's fallback), ibv_query_port (through verbs.h's
    inline ___ibv_query_port), ibv_query_gid and ibv_query_gid_type answered by softrdma.
    Every attribute both listings show has the same value, the GIDs included."""
    r = _run(sys.executable, "-m", "softrdma", "exec", "--addr", IP, "--", "ibv_devinfo", "-v")
    assert r.returncode == 0, r.stderr
    ours = _run(sys.executable, "-m", "softrdma", "devinfo", "-v", env={"SOFTRDMA_IP": IP})
    c, py = _fields(r.stdout), _fields(ours.stdout)
    common = set(c) & set(py)
    for key in ("hca_id", "node_guid", "sys_image_guid", "vendor_id", "phys_port_cnt",
                "max_mr_size", "max_qp", "max_qp_wr", "max_cqe", "max_mr", "max_srq",
                "max_pkeys", "state", "active_mtu", "link_layer", "gid_tbl_len",
                "GID[  1]"):
        assert key in common, (key, r.stdout)
    assert {k: c[k] for k in common} == {k: py[k] for k in common}
    assert c["GID[  1]"].startswith("::ffff:127.0.0.78")


def _exported_functions(path: str) -> set[str]:
    out = subprocess.run(["objdump", "-T", path], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines()
            if " DF .text" in line and "PRIVATE" not in line}


def test_every_function_of_libibverbs_and_librdmacm_is_answered_by_softrdma():
    """The preload library defines every function Debian's libibverbs.so.1 and
    librdmacm.so.1 export (and the one private symbol ibv_devinfo imports): a call that
    reached the real library would hand it a softrdma structure it cannot read."""
    real = _exported_functions("/lib/x86_64-linux-gnu/libibverbs.so.1")
    real |= _exported_functions("/lib/x86_64-linux-gnu/librdmacm.so.1")
    assert len(real) > 140 and "ibv_get_device_index" in real and "rsocket" in real
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library_path())],
                        capture_output=True, text=True, check=True).stdout
    ours = {line.split()[-1] for line in nm.splitlines() if line.split()[-2] == "T"}
    assert real | {"ibv_query_gid_type"} <= ours, sorted(real - ours)


def test_an_unsupported_verb_fails_with_eopnotsupp_and_says_so(tmp_path):
    """A verb softrdma does not support (dma-buf memory) fails as a provider without it
    fails: NULL, errno EOPNOTSUPP, and one line naming the verb on stderr."""
    code = ("import ctypes, errno; lib = ctypes.CDLL(None, use_errno=True); "
            "f = lib.ibv_reg_dmabuf_mr; f.restype = ctypes.c_void_p; "
            "r = f(None, 0, 4096, 0, -1, 0); print(r, ctypes.get_errno())")
    r = _run(sys.executable, "-m", "softrdma", "exec", "--addr", IP, "--", "/usr/bin/python3",
             "-c", code, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", str(errno.EOPNOTSUPP)]
    assert "ibv_reg_dmabuf_mr is not supported by softrdma" in r.stderr
