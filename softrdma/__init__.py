"""softrdma: a pure-Python software RoCEv2 stack, a userspace re-implementation of Linux rxe.

Layers (see docs/architecture.md): :mod:`softrdma.wire` (bytes), :mod:`softrdma.qp`
(protocol engines, sans-IO), :mod:`softrdma.verbs_api` (the objects users program against).
"""

__version__ = "0.1.0"
