"""Run an unchanged pyverbs program on softrdma.

    softrdma run prog.py [args...]
    softrdma run -m package.module [args...]
    python -m softrdma.run prog.py [args...]

In the program's process, and only there, ``import pyverbs`` and every ``pyverbs.X``
resolve to softrdma's modules (``softrdma.pyverbs_compat``, laid out as pyverbs: device,
pd, mr, cq, qp, addr, wr, srq, enums, libibverbs_enums, pyverbs_error, utils, mem_alloc,
base...). Devices are softrdma's (``softrdma0``, live on the first free loopback address).
Child processes started with ``multiprocessing`` (fork) inherit the redirection; programs
started with ``subprocess`` do not (run them with ``softrdma run`` too). With
``SOFTRDMA_NETDEV=1``, a soft device's network interface is served as rdma-core's tests
look it up (``/sys/class/infiniband/<dev>/device/net/`` and ``ip -j addr show``:
``softrdma.pyverbs_compat._netdev``); without it a soft device has no net interface, as
kernel rxe has none in sysfs (its rdma_cm tests skip). Nothing changes
for a process that does not opt in: a real pyverbs installation stays what ``import
pyverbs`` finds elsewhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import traceback
from typing import Any, NoReturn, Sequence

__all__ = ["main", "add_parser"]

PROG = "softrdma run"
USAGE = "softrdma run [-m MODULE | PROGRAM.py] [ARGS...]"
#: the help page's text (the module docstring is for readers of the code)
DESCRIPTION = (
    "Run an unchanged pyverbs program on softrdma. In the program's process, and only there, "
    "'import pyverbs' and every pyverbs module resolve to softrdma's; its devices are "
    "softrdma's (softrdma0, on the first free loopback address). Child processes started "
    "with multiprocessing (fork) inherit this; programs started with subprocess do not (run "
    "them with softrdma run too). With SOFTRDMA_NETDEV=1 a soft device's network interface "
    "is served as rdma-core's tests look it up. Everything after the program or module "
    "belongs to the program. docs/pyverbs.md is the guide.")


class _UsageError(Exception):
    """softrdma could not start the program: one line, status 2."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``run`` subcommand's parser, for ``softrdma --help`` and ``softrdma run --help``
    (its command line is read by :func:`main`: whatever follows the program is the
    program's)."""
    p = sub.add_parser("run", help="run an unchanged pyverbs program on softrdma "
                                   "(softrdma run prog.py [args]; docs/pyverbs.md)",
                       usage=USAGE, description=DESCRIPTION)
    _add_arguments(p)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", metavar="MODULE", dest="module",
                   help="run a module (or package's __main__) as python -m does")
    p.add_argument("program", metavar="PROGRAM.py", nargs="?",
                   help="the program: a .py file, or a directory or zip with __main__.py")
    p.add_argument("args", metavar="ARGS", nargs="*", help="the program's arguments")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, usage=USAGE, description=DESCRIPTION)
    _add_arguments(p)
    return p


def _usage(message: str) -> NoReturn:
    raise _UsageError(f"{PROG}: error: {message} (see {PROG} --help)")


