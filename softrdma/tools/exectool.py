"""``softrdma exec``: run an unmodified C/C++ RDMA program on softrdma devices.

    softrdma exec -- ibv_devices
    softrdma exec --addr 127.0.0.2 -- ibv_rc_pingpong -g 0

The program runs with softrdma's preload library (:mod:`softrdma.exec`) in
``LD_PRELOAD``: its libibverbs calls are answered by softrdma in its own process, as an
ordinary user, with no kernel module. ``--print-env`` prints the environment instead, for
launchers that start programs their own way (mpirun, test runners).
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

from .common import ToolError

__all__ = ["add_parser", "exec_environment"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("exec", help="run an unmodified C/C++ RDMA program on softrdma "
                                    "(softrdma exec -- PROGRAM [ARGS])", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", metavar="IP", help="the device's address (SOFTRDMA_IP); "
                   "default: the first free loopback address")
    p.add_argument("--rebuild", action="store_true", help="build the preload library again")
    p.add_argument("--print-env", action="store_true",
                   help="print the variables to set (shell syntax) and exit")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    p.set_defaults(func=run)


def _package_root() -> str:
    """The directory softrdma is imported from, and nothing else: when the program is
    itself a Python (Debian's python3 with the compiled pyverbs), the embedded code runs in
    *its* interpreter, and another Python's stdlib on its path would crash it."""
    from .. import __file__ as pkg
    return os.path.dirname(os.path.dirname(os.path.abspath(pkg)))


def exec_environment(addr: str | None = None, rebuild: bool = False) -> dict[str, str]:
    """The variables that put softrdma under a program: the preload library (built on
    first use) ahead of any other, the path the embedded interpreter imports softrdma
    from, the device's address if chosen."""
    from ..exec.build import library_path
    try:
        lib = str(library_path(rebuild=rebuild))
    except OSError as e:
        raise ToolError(str(e)) from None
    pre = os.environ.get("LD_PRELOAD", "")
    env = {"LD_PRELOAD": lib + (" " + pre if pre else ""),
           "SOFTRDMA_EXEC_PATH": _package_root(),
           "SOFTRDMA_BACKEND": "soft"}
    if addr:
        env["SOFTRDMA_IP"] = addr
    return env


def run(a: argparse.Namespace) -> int:
    prog = a.program[1:] if a.program[:1] == ["--"] else a.program
    env = exec_environment(a.addr, a.rebuild)
    if a.print_env:
        for k, v in env.items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    if not prog:
        raise ToolError("exec: no program given (softrdma exec -- PROGRAM [ARGS])")
    try:
        os.execvpe(prog[0], prog, {**os.environ, **env})
    except OSError as e:
        raise ToolError(f"exec: {prog[0]}: {e.strerror}") from None
    return 127  # not reached
