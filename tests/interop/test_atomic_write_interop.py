"""ATOMIC WRITE and FLUSH (IBTA 1.5 annex A19) against Linux 6.12's rxe, which has both
since 6.2 (6.1's rxe has neither: the opcodes are unknown to it).

tests/programs/a19_peer.c is the C peer: a responder whose MR the test reads back, or an
ATOMIC WRITE requester through ``ibv_wr_atomic_write``. In guest 0 it runs on rxe; on the
host it runs under ``softrdma exec`` (so the exec backend's extended QP is what posts or
answers). Debian 12's rdma-core 44 has no ``ibv_wr_flush`` (librxe gained it in 45), so
rxe cannot be the FLUSH requester here; softrdma's FLUSH requester is
tests/programs/a19_requester.py (the verbs API), rxe the responder.

What each test holds, derived from rxe's code and IBTA rather than from softrdma's output:
the 8 bytes land at the address named, in memory order, where the other side reads them;
an ATOMIC WRITE completes as IBV_WC_ATOMIC_WRITE (9) with byte_len 8, a FLUSH as
IBV_WC_FLUSH (8) with byte_len its length (rxe_comp.c: wqe->dma.length); a misaligned
ATOMIC WRITE is NAK'd "invalid request" (rxe_mr_do_atomic_write: RESPST_ERR_MISALIGNED_ATOMIC)
and completes IBV_WC_REM_INV_REQ_ERR (9); a persistent FLUSH into an MR registered for
global FLUSH only fails the MR lookup (rxe_resp.c check_rkey) and completes
IBV_WC_REM_ACCESS_ERR (10); rxe refuses IBV_ACCESS_FLUSH_PERSISTENT over memory that is not
pmem (rxe_mr.c, EINVAL) and so does softrdma over memory that is not an mmap; 6.12's rxe
reports device_cap_flags_ex bits 38-40 (FLUSH global, persistent, ATOMIC WRITE), as
softrdma does.

Without softrdma's ATOMIC WRITE and FLUSH, every test but the registration one fails: the
host side's WRs are refused or its responder NAKs the opcodes (checked by running this file
on the commit before them).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from softrdma.harness.lab import HOST_IP, guest_ip

from ..exec_pair import compile_program
from .exec_pair import EXEC, Ready, ok, run_pair

PORTS = iter(range(19850, 19899))
PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "a19_requester.py"
CAPS_EX = (1 << 38) | (1 << 39) | (1 << 40)  # IB_UVERBS_DEVICE_FLUSH_* and _ATOMIC_WRITE
WC_SUCCESS, WC_REM_INV_REQ_ERR, WC_REM_ACCESS_ERR, WC_RETRY_EXC_ERR = 0, 9, 10, 12
WC_FLUSH, WC_ATOMIC_WRITE = 8, 9
EINVAL = 22


def _peer(lab) -> str:
    """a19_peer.c compiled into the lab's directory, which the guest sees too."""
    exe = Path(lab.dir) / "a19_peer"
    if not exe.exists():
        compile_program(lab.dir, "a19_peer")
    return str(exe)


def _wcs(out: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m)) for m in re.findall(r"^wc (\d+) (\d+) (\d+)$", out, re.M)]


def _mem(out: str) -> bytes:
    m = re.search(r"^mem ([0-9a-f]{128})$", out, re.M)
    assert m, out
    return bytes.fromhex(m.group(1))


def _caps(out: str) -> int:
    m = re.search(r"^caps_ex 0x([0-9a-f]+)$", out, re.M)
    assert m, out
    return int(m.group(1), 16)


_OPS = "-o aw:16:1122334455667788 -o aw:40:0102030405060708 -o aw:12:aaaaaaaaaaaaaaaa"


def _check_atomic_writes(requester: str, responder: str) -> None:
    """Two aligned ATOMIC WRITEs land and complete; the misaligned third is NAK'd (only
    the status of a failed completion is defined: rxe leaves its opcode and length 0)."""
    wcs = _wcs(requester)
    assert wcs[:2] == [(WC_SUCCESS, WC_ATOMIC_WRITE, 8)] * 2, requester
    assert [w[0] for w in wcs[2:]] == [WC_REM_INV_REQ_ERR], requester
    mem = _mem(responder)
    assert mem[16:24] == bytes.fromhex("1122334455667788"), mem.hex()
    assert mem[40:48] == bytes.fromhex("0102030405060708"), mem.hex()
    assert mem[8:16] == bytes(8), mem.hex()  # the misaligned one wrote nothing


def test_softrdma_atomic_write_to_rxe(scenario612):
    """softrdma (a19_peer under exec: ibv_wr_atomic_write) -> rxe 6.12 responder."""
    exe, port = _peer(scenario612), next(PORTS)
    ours, rxe = run_pair(scenario612, "exec-client", f"{exe} -C -p {port}",
                         f"{exe} -C -p {port} {_OPS} {{addr}}", Ready("tcp", port))
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    _check_atomic_writes(ours.stdout, rxe.stdout)
    assert _caps(rxe.stdout) & CAPS_EX == CAPS_EX, rxe.stdout
    assert _caps(ours.stdout) & CAPS_EX == CAPS_EX, ours.stdout


