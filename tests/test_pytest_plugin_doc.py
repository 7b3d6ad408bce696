"""docs/testing.md's examples are tests: every ```python block whose first line is
``# test_NAME.py: OUTCOMES`` is written to a fresh directory as test_NAME.py, all of them
run by pytest in one subprocess with the plugin as installed, and each file's outcomes must
be the ones its first line states (``1 passed``, ``1 failed``, ``6 passed``...; words after
a ``(`` are commentary). A ```text block right after such a block is output that run must
show: each of its lines, whitespace collapsed, ``...`` standing for anything.

The lab example runs on a machine the lab cannot boot on (its prerequisite check is told
so), so it is the skip the document shows; ``CI`` is unset for the run, as on a laptop.
"""

from __future__ import annotations

import fnmatch
import glob
import re
from collections import Counter

from .conftest import ROOT

pytest_plugins = ["pytester"]

DOC = ROOT / "docs" / "testing.md"
HEAD = re.compile(r"# (test_\w+\.py): ([^(\n]*)")


def examples() -> list[tuple[str, Counter, str, list[str]]]:
    """(file name, expected outcomes, source, lines of the output block after it)."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", DOC.read_text(), re.S)
    out = []
    for i, (lang, body) in enumerate(blocks):
        m = HEAD.match(body)
        if lang != "python" or m is None:
            continue
        want = Counter({k: int(n) for n, k in re.findall(r"(\d+) (\w+)", m.group(2))})
        shown = blocks[i + 1][1].splitlines() if i + 1 < len(blocks) and \
            blocks[i + 1][0] == "text" else []
        out.append((m.group(1), want, body, shown))
    return out


def test_the_guide_has_examples_of_every_fixture():
    text = "".join(body for _, _, body, _ in examples())
    for fixture in ("qp_pair", "sim_network", "soft_device", "softrdma_replay", "rxe_lab",
                    "softrdma_seed"):
        assert f"({fixture}" in text or f", {fixture}" in text, fixture
    assert {n for n, *_ in examples()} >= {"test_first.py", "test_first_fixed.py",
                                           "test_replay_diff.py"}


def test_the_guides_examples_run_as_it_says(pytester, monkeypatch):
    exs = examples()
    assert len(exs) >= 8
    for name, _, body, _ in exs:
        pytester.path.joinpath(name).write_text(body)
    # no pcaps/ here: the examples use the captures installed with softrdma
    pytester.makeconftest("""
        import softrdma.harness.lab as lab
        lab.missing_prerequisites = lambda: ["qemu-system-x86_64 (qemu-system-x86)"]
    """)
    monkeypatch.delenv("CI", raising=False)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")

    got: dict[str, Counter] = {name: Counter() for name, *_ in exs}
    for line in r.outlines:
        m = re.match(r"(PASSED|FAILED|ERROR) (test_\w+\.py)::", line) or \
            re.match(r"(SKIPPED) \[(\d+)\] (test_\w+\.py):", line)
        if m is None:
            continue
        if m.group(1) == "SKIPPED":
            got[m.group(3)]["skipped"] += int(m.group(2))
        else:
            got[m.group(2)][{"ERROR": "errors"}.get(m.group(1), m.group(1).lower())] += 1
    assert got == {name: want for name, want, *_ in exs}, r.stdout.str()

    lines = [" ".join(x.split()) for x in r.outlines]
    for name, _, _, shown in exs:
        for want in shown:
            pattern = "*" + glob.escape(" ".join(want.split())).replace("...", "*") + "*"
            assert any(fnmatch.fnmatchcase(x, pattern) for x in lines), \
                f"{name}: the output lacks {want!r}\n{r.stdout.str()}"
