"""pyverbs.cm_enums: librdmacm's enums with their C values.

Every name of ``pyverbs.cm_enums``/``librdmacm_enums`` of rdma-core 44..64 (the manifest); the classes
softrdma's rdma_cm uses (``rdma_cm_event_type``, ``rdma_port_space``) are
:mod:`softrdma.rdmacm.enums`' own, so an event type read from a ``CMEvent`` is the very
member this module names (tests/test_pyverbs_compat.py checks that the values agree).
"""

import sys as _sys

from ..rdmacm import enums as _rdmacm_enums
from .unsupported import make_enums as _make

__all__ = _make(_sys.modules[__name__], "cm_enums")

for _cls in (_rdmacm_enums.rdma_cm_event_type, _rdmacm_enums.rdma_port_space):
    _mine = globals()[_cls.__name__]
    # softrdma's members must be pyverbs' (names and values); names of newer releases
    # softrdma's rdma_cm never produces (RDMA_CM_EVENT_ADDRINFO_*, v55) stay the manifest's
    if any(_mine.__members__.get(n) != int(m) for n, m in _cls.__members__.items()):
        raise ImportError(f"pyverbs.cm_enums.{_cls.__name__} disagrees with softrdma.rdmacm")  # pragma: no cover
    globals()[_cls.__name__] = _cls
    globals().update(_cls.__members__)
for _n in ("RAI_PASSIVE", "RAI_NUMERICHOST", "RAI_NOROUTE", "RAI_FAMILY", "RDMA_OPTION_ID",
           "RDMA_OPTION_ID_ACK_TIMEOUT", "RDMA_OPTION_ID_TOS", "RDMA_OPTION_ID_REUSEADDR",
           "RDMA_OPTION_ID_AFONLY", "RDMA_OPTION_IB", "RDMA_UDP_QKEY"):
    if _n in globals() and globals()[_n] != getattr(_rdmacm_enums, _n):  # pragma: no cover
        raise ImportError(f"pyverbs.cm_enums.{_n} disagrees with softrdma.rdmacm")
    if _n not in globals():
        globals()[_n] = getattr(_rdmacm_enums, _n)
        __all__.append(_n)
del _cls, _mine, _n