def test_rxe_atomic_write_to_softrdma(scenario612):
    """rxe 6.12 requester (librxe's ibv_wr_atomic_write) -> softrdma responder (exec)."""
    exe, port = _peer(scenario612), next(PORTS)
    ours, rxe = run_pair(scenario612, "exec-server", f"{exe} -p {port}",
                         f"{exe} -p {port} {_OPS} {{addr}}", Ready("tcp", port))
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    _check_atomic_writes(rxe.stdout, ours.stdout)


def _wait_listen(lab, port: int, job, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while f":{port} " not in lab.guest(0, "ss -Htln", timeout=20).stdout + " ":
        assert job.running(), "the rxe responder exited first"
        assert time.monotonic() < deadline, "the rxe responder is not listening"
        time.sleep(0.2)


def _requester_against_rxe(lab, ops: str, mr_access: str = "0x100") -> tuple[str, str]:
    """a19_requester.py (softrdma) against a19_peer on rxe: (requester's output, rxe's)."""
    exe, port = _peer(lab), next(PORTS)
    job = lab.guest_start(0, f"timeout 60 {exe} -p {port} -a {mr_access}")
    _wait_listen(lab, port, job)
    p = lab.host_start(f"python3 {PROGRAM} -p {port} {ops} {guest_ip(0)}",
                       env={"SOFTRDMA_IP": HOST_IP})
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    rxe = job.wait(timeout=70)
    assert p.returncode == 0 and rxe.rc == 0, f"{out}\n{err[-3000:]}\n{rxe}"
    return out, rxe.stdout


def test_softrdma_flush_to_rxe(scenario612):
    """softrdma FLUSH requester -> rxe 6.12 responder whose MR allows global FLUSH only
    (the FLUSH with rxe's ICRC, without which rxe drops it):
    a global FLUSH of a range and of the whole MR (any length: rxe checks no range at
    level MR) succeed, an ATOMIC WRITE between them lands, a persistent FLUSH is a remote
    access error."""
    out, rxe_out = _requester_against_rxe(scenario612, "-o fl:1:0:0:64 -o fl:1:1:0:99999999 "
                                          "-o aw:24:0a0b0c0d0e0f1011 -o fl:2:0:0:64")
    wcs = _wcs(out)
    assert wcs[:3] == [(WC_SUCCESS, WC_FLUSH, 64), (WC_SUCCESS, WC_FLUSH, 99999999),
                       (WC_SUCCESS, WC_ATOMIC_WRITE, 8)], out
    assert [w[0] for w in wcs[3:]] == [WC_REM_ACCESS_ERR], out
    assert _mem(rxe_out)[24:32] == bytes.fromhex("0a0b0c0d0e0f1011"), rxe_out


def test_rxe_answers_a_repeated_atomic_write_but_not_a_repeated_flush(scenario612):
    """The first answer lost (softrdma's fault injector, -D), the request goes again with
    retry_cnt 1 (and a timeout of 4.3 s, so a slow guest's answer is not taken for a
    loss). rxe finds a repeated ATOMIC WRITE among its responder resources and
    answers it (the value is stored once); a repeated FLUSH it does not find, because
    rxe_prepare_res records no PSN range for a FLUSH, so it drops it and the requester
    fails with IBV_WC_RETRY_EXC_ERR (12). softrdma answers both (tests/test_flush.py)."""
    out, rxe_out = _requester_against_rxe(scenario612, "-D -r 1 -t 20 -o aw:8:1111111111111111")
    assert _wcs(out) == [(WC_SUCCESS, WC_ATOMIC_WRITE, 8)], out
    assert _mem(rxe_out)[8:16] == bytes.fromhex("1111111111111111"), rxe_out
    out, _ = _requester_against_rxe(scenario612, "-D -r 1 -t 20 -o fl:1:0:0:64")
    assert [w[0] for w in _wcs(out)] == [WC_RETRY_EXC_ERR], out


def test_persistent_mr_refused_on_both(scenario612):
    """IBV_ACCESS_FLUSH_PERSISTENT over ordinary memory: EINVAL from rxe 6.12 (its pages
    are not pmem) and from softrdma under exec (not an mmap it can msync); global FLUSH
    access is granted by both."""
    lab = scenario612
    exe = _peer(lab)
    for access, want in (("0x200", EINVAL), ("0x100", 0)):
        rxe = lab.guest(0, f"{exe} -R -a {access}", timeout=60)
        ours = lab.host(f"{EXEC} -- {exe} -R -a {access}", timeout=60)
        assert f"reg_mr {want}" in rxe.stdout, rxe
        assert f"reg_mr {want}" in ours.stdout, ours
