"""``softrdma exec``: run an unmodified C/C++ RDMA program on softrdma devices.

    softrdma exec -- ibv_devices
    softrdma exec --addr 127.0.0.2 -- ibv_rc_pingpong -g 1
    softrdma exec --pcap rc.pcap --fault 'tx:loss=0.05' -- ib_write_bw -n 50
    softrdma exec --trace packet --addr 127.0.0.3 -- ibv_rc_pingpong -g 1 127.0.0.2
    softrdma exec --profile srv.prof --addr 127.0.0.2 -- ib_write_bw -n 5000 -s 64

The program runs with softrdma's preload library (:mod:`softrdma.exec`) in
``LD_PRELOAD``: its libibverbs and librdmacm calls are answered by softrdma in its own
process, as an ordinary user, with no kernel module. The device lives in the program, so
what softrdma's devices read from the environment works for it too: ``--pcap`` (every
packet the program's device sends and receives), ``--fault`` and the tracing options are
handed to it as SOFTRDMA_PCAP, SOFTRDMA_FAULTS and SOFTRDMA_TRACE*; ``--profile``
runs cProfile in it (:mod:`softrdma.exec.profile`). ``--print-env``
prints the environment instead, for launchers that start programs their own way (mpirun,
test runners); ``--ld-library-path`` uses a directory of softrdma's libibverbs.so.1 and
librdmacm.so.1 instead of the preload (:mod:`softrdma.exec.libdir`); ``--dev-infiniband``
gives the program /dev/infiniband/uverbs* nodes, which UCX checks for
(:mod:`softrdma.exec.devnodes`). docs/exec.md is the guide.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from typing import Any

from .common import ToolError, UsageError, add_fault_option

__all__ = ["add_parser", "exec_environment"]


#: the help page's text (the module docstring is for readers of the code)
DESCRIPTION = """\
Run an unmodified C/C++ RDMA program on softrdma devices.

    softrdma exec -- ibv_devices
    softrdma exec --addr 127.0.0.2 -- ibv_rc_pingpong -g 1
    softrdma exec --pcap rc.pcap --fault 'tx:loss=0.05' -- ib_write_bw -n 50
    softrdma exec --trace packet --addr 127.0.0.3 -- ibv_rc_pingpong -g 1 127.0.0.2
    softrdma exec --profile srv.prof --addr 127.0.0.2 -- ib_write_bw -n 5000 -s 64

The program runs with softrdma's preload library in LD_PRELOAD: its libibverbs and
librdmacm calls are answered by softrdma in its own process, as an ordinary user, with no
kernel module. The device lives in the program, so what softrdma's devices read from the
environment works for it too: --pcap (every packet the program's device sends and
receives), --fault and the tracing options are handed to it as SOFTRDMA_PCAP,
SOFTRDMA_FAULTS and SOFTRDMA_TRACE*; --profile runs cProfile in it. --print-env prints the
environment instead, for launchers that start programs their own way (mpirun, test
runners); --ld-library-path uses a directory of softrdma's libibverbs.so.1 and
librdmacm.so.1 instead of the preload; --dev-infiniband gives the program
/dev/infiniband/uverbs* nodes, which UCX checks for. docs/exec.md is the guide."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("exec", help="run an unmodified C/C++ RDMA program on softrdma "
                                    "(softrdma exec -- PROGRAM [ARGS])", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", metavar="IP", help="the device's address (SOFTRDMA_IP); "
                   "default: the first free loopback address")
    p.add_argument("--pcap", metavar="FILE", help="capture every packet of the program's "
                   "device in FILE (SOFTRDMA_PCAP; '{name}' in FILE becomes the device's name)")
    add_fault_option(p)
    p.add_argument("--profile", metavar="FILE", help="run cProfile in the program's process "
                   "and write its statistics to FILE at exit (SOFTRDMA_EXEC_PROFILE; "
                   "'{pid}' in FILE becomes the process id; read with python -m pstats)")
    p.add_argument("--rebuild", action="store_true", help="build the preload library again")
    p.add_argument("--print-env", action="store_true",
                   help="print the variables to set (shell syntax) and exit")
    p.add_argument("--ld-library-path", action="store_true",
                   help="put softrdma's libibverbs.so.1 and librdmacm.so.1 first in "
                        "LD_LIBRARY_PATH instead of preloading (the real ones are not "
                        "loaded at all)")
    p.add_argument("--dev-infiniband", action="store_true",
                   help="run the program in a mount namespace whose /dev has "
                        "/dev/infiniband/uverbs0.. (links to /dev/null), for programs that "
                        "check the kernel's uverbs nodes before using a device (UCX)")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    p.set_defaults(func=run)


