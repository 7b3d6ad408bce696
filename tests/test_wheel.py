"""softrdma as a user installs it: the wheel, in a fresh environment, used from elsewhere.

The module's fixture builds the wheel from a copy of the checkout (``pip wheel --no-deps``:
the build the user's ``pip install .`` does), installs it with pytest into a fresh virtual
environment (``python -m venv --without-pip``, installed into by this interpreter's pip;
dependencies from the registry or pip's cache) and gives every test a directory outside the
checkout, with no ``PYTHONPATH``: nothing but the installed wheel can be imported. Each test
is one thing a newcomer does first, as the docs show it: each tool's smallest real use on
this file's loopback addresses (127.0.2.x, TCP port 22001), the tools and the pytest
plugin's examples (docs/testing.md) reading the reference captures installed with the
package, and the README's first program.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from .conftest import ROOT
from .test_pytest_plugin_doc import examples

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CAPTURES = sorted(p.name for p in (ROOT / "pcaps" / "linux-rxe").glob("*.pcap"))


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The built wheel, installed with pytest into a fresh environment; ``run(*argv)`` runs
    a command of that environment's ``bin/`` in a directory outside the checkout."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "checkout"
    junk = shutil.ignore_patterns(".git", ".venv", "build", "dist", "site", "*.egg-info",
                                  "__pycache__", ".pytest_cache", ".hypothesis", "tmp")
    shutil.copytree(ROOT, src, symlinks=True, ignore=lambda d, names: junk(d, names) | (
        {"pcaps", "tests"} if Path(d) == ROOT else set()))  # what the wheel must not need
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "SOFTRDMA_IP")}
    env["CI"] = ""  # the lab example is the skip docs/testing.md shows, as on a laptop
    pip = [sys.executable, "-m", "pip"]
    r = subprocess.run(pip + ["wheel", "-q", "--no-deps", "-w", str(base / "dist"), str(src)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (base / "dist").glob("softrdma-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = subprocess.run(pip + ["--python", str(venv / "bin" / "python"), "install", "-q",
                              str(wheel), "pytest"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    home = base / "elsewhere"
    home.mkdir()

    def run(*argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        e = dict(env, **kw.pop("env", {}))
        exe = venv / "bin" / argv[0]
        return subprocess.run([str(exe) if exe.exists() else argv[0], *argv[1:]],
                              cwd=kw.pop("cwd", home),
                              env=e, capture_output=True, text=True, timeout=timeout, **kw)

    def popen(*argv: str) -> subprocess.Popen:
        return subprocess.Popen([str(venv / "bin" / argv[0]), *argv[1:]], cwd=home, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    return {"run": run, "popen": popen, "home": home, "wheel": wheel, "venv": venv}


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stdout[-2000:],
                                                                r.stderr[-3000:])
    return r.stdout


def _capture(wheel_env, name: str) -> str:
    """The installed copy of pcaps/linux-rxe/``name``, as a user finds it (docs/install.md)."""
    out = _ok(wheel_env["run"]("python", "-c", "from softrdma.data import reference_capture "
                               f"as r; print(r('linux-rxe/{name}'))"))
    path = Path(out.strip())
    assert path.is_relative_to(wheel_env["venv"]) and \
        path.read_bytes() == (ROOT / "pcaps" / "linux-rxe" / name).read_bytes()
    return str(path)


def test_the_wheel_holds_the_reference_captures(wheel_env):
    """Every capture of pcaps/linux-rxe/ (the tools' and the guides' reference set) is in
    the installed package, byte for byte, and importing softrdma finds the installed
    package, not a checkout."""
    out = _ok(wheel_env["run"]("python", "-c", "import softrdma, softrdma.data as d; "
                               "print(softrdma.__file__); print(*d.reference_captures())"))
    where, names = out.splitlines()
    assert Path(where).is_relative_to(wheel_env["venv"])
    assert names.split() == [f"linux-rxe/{n}" for n in CAPTURES]
    for n in CAPTURES:
        _capture(wheel_env, n)


def test_version_and_devices(wheel_env):
    """``softrdma --version`` names the project's version; ``softrdma devices`` lists the
    default device (pinned to this file's loopback address)."""
    assert _ok(wheel_env["run"]("softrdma", "--version")).strip() == f"softrdma {VERSION}"
    out = _ok(wheel_env["run"]("softrdma", "devices", env={"SOFTRDMA_IP": "127.0.2.5"}))
    assert "softrdma0" in out


def test_a_pingpong_pair(wheel_env):
    """``softrdma pingpong rc`` server and client, two processes on 127.0.2.1 and
    127.0.2.2: both finish their 20 iterations with checked buffers."""
    srv = wheel_env["popen"]("softrdma", "pingpong", "rc", "--addr", "127.0.2.1", "-p", "22001",
                             "-n", "20", "-c")
    try:
        time.sleep(0.5)
        cli = wheel_env["run"]("softrdma", "pingpong", "rc", "--addr", "127.0.2.2", "-p",
                               "22001", "-n", "20", "-c", "127.0.2.1")
        out, err = srv.communicate(timeout=60)
    finally:
        srv.kill()
    assert srv.returncode == 0, err
    for text in (_ok(cli), out):
        assert re.search(r"^20 iters in ", text, re.M) and "Invalid data" not in text, text


def test_dissect_and_check_an_installed_capture(wheel_env):
    """docs/install.md's ``softrdma dissect`` of the installed rc_pingpong capture by its
    name, run by ``sh`` as written, shows its 66 frames (the count its README gives), and
    ``softrdma check`` finds the capture clean, by path and by name."""
    cmd = re.search(r'^softrdma dissect linux-rxe/rc_pingpong\.pcap$',
                    (ROOT / "docs" / "install.md").read_text(), re.M).group(0)
    out = _ok(wheel_env["run"]("sh", "-c", cmd))
    assert sum("10.77.0.1" in line for line in out.splitlines()) == 66, out
    _ok(wheel_env["run"]("softrdma", "check", _capture(wheel_env, "rc_pingpong.pcap")))
    _ok(wheel_env["run"]("softrdma", "check", "linux-rxe/rc_pingpong.pcap"))


@pytest.mark.parametrize("target,addr,seeds", [
    ("data", 11, "RoCE frames from 13 captures"),
    ("cm", 21, r"CM MADs \(3 captures")],  # the README's three rdma_cm captures hold MADs
    ids=["data", "cm"])
def test_fuzz_seeds_from_the_installed_captures(wheel_env, target, addr, seeds):
    """``softrdma fuzz`` (RoCE frames, and CM MADs) with no ``--pcaps``, outside a checkout:
    its seeds come from the installed captures, and a short run passes its checks."""
    out = _ok(wheel_env["run"]("softrdma", "fuzz", "--target", target, "--seconds", "2",
                               "--addrs", f"127.0.2.{addr}", f"127.0.2.{addr + 1}",
                               timeout=120))
    assert re.search(r"^seeds: \d+ " + seeds, out, re.M), out


def test_bench_makes_a_capture_from_the_installed_templates(wheel_env):
    """``softrdma bench capture --make`` tiles the installed rxe captures into a longer one
    (no checkout needed), which ``softrdma check`` finds clean."""
    path = wheel_env["home"] / "long.pcap"
    _ok(wheel_env["run"]("softrdma", "bench", "capture", "--packets", "500", "--make",
                         str(path)))
    _ok(wheel_env["run"]("softrdma", "check", str(path)))


def test_the_pytest_plugin_examples(wheel_env):
    """docs/testing.md's examples (qp_pair, sim_network, soft_device, softrdma_replay of an
    installed capture, the diff of an edited one, rxe_lab's skip) as a project of their
    own, run by the installed pytest with the installed plugin: each file's outcome is the
    one its first line states."""
    project = wheel_env["home"] / "project"
    project.mkdir()
    exs = examples()
    for name, _, body, _ in exs:
        (project / name).write_text(body)
    (project / "conftest.py").write_text(  # the lab cannot boot here: say so, as on a laptop
        "import softrdma.harness.lab as lab\n"
        "lab.missing_prerequisites = lambda: ['qemu-system-x86_64 (qemu-system-x86)']\n")
    r = wheel_env["run"]("python", "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                         cwd=project, timeout=120)
    got: dict[str, dict[str, int]] = {name: {} for name, *_ in exs}
    for line in r.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED) (test_\w+\.py)::", line) or \
            re.match(r"(SKIPPED) \[(\d+)\] (test_\w+\.py):", line)
        if m and m.group(1) == "SKIPPED":
            got[m.group(3)]["skipped"] = got[m.group(3)].get("skipped", 0) + int(m.group(2))
        elif m:
            k = m.group(1).lower()
            got[m.group(2)][k] = got[m.group(2)].get(k, 0) + 1
    assert got == {name: dict(want) for name, want, *_ in exs}, r.stdout[-4000:]
    lines = [" ".join(x.split()) for x in r.stdout.splitlines()]
    for name, _, _, shown in exs:  # the output the guide shows after an example
        for want in shown:
            pattern = "*" + glob.escape(" ".join(want.split())).replace("...", "*") + "*"
            assert fnmatch.filter(lines, pattern), (name, want, r.stdout[-4000:])


def test_the_readmes_first_program(wheel_env):
    """README.md's first program, run with ``python -c`` from elsewhere, prints what its
    last line's comment says: status 0 and the bytes written."""
    text = (ROOT / "README.md").read_text()
    program = re.search(r"## A first program.*?```python\n(.*?)```", text, re.S).group(1)
    want = re.search(r"# (0 b'[^']*')", program).group(1)
    out = _ok(wheel_env["run"]("python", "-c", program, env={"SOFTRDMA_IP": "127.0.2.20"}))
    assert out.strip() == want


def test_the_wheel_carries_its_license(wheel_env):
    """The wheel declares MIT (an SPDX expression) and carries the LICENSE file's text."""
    import zipfile
    with zipfile.ZipFile(wheel_env["wheel"]) as whl:
        names = whl.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: MIT" in whl.read(meta).decode().splitlines()
        (lic,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert whl.read(lic).decode() == (ROOT / "LICENSE").read_text()
