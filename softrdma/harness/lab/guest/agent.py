"""The command agent of a lab guest: ``python3 agent.py IP PORT``.

Runs in each guest of :class:`softrdma.harness.lab.Lab` (started by ``setup.sh``) and
answers one JSON request per TCP connection (``client.py`` sends them) with one JSON line
``{"rc", "stdout", "stderr"}``. Requests: ``run`` (a shell line, waited for), ``start``,
``wait``, ``poll`` and ``kill`` (a background job by id), ``ping``, ``poweroff``. A background
job runs in a session of its own, and a timeout or ``kill`` signals every process in that
session: ``timeout 60 rping ...`` puts itself and rping in a new process group, so killing
the job's process group alone would miss them. Standard library only: the guest
runs it with the host's interpreter from the shared root filesystem.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

jobs = {}


def _session(sid):
    """The processes of session ``sid`` (from /proc: the session is field 6 of stat)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            pids.append(int(d))
    return pids


def _killpg(p, sig):
    """Signal every process of the job's session (its leader first)."""
    for pid in [p.pid] + [q for q in _session(p.pid) if q != p.pid]:
        try:
            os.kill(pid, sig)
        except OSError:  # already gone
            pass


def _finish(p, timeout):
    """Collect a job's output; a job still running after ``timeout`` is killed (rc 124)."""
    try:
        out, err = p.communicate(timeout=timeout)
        return {"rc": p.returncode, "stdout": out, "stderr": err}
    except subprocess.TimeoutExpired:
        _killpg(p, signal.SIGKILL)
        out, err = p.communicate()
        return {"rc": 124, "stdout": out, "stderr": err + "\nTIMEOUT"}


def handle(c):
    f = c.makefile("rwb")
    req = json.loads(f.readline())
    op = req["op"]
    if op == "run":
        try:
            p = subprocess.run(req["cmd"], shell=True, capture_output=True, text=True,
                               timeout=req.get("timeout", 120))
            res = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
        except subprocess.TimeoutExpired as e:
            res = {"rc": 124, "stdout": e.stdout or "", "stderr": (e.stderr or "") + "\nTIMEOUT"}
    elif op == "start":
        p = subprocess.Popen(req["cmd"], shell=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        jobs[req["id"]] = p
        res = {"rc": 0, "stdout": "", "stderr": ""}
    elif op == "wait":
        res = _finish(jobs.pop(req["id"]), req.get("timeout", 120))
    elif op == "poll":  # is the job still running? (its output stays until wait or kill)
        p = jobs.get(req["id"])
        state = "unknown" if p is None else "running" if p.poll() is None else "exited"
        res = {"rc": 0, "stdout": state, "stderr": ""}
    elif op == "kill":  # signal the job's process group, then collect it like wait
        p = jobs.pop(req["id"])
        if p.poll() is None:
            _killpg(p, req.get("signal", signal.SIGTERM))
        res = _finish(p, req.get("timeout", 10))
    elif op == "ping":
        res = {"rc": 0, "stdout": "pong", "stderr": ""}
    elif op == "poweroff":
        f.write((json.dumps({"rc": 0, "stdout": "", "stderr": ""}) + "\n").encode())
        f.flush()
        os.system("poweroff -f")
        return
    f.write((json.dumps(res) + "\n").encode())
    f.flush()
    c.close()


def main():
    ip, port = sys.argv[1], int(sys.argv[2])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    s.listen(16)
    while True:
        c, _ = s.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()


if __name__ == "__main__":
    main()
