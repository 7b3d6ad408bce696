#!/usr/bin/env python3
"""Run rdma-core's pyverbs test suite on kernel rxe in the lab and record what passes.

    sudo .venv/bin/python scripts/rxe_pyverbs_baseline.py [--out tests/data] [--gid 1]
        [--kernel 6.1|6.12|/boot/vmlinuz-...]

Boots one lab guest (softrdma.lab: a Debian kernel, 6.1 unless --kernel says otherwise,
rdma_rxe on its NIC as rxe0), unpacks
the suite Debian ships in /usr/share/doc/rdma-core/tests (some files gzipped) into the lab's
shared directory, and runs it in the guest with the system python3 and the real pyverbs:

    python3 tests/run_tests.py --dev rxe0 -v [--gid N]

The verbose unittest output is written to ``<out>/rdma_core_rxe_run.log`` and the parsed
per-test outcomes to ``<out>/rdma_core_rxe_baseline.txt`` (one ``outcome test_id`` a line,
with a header saying how it was produced). ``tests/test_rdma_core_suite.py`` holds softrdma
to that list: every test rxe passes must pass on softrdma. Another kernel than the default
writes ``rdma_core_rxe<series>_run.log`` and ``..._baseline.txt`` (``rxe612`` for 6.12), the
second baseline docs/pyverbs.md sets beside the first.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from softrdma.pyverbs_compat.suite import parse_unittest_output, unpack_suite  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE.parent / "tests" / "data"))
    ap.add_argument("--gid", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=2400)
    ap.add_argument("--kernel", default=None,
                    help="the guest kernel: a series (6.1, 6.12) or an image path (default 6.1)")
    args = ap.parse_args()

    from softrdma.harness.lab import DEFAULT_KERNEL, Lab, kernel_choice

    series = kernel_choice(args.kernel)
    stem = "rdma_core_rxe" + ("" if series == DEFAULT_KERNEL or "/" in series
                              else series.replace(".", ""))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with Lab(guests=1, memory="2G", kernel=args.kernel) as lab:
        suite = unpack_suite(lab.dir / "rdma-core")
        kver = lab.guest(0, "uname -r", timeout=30).stdout.strip()
        gid = f" --gid {args.gid}" if args.gid is not None else ""
        cmd = (f"cd {suite.parent} && /usr/bin/python3 {suite.name}/run_tests.py "
               f"--dev rxe0 -v{gid} 2>&1")
        r = lab.guest(0, cmd, timeout=args.timeout)
        text = r.stdout + r.stderr
    (out / f"{stem}_run.log").write_text(text)
    results = parse_unittest_output(text)
    counts: dict[str, int] = {}
    for oc in results.values():
        counts[oc] = counts.get(oc, 0) + 1
    header = [
        "# rdma-core 44 pyverbs test suite on Linux kernel rxe " +
        ("(the softrdma baseline)" if stem == "rdma_core_rxe" else f"{kver} (second baseline)"),
        f"# produced {datetime.date.today()} by scripts/rxe_pyverbs_baseline.py:",
        f"#   lab guest (softrdma.lab, qemu TCG), kernel {kver}, rxe0 on the guest NIC",
        f"#   /usr/bin/python3 tests/run_tests.py --dev rxe0 -v{gid}   (Debian python3-pyverbs,"
        f" host {platform.node() or 'unknown'})",
        f"# exit status {r.rc}; totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        "# one line per test: outcome test_id (outcome: ok, FAIL, ERROR, skipped)",
    ]
    lines = [f"{oc} {tid}" for tid, oc in sorted(results.items())]
    (out / f"{stem}_baseline.txt").write_text("\n".join(header + lines) + "\n")
    print("\n".join(header))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
