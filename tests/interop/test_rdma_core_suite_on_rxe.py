"""rdma-core's own pyverbs test suite, run unchanged through softrdma's pyverbs layer on
kernel rxe (rxe0 in a lab guest) through the libibverbs backend, held to real pyverbs'
results on the same device.

The suite is Debian's (/usr/share/doc/rdma-core/tests), unpacked into the lab's shared
directory and run in guest 0 as its maintainers run it,

    SOFTRDMA_BACKEND=ibverbs softrdma run tests/run_tests.py --dev rxe0 -v

so every ``import pyverbs`` resolves to softrdma's pyverbs layer, whose objects are
softrdma.verbs_api's on the ibverbs backend. The rule: every test that real pyverbs passes
on rxe (tests/data/rdma_core_rxe_baseline.txt, recorded in the same kind of guest by
scripts/rxe_pyverbs_baseline.py) passes here too.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from softrdma.pyverbs_compat.suite import parse_unittest_output, read_baseline, unpack_suite

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
BASELINE = ROOT / "tests" / "data" / "rdma_core_rxe_baseline.txt"


def test_rdma_core_suite_through_softrdma_on_rxe_scores_as_real_pyverbs(lab):
    tests = unpack_suite(lab.dir / "rdma-core-suite")
    log = lab.dir / "rdma-core-suite.log"
    r = lab.guest(0, f"cd {tests.parent} && env PYTHONDONTWRITEBYTECODE=1 "
                     f"SOFTRDMA_BACKEND=ibverbs timeout 1500 {PYTHON} -m softrdma.run "
                     f"tests/run_tests.py --dev rxe0 -v > {log} 2>&1; echo rc=$?",
                  timeout=1560)
    assert log.exists(), f"no log from the guest: {r.stdout}\n{r.stderr}"
    text = log.read_text()
    ours = parse_unittest_output(text)
    base = read_baseline(BASELINE)
    assert len(ours) == len(base) > 200, (len(ours), len(base), text[-3000:])
    lost = sorted(t for t, o in base.items() if o == "ok" and ours.get(t) != "ok")
    assert not lost, (f"{len(lost)} tests pass on rxe with real pyverbs and not through "
                      f"softrdma: {[(t, ours.get(t)) for t in lost]}\n{text[-4000:]}")
    # for the log (pytest -s): where the two runs differ, tests rxe does not pass included
    print(f"rdma-core suite on rxe0: softrdma {dict(Counter(ours.values()))}, "
          f"real pyverbs {dict(Counter(base.values()))}; differing: "
          f"{sorted((t, base.get(t), o) for t, o in ours.items() if o != base.get(t))}")
