"""Every ``pip install`` command in README.md and docs/ works as written.

The commands are read from the documents (fenced code blocks and inline code), so a command
added or changed there is tested without touching this file. Each is run by ``sh`` as
written, in a copy of the checkout (the directory every one of them says it runs in, "in a
checkout"; a copy, so the build leaves nothing in the real tree and uses no stale
``build/``), with a fresh virtual environment made by ``python -m venv`` first on PATH: its
own pip, the registry or pip's cache for the dependencies, nothing from the environment
running the tests. After each, from a directory outside the checkout, softrdma imports and
the ``softrdma`` command runs, and each package and each extra the command names is
installed. One environment serves every command, in the documents' order.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]*\bpip install\b[^`\n]*)`")
COMMAND = re.compile(r"^(?:\$ )?((?:python3? -m )?pip install\b.*)$")


def install_commands() -> dict[str, list[str]]:
    """``{command as written: ["doc:line", ...]}``, in the documents' order; a command is a
    code line (or inline code) that starts with ``pip install`` or ``python -m pip install``
    and names something to install. A code line that runs some other pip
    (``.venv/bin/pip install``) is reported as it is: the test says it cannot run it."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        spans = [(m.start(1), m.group(1)) for m in FENCE.finditer(text)]
        lines = [(text.count("\n", 0, start) + i + 1, line.strip())
                 for start, block in spans for i, line in enumerate(block.splitlines())]
        outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        lines += [(outside.count("\n", 0, m.start()) + 1, m.group(1).strip())
                  for m in INLINE.finditer(outside)]
        for lineno, line in sorted(lines):
            if "pip install" not in line:
                continue
            line = " ".join(re.sub(r"\s#.*", "", line).split())  # as sh reads it
            m = COMMAND.match(line)
            cmd = m.group(1) if m else line
            if m and len(cmd.split()) <= 2 + cmd.startswith("python"):
                continue  # "`pip install`" on its own names the command, installs nothing
            found.setdefault(cmd, []).append(f"{doc.relative_to(ROOT)}:{lineno}")
    return found


COMMANDS = install_commands()


def test_the_documents_have_install_commands():
    """The reader's way in is there (and the extraction above found it): README.md says
    how to install softrdma with pip, and docs/testing.md how to install it with pytest."""
    where = {w.split(":")[0] for ws in COMMANDS.values() for w in ws}
    assert {"README.md", "docs/testing.md"} <= where, COMMANDS
    assert "pip install ." in COMMANDS, COMMANDS


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A copy of the checkout, a fresh virtual environment (with its own pip) and the
    environment variables that make it the active one."""
    base = tmp_path_factory.mktemp("install-docs")
    checkout = base / "softrdma"
    shutil.copytree(ROOT, checkout, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__",
        ".pytest_cache", ".hypothesis", "tmp"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    environ["PATH"] = f"{venv / 'bin'}{os.pathsep}{environ.get('PATH', '')}"
    environ["VIRTUAL_ENV"] = str(venv)
    outside = base / "elsewhere"
    outside.mkdir()
    return {"checkout": checkout, "venv": venv, "environ": environ, "outside": outside}


def _installed(cmd: str) -> list[str]:
    """The distributions ``cmd`` asks for: softrdma for ``.``, each extra's requirements
    for ``.[a,b]``, and any other name on the command line."""
    names, extras = [], []
    for arg in cmd.split()[2 + cmd.startswith("python"):]:
        arg = arg.strip("'\"")
        if arg.startswith("-"):
            continue
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
        if m:
            names.append("softrdma")
            extras += (m.group(1) or "").split(",") if m.group(1) else []
        else:
            names.append(re.match(r"[A-Za-z0-9_.-]+", arg).group(0))
    return names + [f"extra:{x}" for x in extras]


CHECK = r"""
import importlib.metadata as md, re, sys
import softrdma
print(softrdma.__file__)
for want in sys.argv[1:]:
    if want.startswith("extra:"):
        extra = want[6:]
        reqs = [r for r in md.requires("softrdma") or ()
                if re.search(r"extra\s*==\s*['\"]%s['\"]" % re.escape(extra), r)]
        assert reqs, f"softrdma has no extra {extra!r}"
        for r in reqs:
            md.version(re.match(r"[A-Za-z0-9_.-]+", r).group(0))
    else:
        md.version(want)
"""


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_the_documented_install_command_works(env, cmd):
    """``cmd``, run as written in a checkout with a fresh environment active, succeeds;
    then outside the checkout softrdma imports from that environment (or, installed
    editable, from the checkout), ``softrdma --version`` runs, and what the command names
    is installed."""
    where = ", ".join(COMMANDS[cmd])
    assert COMMAND.match(cmd), f"{where}: {cmd!r} does not run the active environment's pip"
    r = subprocess.run(["sh", "-c", cmd], cwd=env["checkout"], env=env["environ"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{where}: {cmd} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
    py = env["venv"] / "bin" / "python"
    r = subprocess.run([str(py), "-c", CHECK, *_installed(cmd)], cwd=env["outside"],
                       env=env["environ"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{where}: after {cmd}:\n{r.stderr[-3000:]}"
    home = Path(r.stdout.splitlines()[0]).resolve()
    assert home.is_relative_to(env["venv"].resolve()) or \
        home.is_relative_to(env["checkout"].resolve()), home
    r = subprocess.run([str(env["venv"] / "bin" / "softrdma"), "--version"],
                       cwd=env["outside"], env=env["environ"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("softrdma "), (r.stdout, r.stderr)
