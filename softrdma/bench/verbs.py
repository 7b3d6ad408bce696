"""``softrdma bench verbs``: the cost of the Python path on a device, in one run.

The same RDMA WRITE loop (``softrdma/bench/programs/pyverbs_write_loop.py``, a pyverbs program: two
RC QPs of one context connected in loopback, up to 64 signalled writes outstanding, the CQ
polled in batches) runs, on one device, through:

- **ib_write_bw** (perftest, C): the baseline, the same device in loopback, same sizes and
  iteration counts, ``-F``;
- **pyverbs** (rdma-core's Cython binding, Debian's python3-pyverbs under /usr/bin/python3);
- **softrdma** (``softrdma run``: the unchanged pyverbs program on softrdma's pyverbs layer,
  on whichever backend the device name selects: libibverbs through ctypes for a real
  device such as ``rxe0``, the soft device for ``softrdma0``).

ib_write_bw and pyverbs need a real device (``/sys/class/infiniband/DEV``); on the soft
device their rows say why they did not run. 64-byte writes measure the per-call cost
(messages per second), 64 KiB writes the data path (MB/s, 10^6 bytes as perftest).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_verbs_bench", "LOOP"]

# in a directory of its own: a script's directory goes first on sys.path, and this
# package's socket.py would shadow the stdlib module
LOOP = str(Path(__file__).with_name("programs") / "pyverbs_write_loop.py")
SYSTEM_PYTHON = "/usr/bin/python3"  # where Debian's python3-pyverbs lives
# ib_write_bw's result line: bytes, iterations, BW peak, BW average (MB/s), MsgRate (Mpps)
_PERFTEST = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def is_real_device(name: str) -> bool:
    """A device the kernel's RDMA core knows (what libibverbs would open)."""
    return Path("/sys/class/infiniband", name).exists()


def _loop(argv: list[str], dev: str, gid: int, size: int, iters: int,
          timeout: float) -> dict[str, Any]:
    r = subprocess.run(argv + [LOOP, dev, str(gid), str(size), str(iters)],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _pyverbs_available() -> str | None:
    """None if /usr/bin/python3 imports pyverbs, else why not."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"no {SYSTEM_PYTHON}"
    r = subprocess.run([SYSTEM_PYTHON, "-c", "import pyverbs.device"], capture_output=True,
                       text=True, timeout=60)
    return None if r.returncode == 0 else "python3-pyverbs is not installed"


#: how many times ib_write_bw runs before its report is taken as it is: perftest turns
#: CPU cycles into time with the CPU frequency it detects, which in a virtual machine
#: sometimes gives a bandwidth of 0.00 or below (linux-rdma/perftest#82); a rerun does not
PERFTEST_ATTEMPTS = 3


def _ib_write_bw(dev: str, gid: int, size: int, iters: int, port: int,
                 timeout: float) -> dict[str, Any]:
    """ib_write_bw's average for ``size``, run again while it reports no bandwidth."""
    result: dict[str, Any] = {}
    for _ in range(PERFTEST_ATTEMPTS):
        result = _ib_write_bw_once(dev, gid, size, iters, port, timeout)
        if "error" not in result and result["MBps"] > 0:
            return result
    if "error" not in result:
        result = {"error": f"ib_write_bw reported {result['MBps']} MB/s "
                           f"{PERFTEST_ATTEMPTS} times (its clock, in a VM?)"}
    return result


def _ib_write_bw_once(dev: str, gid: int, size: int, iters: int, port: int,
                      timeout: float) -> dict[str, Any]:
    common = ["ib_write_bw", "-d", dev, "-x", str(gid), "-s", str(size), "-n", str(iters),
              "-p", str(port), "-F"]
    srv = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cli = None
        for _ in range(50):  # the server listens within a moment; connect until it does
            cli = subprocess.run(common + ["127.0.0.1"], capture_output=True, text=True,
                                 timeout=timeout)
            if cli.returncode == 0 or "Couldn't connect" not in cli.stdout + cli.stderr:
                break
        srv.wait(timeout=timeout)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    for line in (cli.stdout if cli else "").splitlines():
        m = _PERFTEST.match(line)
        if m and int(m.group(1)) == size:
            mbps = float(m.group(4))
            return {"size": size, "iters": iters, "MBps": mbps, "msg_per_s": mbps * 1e6 / size}
    tail = ((cli.stdout + cli.stderr) if cli else "").strip().splitlines()
    return {"error": tail[-1] if tail else "no result line"}


def run_verbs_bench(device: str = "softrdma0", gid_index: int | None = None,
                    small_iters: int = 5000, big_iters: int = 1000, port: int = 18515,
                    timeout: float = 600.0, out: Any = None) -> dict[str, dict[int, Any]]:
    """Run the three paths on ``device`` and print a table; returns {path: {size: result}}.

    ``gid_index`` defaults to 1 on a real device (the IPv4-mapped GID of a RoCE port with an
    IPv4 address, as in the lab) and 0 on a soft one."""
    out = out or sys.stdout
    real = is_real_device(device)
    gid = gid_index if gid_index is not None else (1 if real else 0)
    sizes = ((64, small_iters), (65536, big_iters))
    why_not_pyverbs = "not a real device" if not real else _pyverbs_available()
    why_not_perftest = "not a real device" if not real else \
        (None if shutil.which("ib_write_bw") else "perftest is not installed")
    results: dict[str, dict[int, Any]] = {"ib_write_bw": {}, "pyverbs": {}, "softrdma": {}}
    for size, iters in sizes:
        results["ib_write_bw"][size] = {"error": why_not_perftest} if why_not_perftest else \
            _ib_write_bw(device, gid, size, iters, port, timeout)
        results["pyverbs"][size] = {"error": why_not_pyverbs} if why_not_pyverbs else \
            _loop([SYSTEM_PYTHON], device, gid, size, iters, timeout)
        results["softrdma"][size] = _loop([sys.executable, "-m", "softrdma.run"], device, gid,
                                          size, iters, timeout)
    base = results["ib_write_bw"]

    def cell(r: dict[str, Any], key: str, b: dict[str, Any], fmt: str) -> str:
        if "error" in r:
            return "n/a"
        s = format(r[key], fmt)
        return f"{s} ({r[key] / b[key]:.2f}x)" if "error" not in b and b[key] > 0 else s

    print(f"RDMA WRITE loop on {device} (gid {gid}), two RC QPs in loopback, tx depth 64",
          file=out)
    print(f"{'path':<34}{'64 B msg/s':>22}{'64 KiB MB/s':>22}", file=out)
    label = {"ib_write_bw": "ib_write_bw (perftest, C)",
             "pyverbs": "pyverbs (Cython)",
             "softrdma": "softrdma (" + ("libibverbs via ctypes" if real else "soft device") + ")"}
    for path, rs in results.items():
        print(f"{label[path]:<34}{cell(rs[64], 'msg_per_s', base[64], ',.0f'):>22}"
              f"{cell(rs[65536], 'MBps', base[65536], ',.1f'):>22}", file=out)
    for path, rs in results.items():
        errs = sorted({r["error"] for r in rs.values() if "error" in r})
        for err in errs:
            print(f"  {path}: {err}", file=out)
    print("(ratios against ib_write_bw in the same run)", file=out)
    return results
