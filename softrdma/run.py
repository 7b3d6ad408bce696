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

import os
import runpy
import sys
from typing import Sequence

USAGE = "usage: softrdma run [-m MODULE | PROGRAM.py] [ARGS...]"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n")[2].strip(), file=sys.stderr if not args
              else sys.stdout)
        return 2 if not args else 0
    from .pyverbs_compat._finder import install
    from .pyverbs_compat._netdev import install as install_netdev
    install()
    if os.environ.get("SOFTRDMA_NETDEV", "").strip() == "1":
        install_netdev()
    try:
        if args[0] == "-m":
            if len(args) < 2:
                print(USAGE, file=sys.stderr)
                return 2
            sys.argv = [args[1]] + args[2:]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            prog = args[0]
            if not os.path.exists(prog):
                print(f"softrdma run: {prog}: no such file", file=sys.stderr)
                return 2
            sys.argv = [prog] + args[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(prog)))
            runpy.run_path(prog, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
