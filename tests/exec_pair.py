"""Two processes, at least one under ``softrdma exec``: start a server, wait until it is
ready, run the client, collect both -- the one helper of the exec test files.

A server is ready in one of a few ways, each a *readiness* passed to :func:`pair`:

* :func:`tcp_port` -- it listens on a TCP port (the pingpongs' and perftest's
  out-of-band exchange): /proc/net/tcp says so, without taking its only accept;
* :func:`device_up` -- its soft device has bound UDP 4791 (an rdma_cm program's first
  sign of life), then ``settle`` seconds more;
* :func:`line` -- it printed a line (``SOFTRDMA_EXEC_CM_TRACE=1``'s ``rdma_listen -> 0``
  on stderr, a Python server's "listening" on stdout): a tool's own stdout to a pipe is
  block-buffered and says nothing in time;
* :data:`started` -- nothing to wait for: the client is run again while ``again`` says
  it came too early (refused, rejected).

Every process is killed and reaped if it is still running when the test is done with it.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from typing import Callable

__all__ = ["SOFT", "LIMIT", "exec_argv", "free_port", "tcp_listening", "udp_4791_bound",
           "Server", "tcp_port", "device_up", "line", "started", "run", "run_until",
           "pair", "env_with", "compile_program", "PROGRAMS"]

SOFT = [sys.executable, "-m", "softrdma"]
#: seconds a tool may take: the tests' transfers are small and finish in well under 10
LIMIT = 120
#: seconds a server may take to be ready (its interpreter and device start; more under load)
READY = 60


def exec_argv(addr: str, *argv: str, opts: tuple[str, ...] = ()) -> list[str]:
    """The command line running ``argv`` under ``softrdma exec [opts] --addr addr``."""
    return [*SOFT, "exec", *opts, "--addr", addr, "--", *argv]


def free_port() -> str:
    """A TCP port nothing uses now (servers that listen on every address: a fixed port
    could collide with another test's)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return str(s.getsockname()[1])


def tcp_listening(port: int) -> bool:
    """Some socket of this machine listens on TCP ``port`` (/proc/net/tcp: a connect
    attempt would take the server's only accept)."""
    want = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                for row in f.readlines()[1:]:
                    local, state = row.split()[1], row.split()[3]
                    if state == "0A" and local.endswith(want):
                        return True
        except OSError:
            pass
    return False


def udp_4791_bound(ip: str) -> bool:
    """Whether a softrdma device answers on ``ip`` (its RoCE v2 UDP port 4791 bound)."""
    want = "%08X:12B7" % int.from_bytes(socket.inet_aton(ip), "little")
    with open("/proc/net/udp") as f:
        return any(row.split()[1] == want for row in f.readlines()[1:])


class Server:
    """A server process with its output on pipes. :meth:`finish` collects it; the lines
    a readiness read on the way are part of what it collects."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None,
                 cwd: str | None = None, stdin: bool = False) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.PIPE if stdin else None, text=True,
                                     env=env, cwd=cwd)
        self.seen = {"stdout": "", "stderr": ""}

    def send_line(self, text: str) -> None:
        """A line to the server's stdin (made with ``stdin=True``)."""
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def until(self, ready: Callable[[], bool], what: str, timeout: float = READY) -> None:
        """Poll ``ready()`` until true; fails if the server exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, (what, self.finish())
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
            time.sleep(0.05)

    def until_line(self, text: str, stream: str = "stderr", timeout: float = READY) -> None:
        """Read ``stream`` until a line containing ``text``; fails at its end or after
        ``timeout``."""
        # the pipe's descriptor itself, not its buffered file: select() cannot see lines
        # a readline() already pulled into the buffer
        fd = getattr(self.proc, stream).fileno()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not select.select([fd], [], [], 0.5)[0]:
                if self.proc.poll() is not None:
                    break
                continue
            got = os.read(fd, 65536).decode(errors="replace")
            if not got:
                break
            start = max(0, len(self.seen[stream]) - len(text))
            self.seen[stream] += got
            if text in self.seen[stream][start:]:
                return
        self.kill()
        raise AssertionError(f"the server never said {text!r}: {self.finish()}")

    def finish(self, timeout: float = LIMIT) -> subprocess.CompletedProcess:
        """Wait for the server to end (killed after ``timeout``); all it said."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
        return subprocess.CompletedProcess(self.argv, self.proc.returncode,
                                           self.seen["stdout"] + out,
                                           self.seen["stderr"] + err)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


Readiness = Callable[[Server], None]


def tcp_port(port: int | str) -> Readiness:
    """Ready once something listens on TCP ``port``."""
    return lambda srv: srv.until(lambda: tcp_listening(int(port)), f"TCP port {port}")


def device_up(ip: str, settle: float = 0.0) -> Readiness:
    """Ready ``settle`` seconds after a soft device bound UDP 4791 on ``ip``."""
    def wait(srv: Server) -> None:
        srv.until(lambda: udp_4791_bound(ip), f"a device on {ip}")
        time.sleep(settle)
    return wait


def line(text: str, stream: str = "stderr") -> Readiness:
    """Ready once the server printed a line containing ``text`` on ``stream``."""
    return lambda srv: srv.until_line(text, stream)


def started(srv: Server) -> None:
    """Ready as soon as started (the client's ``again`` copes with an early start)."""


def run(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
        timeout: float = LIMIT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd)


def run_until(argv: list[str], server: Server,
              again: Callable[[subprocess.CompletedProcess], bool],
              env: dict[str, str] | None = None, cwd: str | None = None,
              timeout: float = READY, pause: float = 0.5) -> subprocess.CompletedProcess:
    """Run the client, again while ``again(result)`` says it came before the server was
    ready (and the server lives, for up to ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        r = run(argv, env=env, cwd=cwd)
        if not again(r) or time.monotonic() > deadline or server.proc.poll() is not None:
            return r
        time.sleep(pause)


def pair(server_argv: list[str], client_argv: list[str], ready: Readiness, *,
         again: Callable[[subprocess.CompletedProcess], bool] | None = None,
         abandon: Callable[[subprocess.CompletedProcess], bool] | None = None,
         server_env: dict[str, str] | None = None, client_env: dict[str, str] | None = None,
         cwd: str | None = None, timeout: float = LIMIT,
         ) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """Start the server, wait until ``ready``, run the client (again while ``again``
    says it came too early), let the server end -- or kill it at once if ``abandon``
    says the client's result leaves it waiting for ever: ``(client, server)`` results."""
    with Server(server_argv, env=server_env, cwd=cwd) as srv:
        ready(srv)
        if again is None:
            cli = run(client_argv, env=client_env, cwd=cwd, timeout=timeout)
        else:
            cli = run_until(client_argv, srv, again, env=client_env, cwd=cwd)
        if abandon is not None and abandon(cli):
            srv.kill()
        return cli, srv.finish(timeout)


def env_with(**extra: str) -> dict[str, str]:
    """This environment plus ``extra``."""
    return {**os.environ, **extra}


PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")


def compile_program(tmp_path: object, name: str, *libs: str) -> str:
    """tests/programs/``name``.c compiled against the installed headers, linked with
    libibverbs and ``libs``; the executable's path."""
    from .conftest import require_tool
    exe = os.path.join(str(tmp_path), name)
    r = subprocess.run([require_tool("gcc"), "-O1", "-Wall", "-o", exe,
                        os.path.join(PROGRAMS, f"{name}.c"), "-libverbs", *libs],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe
