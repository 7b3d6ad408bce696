"""``softrdma exec``: librdmacm's ``rdma_*`` calls answered by softrdma's rdma_cm
(softrdma/exec/cma.py, cma_conn.py, cma_qp.py, cma_addr.py).

Two kinds of program, each in processes of its own on this helper's loopback addresses:
Debian's librdmacm tools, unmodified (rping, ucmatose, udaddy, rdma_server/rdma_client),
with both ends under ``softrdma exec``; and tests/programs/exec_cm_ctypes.py, which calls
the library through ctypes exactly as a C program binds it, to look at what the tools do
not print (the structures, the descriptor, errnos)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import require_tool
from .exec_pair import LIMIT as TIMEOUT, exec_argv, line as printed, pair, run, started

SERVER, CLIENT = "127.0.3.11", "127.0.3.12"
PROGRAM = str(Path(__file__).parent / "programs" / "exec_cm_ctypes.py")


pytestmark = pytest.mark.usefixtures("exec_library")
#: the server is ready once its rdma_listen returned 0 (SOFTRDMA_EXEC_CM_TRACE's line on
#: stderr: a tool's stdout is a pipe, so block-buffered, and says nothing until it ends)
LISTENING = printed("rdma_listen -> 0")


def _exec(addr: str, *argv: str) -> list[str]:
    return exec_argv(addr, *argv)


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _trace_env() -> dict[str, str]:
    return {**_env(), "SOFTRDMA_EXEC_CM_TRACE": "1"}


def _run(addr: str, *argv: str) -> subprocess.CompletedProcess:
    return run(_exec(addr, *argv), env=_env(), timeout=TIMEOUT)


def _pair(server_argv: list[str], client_argv: list[str],
          client_addr: str = CLIENT) -> tuple[str, str]:
    """Run a server until it listens, then the client; both outputs once both ended
    (each must exit 0)."""
    cli, srv = pair(_exec(SERVER, *server_argv), _exec(client_addr, *client_argv), LISTENING,
                    server_env=_trace_env(), client_env=_env(), timeout=TIMEOUT)
    out, err = srv.stdout, srv.stderr
    assert cli.returncode == 0, (cli.stdout, cli.stderr)
    assert srv.returncode == 0, (out, err)
    return out, cli.stdout


# ---- the structures and the descriptor, through ctypes -------------------------------------

def test_connection_without_qp_events_private_data_and_the_ids_structures():
    """A connection made with rdma_cm alone (no QP: qp_num in the parameters, the
    client's rdma_establish after CONNECT_RESPONSE): every event in librdmacm's order,
    each side's private data and QP number in the other's event, the new id a
    CONNECT_REQUEST brings (listen_id is the listener), and the rdma_cm_id fields
    librdmacm keeps current (verbs the same context rdma_get_devices lists, port_num 1,
    both addresses, the route's path)."""
    port = "7481"
    srv, cli = _pair(["/usr/bin/python3", PROGRAM, "server", SERVER, port],
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
    assert "event RDMA_CM_EVENT_CONNECT_RESPONSE 0 hello client 196 273" in cli
    assert cli.splitlines()[-2:] == ["event RDMA_CM_EVENT_DISCONNECTED 0  0 0", "done"]


def test_event_channel_is_a_real_descriptor_and_o_nonblock_is_the_programs():
    """``channel->fd`` is a descriptor poll/select work on: not readable while no event
    waits, readable once rdma_resolve_addr queued ADDR_RESOLVED, not after it was taken,
    closed by rdma_destroy_event_channel. It starts blocking; the program's
    fcntl(O_NONBLOCK) makes rdma_get_cm_event fail with EAGAIN instead of waiting. Each
    event is an edge for epoll's EPOLLET, even one queued behind another not yet taken
    (as each event wakes an rdma_cm file's waiters)."""
    r = _run(SERVER, "/usr/bin/python3", PROGRAM, "channel", SERVER)
    assert r.returncode == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    assert first.startswith("fd ") and first.endswith(" blocking True readable False")
    assert rest == ["empty get -1 EAGAIN", "readable after resolve True",
                    "got RDMA_CM_EVENT_ADDR_RESOLVED", "readable after get False",
                    "epoll edge 1", "epoll edge 1", "epoll after draining 0",
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
    device, pointers that are not the library's, options of the wrong size or level, an
    ECE without a vendor: -1 with the errno librdmacm and the kernel give (EINVAL, ENODEV,
    ENOSYS; EINVAL for a multicast join on an id with no device yet, as the kernel's
    rdma_join_multicast), never a crash. The
    peer's ECE is all zeros: rxe has none to offer."""
    r = _run(SERVER, "/usr/bin/python3", PROGRAM, "misuse", SERVER)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "resolve_route before resolve_addr -1 EINVAL", "bind AF_UNIX -1 EINVAL",
        "bind unknown address -1 ENODEV", "listen on a freed id -1 EINVAL",
        "connect without QP or param -1 EINVAL", "disconnect unconnected -1 EINVAL",
        "ack of a non-event -1 EINVAL", "get_request on an async id -1 EINVAL",
        "join multicast -1 EINVAL", "set TOS 0 ", "set TOS, optlen 4 -1 EINVAL",
        "set option of level 7 -1 ENOSYS", "set local ECE without vendor -1 EINVAL",
        "set local ECE 0 ", "get remote ECE 0 ", "remote ECE [0, 0, 0]", "alive"]
    assert "Traceback" not in r.stderr


# ---- Debian's librdmacm tools, both ends under softrdma exec --------------------------------

def _ping_lines(out: str, prefix: str) -> list[str]:
    return [line.removeprefix(prefix) for line in out.splitlines() if line.startswith(prefix)]


def test_rping_both_ends_under_exec_the_client_names_only_the_servers_address():
    """Debian's rping -v -C 5: the client resolves the server's address with no source
    address (no -I: the route's device, as on an rxe host), connects with rdma_connect
    on a QP made by rdma_create_qp (the CM moves that very QP), and its CM thread blocks in
    rdma_get_cm_event while the CQ thread waits on a completion channel. The server RDMA
    READs each ping from the client's buffer and WRITEs it back: both print the same five
    pings, and both exit 0 (the client's CM thread, still waiting when main destroys the
    channel, does not turn that into an error)."""
    port = "7483"
    srv, cli = _pair(["rping", "-s", "-v", "-C", "5", "-a", SERVER, "-p", port],
                     ["rping", "-c", "-v", "-C", "5", "-a", SERVER, "-p", port])
    want = [f"rdma-ping-{i}: " + "".join(chr(65 + (i + j) % 58) for j in range(48))
            for i in range(5)]
    pings = _ping_lines(cli, "ping data: ")
    assert [p[:len(w)] for p, w in zip(pings, want)] == want, cli
    assert _ping_lines(srv, "server ping data: ") == pings, srv


def test_ucmatose_connects_sends_and_disconnects():
    """Debian's ucmatose (-C 3 -S 100): RC connections from rdma_create_id on a channel,
    rdma_create_qp on the context the id got, messages both ways, rdma_disconnect, and
    the ids migrated back on rdma_destroy: every step's line and 'return status 0'."""
    port = "7484"
    srv, cli = _pair(["ucmatose", "-b", SERVER, "-p", port, "-C", "3", "-S", "100"],
                     ["ucmatose", "-s", SERVER, "-p", port, "-C", "3", "-S", "100"])
    for line in ("cmatose: starting server", "receiving data transfers",
                 "data transfers complete", "disconnected", "return status 0"):
        assert line in srv, srv
    for line in ("cmatose: connecting", "receiving data transfers", "sending replies",
                 "data transfers complete", "return status 0"):
        assert line in cli, cli


def test_udaddy_resolves_the_ud_service_and_sends_through_the_events_address():
    """Debian's udaddy (-C 3 -S 100): UD ids, the server's SIDR reply with its QP number
    and Q_Key, and the client's ESTABLISHED event carrying param.ud.ah_attr, from which it
    makes the AH it sends with (the server answers through ibv_create_ah_from_wc)."""
    srv, cli = _pair(["udaddy", "-b", SERVER, "-C", "3", "-S", "100"],
                     ["udaddy", "-s", SERVER, "-C", "3", "-S", "100"])
    for line in ("receiving data transfers", "sending replies", "data transfers complete",
                 "return status 0"):
        assert line in srv, srv
    for line in ("udaddy: connecting", "initiating data transfers", "receiving data transfers",
                 "data transfers complete", "return status 0"):
        assert line in cli, cli


def test_rdma_server_and_rdma_client_synchronous_endpoints():
    """Debian's rdma_server / rdma_client: the synchronous API (rdma_getaddrinfo,
    rdma_create_ep with the QP attributes, rdma_get_request making the request's QP,
    rdma_accept and rdma_connect waiting for ESTABLISHED on ids without a channel), the
    rdma_verbs.h helpers on id->pd, id->qp and the CQs and channels rdma_create_qp made,
    a 16-byte message sent inline from a buffer the client never registered, and back.
    The server listens on the wildcard address."""
    port = "7485"
    srv, cli = _pair(["rdma_server", "-p", port],
                     ["rdma_client", "-s", SERVER, "-p", port])
    assert srv.splitlines()[-2:] == ["rdma_server: start", "rdma_server: end 0"], srv
    assert cli.splitlines()[-2:] == ["rdma_client: start", "rdma_client: end 0"], cli


@pytest.mark.parametrize("exec_role", ["client", "server"])
def test_rping_against_softrdmas_own_rping(exec_role):
    """One end Debian's rping under softrdma exec, the other softrdma's Python rping (the
    same protocol, on softrdma's rdma_cm directly): three pings either way round, the
    same data on both sides."""
    port = "7486" if exec_role == "client" else "7487"
    py = [sys.executable, "-m", "softrdma", "rping"]
    if exec_role == "client":
        # -d: the Python server says "rdma_listen" (flushed) just before it listens; a
        # request in the instant before listen() is rejected: again
        cli, res = pair(py + ["-s", "-v", "-d", "-a", SERVER, "-p", port],
                        _exec(CLIENT, "rping", "-c", "-v", "-C", "3", "-a", SERVER, "-p", port),
                        printed("rdma_listen", "stdout"),
                        again=lambda r: r.returncode != 0 and "REJECTED" in r.stdout + r.stderr,
                        server_env={**_env(), "SOFTRDMA_IP": SERVER}, client_env=_env(),
                        timeout=TIMEOUT)
    else:
        cli, res = pair(_exec(SERVER, "rping", "-s", "-v", "-a", SERVER, "-p", port),
                        py + ["-c", "-v", "-C", "3", "-a", SERVER, "-p", port], LISTENING,
                        server_env=_trace_env(), client_env={**_env(), "SOFTRDMA_IP": CLIENT},
                        timeout=TIMEOUT)
    srv, out, err = res, res.stdout, res.stderr
    assert cli.returncode == 0, (cli.stdout, cli.stderr)
    assert srv.returncode == 0, (out, err)
    pings = _ping_lines(cli.stdout, "ping data: ")
    assert len(pings) == 3 and pings[0].startswith("rdma-ping-0: ABCDEFG"), cli.stdout
    assert _ping_lines(out, "server ping data: ") == pings, out


@pytest.mark.parametrize("host", ["c", "python"])
def test_a_program_exiting_with_a_live_connection_disconnects_its_peer(host, tmp_path):
    """A client that connects and exits without rdma_destroy_id (a C program calling
    exit(), a Python one returning): its ids leave the CM at exit as the kernel's do when
    the process's rdma_cm file closes, so the server sees ESTABLISHED then DISCONNECTED
    at once (nothing else would ever tell it: an idle connection has no keepalive)."""
    port = "7488" if host == "c" else "7489"
    if host == "c":
        exe = tmp_path / "exec_cm_exit"
        r = subprocess.run([require_tool("gcc"), "-O1", "-Wall", "-o", str(exe),
                            str(Path(PROGRAM).with_name("exec_cm_exit.c")), "-lrdmacm"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        client = [str(exe), SERVER, port]
    else:
        client = ["/usr/bin/python3", PROGRAM, "client-exit", SERVER, port]
    # the server's wait for each event is 60 s: the DREQ must come long before
    cli, srv = pair(_exec(SERVER, "/usr/bin/python3", PROGRAM, "server", SERVER, port),
                    _exec(CLIENT, *client), LISTENING, server_env=_trace_env(),
                    client_env=_env(), timeout=30)
    out, err = srv.stdout, srv.stderr
    assert cli.returncode == 0, (cli.stdout, cli.stderr)
    assert "exiting without rdma_destroy_id" in cli.stdout
    assert srv.returncode == 0, (out, err)
    assert out.splitlines()[-3:] == ["event RDMA_CM_EVENT_ESTABLISHED 0  0 0",
                                     "event RDMA_CM_EVENT_DISCONNECTED 0  0 0", "done"]


_PY_TOOLS = {  # tool: (Debian's binary, server args, client args) with {addr} {port}
    "cmatose": ("ucmatose", ["-b", "{addr}", "-p", "{port}", "-C", "3"],
                ["-s", "{addr}", "-p", "{port}", "-C", "3"]),
    "udaddy": ("udaddy", ["-b", "{addr}", "-C", "3"], ["-s", "{addr}", "-C", "3"]),
}


@pytest.mark.parametrize("exec_role", ["client", "server"])
@pytest.mark.parametrize("tool", sorted(_PY_TOOLS))
def test_cmatose_and_udaddy_against_softrdmas_own(tool, exec_role):
    """Debian's ucmatose / udaddy under softrdma exec against softrdma's Python cmatose /
    udaddy (same protocol, same messages), in both roles: each side says 'return status
    0'. The C client is started again while the Python server has not listened yet (it
    says nothing when it does): a request before listen() is refused at once."""
    binary, sargs, cargs = _PY_TOOLS[tool]
    port = {"cmatose": {"client": "7491", "server": "7492"},
            "udaddy": {"client": "7174", "server": "7174"}}[tool][exec_role]
    fill = lambda args: [a.format(addr=SERVER, port=port) for a in args]  # noqa: E731
    py = [sys.executable, "-m", "softrdma", tool]
    if exec_role == "client":
        cli, srv = pair(py + fill(sargs), _exec(CLIENT, binary, *fill(cargs)), started,
                        again=lambda r: r.returncode != 0,
                        server_env={**_env(), "SOFTRDMA_IP": SERVER}, client_env=_env(),
                        timeout=TIMEOUT)
    else:
        cli, srv = pair(_exec(SERVER, binary, *fill(sargs)), py + fill(cargs), LISTENING,
                        server_env=_trace_env(), client_env={**_env(), "SOFTRDMA_IP": CLIENT},
                        timeout=TIMEOUT)
    out, err = srv.stdout, srv.stderr
    assert cli.returncode == 0, (cli.stdout, cli.stderr)
    assert srv.returncode == 0, (out, err)
    assert "return status 0" in cli.stdout and "return status 0" in out, (cli.stdout, out)
