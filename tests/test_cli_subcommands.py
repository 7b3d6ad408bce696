"""Every subcommand of ``softrdma``, walked from the command line's own parser (so one added
later, nested ones such as ``bench wire`` or ``lab run``, and ``run`` are covered without
touching this file), is tried the way a newcomer gets it wrong:

- an unknown option: status 2 and one line on stderr that names the subcommand and ITS help
  page (``softrdma dissect: error: ... (see softrdma dissect --help)``), as argparse's usage
  errors inside a subcommand already do, never ``softrdma: error: ... (see softrdma --help)``;
- a file that is not there, where the subcommand reads one (a capture, a program, a
  directory of captures): one line naming the file;
- ``softrdma run`` given no program, an option it does not have, a module that does not
  exist: one line, while an exception the program raises itself is shown as python shows it
  (the program's traceback, without softrdma's and runpy's frames);
- its ``--help`` page: plain text, none of the reStructuredText of the docstrings (````x````,
  ``:mod:`x```...) nor the issue notes of the developers ("issue 18's goals").

The cases run in this process through :func:`softrdma.cli.main` (no subcommand gets as far as
doing anything: a guard replaces what each would run); only those that put pyverbs under a
program run ``python -m softrdma run`` in a process of their own.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap

import pytest

from softrdma import cli

TIMEOUT = 30
MISSING = "/nonexistent/softrdma-test/missing"
UNKNOWN = "--no-such-option"


def _subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(words after ``softrdma``, parser) of every subcommand, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subcommands(sub, prefix + (name,))


_REAL_BUILD_PARSER = cli.build_parser
SUBCOMMANDS = {" ".join(words): sub for words, sub in _subcommands(cli.build_parser())}


#: the parsed command lines the guard stopped (a subcommand that would have run)
accepted: list[argparse.Namespace] = []


def _must_not_run(args: argparse.Namespace) -> int:
    accepted.append(args)
    return 0


@pytest.fixture
def softrdma(monkeypatch, capsys):
    """``softrdma ARGV`` in this process: (status, stdout, stderr). No subcommand runs: if
    parsing let one through, the guard records it in ``accepted`` (status 0) instead of,
    say, booting the lab."""
    build = cli.build_parser
    accepted.clear()

    def guarded() -> argparse.ArgumentParser:
        p = build()
        for _, sub in _subcommands(p):
            sub.set_defaults(func=_must_not_run)
        return p

    monkeypatch.setattr(cli, "build_parser", guarded)
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("SOFTRDMA_DEBUG", raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            status = cli.main(list(argv))
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _has_subcommands(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def _required_words(parser: argparse.ArgumentParser) -> list[str]:
    """Values for the subcommand's required arguments (the first choice, or a word its type
    accepts), so that the unknown option is the only thing wrong with the line."""
    words: list[str] = []
    one_of = {id(g._group_actions[0]) for g in parser._mutually_exclusive_groups if g.required}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) or a.nargs in ("?", "*", argparse.REMAINDER):
            continue
        if a.option_strings and not a.required and id(a) not in one_of:
            continue
        if a.choices:
            value = str(next(iter(a.choices)))
        else:
            value = "x"
            for candidate in ("1", "127.0.3.1:23000", "127.0.3.1", "x.pcap"):
                try:
                    (a.type or str)(candidate)
                except Exception:
                    continue
                value = candidate
                break
        words += a.option_strings[:1] + [value] * (a.nargs if isinstance(a.nargs, int) else 1)
    return words


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_unknown_option_names_the_subcommand_and_its_help_page(softrdma, sub):
    """``softrdma SUB --no-such-option [its required arguments]``: status 2, one line naming
    ``softrdma SUB`` and ``see softrdma SUB --help`` (before the fix, an option unknown to a
    subcommand was reported by the top parser: ``softrdma: error: unrecognized arguments:
    -r (see softrdma --help)`` for ``softrdma dissect -r file``). A subcommand that has
    subcommands of its own (``bench``) says that one is required: still its own page."""
    parser = SUBCOMMANDS[sub]
    # first: what follows a program's or a guest's command line is theirs (exec, lab guest)
    status, out, err = softrdma(*sub.split(), UNKNOWN, *_required_words(parser))
    line = _one_line(err)
    assert status == 2, err
    assert line.startswith(f"softrdma {sub}: error: "), line
    assert line.endswith(f"(see softrdma {sub} --help)"), line
    if _has_subcommands(parser):
        assert "required" in line, line
    else:
        assert f"unrecognized arguments: {UNKNOWN}" in line, line
    assert out == ""


def test_where_the_unknown_option_is_decides_whose_it_is(softrdma):
    """An option given before the subcommand is one of softrdma's (the top page), the same
    option after it is the subcommand's, also with a tracing option in between."""
    status, _, err = softrdma(UNKNOWN, "devices")
    assert status == 2
    assert _one_line(err) == (f"softrdma: error: unrecognized arguments: {UNKNOWN} "
                              "(see softrdma --help)")
    status, _, err = softrdma("--trace", "packet", "devices", UNKNOWN)
    assert status == 2
    assert _one_line(err) == (f"softrdma devices: error: unrecognized arguments: {UNKNOWN} "
                              "(see softrdma devices --help)")


