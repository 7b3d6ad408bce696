"""``softrdma exec``: C programs that misuse the libraries, or are misused, behave as on
Linux. Each test runs a real binary under ``softrdma exec`` (Debian's, or a small program
of tests/programs/ compiled here against the installed headers):

* the blocking waits (``ibv_get_cq_event``, ``ibv_get_async_event``,
  ``rdma_get_cm_event``) end with EINTR on a signal handled without SA_RESTART and go on
  with SA_RESTART, as the ``read()`` of a uverbs or rdma_cm file does;
* ``ibv_close_device`` with objects still alive destroys them all, as closing the uverbs
  file does, and later calls with their stale pointers are EINVAL, never a crash;
* a program killed in the middle of an rdma_cm transfer leaves its peer an error in
  bounded time, a working device and no leaked descriptor.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from .conftest import require_tool
from .exec_pair import SOFT, Server, compile_program, exec_argv, line as printed, run

pytestmark = pytest.mark.usefixtures("exec_library")


@pytest.mark.parametrize("mode,expected", [
    ("norestart", ["EINTR cq_event", "OK cq_event", "EINTR async_event", "OK async_event",
                   "EINTR cm_event", "OK cm_event"]),
    ("restart", ["RESTARTED cq_event", "RESTARTED async_event", "RESTARTED cm_event"]),
])
def test_a_signal_ends_a_blocking_wait_with_eintr_unless_sa_restart(tmp_path, mode, expected):
    """tests/programs/exec_eintr.c blocks in ibv_get_cq_event, ibv_get_async_event and
    rdma_get_cm_event with an alarm(1) pending. On Linux each is a blocking read() of the
    uverbs or rdma_cm file: without SA_RESTART the handler's signal fails the call with
    EINTR (how a program stops waiting), and the event made afterwards is then returned by
    the same call; with SA_RESTART the kernel restarts the read and the call returns the
    event a thread makes 0.3 s after the handler ran. (Python's own waits retry after
    EINTR, PEP 475: without the libc read the first case hangs, bounded here by the
    timeout.)"""
    exe = compile_program(tmp_path, "exec_eintr", "-lrdmacm", "-lpthread")
    r = subprocess.run(exec_argv("127.0.3.21", exe, mode, "127.0.3.21"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:-1] == expected, r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_closing_a_context_with_live_objects_destroys_them_as_closing_uverbs_does(tmp_path):
    """tests/programs/exec_close_live.c closes a context that still holds a PD, an MR, a
    memory window, an AH, an SRQ, a CQ on a channel with an event not acknowledged, and an
    RC QP connected to a QP of a second context. As when Linux closes the uverbs file:
    every object goes (no descriptor of the context stays open), the peer's next SEND
    completes with IBV_WC_RETRY_EXC_ERR (timeout 14, retry_cnt 3: about 0.27 s, allowed
    60 s), each stale pointer afterwards -- the data path's inlines through
    ``qp->context->ops`` included -- is EINVAL and never a crash, and a context opened
    after works."""
    exe = compile_program(tmp_path, "exec_close_live")
    r = subprocess.run(exec_argv("127.0.3.22", exe), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    oks = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert oks == ["connected", "closed", "descriptors", "stale", "peer", "device"], \
        r.stdout + r.stderr
    assert "Traceback" not in r.stderr


#: a Python host under exec: it opens a context, leaves a PD, a channel, a CQ on it and an
#: MR in it, closes the context and says whether softrdma's records are as before
_RECORDS_PROBE = """
import ctypes
from ctypes import c_void_p, c_int
lib = ctypes.CDLL(None, use_errno=True)
def fn(name, res, *args):
    f = getattr(lib, name); f.restype = res; f.argtypes = args; return f
devs = fn("ibv_get_device_list", ctypes.POINTER(c_void_p), c_void_p)(None)
from softrdma.exec.shim import handles  # the library's own, loaded by that first call
before = handles.count()
ctx = fn("ibv_open_device", c_void_p, c_void_p)(devs[0])
pd = fn("ibv_alloc_pd", c_void_p, c_void_p)(ctx)
ch = fn("ibv_create_comp_channel", c_void_p, c_void_p)(ctx)
cq = fn("ibv_create_cq", c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int)(
    ctx, 4, None, ch, 0)
