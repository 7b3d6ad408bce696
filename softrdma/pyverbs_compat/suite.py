"""rdma-core's pyverbs test suite as Debian ships it: unpack it, parse unittest's output.

Used by ``tests/test_rdma_core_suite.py`` (softrdma) and ``scripts/rxe_pyverbs_baseline.py``
(kernel rxe in the lab), so both sides are read the same way.
"""

from __future__ import annotations

import gzip
import re
import shutil
from pathlib import Path

SUITE_SRC = Path("/usr/share/doc/rdma-core/tests")

OUTCOMES = ("ok", "FAIL", "ERROR", "skipped", "expected failure", "unexpected success")


def unpack_suite(dest: str | Path, src: str | Path = SUITE_SRC) -> Path:
    """Copy the suite to ``dest/tests``, gunzipping ``*.py.gz``; return that directory."""
    src, dest = Path(src), Path(dest) / "tests"
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name.endswith(".py.gz"):
            with gzip.open(f, "rb") as g:
                (dest / f.name[:-3]).write_bytes(g.read())
        elif f.name.endswith(".py"):
            shutil.copyfile(f, dest / f.name)
    return dest


# unittest -v: "test_x (tests.test_mod.Class.test_x) ... ok" (3.11) or
# "test_x (tests.test_mod.Class) ... ok" (older); a test's own output may come between the
# " ... " and the outcome, on the same or on later lines.
_START = re.compile(r"^(\w+) \(([\w.]+)\)(?: \.\.\. |\n|$)")
_END = re.compile(r"(?:^|\.\.\. |\s)(ok|FAIL|ERROR|skipped(?: .*)?|expected failure|"
                  r"unexpected success)$")
_SUMMARY = re.compile(r"^(ERROR|FAIL): (\w+) \(([\w.]+)\)")


def _tid(method: str, where: str) -> str:
    return where if where.endswith("." + method) else f"{where}.{method}"


def parse_unittest_output(text: str) -> dict[str, str]:
    """Map each test id (``tests.test_mod.Class.test_x``) to ok/FAIL/ERROR/skipped.

    Errors raised outside a test (``setUpClass``, module import) are reported by unittest
    only in its summary; they appear here under their own id (``tests.test_mod.Class.
    setUpClass``) with outcome ERROR.
    """
    res: dict[str, str] = {}
    lines = text.splitlines()
    cur: str | None = None
    for line in lines:
        m = _START.match(line)
        if m and not line.startswith(("ERROR: ", "FAIL: ")):
            method, where = m.group(1), m.group(2)
            if method in ("setUpClass", "tearDownClass", "setUpModule", "tearDownModule"):
                cur = None
                continue
            cur = _tid(method, where)
            rest = line[m.end():]
            e = _END.search(rest) if rest else None
            if e or (rest.strip() in OUTCOMES):
                res[cur] = (e.group(1) if e else rest.strip()).split(" ")[0]
                cur = None
            continue
        if cur is not None:
            e = _END.search(line.rstrip())
            if e:
                res[cur] = e.group(1).split(" ")[0]
                cur = None
    for line in lines:
        m = _SUMMARY.match(line)
        if m:
            kind, method, where = m.groups()
            tid = _tid(method, where)
            if method in ("setUpClass", "tearDownClass", "setUpModule", "tearDownModule"):
                res.setdefault(tid, kind)
            elif tid not in res or res[tid] == "ok":
                res[tid] = kind
    # "expected failure"/"unexpected success" were cut to their first word above
    return {k: {"expected": "expected failure", "unexpected": "unexpected success"}.get(v, v)
            for k, v in res.items()}


def file_of(test_id: str) -> str:
    """``tests.test_qp.QPTest.test_x`` -> ``test_qp``."""
    parts = test_id.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tests" else parts[0]


def per_file(results: dict[str, str]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for tid, oc in results.items():
        row = table.setdefault(file_of(tid), {"passed": 0, "failed": 0, "errored": 0,
                                              "skipped": 0})
        key = {"ok": "passed", "FAIL": "failed", "ERROR": "errored",
               "skipped": "skipped"}.get(oc, "failed")
        row[key] += 1
    return dict(sorted(table.items()))


def read_baseline(path: str | Path) -> dict[str, str]:
    res = {}
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            oc, tid = line.split(None, 1)
            res[tid.strip()] = oc
    return res
