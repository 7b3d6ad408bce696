"""``softrdma exec``: the core verbs objects (PD, MR, CQ, channels, QP, SRQ, AH) and the
data path through ``context->ops``, exercised by unmodified C programs: Debian's
ibverbs-utils pingpongs, two processes each under ``softrdma exec`` on its own loopback
address (or one against ``softrdma pingpong``), and a small libibverbs program compiled
here (tests/programs/exec_verbs_checks.c) for what the pingpongs do not reach: RDMA
WRITE/READ into the program's own memory, immediate data, bad_wr, EBUSY, O_NONBLOCK
channels, poll() on the channel fd."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import require_tool
from .exec_pair import Server, compile_program, exec_argv, free_port as _free_port, \
    pair, tcp_port

SOFT = [sys.executable, "-m", "softrdma"]
PROGRAMS = Path(__file__).parent / "programs"
pytestmark = pytest.mark.usefixtures("exec_library")


def _exec(addr: str, *argv: str) -> list[str]:
    return exec_argv(addr, *argv)


def _pair(server: list[str], client: list[str]) -> tuple[subprocess.CompletedProcess, tuple]:
    """Start ``server``, then, once it listens (the port is the argument after ``-p``),
    ``client``; wait for both."""
    cli, srv = pair(server, client, tcp_port(server[server.index("-p") + 1]), timeout=90)
    return cli, (srv.returncode, srv.stdout, srv.stderr)


def _check_pingpong_output(out: str, me: str, peer: str, n: int) -> None:
    lines = out.splitlines()
    assert any(re.match(rf"  local address:  LID 0x0000, QPN 0x[0-9a-f]{{6}}, PSN "
                        rf"0x[0-9a-f]{{6}}[:,] GID ::ffff:{re.escape(me)}$", ln) for ln in lines)
    assert any(re.match(rf"  remote address: LID 0x0000, QPN 0x[0-9a-f]{{6}}, PSN "
                        rf"0x[0-9a-f]{{6}}, GID ::ffff:{re.escape(peer)}$", ln) for ln in lines)
    assert re.match(rf"{n} iters in \d+\.\d\d seconds = \d+\.\d\d usec/iter$", lines[-1]), out


@pytest.mark.parametrize("kind,extra", [
    ("rc", []), ("rc", ["-e", "-c"]), ("uc", ["-e"]), ("ud", []), ("ud", ["-e"]),
    ("srq", ["-e"]),
])
def test_debian_pingpongs_run_between_two_exec_programs(kind, extra):
    """ibverbs-utils' ibv_{rc,uc,ud,srq}_pingpong, unchanged, both ends under softrdma
    exec: the whole path of an ordinary verbs program (PD, MR over its buffer, CQ with a
    completion channel, QP or SRQ and AH, modify to RTS, the inline data path through
    context->ops) moves every message, busy-polling ibv_poll_cq or (``-e``) sleeping in
    ibv_get_cq_event on the channel while the device's progress thread delivers."""
    prog = f"ibv_{kind}_pingpong"
    require_tool(prog)
    port = _free_port()
    n = 5
    args = [prog, "-g", "1", "-n", str(n), "-p", port, *extra]
    cli, (src, sout, serr) = _pair(_exec("127.0.1.11", *args),
                                   _exec("127.0.1.12", *args, "127.0.1.11"))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert src == 0, sout + serr
    _check_pingpong_output(cli.stdout, "127.0.1.12", "127.0.1.11", n)
    _check_pingpong_output(sout, "127.0.1.11", "127.0.1.12", n)
    for err in (cli.stderr, serr):
        assert "not supported by softrdma" not in err, err  # no verb fell to a stub


@pytest.mark.parametrize("c_role", ["server", "client"])
def test_rc_pingpong_against_softrdma_pingpong(c_role):
    """One end Debian's ibv_rc_pingpong under exec, the other ``softrdma pingpong`` (the
    Python API): the C program's QP, MR and CQ interoperate with softrdma's own tool in
    either role -- the exchange, the GIDs, the PSNs and the messages are the same."""
    require_tool("ibv_rc_pingpong")
    port = _free_port()

    def c(addr, *peer):
        return _exec(addr, "ibv_rc_pingpong", "-g", "1", "-n", "5", "-p", port, *peer)

    def py(addr, *peer):
        return SOFT + ["pingpong", "rc", "-n", "5", "-p", port, "-a", addr, *peer]

    srv, cli_ = (c, py) if c_role == "server" else (py, c)
    cli, (src, sout, serr) = _pair(srv("127.0.1.13"), cli_("127.0.1.14", "127.0.1.13"))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert src == 0, sout + serr
    _check_pingpong_output(cli.stdout, "127.0.1.14", "127.0.1.13", 5)
    _check_pingpong_output(sout, "127.0.1.13", "127.0.1.14", 5)


def _compile(tmp_path: Path, name: str) -> str:
    return compile_program(tmp_path, name)


