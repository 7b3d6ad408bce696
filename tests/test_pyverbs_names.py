"""pyverbs' names of every rdma-core release 44..64 under ``softrdma run``.

softrdma/pyverbs_compat/_manifest.py is generated from rdma-core's own sources, release by
release (scripts/gen_pyverbs_manifest.py, docs/pyverbs.md). These tests need no rdma-core
checkout: they hold the committed manifest to

* every ``import pyverbs...``/``from pyverbs... import X`` line of any release's tests/
  (recorded in the manifest) resolving under softrdma's finder;
* its C values, against the C headers: a few anchors read from rdma-core's v64 headers by
  hand, and every v44 name against Debian's installed headers (libibverbs-dev,
  librdmacm-dev: rdma-core 44), compiled here with gcc;
* what softrdma does not implement failing as pyverbs fails on Linux rxe, and the names
  newer releases added that softrdma implements behaving as on rxe.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from softrdma.pyverbs_compat import _manifest as M

from .conftest import IN_CI, require_tool

ROOT = Path(__file__).resolve().parent.parent


def run_prog(tmp_path: Path, code: str, **extra: str) -> subprocess.CompletedProcess:
    """Run ``code`` as a pyverbs program under ``softrdma run``."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "softrdma.run", str(prog)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_manifest_covers_releases_44_to_64():
    """Every release tag v44.0..v64.0 was read; the module renames are recorded where
    rdma-core made them (libibverbs_enums/librdmacm_enums from v50, enums/cm_enums last
    built in v58, mlx5dv_event from v60: pyverbs/CMakeLists.txt of those releases)."""
    assert M.RELEASES == [f"v{n}.0" for n in range(44, 65)]
    assert M.SPAN["libibverbs_enums"] == ("v50.0", "v64.0")
    assert M.SPAN["librdmacm_enums"] == ("v50.0", "v64.0")
    assert M.SPAN["enums"] == ("v44.0", "v58.0")
    assert M.SPAN["cm_enums"] == ("v44.0", "v58.0")
    assert M.SPAN["providers.mlx5.mlx5dv_event"] == ("v60.0", "v64.0")
    # the import lines the issue measured as failing on rdma-core 44's names
    assert "from pyverbs.librdmacm_enums import rdma_port_space" in M.TEST_IMPORTS
    assert "from pyverbs.providers.mlx5.mlx5_enums import mlx5dv_context_attr_comp_mask" \
        in M.TEST_IMPORTS


def test_every_pyverbs_import_of_every_release_suite_resolves(tmp_path):
    """Each import line of rdma-core 44..64's tests/ works in a pyverbs program on
    softrdma (the v64 suite stopped at its first: pyverbs.librdmacm_enums)."""
    p = run_prog(tmp_path, """
        import json
        from softrdma.pyverbs_compat import _manifest as M
        bad = []
        for line in M.TEST_IMPORTS:
            try:
                exec(line, {})
            except Exception as e:
                bad.append(f"{line}: {e!r}")
        print(json.dumps([len(M.TEST_IMPORTS), bad]))
    """)
    assert p.returncode == 0, p.stderr
    n, bad = json.loads(p.stdout.splitlines()[-1])
    assert n > 250 and not bad, "\n".join(bad)


# C values read by hand from rdma-core v64's headers (libibverbs/verbs.h,
# librdmacm/rdma_cma.h, providers/mlx5/mlx5dv.h), names newer than Debian's rdma-core 44
ANCHORS = [
    ("libibverbs_enums", "IBV_WR_FLUSH", 14),
    ("libibverbs_enums", "IBV_WR_ATOMIC_WRITE", 15),
    ("libibverbs_enums", "IBV_ACCESS_FLUSH_GLOBAL", 1 << 8),
    ("libibverbs_enums", "IBV_ACCESS_FLUSH_PERSISTENT", 1 << 9),
    ("libibverbs_enums", "IBV_QP_EX_WITH_FLUSH", 1 << 11),
    ("libibverbs_enums", "IBV_QP_EX_WITH_ATOMIC_WRITE", 1 << 12),
    ("libibverbs_enums", "_IBV_ALLOCATOR_USE_DEFAULT", (1 << 64) - 1),  # <size_t>(void *)-1
    ("librdmacm_enums", "RDMA_CM_EVENT_ADDRINFO_RESOLVED", 16),
    ("librdmacm_enums", "RDMA_CM_EVENT_ADDRINFO_ERROR", 17),
    ("librdmacm_enums", "RDMA_PS_TCP", 0x0106),
    ("providers.mlx5.mlx5_enums", "MLX5DV_CONTEXT_ATTR_MASK_FD_ARRAY", 1 << 0),
    ("providers.mlx5.mlx5_enums", "MLX5DV_CONTEXT_FLAGS_DEVX", 1 << 0),
]