def _split(args: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(module, program, the program's arguments) from ``softrdma run``'s command line, read
    as python reads its own: options only before the program, ``-m MODULE`` or ``-mMODULE``
    ends them, ``--`` too."""
    if not args:
        _usage("expected a PROGRAM.py or -m MODULE")
    first = args[0]
    if first == "--":
        if len(args) < 2:
            _usage("expected a PROGRAM.py after --")
        return None, args[1], args[2:]
    if first.startswith("-m"):
        module = first[2:] or (args[1] if len(args) > 1 else "")
        if not module:
            _usage("argument -m: expected one argument")
        return module, None, args[1 if first[2:] else 2:]
    if first.startswith("-") and first != "-":
        _usage(f"unrecognized arguments: {first}")
    return None, first, args[1:]


def _check_module_name(name: str) -> None:
    """Names ``-m`` cannot take, found before anything is imported."""
    if name.startswith("."):
        raise _UsageError(f"{PROG}: {name}: a relative module name (give the package too)")
    if name.endswith(".py"):  # python would import the file as a package first: run it
        raise _UsageError(f"{PROG}: {name}: a file name, not a module name (softrdma run "
                          f"{name}, or -m {name[:-3]})")


def _check_module(name: str) -> None:
    """Fail in one line, as ``python -m`` does, when softrdma cannot find ``name``'s code;
    an exception raised while importing the program's own packages is the program's."""
    try:
        spec = importlib.util.find_spec(name)
    except ImportError as e:  # a parent package is missing (or raised ImportError itself)
        parent_missing = e.name is not None and (name == e.name or name.startswith(e.name + "."))
        if not parent_missing:
            raise
        raise _UsageError(f"{PROG}: {name}: no module named {e.name}") from None
    except ValueError as e:  # e.g. an empty or relative name
        raise _UsageError(f"{PROG}: {name}: {e}") from None
    if spec is None:
        raise _UsageError(f"{PROG}: {name}: no such module")
    if spec.submodule_search_locations is not None:  # a package: python -m runs __main__
        _check_module(name + ".__main__")
    elif spec.loader is None:
        raise _UsageError(f"{PROG}: {name}: not a module that can be run")


def _check_program(prog: str) -> None:
    """Fail in one line when ``prog`` cannot be run: missing, unreadable, a directory
    without ``__main__.py``."""
    if not os.path.exists(prog):
        raise _UsageError(f"{PROG}: {prog}: no such file")
    if os.path.isdir(prog):
        if not any(os.path.isfile(os.path.join(prog, f"__main__.{x}")) for x in ("py", "pyc")):
            raise _UsageError(f"{PROG}: {prog}: a directory without __main__.py")
    elif not os.access(prog, os.R_OK):
        raise _UsageError(f"{PROG}: {prog}: permission denied")


def _program_traceback(e: BaseException) -> None:
    """Show an exception of the program as python would: without the frames of softrdma
    and runpy that started it (through ``sys.excepthook``, which the program may have set)."""
    tb = e.__traceback__
    ours = (os.path.abspath(__file__), runpy.__file__)
    while tb is not None and (tb.tb_frame.f_code.co_filename in ours or
                              tb.tb_frame.f_code.co_filename.startswith("<frozen ")):
        tb = tb.tb_next
    e.with_traceback(tb)  # the default hook shows the exception's own traceback
    try:
        sys.excepthook(type(e), e, tb)
    except Exception:  # a broken hook: python falls back to the default display too
        traceback.print_exception(type(e), e, tb)


def main(argv: Sequence[str] | None = None) -> int:
    """``softrdma run``: 0 or the program's exit status; 2 and one line when softrdma cannot
    start the program; 1 and the program's traceback when the program raises."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        _parser().print_help()
        return 0
    try:
        module, prog, rest = _split(args)
        if prog is not None:
            _check_program(prog)
        else:
            assert module is not None
            _check_module_name(module)
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    from .pyverbs_compat._finder import install
    from .pyverbs_compat._netdev import install as install_netdev
    install()  # first: "-m pyverbs.x" must find softrdma's pyverbs
    if os.environ.get("SOFTRDMA_NETDEV", "").strip() == "1":
        install_netdev()
    try:
        if module is not None:
            sys.path.insert(0, os.getcwd())
            _check_module(module)  # may import the program's packages: their errors are its
            sys.argv = [module] + rest
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            assert prog is not None
            sys.argv = [prog] + rest
            sys.path.insert(0, os.path.dirname(os.path.abspath(prog)))
            runpy.run_path(prog, run_name="__main__")
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        _program_traceback(e)
        return 130
    except Exception as e:  # the program's own: its traceback, as python shows it
        _program_traceback(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