def test_server_name_after_the_options_still_works(softrdma):
    """rdma-core's tools take the server name after the options (``ibv_rc_pingpong -n 5
    HOST``): the parser accepts it there (the guard stops the run, keeping what was parsed);
    a second one is
    pingpong's usage error."""
    assert softrdma("pingpong", "rc", "-n", "5", "somehost") == (0, "", "")
    assert [a.servername for a in accepted] == ["somehost"]
    status, _, err = softrdma("pingpong", "rc", "-n", "5", "somehost", "extra")
    line = _one_line(err)
    assert status == 2
    assert line == ("softrdma pingpong: error: unrecognized arguments: somehost extra "
                    "(see softrdma pingpong --help)")


#: subcommand -> its command line reading MISSING (a file or directory it reads)
MISSING_INPUT = {
    "dissect": ["dissect", MISSING],
    "check": ["check", MISSING],
    "diagram": ["diagram", MISSING],
    "replay": ["replay", MISSING],
    "fuzz": ["fuzz", "--pcaps", MISSING, "--addrs", "127.0.3.1", "127.0.3.2"],
    "bench capture": ["bench", "capture", "--file", MISSING],
    "run": ["run", MISSING],
    "exec": ["exec", "--", MISSING],
}


def test_the_walk_covers_nested_subcommands_run_and_every_file_reader():
    """What the other tests cover (a check of this file, not of softrdma: it passes on
    main too): the walk reaches nested subcommands and ``run``, and every subcommand whose
    positional argument is a capture or a program is in MISSING_INPUT, so a new
    capture-reading tool is tried with a missing file too."""
    for name in ("dissect", "bench wire", "bench scale", "lab run", "mq recv", "fuzz", "exec",
                 "run"):
        assert name in SUBCOMMANDS
    readers = {name for name, p in SUBCOMMANDS.items()
               for a in p._actions if not a.option_strings and a.dest in ("pcap", "program")}
    assert readers <= set(MISSING_INPUT), readers - set(MISSING_INPUT)


@pytest.mark.parametrize("sub", sorted(MISSING_INPUT))
def test_missing_file_is_one_line_naming_it(softrdma, monkeypatch, sub):
    """A file that is not there: one line ``softrdma SUB: ...MISSING...``, a failure status,
    no traceback (before the fix ``bench capture --file`` was the last resort's
    "unexpected" line). These subcommands really run, and stop at the file."""
    monkeypatch.setattr(cli, "build_parser", _REAL_BUILD_PARSER)  # these must run
    status, _, err = softrdma(*MISSING_INPUT[sub])
    line = _one_line(err)
    assert status in (1, 2), err
    assert line.startswith(f"softrdma {sub}: ") and MISSING in line, line
    assert "SOFTRDMA_DEBUG" not in line, line  # not the last resort's "unexpected error"


def test_trace_file_that_cannot_be_written_is_one_line(softrdma):
    status, _, err = softrdma("--trace-file", MISSING, "devices")
    line = _one_line(err)
    assert status == 1 and MISSING in line and line.startswith("softrdma: "), line


