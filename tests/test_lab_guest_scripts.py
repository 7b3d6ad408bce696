"""The lab's guest scripts (softrdma/harness/lab/guest/) are real files: they compile, the
shell script parses, they ship as package data, and the agent and client work together on
this host exactly as the host and a guest use them (no VM needed)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from softrdma.harness import lab

GUEST = Path(lab.__file__).parent / "guest"


def test_every_guest_script_is_shipped_and_read_from_the_package():
    assert sorted(p.name for p in GUEST.iterdir() if p.is_file()) == sorted(lab.GUEST_SCRIPTS)
    for name in lab.GUEST_SCRIPTS:
        assert lab.guest_script(name) == (GUEST / name).read_text()


@pytest.mark.parametrize("name", [n for n in lab.GUEST_SCRIPTS if n.endswith(".py")])
def test_guest_python_scripts_compile(name):
    compile((GUEST / name).read_text(), str(GUEST / name), "exec")


def test_guest_setup_script_parses_with_sh_n():
    sh = shutil.which("sh")
    assert sh, "no sh on this machine"
    p = subprocess.run([sh, "-n", str(GUEST / "setup.sh")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (GUEST / "setup.sh").read_text().startswith("#!/bin/sh\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_agent_and_client_answer_requests(tmp_path):
    port = _free_port()
    agent = subprocess.Popen([sys.executable, str(GUEST / "agent.py"), "127.0.0.1", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ask(req: dict) -> dict:
        p = subprocess.run([sys.executable, str(GUEST / "client.py"), "127.0.0.1", str(port),
                            json.dumps(req)], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])

    try:
        assert ask({"op": "ping", "_connect": 10}) == {"rc": 0, "stdout": "pong", "stderr": ""}
        r = ask({"op": "run", "cmd": "echo out; echo err >&2; exit 3"})
        assert r == {"rc": 3, "stdout": "out\n", "stderr": "err\n"}
        assert ask({"op": "start", "id": "j1", "cmd": "sleep 0.2; echo done"})["rc"] == 0
        assert ask({"op": "wait", "id": "j1"}) == {"rc": 0, "stdout": "done\n", "stderr": ""}
        r = ask({"op": "run", "cmd": "sleep 5", "timeout": 0.2})
        assert r["rc"] == 124 and r["stderr"].endswith("TIMEOUT")
    finally:
        agent.kill()
        agent.wait(timeout=10)
    # and an agent that is not there: the client says so in the agent's format
    t = time.monotonic()
    r = ask({"op": "ping", "_connect": 0.5})
    assert r["rc"] == 255 and r["stderr"] == "agent unreachable"
    assert time.monotonic() - t < 10
