"""One exchange between a Debian tool under ``softrdma exec`` on the lab's host side
(10.77.0.1) and the same tool on kernel rxe in guest 0 (10.77.0.11), in either role.

The server is started first and the client only once the server is ready, found out
rather than guessed: the tool's TCP port listening (the pingpongs' and perftest's
exchange of QP numbers), the rdma_cm port listening (``rdma resource show cm_id`` in the
guest; ``SOFTRDMA_EXEC_CM_TRACE``'s ``rdma_listen -> 0`` line on the host side), or, for
rsocket servers, which neither shows, the client run again while it is refused. Output goes
to files, not pipes, so a chatty tool never blocks on a full pipe.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from softrdma.harness.lab import HOST_IP, Result, guest_ip

#: what starts every host-side command: the tool's device on the lab's host address
EXEC = f"softrdma exec --addr {HOST_IP}"
ROLES = ["exec-server", "exec-client"]


@dataclass
class Ready:
    """How to know the server is ready: ``kind`` "tcp" (a TCP listener on ``port``), "cm"
    (an rdma_cm listener on ``port`` in port space ``ps``) or "retry" (run the client
    again while its output has ``refused`` in it)."""
    kind: str
    port: int = 0
    ps: str = "TCP"
    refused: str = "refused"


def _ss_listening(out: str, port: int) -> bool:
    return any(line.split()[3].endswith(f":{port}") for line in out.splitlines()
               if len(line.split()) > 3)


def _wait(cond, timeout: float, what: str, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if not alive():
            raise AssertionError(f"{what}: the server exited first")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not ready after {timeout} s")
        time.sleep(0.2)


def _retry_shell(cmd: str, refused: str, tries: int = 20) -> str:
    """A guest shell line running ``cmd`` again while its output says ``refused`` (the
    exec'd server not listening yet), leaving the last run's exit status."""
    return (f"for i in $(seq {tries}); do {cmd} >/tmp/retry.out 2>&1; rc=$?; "
            f"grep -q '{refused}' /tmp/retry.out || break; sleep 0.5; done; "
            f"cat /tmp/retry.out; exit $rc")


def run_pair(lab, role: str, server: str, client: str, ready: Ready, *,
             exec_opts: str = "", env: dict[str, str] | None = None,
             timeout: float = 60) -> tuple[Result, Result]:
    """Run ``server`` and ``client`` (a tool's command lines; ``{addr}`` in ``client``
    becomes the server's address), one under ``softrdma exec [exec_opts]`` on the host,
    the other in guest 0 under ``timeout``, as ``role`` says. Returns (exec's Result,
    rxe's Result)."""
    if role == "exec-server":
        return _exec_serves(lab, server, client.format(addr=HOST_IP), ready, exec_opts, env,
                            timeout)
    return _rxe_serves(lab, server, client.format(addr=guest_ip(0)), ready, exec_opts, env,
                       timeout)


def _collect(p, timeout: float) -> None:
    """Wait for a host-side process; one still running after ``timeout`` is killed (its
    status is then -9, and the test reports what it printed)."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _exec_serves(lab, server, client, ready, exec_opts, env, timeout):
    env = dict(env or {})
    if ready.kind == "cm":
        env["SOFTRDMA_EXEC_CM_TRACE"] = "1"
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "out", Path(d) / "err"
        with open(out, "w") as fo, open(err, "w") as fe:
            srv = lab.host_start(f"{EXEC} {exec_opts} -- {server}", env=env, stdout=fo,
                                 stderr=fe)
        try:
            if ready.kind == "tcp":
                _wait(lambda: _ss_listening(lab.host(["ss", "-Htln"], timeout=10).stdout,
                                            ready.port), 30, server, lambda: srv.poll() is None)
            elif ready.kind == "cm":
                _wait(lambda: "rdma_listen -> 0" in err.read_text(), 30, server,
                      lambda: srv.poll() is None)
            else:  # the device up (UDP 4791): a client early for the listen is refused at once
                _wait(lambda: ":4791" in lab.host(["ss", "-Huln", "sport = :4791"],
                                                  timeout=10).stdout, 30, server,
                      lambda: srv.poll() is None)
            cmd = f"timeout {timeout} {client}"
            if ready.kind == "retry":
                cmd = _retry_shell(cmd, ready.refused)
            rxe = lab.guest(0, cmd, timeout=timeout * (3 if ready.kind == "retry" else 1) + 10)
            _collect(srv, timeout)
        finally:
            if srv.poll() is None:  # never leave a server holding UDP 4791 for the next test
                srv.kill()
                srv.wait()
        return Result(srv.returncode, out.read_text(), err.read_text()), rxe


def _rxe_serves(lab, server, client, ready, exec_opts, env, timeout):
    job = lab.guest_start(0, f"timeout {timeout} {server}")
    if ready.kind == "tcp":
        _wait(lambda: _ss_listening(lab.guest(0, "ss -Htln", timeout=20).stdout, ready.port),
              30, server, job.running)
    elif ready.kind == "cm":
        _wait(lambda: lab.wait_cm_listen(0, ready.port, ready.ps, timeout=0), 30, server,
              job.running)
    else:  # rxe's rsocket server listens as the tool starts: the rdma_cm id shows it
        _wait(lambda: lab.wait_cm_listen(0, ready.port, "TCP", timeout=0), 30, server,
              job.running)
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "out", Path(d) / "err"
        with open(out, "w") as fo, open(err, "w") as fe:
            cli = lab.host_start(f"{EXEC} {exec_opts} -- {client}", env=env, stdout=fo,
                                 stderr=fe)
        _collect(cli, timeout + 10)
        ours = Result(cli.returncode, out.read_text(), err.read_text())
    return ours, job.wait(timeout=timeout + 10)


def ok(exec_res: Result, rxe_res: Result) -> str:
    """Both ended with status 0, or the assertion message naming who did not."""
    return (f"exec rc {exec_res.rc}:\n{exec_res.stdout}\n{exec_res.stderr[-3000:]}\n"
            f"rxe rc {rxe_res.rc}:\n{rxe_res.stdout}\n{rxe_res.stderr[-3000:]}")
