"""ibverbs-utils' pingpongs under ``softrdma exec`` against the same Debian binaries on
kernel rxe (issue 27): rdma-core's provider in guest 0, softrdma's preload library on the
host (10.77.0.1), each tool in both roles (ibv_rc_pingpong is in test_exec_interop.py,
perftest in test_exec_interop_perftest.py).

What each test holds: both ends exit 0; each prints the other's QP numbers as its remote
ones (so both sides really talked to each other, not to something else); the byte and
iteration counts the tool reports; the tool's own data check (``-c``). Without ``softrdma
exec`` the host side has no RDMA device (the machine's kernel has no RDMA) and every
host-side tool ends at once ("Failed to get IB devices list: Function not implemented"),
failing each test: checked by running this file with the host side's ``softrdma exec ...
--`` replaced by ``env --`` (all fail).
"""

from __future__ import annotations

import re

import pytest

from .exec_pair import ROLES, Ready, ok, run_pair

PORTS = iter(range(19700, 19749))  # test_exec_interop.py has 19600-19698
#: on 6.12 as well as 6.1 (tests/interop/conftest.py; docs/lab.md, "Two kernels in CI")
ON_BOTH_KERNELS = pytest.mark.kernels("6.1", "6.12")

# ---- ibverbs-utils ----------------------------------------------------------------------

_QPN = r"QPN (0x[0-9a-f]+)"


def _pingpong(out: str, iters: int, size: int) -> None:
    """The pingpong's result lines: size bytes each way per iteration."""
    assert re.search(rf"^{size * iters * 2} bytes in [\d.]+ seconds", out, re.M), out
    assert re.search(rf"^{iters} iters in [\d.]+ seconds", out, re.M), out
    assert "invalid data" not in out.lower(), out  # -c: the receive buffer checked


def _qpns(out: str, side: str) -> list[str]:
    return re.findall(rf"{side} address:\s+LID 0x?0+,? {_QPN}", out)


# (tool, options, size): -g 1 is the RoCE v2 IPv4 GID on both sides; a UD message must fit
# the path MTU (1024 on rxe's 1500-byte NIC), 40 bytes of it the GRH
PINGPONGS = [("ibv_ud_pingpong", "", 512), ("ibv_uc_pingpong", "", 4096),
             ("ibv_srq_pingpong", "-q 4", 4096)]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("tool,opts,size",
                         [pytest.param(*PINGPONGS[0], marks=ON_BOTH_KERNELS), *PINGPONGS[1:]],
                         ids=[p[0][4:] for p in PINGPONGS])
def test_pingpong_under_exec_against_rxe(scenario, tool, opts, size, role):
    """ibv_{ud,uc,srq}_pingpong -g 1 -c, 20 iterations: UD sends through an AH to the
    peer's GID, UC sends, and an SRQ shared by 4 QPs; each side names every one of the
    other's QPs as its remote ones."""
    port, iters = next(PORTS), 20
    cmd = f"{tool} -g 1 -c -n {iters} -s {size} -p {port} {opts}"
    ours, rxe = run_pair(scenario, role, cmd, cmd + " {addr}", Ready("tcp", port))
    assert ours.rc == 0 and rxe.rc == 0, ok(ours, rxe)
    for out in (ours.stdout, rxe.stdout):
        _pingpong(out, iters, size)
    nqp = 4 if tool == "ibv_srq_pingpong" else 1
    assert len(_qpns(ours.stdout, "local")) == nqp, ours.stdout
    assert _qpns(ours.stdout, "local") == _qpns(rxe.stdout, "remote")
    assert _qpns(rxe.stdout, "local") == _qpns(ours.stdout, "remote")
