"""Unchanged pyverbs programs on softrdma (softrdma run / python -m softrdma.run), the shim's
API surface where it differs from softrdma.verbs_api, and GID index 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from softrdma.pyverbs_compat.suite import parse_unittest_output, per_file

from .conftest import IN_CI

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "programs"
IB_DEVICES = Path("/usr/share/doc/python3-pyverbs/examples/ib_devices.py")
SYSTEM_PY = Path("/usr/bin/python3")


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    e["PYTHONPATH"] = str(ROOT)
    e.update(extra)
    return e


def run(args: list[str], timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "softrdma.run", *args], env=env(**extra),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def need(path: Path, what: str) -> Path:
    if not path.exists():
        msg = f"{path} is missing ({what})"
        if IN_CI:
            pytest.fail("CI=true and a prerequisite is missing: " + msg)
        pytest.skip(msg)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the opt-in --------------------------------------------------------------------------
def test_pyverbs_is_not_shadowed_without_the_runner():
    code = ("import softrdma, softrdma.verbs_api, softrdma.pyverbs_compat.device, sys\n"
            "try:\n import pyverbs; print(pyverbs.__file__)\n"
            "except ImportError: print('none')\n")
    p = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "softrdma" not in p.stdout


def test_the_runner_resolves_pyverbs_modules_to_softrdma(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text(textwrap.dedent("""
        import sys
        import pyverbs.device as d, pyverbs.enums as e, pyverbs.libibverbs_enums as le
        from pyverbs.qp import QP, QPInitAttr, QPAttr, QPCap, QPEx, QPInitAttrEx
        from pyverbs.cq import CQ, CQEX, CqInitAttrEx, PollCqAttr, CompChannel
        from pyverbs.mr import MR, MW, MWBindInfo
        from pyverbs.pyverbs_error import PyverbsRDMAError, PyverbsUserError
        from pyverbs.providers.mlx5.mlx5dv import Mlx5Context
        import pyverbs.mem_alloc as mem, pyverbs.utils as pu
        print(d.Context.__module__, e.IBV_QPT_RC, le.IBV_WR_SEND, sys.argv[1:])
        try:
            Mlx5Context(None, name="softrdma0")
        except PyverbsUserError as ex:
            print("mlx5:", ex)
        sys.exit(3)
    """))
    p = run([str(prog), "a", "-b"])
    assert p.returncode == 3, p.stderr
    assert p.stdout.splitlines() == ["softrdma.pyverbs_compat.device 2 2 ['a', '-b']",
                                     "mlx5: This is not an MLX5 device"]
    p2 = subprocess.run([sys.executable, "-m", "softrdma", "run", str(prog)], env=env(),
                        capture_output=True, text=True, timeout=60)
    assert p2.returncode == 3 and "softrdma.pyverbs_compat.device" in p2.stdout, p2.stderr


def test_enum_values_are_real_pyverbs_values():
    """The shim's enums (from the manifest) equal those of Debian's pyverbs, read now."""
    need(SYSTEM_PY, "python3")
    code = ("import json, enum, pyverbs.enums as e\n"
            "print(json.dumps({n: int(getattr(e, n)) for n in dir(e) if n.startswith('IBV_')"
            " and isinstance(getattr(e, n), int)}))")
    p = subprocess.run([str(SYSTEM_PY), "-c", code], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        msg = "Debian's python3-pyverbs is not installed: " + p.stderr[-300:]
        if IN_CI:
            pytest.fail("CI=true and a prerequisite is missing: " + msg)
        pytest.skip(msg)
    real = json.loads(p.stdout)
    from softrdma.pyverbs_compat import enums as ours
    assert len(real) > 300
    assert {n: int(getattr(ours, n)) for n in real} == real
    # and where softrdma has its own enum classes, they agree too
    import softrdma.enums as se
    for n, v in real.items():
        if hasattr(se, n):
            assert int(getattr(se, n)) == v, n


# -- real programs, unchanged ------------------------------------------------------------
def test_debian_example_ib_devices_runs_unchanged():
    need(IB_DEVICES, "python3-pyverbs examples")
    p = run([str(IB_DEVICES)])
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines()[2:]]
    assert rows and rows[0][:3] == ["softrdma0", "CA", "IB"], p.stdout
    assert int(rows[0][3], 16) != 0


@pytest.mark.parametrize("gid", ["0", "1"])
def test_pingpong_in_one_process(gid):
    p = run([str(PROGRAMS / "pyverbs_pingpong.py"), "loopback", "-n", "20", "-g", gid])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "pingpong ok: 20 iterations"


@pytest.mark.parametrize("gid", ["0", "1"])
def test_pingpong_in_two_processes(gid):
    """Server and client each open softrdma0 in their own process; GID index 0 (the
    link-local GID) reaches the other process's device as rxe's link-local GIDs do."""
    port = str(_free_port())
    prog = str(PROGRAMS / "pyverbs_pingpong.py")
    # each process pins its device's address (SOFTRDMA_IP); test_live_device covers two
    # programs that let their default devices pick the first free addresses
    srv = subprocess.Popen([sys.executable, "-m", "softrdma.run", prog, "server", port, "-n",
                            "10", "-g", gid], env=env(SOFTRDMA_IP=f"127.0.0.{61 + 2 * int(gid)}"),
                           cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cli = run([prog, "client", port, "-n", "10", "-g", gid],
                  SOFTRDMA_IP=f"127.0.0.{62 + 2 * int(gid)}")
        sout, serr = srv.communicate(timeout=60)
    finally:
        srv.kill()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert srv.returncode == 0, sout + serr
    assert cli.stdout.strip() == sout.strip() == "pingpong ok: 10 iterations"
    if gid == "0":
        assert "gid fe80:" in cli.stderr and "gid fe80:" in serr


# -- GID 0 at the device -----------------------------------------------------------------
def test_every_gid_of_the_table_maps_to_an_address():
    import ipaddress
    from softrdma.soft.netdev import _derived_mac, eui64_link_local
    from softrdma.verbs_api import add_device, get_soft_device, remove_device
    add_device("127.0.0.71", name="gidtest", live=False)
    try:
        dev = get_soft_device("gidtest")
        own = bytes([127, 0, 0, 71])
        assert [dev.ip_of_gid(g) for g in dev.gid_table] == [own, own]
        peer = eui64_link_local(_derived_mac(ipaddress.ip_address("127.0.0.72")))
        assert dev.ip_of_gid(peer) == bytes([127, 0, 0, 72])
        foreign = ipaddress.IPv6Address("fe80::5054:ff:fe12:3456").packed  # a real NIC's
        assert dev.ip_of_gid(foreign) == foreign
    finally:
        remove_device("gidtest")


# -- pyverbs semantics the shim adds -----------------------------------------------------
def _shim():
    from softrdma.pyverbs_compat import cq, device, mr, pd, qp, wr
    return device, pd, mr, cq, qp, wr


def test_close_closes_dependents_first_as_pyverbs():
    device, pd_m, mr_m, cq_m, qp_m, _ = _shim()
    from softrdma.errors import PyverbsRDMAError
    from softrdma.verbs_api import PD as VPD
    with device.Context(name="softrdma0") as ctx:
        pd = pd_m.PD(ctx)
        cq = cq_m.CQ(ctx, 10)
        mr = mr_m.MR(pd, 64, 1)
        q = qp_m.QP(pd, qp_m.QPInitAttr(qp_type=2, scq=cq, rcq=cq))
        cq.close()                   # closes the QP that uses it
        assert q.closed and cq.closed and not pd.closed
        pd.close()                   # closes the MR
        assert mr.closed and pd.closed
        vpd = VPD(ctx)               # softrdma.verbs_api keeps the kernel's answer: EBUSY
        mr_m.MR(vpd, 64, 1)
        with pytest.raises(PyverbsRDMAError) as ei:
            VPD.close(vpd)
        assert ei.value.error_code == 16


def test_errors_carry_pyverbs_text_in_args():
    device, *_ = _shim()
    from softrdma.errors import PyverbsRDMAError
    with device.Context(name="softrdma0") as ctx:
        with pytest.raises(PyverbsRDMAError) as ei:
            ctx.query_port(5)
    assert ei.value.args == ("Failed to query port 5. Errno: 22, Invalid argument",)
    assert ei.value.error_code == 22


def test_send_wr_rkey_after_set_bind_wr_is_the_new_window_key():
    device, pd_m, mr_m, _, _, wr_m = _shim()
    with device.Context(name="softrdma0") as ctx:
        pd = pd_m.PD(ctx)
        m = mr_m.MR(pd, 64, 1 | 16)
        mw = mr_m.MW(pd, 2)
        w = wr_m.SendWR(opcode=8)  # IBV_WR_BIND_MW: no SGE needed
        w.set_bind_wr(mw, mr_m.MWBindInfo(m, m.buf, 64, 2))
        assert w.rkey == (mw.rkey & ~0xFF) | ((mw.rkey + 1) & 0xFF)
        r = wr_m.SendWR(opcode=0, num_sge=1, sg=[wr_m.SGE(m.buf, 8, m.lkey)])
        r.set_wr_rdma(0x1234, 0x10)
        assert r.rkey == 0x1234


def test_query_gid_table_and_gid_ex():
    device, *_ = _shim()
    from softrdma.errors import PyverbsRDMAError
    with device.Context(name="softrdma0") as ctx:
        ents = ctx.query_gid_table(16)
        assert [g.gid_index for g in ents] == [0, 1]
        assert [g.gid_str() for g in ents] == [ctx.query_gid(1, i).gid for i in (0, 1)]
        with pytest.raises(PyverbsRDMAError) as ei:
            ctx.query_gid_table(1)
        assert ei.value.error_code == -22
        with pytest.raises(PyverbsRDMAError) as ei:
            ctx.query_gid_ex(1, 5)
        assert ei.value.error_code == 61  # ENODATA: an empty entry
        ex = ctx.query_device_ex()
        assert ex.orig_attr.phys_port_cnt == ex.phys_port_cnt_ex == 1
        assert ex.odp_caps.general_caps == 0 and ex.max_dm_size == 0


# -- the suite's output parser -----------------------------------------------------------
def test_parse_unittest_output():
    text = textwrap.dedent("""\
        test_a (tests.test_x.A.test_a) ... ok
        test_b (tests.test_x.A.test_b)
        Docstring line ... skipped 'no XRC'
        test_c (tests.test_y.B) ... some output
        more output
        FAIL
        test_d (tests.test_y.B.test_d) ... ERROR
        test_e (tests.test_y.B.test_e) ... expected failure

        ======================================================================
        ERROR: setUpClass (tests.test_z.C)
        ----------------------------------------------------------------------
        ERROR: test_d (tests.test_y.B.test_d)
        """)
    res = parse_unittest_output(text)
    assert res == {"tests.test_x.A.test_a": "ok", "tests.test_x.A.test_b": "skipped",
                   "tests.test_y.B.test_c": "FAIL", "tests.test_y.B.test_d": "ERROR",
                   "tests.test_y.B.test_e": "expected failure",
                   "tests.test_z.C.setUpClass": "ERROR"}
    t = per_file(res)
    assert t["test_x"] == {"passed": 1, "failed": 0, "errored": 0, "skipped": 1}
    assert t["test_y"] == {"passed": 0, "failed": 2, "errored": 1, "skipped": 0}


def _rc_pair(ctx, pd, scq, rcq, sender_qp_cls, init_cls):
    """Two RC QPs of one context connected in loopback: the first of class sender_qp_cls."""
    from softrdma.verbs_api import QP, AHAttr, GlobalRoute, QPAttr, QPCap
    cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
    a = sender_qp_cls(pd, init_cls(qp_type=2, scq=scq, rcq=scq, cap=cap))
    b = QP(pd, init_cls(qp_type=2, scq=rcq, rcq=rcq, cap=cap))
    gid = ctx.query_gid(1, 1)
    for me, peer in ((a, b), (b, a)):
        attr = QPAttr(qp_access_flags=7, dest_qp_num=peer.qp_num, path_mtu=3, rq_psn=0,
                      sq_psn=0, max_dest_rd_atomic=1, max_rd_atomic=1, min_rnr_timer=12,
                      timeout=14, retry_cnt=7, rnr_retry=7)
        attr.ah_attr = AHAttr(port_num=1, is_global=1,
                              gr=GlobalRoute(dgid=gid, sgid_index=1))
        QP.to_rts(me, attr)
    return a, b


def _poll_one(cq, deadline_s: float = 10.0):
    import time
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        n, wcs = cq.poll(1)
        if n:
            return wcs[0]
    raise AssertionError("no completion")


@pytest.mark.parametrize("opcode", [3, 1])  # IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM
def test_imm_data_is_pyverbs_raw_be32_at_the_pyverbs_layer(opcode):
    # Real pyverbs stores SendWR.imm_data raw into ibv_send_wr's __be32 and reads
    # ibv_wc.imm_data raw, so rdma-core's tests post socket.htonl(x) and compare a received
    # imm_data with socket.htonl(x): the wire carries x big-endian. softrdma's verbs take x
    # itself. A pyverbs program on softrdma must put the same bytes on the wire as on
    # real pyverbs, so a softrdma.verbs_api receiver must see x, and a pyverbs receiver
    # htonl(x).
    device, pd_m, mr_m, cq_m, qp_m, wr_m = _shim()
    from softrdma.verbs_api import CQ as VCQ, RecvWR as VRecvWR, SGE as VSGE
    x = 0x11223344
    with device.Context(name="softrdma0") as ctx:
        pd = pd_m.PD(ctx)
        scq, vcq, pcq = cq_m.CQ(ctx, 8), VCQ(ctx, 8), cq_m.CQ(ctx, 8)
        m = mr_m.MR(pd, 256, 7)
        # pyverbs sender -> softrdma.verbs_api receiver
        a, b = _rc_pair(ctx, pd, scq, vcq, qp_m.QP, qp_m.QPInitAttr)
        b.post_recv(VRecvWR(wr_id=9, sg=[VSGE(m.buf + 128, 64, m.lkey)]))
        w = wr_m.SendWR(wr_id=1, opcode=opcode, num_sge=1, sg=[wr_m.SGE(m.buf, 8, m.lkey)],
                        imm_data=socket.htonl(x))
        if opcode == 1:
            w.set_wr_rdma(m.rkey, m.buf + 64)
        a.post_send(w)
        assert w.imm_data == socket.htonl(x)       # the caller's WR is left as it was
        wc = _poll_one(vcq)
        assert wc.status == 0 and wc.imm_data == x
        # softrdma.verbs_api sender -> pyverbs receiver (a pyverbs CQ)
        c, d = _rc_pair(ctx, pd, scq, pcq, qp_m.QP, qp_m.QPInitAttr)
        d.post_recv(VRecvWR(wr_id=8, sg=[VSGE(m.buf + 128, 64, m.lkey)]))
        from softrdma.verbs_api import QP as VQP, SendWR as VSendWR
        v = VSendWR(wr_id=2, opcode=opcode, sg=[VSGE(m.buf, 8, m.lkey)], imm_data=x)
        if opcode == 1:
            v.set_wr_rdma(m.rkey, m.buf + 64)
        VQP.post_send(c, v)
        wc = _poll_one(pcq)
        assert wc.status == 0 and wc.imm_data == socket.htonl(x)