def test_verbs_checks_program(tmp_path):
    """A libibverbs program of our own (tests/programs/exec_verbs_checks.c), compiled
    against Debian's headers: its RDMA WRITE lands in, and its RDMA READ reads, the
    program's own malloc'd buffers (the MR is its memory, no copy); SEND_WITH_IMM carries
    imm_data in network order; IBV_SEND_INLINE data comes from unregistered memory with
    lkey 0 (libibverbs ignores an inline SGE's lkey); atomics work on its memory; a chain
    whose second WR has too many SGEs fails with EINVAL and bad_wr at that WR while the
    first is posted, and a chain looping on itself stops at the queue's depth with ENOMEM
    instead of hanging; a wrong lkey completes with IBV_WC_LOC_PROT_ERR, as rxe;
    ibv_dealloc_pd with MRs and ibv_destroy_cq with QPs are EBUSY; destroyed or foreign
    handles are EINVAL; qp->state follows ibv_modify_qp; ibv_resize_cq, ibv_rereg_mr, an
    SRQ limit event on context->async_fd, UD answered through ibv_create_ah_from_wc; the
    channel fd is a real descriptor (O_NONBLOCK makes ibv_get_cq_event EAGAIN, poll()
    sees an armed completion)."""
    exe = _compile(tmp_path, "exec_verbs_checks")
    r = subprocess.run(_exec("127.0.1.15", exe), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    oks = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert oks == ["reg_mr", "dealloc_pd_busy", "channel_nonblock", "qp_state", "rdma_write",
                   "rdma_read", "send_imm", "inline", "atomics", "bad_wr", "cq_event", "resize_cq",
                   "rereg_mr", "srq_limit", "ud_ah_from_wc", "bad_lkey",
                   "destroy_busy", "teardown", "stale_handles"], r.stdout + r.stderr
    assert "not supported by softrdma" not in r.stderr
    assert "Traceback" not in r.stderr  # each misuse was an errno, none a Python error
    # without softrdma the same binary finds no device at all
    bare = subprocess.run([exe], capture_output=True, text=True, timeout=30,
                          env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert bare.returncode != 0 and "OK reg_mr" not in bare.stdout


def test_a_killed_exec_program_fails_its_peers_sends_in_bounded_time():
    """Debian's ibv_rc_pingpong server under exec takes three messages, then is killed
    (SIGKILL: no teardown, its softrdma device vanishes with the process). The peer's next
    SEND is never acknowledged and completes with IBV_WC_RETRY_EXC_ERR once the QP's
    retries are spent: timeout 14 (67 ms) and retry_cnt 3 bound it to about 0.3 s plus the
    peer's own scheduling; the assertion allows a generous 60 s, never a hang."""
    require_tool("ibv_rc_pingpong")
    port = _free_port()
    victim = Server(_exec("127.0.1.16", "ibv_rc_pingpong", "-g", "1", "-n", "1000000",
                          "-p", port))
    survivor = None
    try:
        tcp_port(port)(victim)
        survivor = subprocess.Popen([sys.executable, str(PROGRAMS / "exec_rc_survivor.py"),
                                     port, "127.0.1.16"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "SOFTRDMA_IP": "127.0.1.17"})
        line = survivor.stdout.readline()
        assert line == "sent 3\n", line + survivor.stderr.read()
        victim.kill()
        survivor.stdin.write("go\n")
        survivor.stdin.flush()
        out, err = survivor.communicate(timeout=180)
        assert survivor.returncode == 0, out + err
        m = re.match(r"status (\d+) after (\d+\.\d+) s$", out.strip())
        assert m, out + err
        assert int(m.group(1)) == 12  # IBV_WC_RETRY_EXC_ERR
        assert float(m.group(2)) < 60
    finally:
        victim.kill()
        if survivor is not None:
            survivor.kill()


def test_a_program_asleep_in_poll_on_its_channel_fd_is_woken_by_the_device(tmp_path):
    """tests/programs/exec_fd_wait.c arms its CQ and sleeps in poll() on the completion
    channel's descriptor, in C, calling no verb: the SEND a peer process makes meanwhile
    is delivered by the soft device's progress thread alone (the program holds no GIL
    while it sleeps), which makes the eventfd readable; then ibv_get_cq_event and
    ibv_poll_cq give the completion and the program's buffer holds the bytes."""
    exe = _compile(tmp_path, "exec_fd_wait")
    prog = subprocess.Popen(_exec("127.0.1.19", exe), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peer = subprocess.Popen([sys.executable, str(PROGRAMS / "exec_fd_peer.py"),
                             "woken by the progress thread"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SOFTRDMA_IP": "127.0.1.20"})
    try:
        for src, dst in ((prog, peer), (peer, prog), (prog, peer)):  # address, address, ready
            line = src.stdout.readline()
            assert line, src.communicate(timeout=30)
            dst.stdin.write(line)
            dst.stdin.flush()
        pout, perr = peer.communicate(timeout=120)
        assert peer.returncode == 0 and pout.strip() == "sent", pout + perr
        out, err = prog.communicate(timeout=120)
        assert prog.returncode == 0, out + err
        assert out.strip() == "OK 28 woken by the progress thread", out + err
    finally:
        prog.kill()
        peer.kill()
