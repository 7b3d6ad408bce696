"""``softrdma exec``'s rsocket calls (softrdma/exec/rsocket.py): Debian's librdmacm tools
``rstream`` and ``riostream`` (rdmacm-utils 44, unmodified), their rsocket calls answered
by softrdma's rsocket protocol -- both ends under ``softrdma exec``, and one end against
softrdma's own Python rsocket (tests/programs/rsocket_stream.py, which verifies every byte
against rstream's counter), in both roles; and rsocket(7)'s errnos, rpoll/rselect, rfcntl
and threads through the calls themselves (tests/programs/rsocket_exec_checks.py).

Each process has its own device: servers on 127.0.4.1, clients on 127.0.4.2, the
single-process checks on 127.0.4.5."""

from __future__ import annotations

import os
import random
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .exec_pair import LIMIT, Readiness, Server, exec_argv, line as printed, pair, run_until, \
    started

ROOT = Path(__file__).resolve().parent.parent
STREAM = str(ROOT / "tests" / "programs" / "rsocket_stream.py")
CHECKS = str(ROOT / "tests" / "programs" / "rsocket_exec_checks.py")
SERVER, CLIENT, SINGLE = "127.0.4.1", "127.0.4.2", "127.0.4.5"
pytestmark = pytest.mark.usefixtures("exec_library")


