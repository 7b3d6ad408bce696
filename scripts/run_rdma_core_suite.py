#!/usr/bin/env python3
"""Run one rdma-core release's own pyverbs test suite, unchanged, under ``softrdma run``.

    python scripts/run_rdma_core_suite.py --rdma-core /path/to/rdma-core.git --tag v64.0 \
        [--keep DIR] [--log FILE] [--table]
    python scripts/run_rdma_core_suite.py --rdma-core DIR --tag v44.0 v50.0 v64.0  # totals

Takes the release's ``tests/`` out of the given rdma-core git directory (``git archive``,
a bare mirror is enough), runs ``SOFTRDMA_NETDEV=1 softrdma run tests/run_tests.py --dev
softrdma0 -v`` in it as tests/test_rdma_core_suite.py runs Debian's v44 suite, and prints
unittest's outcome per test file (``--table``: the markdown table of docs/pyverbs.md). CI
never needs it: it is how docs/pyverbs.md's v64 table was made.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from softrdma.pyverbs_compat.suite import parse_unittest_output, per_file  # noqa: E402


def extract(repo: str, tag: str, dest: Path) -> Path:
    """``git archive <tag> tests`` into ``dest``; return ``dest``."""
    arch = subprocess.run(["git", "-C", repo, "archive", tag, "tests"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    return dest


def run_suite(where: Path, rdmacm_dir: Path, timeout: float = 900) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTRDMA_")}
    env["PYTHONPATH"] = str(ROOT)
    env["SOFTRDMA_NETDEV"] = "1"
    env["SOFTRDMA_RDMACM_DIR"] = str(rdmacm_dir)
    p = subprocess.run([sys.executable, "-m", "softrdma.run", "tests/run_tests.py", "--dev",
                        "softrdma0", "-v"], cwd=where, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def table(results: dict[str, str]) -> str:
    rows = per_file(results)
    mlx5 = {k: v for k, v in rows.items() if k.startswith("test_mlx5_")}
    out = ["| file | passed | failed | errored | skipped |", "|---|---|---|---|---|"]
    keys = ("passed", "failed", "errored", "skipped")
    for f, r in rows.items():
        if f not in mlx5:
            out.append(f"| {f} | " + " | ".join(str(r[k]) for k in keys) + " |")
    if mlx5:
        tot = {k: sum(r[k] for r in mlx5.values()) for k in keys}
        out.append(f"| test_mlx5_* ({len(mlx5)} files) | " +
                   " | ".join(str(tot[k]) for k in keys) + " |")
    tot = {k: sum(r[k] for r in rows.values()) for k in keys}
    out.append(f"| **total ({len(results)})** | " +
               " | ".join(f"**{tot[k]}**" for k in keys) + " |")
    return "\n".join(out)


def run_tag(repo: str, tag: str, keep: Path | None) -> str:
    """Extract ``tag``'s tests/ (into ``keep``, or a temporary directory) and run them."""
    with tempfile.TemporaryDirectory(prefix="softrdma-rc-") as td:
        where = keep or Path(td) / "src"
        where.mkdir(parents=True, exist_ok=True)
        extract(repo, tag, where)
        (Path(td) / "rdmacm").mkdir()
        _rc, text = run_suite(where, Path(td) / "rdmacm")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rdma-core", required=True, help="rdma-core git directory")
    ap.add_argument("--tag", nargs="+", default=["v64.0"],
                    help="release tag(s); with several, one line of totals per release")
    ap.add_argument("--keep", type=Path, help="extract into this directory and keep it")
    ap.add_argument("--log", type=Path, help="write unittest's output here")
    ap.add_argument("--table", action="store_true", help="print the per-file markdown table")
    a = ap.parse_args()
    if len(a.tag) > 1:
        for tag in a.tag:
            res = parse_unittest_output(run_tag(a.rdma_core, tag, None))
            tot = {k: sum(r[k] for r in per_file(res).values())
                   for k in ("passed", "failed", "errored", "skipped")}
            print(tag, len(res), " ".join(f"{k}={v}" for k, v in tot.items()), flush=True)
        return 0
    text = run_tag(a.rdma_core, a.tag[0], a.keep)
    if a.log:
        a.log.write_text(text)
    res = parse_unittest_output(text)
    for tid, oc in sorted(res.items()):
        if oc not in ("ok", "skipped"):
            print(f"{oc:8} {tid}")
    print(table(res) if a.table else "\n".join(
        f"{f:28} " + " ".join(f"{k}={v}" for k, v in r.items()) for f, r in
        per_file(res).items()))
    return 0 if "Ran " in text else 1


if __name__ == "__main__":
    sys.exit(main())
