"""``softrdma lab``: the real Linux rxe peers of the interop tests, for your own experiments.

    softrdma lab run --guest-cmd "ibv_rc_pingpong -g 1" -- softrdma pingpong rc 10.77.0.11
    softrdma lab shell                 # a shell in the lab's network (softrdma side: 10.77.0.1)
        (inside) softrdma lab guest 0 -- ibv_devinfo -d rxe0
    softrdma lab --kernel 6.12 shell   # the guests on Linux 6.12's rxe (default: 6.1)
    softrdma lab kernels               # the guest kernels this machine can boot

--kernel takes a series ("6.1", "6.12") or an image path (/boot/vmlinuz-...); without it,
$SOFTRDMA_LAB_KERNEL or 6.1 (docs/lab.md: what differs between the two).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from ..harness.lab import (AGENT_PORT, DEFAULT_KERNEL, Lab, LabUnavailable, guest_ip,
                           kernel_choice, kernel_missing, kernels)
from .argtypes import int_range
from .common import ToolError

__all__ = ["add_parser"]

MAX_GUESTS = 244  # guest i is 10.77.0.(11 + i)
_GUESTS = int_range(1, MAX_GUESTS)


#: the help page's text (the module docstring is for readers of the code)
DESCRIPTION = """\
The real Linux rxe peers of the interop tests, for your own experiments.

    softrdma lab run --guest-cmd "ibv_rc_pingpong -g 1" -- softrdma pingpong rc 10.77.0.11
    softrdma lab shell                 # a shell in the lab's network (softrdma side: 10.77.0.1)
        (inside) softrdma lab guest 0 -- ibv_devinfo -d rxe0
    softrdma lab --kernel 6.12 shell   # the guests on Linux 6.12's rxe (default: 6.1)
    softrdma lab kernels               # the guest kernels this machine can boot

--kernel takes a series ("6.1", "6.12") or an image path (/boot/vmlinuz-...); without it,
$SOFTRDMA_LAB_KERNEL or 6.1 (docs/lab.md: what differs between the two)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("lab", help="boot Linux rxe peers in VMs next to softrdma (needs root)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _kernel_option(p, None)
    ls = p.add_subparsers(dest="lab_cmd", metavar="{run,shell,guest,kernels}", required=True)
    k = ls.add_parser("kernels", help="list the guest kernels this machine can boot")
    k.set_defaults(func=_kernels)
    r = ls.add_parser("run", help="boot, run a command on the softrdma side, tear down")
    r.add_argument("--guests", type=_GUESTS, default=1, help=f"1..{MAX_GUESTS} (1)")
    _kernel_option(r, argparse.SUPPRESS)
    r.add_argument("--guest-cmd", help="start this in guest 0 first (e.g. a server)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the host-side command")
    r.set_defaults(func=_run)
    s = ls.add_parser("shell", help="boot and open a shell in the lab's network namespace")
    s.add_argument("--guests", type=_GUESTS, default=1, help=f"1..{MAX_GUESTS} (1)")
    _kernel_option(s, argparse.SUPPRESS)
    s.set_defaults(func=_shell)
    g = ls.add_parser("guest", help="(inside 'lab shell') run a command in a guest")
    g.add_argument("index", type=int_range(0, MAX_GUESTS - 1), help="guest number, from 0")
    g.add_argument("cmd", nargs=argparse.REMAINDER)
    g.set_defaults(func=_guest)


def _kernel_option(p: argparse.ArgumentParser, default: Any) -> None:
    # on 'lab' and on each boot subcommand ('lab --kernel 6.12 run' and 'lab run --kernel
    # 6.12'); the subcommands' default is SUPPRESS so they do not overwrite the parent's
    p.add_argument("--kernel", metavar="SERIES|PATH", default=default,
                   help=f"the guests' kernel: a series of 'softrdma lab kernels' (6.1, 6.12) "
                        f"or a /boot/vmlinuz-* path (default: $SOFTRDMA_LAB_KERNEL or "
                        f"{DEFAULT_KERNEL})")


def _strip(cmd: list[str]) -> list[str]:
    return cmd[1:] if cmd and cmd[0] == "--" else cmd


def _kernels(a: argparse.Namespace) -> int:
    chosen = kernel_choice(a.kernel)
    for series, image in kernels().items():
        mark = "  (selected)" if series == chosen or image == chosen else ""
        print(f"{series:6} {image}{mark}")
    return 0


def _boot(n: int, kernel: str | None):
    miss = kernel_missing(kernel)  # before anything boots: one line naming what can
    if miss:
        raise ToolError(miss)
    print(f"lab: booting {n} guest(s) with kernel rxe {kernel_choice(kernel)} (20-60 s)...",
          file=sys.stderr)
    try:
        return Lab(guests=n, kernel=kernel)
    except LabUnavailable as e:
        raise ToolError(str(e)) from None


def _run(a: argparse.Namespace) -> int:
    cmd = _strip(a.cmd)
    if not cmd:
        raise ToolError("give the host-side command after --")
    with _boot(a.guests, a.kernel) as lab:
        job = lab.guest_start(0, a.guest_cmd) if a.guest_cmd else None
        if job:
            time.sleep(1.0)
        r = lab.host(cmd, timeout=600)
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        if job:
            g = job.wait(timeout=120)
            print(f"--- guest 0: {a.guest_cmd} (exit {g.rc})")
            sys.stdout.write(g.stdout)
            sys.stderr.write(g.stderr)
        return r.rc


def _shell(a: argparse.Namespace) -> int:
    with _boot(a.guests, a.kernel) as lab:
        env = lab.env()
        env["SOFTRDMA_LAB_DIR"] = str(lab.dir)
        env["PS1"] = "(softrdma-lab) # "
        print(f"lab: softrdma side {lab.dir} 10.77.0.1; guests 10.77.0.11.. with rxe0; "
              f"'softrdma lab guest 0 -- CMD' runs CMD in guest 0; exit to tear down",
              file=sys.stderr)
        return subprocess.call(["ip", "netns", "exec", lab.ns, os.environ.get("SHELL", "/bin/sh")],
                               env=env)


def _guest(a: argparse.Namespace) -> int:
    if "SOFTRDMA_LAB_DIR" not in os.environ:
        raise ToolError("'softrdma lab guest' runs inside 'softrdma lab shell'")
    cmd = " ".join(_strip(a.cmd))
    try:
        c = socket.create_connection((guest_ip(a.index), AGENT_PORT), timeout=5)
    except OSError as e:
        raise ToolError(f"guest {a.index} is not reachable: {e.strerror}") from None
    f = c.makefile("rwb")
    f.write((json.dumps({"op": "run", "cmd": cmd, "timeout": 600}) + "\n").encode())
    f.flush()
    res = json.loads(f.readline())
    sys.stdout.write(res["stdout"])
    sys.stderr.write(res["stderr"])
    return res["rc"]
