"""rdma_cm for softrdma: connection management by IP address, over the IB CM on QP1.

    from softrdma.rdmacm import CMID, AddrInfo, ConnParam, RDMA_PS_TCP, RAI_PASSIVE

The API is pyverbs.cmid's (:mod:`softrdma.rdmacm.cmid`). Under it, one module per job of
what the kernel's cma.c and librdmacm do:

* :mod:`~softrdma.rdmacm.cm_id`: the rdma_cm id (:class:`RdmaCmId`), whose states follow
  cma.c's transition table (:mod:`~softrdma.rdmacm.state`);
* :mod:`~softrdma.rdmacm.channel`: the event channel (:class:`EventChannel`) and
  :mod:`~softrdma.rdmacm.events` what events and calls carry;
* :mod:`~softrdma.rdmacm.device`: rdma_cm's view of a soft device (its IB CM, listeners);
* :mod:`~softrdma.rdmacm.addr`: which device an address names, RoCE routes;
* :mod:`~softrdma.rdmacm.ports`: port spaces and ephemeral ports;
* :mod:`~softrdma.rdmacm.loopback`: loopback listeners shared by processes.

The CM agent of each soft device is :mod:`softrdma.soft.cm_service`. docs/cm.md walks
through a connection.
"""

from .channel import EventChannel
from .cm_id import RdmaCmId
from .cmid import CMEvent, CMEventChannel, CMID, AddrInfo, ConnParam, UDParam
from .enums import *  # noqa: F401,F403
from .enums import __all__ as _enum_names
from .events import ConnParams, RdmaCmEvent, UdParams

__all__ = ["CMEvent", "CMEventChannel", "CMID", "AddrInfo", "ConnParam", "UDParam",
           "RdmaCmEvent", "RdmaCmId", "ConnParams", "EventChannel", "UdParams"] + \
    list(_enum_names)