@pytest.mark.parametrize("argv,message", [
    ([], "expected a PROGRAM.py or -m MODULE"),
    (["-m"], "argument -m: expected one argument"),
    (["--"], "expected a PROGRAM.py after --"),
])
def test_run_usage_errors_are_one_line(softrdma, argv, message):
    """``softrdma run`` without a program printed its usage and a paragraph (14 lines)."""
    status, out, err = softrdma("run", *argv)
    assert status == 2
    assert _one_line(err) == f"softrdma run: error: {message} (see softrdma run --help)"
    assert out == ""


@pytest.mark.parametrize("argv,line", [
    (["-m", "prog.py"], "softrdma run: prog.py: a file name, not a module name (softrdma run "
                        "prog.py, or -m prog)"),
    (["-m", ".relative"], "softrdma run: .relative: a relative module name (give the package "
                          "too)"),
    ([MISSING], f"softrdma run: {MISSING}: no such file"),
])
def test_run_cannot_start_it_in_one_line(softrdma, argv, line):
    """What ``softrdma run`` refuses before importing anything: a file name given to -m
    (python would import it as a package, running it), a relative module name (a traceback
    of importlib's before the fix), a program that is not there."""
    status, out, err = softrdma("run", *argv)
    assert status == 2 and out == ""
    assert _one_line(err) == line


def _softrdma_run(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """``python -m softrdma run ARGV`` from tmp_path (it puts pyverbs under the program:
    not in this process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(cli.__file__)), os.environ.get("PYTHONPATH", "")]))
    env.pop("SOFTRDMA_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "softrdma", "run", *argv], cwd=tmp_path,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=TIMEOUT)


def test_run_wrong_module_is_one_line_and_the_programs_own_errors_are_its_traceback(tmp_path):
    """``softrdma run -m nosuchmodule`` printed a 12-line traceback of runpy. A module softrdma
    cannot find (or a package without __main__) is one line, status 2; a module that is
    found but raises, ImportError included, shows ITS traceback, as ``python -m`` does,
    status 1, with none of softrdma's frames."""
    (tmp_path / "importsmissing.py").write_text("import no_such_module_zz\n")
    (tmp_path / "raises.py").write_text(textwrap.dedent("""\
        def inner():
            raise ValueError("the program's own error")
        inner()
        """))
    (tmp_path / "pkg_without_main").mkdir()
    (tmp_path / "pkg_without_main" / "__init__.py").write_text("")
    for argv, needle in ((["-m", "nosuchmodule_zz"], "nosuchmodule_zz"),
                         (["-m", "nosuchpkg_zz.sub"], "nosuchpkg_zz"),
                         (["-m", "pkg_without_main"], "pkg_without_main")):
        r = _softrdma_run(tmp_path, *argv)
        line = _one_line(r.stderr)
        assert r.returncode == 2, r.stderr
        assert line.startswith("softrdma run: ") and needle in line, line
    for argv, last in ((["-m", "importsmissing"], "No module named 'no_such_module_zz'"),
                       (["raises.py"], "ValueError: the program's own error")):
        r = _softrdma_run(tmp_path, *argv)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert lines[0] == "Traceback (most recent call last):", r.stderr
        assert lines[-1].endswith(last), r.stderr
        assert "runpy" not in r.stderr and "softrdma" not in r.stderr, r.stderr


#: what a help page must not show: reStructuredText roles and literals, markdown links and
#: emphasis, the developers' issue numbers
MARKUP = re.compile(r"``|`[^`\s]+`|:(?:mod|func|class|meth|attr|ref|data|exc):|\bissues?\s+\d+|"
                    r"\*\*|(?<![\w*])\*[A-Za-z][^*\s]*\*(?![\w*])|\]\(", re.IGNORECASE)


@pytest.mark.parametrize("sub", [""] + sorted(SUBCOMMANDS))
def test_help_page_is_plain_text(softrdma, sub):
    """``softrdma SUB --help`` (and ``softrdma --help``): the usage, status 0, and no
    documentation markup (seven pages showed the docstrings' ````softrdma bench
    wire|...````, ``:mod:`softrdma.bench```, "issue 18's goals")."""
    status, out, _ = softrdma(*sub.split(), "--help")
    assert status == 0
    assert out.startswith("usage: softrdma"), out[:200]
    flat = " ".join(out.split())  # a wrapped "issue\n18" is still found
    found = [flat[max(0, m.start() - 30):m.end() + 30] for m in MARKUP.finditer(flat)]
    assert not found, found