buf = ctypes.create_string_buffer(64)
mr = fn("ibv_reg_mr", c_void_p, c_void_p, c_void_p, ctypes.c_size_t, c_int)(pd, buf, 64, 1)
assert pd and ch and cq and mr
alive = handles.count()
assert fn("ibv_close_device", c_int, c_void_p)(ctx) == 0
print(sorted(set(alive) - set(before)), handles.count() == before)
"""


def test_closing_a_context_forgets_the_exec_records_of_its_objects(tmp_path):
    """The records softrdma exec keeps for each structure it handed out (shim.handles)
    go with the context: after ibv_close_device of a context left with a PD, a channel,
    a CQ and an MR, the records are exactly those from before it was opened (seen from a
    Python host, whose interpreter runs the library)."""
    r = subprocess.run(exec_argv("127.0.3.23", "/usr/bin/python3", "-c", _RECORDS_PROBE),
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "['comp_channel', 'context', 'cq', 'mr', 'pd'] True", \
        r.stdout + r.stderr


# ---- a program killed in the middle of an rdma_cm transfer ------------------------------

class _Lines:
    """A process's merged output, read line by line on a thread, with times."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()[:120]))

    def wait_for(self, pred, timeout: float, start: int = 0) -> float:
        """Until a line from the ``start``-th on that ``pred`` accepts; the time it
        came. Fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines)[start:]:
                if pred(line):
                    return t
            assert self.proc.poll() is None, self.lines[-20:]
            time.sleep(0.02)
        raise AssertionError(f"no such line in {timeout} s: {self.lines[-20:]}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _settled_fds(pid: int, want: int, timeout: float = 20) -> int:
    """The descriptor count of ``pid`` once it is ``want`` (a connection's teardown runs
    on the server's threads after the event), or the last seen after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (n := _fds(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


#: the peer learns of the death from the DREQ the dead program's guardian sends as soon
#: as the program's descriptors close (milliseconds); this is a generous bound for a
#: loaded machine, not the expected time
DISCONNECT_BOUND = 30.0


@pytest.mark.parametrize("server_kind", ["exec", "python"])
def test_a_killed_rping_client_disconnects_its_long_lived_server(server_kind):
    """A persistent rping server (Debian's under exec, or softrdma's Python rping -P),
    its client -- Debian's rping under exec -- killed with SIGKILL in the middle of its
    pings (the server between its RDMA READ, WRITE and SEND). On Linux the kernel closes
    the dead client's rdma_cm file and sends the DREQ; under exec the program's guardian
    (softrdma.exec.reaper) does, so the server prints "DISCONNECT EVENT" within
    milliseconds (bound asserted: DISCONNECT_BOUND); without the guardian it waits for
    the client's next SEND for ever. Then the server's device lives (a new client pings
    3 times) and it holds exactly the descriptors it held before the killed connection
    (its connection's channel, CQ and the QP's UDP source-port socket went with it)."""
    require_tool("rping")
    srv_ip, cli_ip, port = "127.0.3.24", "127.0.3.25", str(7600 + (server_kind == "python"))
    size = ["-S", "200"]
    if server_kind == "exec":
        argv = exec_argv(srv_ip, "stdbuf", "-oL", "rping", "-s", "-P", "-v", "-a", srv_ip,
                     "-p", port, *size)
    else:
        argv = SOFT + ["rping", "-s", "-P", "-v", "-a", srv_ip, "-p", port, *size]
    srv = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1",
                                "SOFTRDMA_EXEC_CM_TRACE": "1", "SOFTRDMA_IP": srv_ip})
    out = _Lines(srv)
    victim = None
    try:
        if server_kind == "exec":
            out.wait_for(lambda ln: "rdma_listen -> 0" in ln, 60)
        client = exec_argv(cli_ip, "rping", "-c", "-a", srv_ip, "-p", port, *size)
        warm = subprocess.run(client + ["-C", "2"], capture_output=True, text=True,
                              timeout=120)
        assert warm.returncode == 0, warm.stdout + warm.stderr
        before = _settled_fds(srv.pid, -1, timeout=1)
        victim = subprocess.Popen(client + ["-C", "0"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        out.wait_for(lambda ln: "ping data: rdma-ping-20:" in ln, 120, start=len(out.lines))
        victim.kill()
        killed = time.monotonic()
        victim.wait(timeout=30)
        seen = out.wait_for(lambda ln: "DISCONNECT EVENT" in ln, DISCONNECT_BOUND)
        assert seen - killed < DISCONNECT_BOUND
        again = subprocess.run(client + ["-C", "3", "-v"], capture_output=True, text=True,
                               timeout=120)
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.count("ping data: rdma-ping-") == 3
        assert _settled_fds(srv.pid, before) == before
        assert srv.poll() is None
    finally:
        if victim is not None:
            victim.kill()
        srv.kill()
        srv.wait()


def _guardian_of(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` has started its connection guardian (softrdma/exec/reaper.py)."""
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if b"reaper.py" in cmd and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                return True
        time.sleep(0.1)
    return False


def test_a_killed_rstream_client_fails_its_server_in_bounded_time():
    """Debian's rstream, both ends under exec, 10,000-byte transfers with -T a (rpoll
    before each call); the client is killed with SIGKILL mid-transfer. The server's rpoll
    says POLLHUP once the dead client's DREQ arrived (sent by its guardian), and rstream
    ends with an error instead of waiting for ever (bound: DISCONNECT_BOUND). (With its
    default -T, non-blocking calls and no rpoll, rstream takes rrecv's 0 at the end of
    the stream with a stale EAGAIN in errno for "try again" and spins: rstream's own
    loop, the same on Linux, where rsocket.c's rrecv also returns 0.)"""
    require_tool("rstream")
    srv_ip, cli_ip, port = "127.0.3.26", "127.0.3.27", "7602"
    args = ["-p", port, "-C", "100000000", "-S", "10000", "-T", "a"]
    srv = subprocess.Popen(exec_argv(srv_ip, "rstream", "-b", srv_ip, *args),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 60
        while True:  # until the server listens: a client refused before then is retried
            victim = subprocess.Popen(exec_argv(cli_ip, "rstream", "-s", srv_ip, *args),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)
            try:
                err = victim.communicate(timeout=3)[1]
            except subprocess.TimeoutExpired:
                break  # running: connected, or still connecting on a loaded machine
            assert time.monotonic() < deadline and srv.poll() is None, err
            time.sleep(0.5)
        # killed once connected: its guardian starts at the first ESTABLISHED connection
        # (a client killed before that is a handshake the server's CM times out, a
        # different case)
        assert _guardian_of(victim.pid, deadline), "the client never got connected"
        victim.kill()
        killed = time.monotonic()
        victim.wait(timeout=30)
        try:
            out, err = srv.communicate(timeout=DISCONNECT_BOUND)
        except subprocess.TimeoutExpired:
            srv.kill()
            raise AssertionError(f"the server still runs: {srv.communicate()}") from None
        assert time.monotonic() - killed < DISCONNECT_BOUND
        assert srv.returncode != 0, out + err
    finally:
        if victim is not None:
            victim.kill()
        srv.kill()


# ---- a server between two listeners (perftest -R) ----------------------------------------

def test_a_request_between_two_listeners_is_rejected_and_the_next_listener_serves():
    """What softrdma does in perftest -R's gap (tests/programs/exec_cm_relisten.py plays
    its server: listen, accept, destroy the listener, listen again on the same port): a
    client's request while no listener exists is REJECTED with reason 8 (no listener), as
    Linux's CM answers it, at once; the listener made afterwards takes the next client,
    which connects and disconnects normally. (What hangs after a rejected perftest client
    is perftest's own: its server waits for ever for the data connection, and a later
    client's control connection is taken as one; docs/exec.md.)"""
    srv_ip, cli_ip, port = "127.0.3.28", "127.0.3.29", "7603"
    programs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
    client = exec_argv(cli_ip, "/usr/bin/python3", os.path.join(programs, "exec_cm_ctypes.py"),
                       "client", srv_ip, port)
    with Server(exec_argv(srv_ip, "/usr/bin/python3",
                          os.path.join(programs, "exec_cm_relisten.py"), srv_ip, port),
                stdin=True) as srv:
        printed("listening", "stdout")(srv)
        first = run(client)
        assert first.returncode == 0, first.stdout + first.stderr
        printed("no listener", "stdout")(srv)
        early = run(client)
        assert early.returncode != 0
        assert "event RDMA_CM_EVENT_REJECTED 8 " in early.stdout, early.stdout + early.stderr
        srv.send_line("go")
        printed("listening again", "stdout")(srv)
        later = run(client)
        assert later.returncode == 0, later.stdout + later.stderr
        res = srv.finish()
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1] == "done", res.stdout