#: the tracing options of softrdma's command line -> the variables a device reads them from
_TRACE_ENV = {"--trace": "SOFTRDMA_TRACE", "--trace-format": "SOFTRDMA_TRACE_FORMAT",
              "--trace-file": "SOFTRDMA_TRACE_FILE", "--trace-qpn": "SOFTRDMA_TRACE_QPN"}


def exec_environment(addr: str | None = None, rebuild: bool = False,
                     pcap: str | None = None, libdir: bool = False,
                     profile: str | None = None) -> dict[str, str]:
    """The variables that put softrdma under a program: the preload library (built on
    first use) ahead of any other -- or, with ``libdir``, the directory whose
    libibverbs.so.1 and librdmacm.so.1 are softrdma first in LD_LIBRARY_PATH -- the path
    the embedded interpreter imports softrdma from, the device's address if chosen, and
    what the program's device should do that the command line asked for (capture,
    faults, tracing)."""
    from ..exec.build import library_path, package_root
    from ..exec.libdir import library_dir
    try:
        if libdir:
            name, first = "LD_LIBRARY_PATH", str(library_dir(rebuild=rebuild))
        else:
            name, first = "LD_PRELOAD", str(library_path(rebuild=rebuild))
    except OSError as e:
        raise ToolError(str(e)) from None
    before = os.environ.get(name, "")
    sep = ":" if libdir else " "
    env = {name: first + (sep + before if before else ""),
           "SOFTRDMA_EXEC_PATH": package_root(),
           "SOFTRDMA_BACKEND": "soft"}
    if addr:
        env["SOFTRDMA_IP"] = addr
    if pcap:
        env["SOFTRDMA_PCAP"] = os.path.abspath(pcap)
    if profile:
        from ..exec.profile import ENV_PROFILE
        env[ENV_PROFILE] = os.path.abspath(profile)
    from ..soft.faults import ENV_FAULTS
    if os.environ.get(ENV_FAULTS):  # --fault joined it (tools.common.apply_fault_options)
        env[ENV_FAULTS] = os.environ[ENV_FAULTS]
    from ..cli import trace_options
    for opt, value in trace_options.items():
        env[_TRACE_ENV[opt]] = os.path.abspath(value) if opt == "--trace-file" else value
    return env


def run(a: argparse.Namespace) -> int:
    prog = a.program[1:] if a.program[:1] == ["--"] else a.program
    if not a.print_env:  # what is wrong with the line, before building the library
        if not prog:
            raise UsageError("no program given (softrdma exec -- PROGRAM [ARGS])")
        if os.sep in prog[0] and not os.path.exists(prog[0]):
            raise ToolError(f"{prog[0]}: No such file or directory")
        if os.sep not in prog[0] and shutil.which(prog[0]) is None:
            raise ToolError(f"{prog[0]}: command not found")
    env = exec_environment(a.addr, a.rebuild, a.pcap, a.ld_library_path, a.profile)
    if a.print_env:
        for k, v in env.items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    from ..exec.process import python_mismatch
    why = python_mismatch(prog[0])
    if why:
        raise ToolError(why)
    try:
        if a.dev_infiniband:
            from ..exec.devnodes import wrap
            prog = wrap(prog)
        os.execvpe(prog[0], prog, {**os.environ, **env})
    except OSError as e:
        raise ToolError(f"{prog[0]}: {e.strerror}") from None
    return 127  # not reached
