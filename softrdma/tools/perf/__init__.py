"""``softrdma perf {send,write,read,atomic} [--lat]``: perftest's ib_*_bw and ib_*_lat.

The main options of perftest 4.5 with the same letters, its out-of-band exchange on TCP
(default port 18515, see :mod:`.communication` for every record and which
side sends first) and its output table, so that Debian 12's ib_send_bw, ib_write_bw,
ib_read_bw, ib_atomic_bw and the _lat tools can be either peer. Between two softrdma
processes it is softrdma's benchmark tool; ``--check`` (on both sides) verifies the data.

Differences from perftest, all deliberate:

- ``-x`` (GID index) defaults to 1, the IPv4/IPv6 address of the soft device (perftest
  picks one itself on RoCE); the local address is ``--addr`` (perftest's ``-a`` is "all
  sizes" and keeps that meaning here), or ``-d softrdma-<IP>``.
- ``-R`` (rdma_cm, :mod:`.cm`): as perftest, the exchange runs over an rdma_cm connection and
  the QPs are connected by rdma_cm; the client retries a refused connection for 5 s.
- ``-q`` (several QPs) is for the BW tests, as in perftest; ``-D`` too.
- ``-F`` is accepted and ignored (there is no CPU frequency to check).
- The client retries the TCP connection for 5 s (perftest tries once), so both sides can be
  started together.

The package follows perftest's split: :mod:`.parameters` (options, defaults, their checks),
:mod:`.communication` (the out-of-band exchange on TCP), :mod:`.cm` (``-R``), :mod:`.resources` (the verbs
objects of a test and waiting on the device), :mod:`.loops` (the test loops),
:mod:`.report` (the result tables), :mod:`.check` (``--check``) and :mod:`.main` (each
test's order of handshakes, loops and reports).
"""

from __future__ import annotations

from typing import Any

from .main import run
from .parameters import add_arguments
from .resources import Perf, pattern

__all__ = ["add_parser", "run", "pattern", "Perf"]


def add_parser(sub: Any) -> None:
    add_arguments(sub).set_defaults(func=run)