def test_anchor_values_are_the_c_headers(tmp_path):
    """Names of newer releases carry their C values, under both module names."""
    p = run_prog(tmp_path, f"""
        import importlib, json
        out = []
        for mod, name, _ in {[(m, n, 0) for m, n, _ in ANCHORS]!r}:
            m = importlib.import_module("pyverbs." + mod)
            out.append(int(getattr(m, name)))
        import pyverbs.enums as e, pyverbs.cm_enums as ce
        out += [int(e.IBV_WR_ATOMIC_WRITE), int(ce.RDMA_CM_EVENT_ADDRINFO_ERROR)]
        print(json.dumps(out))
    """)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert got == [v for _, _, v in ANCHORS] + [15, 17]


def _debian_header_values(names: list[str], tmp: Path) -> dict[str, int]:
    """Compile a program against the installed rdma-core headers printing each name's
    value; names those headers do not declare (driver.h's) are dropped."""
    heads = ["infiniband/verbs.h", "rdma/rdma_cma.h", "infiniband/mlx5dv.h",
             "infiniband/efadv.h"]
    names = set(names)
    for _ in range(10):
        src = "\n".join(["#include <stdio.h>", *[f"#include <{h}>" for h in heads],
                         "int main(void) {",
                         *[f'printf("%s %lld\\n", "{n}", (long long)({n}));'
                           for n in sorted(names)], "return 0; }"])
        (tmp / "v.c").write_text(src)
        r = subprocess.run(["gcc", "-w", "-o", str(tmp / "v"), str(tmp / "v.c")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            out = subprocess.run([str(tmp / "v")], capture_output=True, text=True).stdout
            return {a: int(b) for a, b in (line.split() for line in out.splitlines())}
        bad = set(re.findall(r"['‘](\w+)['’] undeclared", r.stderr))
        assert bad, r.stderr[-2000:]
        names -= bad
    raise AssertionError("could not compile against the installed headers")


def test_v44_names_equal_debians_installed_headers(tmp_path):
    """Every enum member of rdma-core 44's enums, cm_enums, mlx5_enums and efa_enums has
    the value Debian's installed headers (rdma-core 44) give it, compiled here."""
    require_tool("gcc")
    if not Path("/usr/include/infiniband/verbs.h").exists() or \
            not Path("/usr/include/rdma/rdma_cma.h").exists():
        msg = "libibverbs-dev/librdmacm-dev are not installed (scripts/setup installs them)"
        if IN_CI:
            pytest.fail("CI=true and a prerequisite is missing: " + msg)
        pytest.skip(msg)
    want = {}
    for mod in ("enums", "cm_enums", "providers.mlx5.mlx5_enums", "providers.efa.efa_enums"):
        for cls, (_base, members) in M.ENUMS[mod].items():
            for n, v in members.items():
                first = M.SPAN.get(f"{mod}.{n}", ("v44.0",))[0]
                if first == "v44.0" and f"{mod}.{n}" not in M.CHANGED:
                    want[n] = v
    got = _debian_header_values(list(want), tmp_path)
    # all but driver.h's two (ibv_gid_type_sysfs: rdma-core's internal header, not installed)
    assert len(got) >= len(want) - 2 and len(got) > 500, (len(got), len(want))
    diff = {n: (want[n], got[n]) for n in got if want[n] != got[n]}
    assert not diff, diff


def test_unimplemented_objects_fail_as_on_rxe(tmp_path):
    """Provider contexts say the device is not theirs; other objects EOPNOTSUPP, names
    of old and new releases alike; attribute records can be made."""
    p = run_prog(tmp_path, """
        import errno, json
        from pyverbs.device import Context
        from pyverbs.pyverbs_error import PyverbsRDMAError, PyverbsUserError
        from pyverbs.providers.mlx5.mlx5dv import Mlx5Context, Mlx5DVContextAttr
        from pyverbs.providers.efa.efadv import EfaContext
        from pyverbs.providers.mlx5.mlx5dv_event import EventChannel      # v60 on
        from pyverbs.xrcd import XRCD, XRCDInitAttr
        from pyverbs.qp import QPRateLimitAttr                            # v64
        from pyverbs.mr import DMAHandle                                  # v60 on
        out = []
        ctx = Context(name="softrdma0")
        for make in (lambda: Mlx5Context(Mlx5DVContextAttr(), name="softrdma0"),
                     lambda: EfaContext(name="softrdma0")):
            try:
                make()
            except PyverbsUserError as e:
                out.append(str(e))
        for make in (lambda: XRCD(ctx, XRCDInitAttr()), lambda: EventChannel(ctx),
                     lambda: DMAHandle(ctx)):
            try:
                make()
            except PyverbsRDMAError as e:
                out.append(e.error_code)
        QPRateLimitAttr(rate_limit=10)
        print(json.dumps(out))
    """)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == [
        "This is not an MLX5 device", "This is not an EFA device", 95, 95, 95]


def test_newer_release_calls_behave_as_on_rxe(tmp_path):
    """What rdma-core 46..64's suite calls and rxe answers: MREx registers host memory
    (libibverbs' legacy path for a provider without reg_mr_ex) and refuses a dma-buf fd;
    get_pkey_index finds the default P_Key at 0; query_port_speed is EOPNOTSUPP (no
    provider op); madvise; AddrInfo() resolves nothing until get_addrinfo; ``rdma link
    show -j`` names the soft device's netdev."""
    p = run_prog(tmp_path, """
        import errno, json, subprocess
        import pyverbs.device as d
        import pyverbs.mem_alloc as mem
        from pyverbs.pd import PD
        from pyverbs.mr import MREx
        from pyverbs.cmid import AddrInfo
        from pyverbs.pyverbs_error import PyverbsRDMAError
        from pyverbs.libibverbs_enums import ibv_access_flags as a
        out = []
        ctx = d.Context(name="softrdma0")
        pd = PD(ctx)
        mr = MREx(pd, 4096, a.IBV_ACCESS_LOCAL_WRITE | a.IBV_ACCESS_REMOTE_WRITE)
        mr.write(b"x" * 8, 8)
        out.append([mr.length, mr.read(8, 0).decode()])
        try:
            MREx(pd, 4096, a.IBV_ACCESS_LOCAL_WRITE, fd=0)
        except PyverbsRDMAError as e:
            out.append(e.error_code)
        out.append(ctx.get_pkey_index(1, 0xffff))
        try:
            ctx.query_port_speed(1)
        except PyverbsRDMAError as e:
            out.append(e.error_code)
        buf = mem.mmap(4096)
        mem.madvise(buf, 4096)
        ai = AddrInfo()
        ai.get_addrinfo(src="127.0.4.9", dst="127.0.4.9", dst_service=7471)
        out.append(str(ai.dst))
        links = json.loads(subprocess.check_output(["rdma", "link", "show", "-j"]))
        out.append([(r["ifname"], r["port"], r["netdev"]) for r in links
                    if r["ifname"] == "softrdma0"])
        print(json.dumps(out))
    """, SOFTRDMA_NETDEV="1")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == [
        [4096, "xxxxxxxx"], 95, 0, 95, "127.0.4.9", [["softrdma0", 1, "lo:softrdma0"]]]
