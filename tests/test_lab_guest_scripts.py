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
        # a background job: poll, then kill its whole process group and keep its output
        # (the shell and the sleep it started: a timeout or kill must reach both)
        pidfile = tmp_path / "child.pid"
        assert ask({"op": "start", "id": "j2",
                    "cmd": f"echo started; sleep 30 & echo $! > {pidfile}; wait"})["rc"] == 0
        assert ask({"op": "poll", "id": "j2"})["stdout"] == "running"
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pidfile.read_text())
        r = ask({"op": "kill", "id": "j2", "signal": 15})
        assert r["rc"] == -15 and r["stdout"] == "started\n"
        assert not Path(f"/proc/{child}").exists() or \
            Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        assert ask({"op": "poll", "id": "j2"})["stdout"] == "unknown"
        # a job that ended by itself reports "exited" and kill collects it like wait
        assert ask({"op": "start", "id": "j3", "cmd": "echo bye; exit 4"})["rc"] == 0
        deadline = time.monotonic() + 10
        while ask({"op": "poll", "id": "j3"})["stdout"] != "exited":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ask({"op": "kill", "id": "j3"}) == {"rc": 4, "stdout": "bye\n", "stderr": ""}
        # wait's timeout kills the session too
        t = time.monotonic()
        assert ask({"op": "start", "id": "j4", "cmd": "sleep 30 & wait"})["rc"] == 0
        r = ask({"op": "wait", "id": "j4", "timeout": 0.3})
        assert r["rc"] == 124 and r["stderr"].endswith("TIMEOUT")
        # `timeout` moves itself and its command to a process group of their own: kill
        # still reaches them (the tests start guest tools as `timeout 60 rping ...`)
        assert ask({"op": "start", "id": "j5", "cmd": "echo x; timeout 30 sleep 20"})["rc"] == 0
        time.sleep(0.3)
        r = ask({"op": "kill", "id": "j5", "signal": 15, "timeout": 5})
        assert r == {"rc": -15, "stdout": "x\n", "stderr": ""}  # no SIGKILL fallback
        assert time.monotonic() - t < 10
    finally:
        agent.kill()
        agent.wait(timeout=10)
    # and an agent that is not there: the client says so in the agent's format
    t = time.monotonic()
    r = ask({"op": "ping", "_connect": 0.5})
    assert r["rc"] == 255 and r["stderr"] == "agent unreachable"
    assert time.monotonic() - t < 10


def test_cm_listeners_reads_rdma_resource_json():
    # `rdma -j resource show cm_id` in a lab guest with rping -s -a, udaddy, ib_send_bw -R and
    # rping -s (no -a) waiting for clients, plus a connected ID that is not listening
    out = json.dumps([
        {"ifindex": 0, "ifname": "rxe0", "cm-idn": 39, "state": "LISTEN", "ps": "UDP",
         "pid": 454, "comm": "udaddy", "src-addr": "0.0.0.0:7174"},
        {"ifindex": 0, "ifname": "rxe0", "cm-idn": 40, "state": "LISTEN", "ps": "TCP",
         "pid": 458, "comm": "ib_send_bw", "src-addr": "0.0.0.0:18600"},
        {"ifindex": 0, "ifname": "rxe0", "port": 1, "cm-idn": 38, "state": "LISTEN",
         "ps": "TCP", "pid": 449, "comm": "rping", "src-addr": "10.77.0.11:7174",
         "dst-addr": "0.0.0.0:0"},
        {"ifindex": 0, "ifname": "rxe0", "port": 1, "cm-idn": 42, "state": "CONNECT",
         "ps": "TCP", "pid": 449, "comm": "rping", "src-addr": "10.77.0.11:7174",
         "dst-addr": "10.77.0.12:56000"},
    ])
    got = lab.cm_listeners(out)
    assert [(d["comm"], d["ps"], d["src-addr"]) for d in got] == [
        ("udaddy", "UDP", "0.0.0.0:7174"), ("ib_send_bw", "TCP", "0.0.0.0:18600"),
        ("rping", "TCP", "10.77.0.11:7174")]
    assert lab.cm_listeners("") == lab.cm_listeners("[]") == lab.cm_listeners("garbage") == []


def test_wait_cm_listen_polls_the_guest_until_the_port_listens():
    listening = json.dumps([{"state": "LISTEN", "ps": "TCP", "src-addr": "0.0.0.0:7174"}])
    answers = iter(["[]", "[]", listening])
    asked = []
    fake = lab.Lab.__new__(lab.Lab)  # no VM: only the guest-command seam is used
    fake.guest = lambda i, cmd, timeout=120: (asked.append((i, cmd)),
                                              lab.Result(0, next(answers), ""))[1]
    assert fake.wait_cm_listen(1, 7174, timeout=10)
    assert asked == [(1, "rdma -j resource show cm_id")] * 3
    # the wrong port space, or another port, is not it
    fake.guest = lambda i, cmd, timeout=120: lab.Result(0, listening, "")
    assert not fake.wait_cm_listen(0, 7174, ps="UDP", timeout=0.3)
    assert not fake.wait_cm_listen(0, 7175, timeout=0.3)
