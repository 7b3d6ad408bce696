"""``softrdma exec``: librdmacm's ``rdma_*`` calls answered by softrdma's rdma_cm
(softrdma/exec/cma.py, cma_addr.py, cma_qp.py).

Two kinds of program, each in processes of its own on this helper's loopback addresses:
Debian's librdmacm tools, unmodified (rping, ucmatose, udaddy, rdma_server/rdma_client),
with both ends under ``softrdma exec``; and tests/programs/exec_cm_ctypes.py, which calls
the library through ctypes exactly as a C program binds it, to look at what the tools do
not print (the structures, the descriptor, errnos)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SERVER, CLIENT = "127.0.3.11", "127.0.3.12"
PROGRAM = str(Path(__file__).parent / "programs" / "exec_cm_ctypes.py")
#: a generous bound for one tool's whole run (a handful of messages on loopback)
TIMEOUT = 120


def _exec(addr: str, *argv: str) -> list[str]:
    return [sys.executable, "-m", "softrdma", "exec", "--addr", addr, "--", *argv]


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(addr: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(_exec(addr, *argv), capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env())


def _start(addr: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(_exec(addr, *argv), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _wait_line(p: subprocess.Popen, want: str, timeout: float = 60) -> list[str]:
    """Lines of ``p``'s stdout up to one containing ``want`` (the server is ready)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if want in line:
            return lines
    p.kill()
    raise AssertionError(f"no {want!r} from the server: {lines} {p.stderr.read()}")


def _pair(server_argv: list[str], ready: str, client_argv: list[str],
          client_addr: str = CLIENT) -> tuple[str, str]:
    """Run a server until it prints ``ready``, then the client; both outputs once both
    ended (each must exit 0)."""
    srv = _start(SERVER, *server_argv)
    try:
        head = _wait_line(srv, ready)
        cli = _run(client_addr, *client_argv)
        out, err = srv.communicate(timeout=TIMEOUT)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.communicate()
    assert cli.returncode == 0, (cli.stdout, cli.stderr)
    assert srv.returncode == 0, (out, err)
    return "".join(head) + out, cli.stdout


# ---- the structures and the descriptor, through ctypes -------------------------------------

def test_connection_without_qp_events_private_data_and_the_ids_structures():
    """A connection made with rdma_cm alone (no QP: qp_num in the parameters, the
    client's rdma_establish after CONNECT_RESPONSE): every event in librdmacm's order,
    each side's private data and QP number in the other's event, the new id a
    CONNECT_REQUEST brings (listen_id is the listener), and the rdma_cm_id fields
    librdmacm keeps current (verbs the same context rdma_get_devices lists, port_num 1,
    both addresses, the route's path)."""
    port = "7481"
    srv, cli = _pair(["/usr/bin/python3", PROGRAM, "server", SERVER, port], "listening",
                     ["/usr/bin/python3", PROGRAM, "client", SERVER, port])
    assert f"bound verbs True pd True port_num 1 src {SERVER}:{port} ps 0x106 qp_type 2" in srv
    assert "devices 1 same verbs True" in srv
    assert "event RDMA_CM_EVENT_CONNECT_REQUEST 0 hello server 56 546" in srv
    assert "listen_id is the listener True" in srv
    assert f"child verbs True pd True port_num 1 src {SERVER}:{port}" in srv
    assert f"child dst {CLIENT}:" in srv and f"src port {port}" in srv
    assert srv.splitlines()[-3:] == ["event RDMA_CM_EVENT_ESTABLISHED 0  0 0",
                                     "event RDMA_CM_EVENT_DISCONNECTED 0  0 0", "done"]
    assert f"resolved verbs True pd True port_num 1 src {CLIENT}:" in cli
    assert f"dst {SERVER}:{port} dst port {port}" in cli
    assert "num_paths 1" in cli
    assert "event RDMA_CM_EVENT_CONNECT_RESPONSE 0 hello client 196 273" in cli
    assert cli.splitlines()[-2:] == ["event RDMA_CM_EVENT_DISCONNECTED 0  0 0", "done"]


def test_event_channel_is_a_real_descriptor_and_o_nonblock_is_the_programs():
    """``channel->fd`` is a descriptor poll/select work on: not readable while no event
    waits, readable once rdma_resolve_addr queued ADDR_RESOLVED, not after it was taken,
    closed by rdma_destroy_event_channel. It starts blocking; the program's
    fcntl(O_NONBLOCK) makes rdma_get_cm_event fail with EAGAIN instead of waiting."""
    r = _run(SERVER, "/usr/bin/python3", PROGRAM, "channel", SERVER)
    assert r.returncode == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    assert first.startswith("fd ") and first.endswith(" blocking True readable False")
    assert rest == ["empty get -1 EAGAIN", "readable after resolve True",
                    "got RDMA_CM_EVENT_ADDR_RESOLVED", "readable after get False",
                    "fd closed after destroy"]


def test_rdma_getaddrinfo_as_librdmacm_answers():
    """rdma_getaddrinfo: RAI_PASSIVE gives the source address and RC/TCP defaults; an
    active UD/UDP request keeps the hints' QP type and port space and gives the
    destination; a name that does not resolve returns getaddrinfo's EAI_NONAME (-2) for
    gai_strerror, as librdmacm does."""
    r = _run(SERVER, "/usr/bin/python3", PROGRAM, "addrinfo", SERVER, "7482")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"passive flags 1 family 2 qp_type 2 ps 0x106 src {SERVER}:7482 dst_len 0",
        f"active flags 0 family 2 qp_type 4 ps 0x111 dst {SERVER}:7482 src_len 0",
        "bad name -2"]


def test_misuse_gets_librdmacms_errno_and_the_program_lives():
    """Calls the id's state does not allow, addresses of the wrong family or of no
    device, pointers that are not the library's: -1 with the errno (EINVAL, ENODEV,
    EOPNOTSUPP for multicast, which softrdma's rdma_cm lacks), never a crash."""
    r = _run(SERVER, "/usr/bin/python3", PROGRAM, "misuse", SERVER)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "resolve_route before resolve_addr -1 EINVAL", "bind AF_UNIX -1 EINVAL",
        "bind unknown address -1 ENODEV", "listen on a freed id -1 EINVAL",
        "connect without QP or param -1 EINVAL", "disconnect unconnected -1 EINVAL",
        "ack of a non-event -1 EINVAL", "get_request on an async id -1 EINVAL",
        "join multicast -1 ENOTSUP", "alive"]
    assert "Traceback" not in r.stderr