def _env(ip: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    env["PYTHONPATH"] = str(ROOT)
    if ip:
        env["SOFTRDMA_IP"] = ip
    return env


def _exec(ip: str, *argv: str) -> list[str]:
    return exec_argv(ip, *argv)


def _port() -> int:
    return random.randint(20000, 40000)


def _refused(r: subprocess.CompletedProcess) -> bool:
    """The client found nobody listening (the server still starting; its stdout is a
    pipe, so it says nothing before it ends): it is run again."""
    return r.returncode != 0 and ("Connection refused" in r.stderr
                                  or "ConnectionRefused" in r.stderr)


#: softrdma's Python rsocket server says "listening" (flushed) once it listens
LISTENING = printed("listening", "stdout")


#: riostream's server sets its options -- RDMA_IOMAPSIZE among them -- on its listener
#: after rlisten. A connection the listen service accepts before that has no iomap (as
#: with librdmacm, whose service answers at once too), and the client's riomap fails
#: with ENOMEM. Its server is ready once SOFTRDMA_EXEC_CM_TRACE says the option is set.
IOMAP_SET = printed("RDMA_IOMAPSIZE, 1) -> 0", "stderr")


def _run_pair(server: list[str], client: list[str], python_server: bool = False,
              ready: Readiness | None = None) -> tuple[subprocess.CompletedProcess, tuple]:
    """``server`` until it listens (``ready``; a C tool says nothing by default: its
    client is run again while refused), then ``client``; the client's result and the
    server's (rc, out, err)."""
    env = _env(SERVER)
    if ready is not None:
        env["SOFTRDMA_EXEC_CM_TRACE"] = "1"
    cli, res = pair(server, client, ready or (LISTENING if python_server else started),
                    again=None if python_server else _refused, server_env=env,
                    client_env=_env(CLIENT), cwd=str(ROOT), timeout=LIMIT)
    return cli, (res.returncode, res.stdout, res.stderr)


def _pair(tool: str, args: list[str]) -> tuple[subprocess.CompletedProcess, tuple]:
    """``tool`` as server and client, both under softrdma exec."""
    port = str(_port())
    return _run_pair(_exec(SERVER, tool, "-b", SERVER, "-p", port, *args),
                     _exec(CLIENT, tool, "-s", SERVER, "-p", port, *args),
                     ready=IOMAP_SET if tool == "riostream" else None)


def _perf_line(out: str, size: int, count: int) -> str:
    """rstream/riostream's result line: custom, size, transfers, 1 iteration, the total
    both ways (rstream's size_str: 1000-byte units below 1 KiB, k/m above)."""
    lines = [ln for ln in out.splitlines() if ln.startswith("custom")]
    assert len(lines) == 1, out
    fields = lines[0].split()
    assert fields[2:4] == [str(count), "1"], lines[0]
    return lines[0]


# ---- both ends under softrdma exec ---------------------------------------------------------

@pytest.mark.parametrize("topts", [["-T", "v"], ["-T", "a", "-T", "b", "-T", "v"]],
                         ids=["nonblocking", "rpoll-blocking"])
def test_rstream_both_ends_under_exec(topts):
    """rstream's custom test (a 16-byte sync, then 20 transfers of 10000 bytes each way,
    every byte checked against rstream's counter, -T v): non-blocking (rfcntl O_NONBLOCK,
    a non-blocking rconnect finished through rpoll and SO_ERROR, raccept/rsend/rrecv
    answering EAGAIN) and with rpoll blocking (-T a -T b: rpoll's wait, MSG_WAITALL)."""
    cli, (src, sout, serr) = _pair("rstream", ["-S", "10000", "-C", "20", *topts])
    assert cli.returncode == 0, cli.stderr + cli.stdout
    assert src == 0, serr + sout
    for out in (cli.stdout, sout):
        assert _perf_line(out, 10000, 20).split()[1:5] == ["9.7k", "20", "1", "390k"]


@pytest.mark.parametrize("topts", [["-T", "v"], ["-T", "a", "-T", "v"]],
                         ids=["nonblocking", "rpoll"])
def test_riostream_both_ends_under_exec(topts):
    """riostream: each side riomaps its own buffer (an MR over the program's memory, at
    its address), the peer riowrites into it by RDMA WRITE, and the program spins on the
    buffer's last byte in C -- no rsocket call -- until softrdma's progress thread has
    placed the peer's marker there; -T v checks every byte written."""
    cli, (src, sout, serr) = _pair("riostream", ["-S", "65536", "-C", "10", *topts])
    assert cli.returncode == 0, cli.stderr + cli.stdout
    assert src == 0, serr + sout
    for out in (cli.stdout, sout):
        assert _perf_line(out, 65536, 10).split()[1:5] == ["64k", "10", "1", "1.2m"]


def test_rcopy_copies_a_file_both_ends_under_exec(tmp_path):
    """rcopy (rdmacm-utils): the client mmaps a 3 MB file and rsends it whole from the
    mapping, the server rrecvs it into a mapping of the destination file (its server
    binds the wildcard address and serves until killed); the copy is the file."""
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(random.randbytes(3_000_000))
    port = str(_port())
    with Server(_exec(SERVER, "rcopy", "-p", port), env=_env(SERVER), cwd=str(ROOT)) as srv:
        cli = run_until(_exec(CLIENT, "rcopy", str(src), f"{SERVER}:{dst}", "-p", port),
                        srv, _refused, env=_env(CLIENT), cwd=str(ROOT))
        # the server says what it did when it waits for the next client (its fflush)
        out, deadline = "", time.monotonic() + 60
        while out.count("waiting for connection") < 2 and time.monotonic() < deadline \
                and srv.proc.poll() is None:
            if select.select([srv.proc.stdout], [], [], 0.5)[0]:
                out += os.read(srv.proc.stdout.fileno(), 4096).decode()
        srv.kill()
        res = srv.finish()
        rest, err = res.stdout, res.stderr
        out += rest
    assert cli.returncode == 0, cli.stderr + cli.stdout
    assert "3000000 bytes in" in cli.stdout and "done" in cli.stdout
    assert "transferring...3000000 bytes...closing...done" in out, err + out
    assert dst.read_bytes() == src.read_bytes()


def test_rstream_without_softrdma_has_no_device():
    """The same binary without softrdma exec finds no RDMA device on this machine: what
    the tests above see is softrdma's."""
    r = subprocess.run(["rstream", "-s", SERVER, "-p", str(_port()), "-C", "1", "-S", "10"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode != 0
    assert "No RDMA devices were detected" in r.stderr


# ---- one end against softrdma's Python rsocket --------------------------------------------

@pytest.mark.parametrize("tool", ["rstream", "riostream"])
@pytest.mark.parametrize("c_role", ["client", "server"])
def test_tool_against_softrdma_python_rsocket(tool, c_role):
    """The C tool under softrdma exec on one end, softrdma.socket's RSocket (a Python
    program doing rstream's or riostream's exchange and checking every byte against the
    tool's counter) on the other: the preload library speaks the rsocket protocol on
    the wire, as librdmacm does, in both roles."""
    port = str(_port())
    size, count = ("10000", "20") if tool == "rstream" else ("65536", "10")
    py = [sys.executable, STREAM, None, SERVER, port, "-S", size, "-C", count, "--verify",
          "-B", str(1 << 19)] + (["--rio"] if tool == "riostream" else [])
    c_args = ["-p", port, "-S", size, "-C", count, "-T", "v"]
    if c_role == "client":
        cli, (src, sout, serr) = _run_pair([x if x else "server" for x in py],
                                           _exec(CLIENT, tool, "-s", SERVER, *c_args),
                                           python_server=True)
        c_out, c_rc, c_err, py_out, py_rc, py_err = (cli.stdout, cli.returncode, cli.stderr,
                                                      sout, src, serr)
    else:
        cli, (src, sout, serr) = _run_pair(_exec(SERVER, tool, "-b", SERVER, *c_args),
                                           [x if x else "client" for x in py],
                                           ready=IOMAP_SET if tool == "riostream" else None)
        c_out, c_rc, c_err, py_out, py_rc, py_err = (sout, src, serr, cli.stdout,
                                                      cli.returncode, cli.stderr)
    assert c_rc == 0, c_err + c_out
    assert py_rc == 0, py_err + py_out
    total = 2 * int(size) * int(count)
    assert re.search(rf"{tool} ok {total} bytes .* verified", py_out), py_out
    _perf_line(c_out, int(size), int(count))


# ---- the calls themselves -------------------------------------------------------------------

def test_rsocket_calls_errnos_rpoll_rselect_threads():
    """rsocket(7)'s calls as a program makes them (ctypes in a Python program under
    softrdma exec, one device): the errnos (EBADF for a number that is no rsocket,
    ECONNREFUSED, EAGAIN, EINPROGRESS, EISCONN, EINVAL, EOPNOTSUPP, ENOTCONN, EPIPE),
    rfcntl's O_NONBLOCK, rpoll and rselect over rsockets and a pipe together (and the
    pipe alone, as poll(2)), MSG_PEEK/MSG_WAITALL/MSG_DONTWAIT, the vector calls, names
    and options, a blocking rrecv and raccept in one thread while another sends and
    connects, a connection completed before raccept, EOF and POLLHUP after rshutdown."""
    r = subprocess.run(_exec(SINGLE, "/usr/bin/python3", "-X", "faulthandler", CHECKS, SINGLE,
                             str(_port())), env=_env(SINGLE), capture_output=True, text=True,
                       timeout=LIMIT, cwd=ROOT)
    assert r.returncode == 0, r.stderr + r.stdout
    said = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert said == ["errnos", "nonblocking-connect-refused",
                    "nonblocking-connect-accept-names", "rpoll-peek", "rselect", "vectors",
                    "options", "threads", "backlog", "close"], r.stdout
