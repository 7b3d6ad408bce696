"""rdma_cm for softrdma: connection management by IP address, over the IB CM on QP1.

    from softrdma.rdmacm import CMID, AddrInfo, ConnParam, RDMA_PS_TCP, RAI_PASSIVE

The API is pyverbs.cmid's (:mod:`softrdma.rdmacm.cmid`); the machinery under it is
:mod:`softrdma.rdmacm.core` (what the kernel's cma.c and librdmacm do), on top of the
CM agent of each soft device (:mod:`softrdma.soft.cm_service`). docs/cm.md walks
through a connection.
"""

from .cmid import CMEvent, CMEventChannel, CMID, AddrInfo, ConnParam, UDParam
from .core import CmaEvent, CmaId, ConnParams, EventChannel, UdParams
from .enums import *  # noqa: F401,F403
from .enums import __all__ as _enum_names

__all__ = ["CMEvent", "CMEventChannel", "CMID", "AddrInfo", "ConnParam", "UDParam",
           "CmaEvent", "CmaId", "ConnParams", "EventChannel", "UdParams"] + list(_enum_names)
