"""softrdma.verbs_api: the objects users program against, shaped like pyverbs.

    from softrdma.verbs_api import *          # Context, PD, MR, CQ, QP, ... and IBV_* names

Classes: :class:`Context` (device), :class:`PD`, :class:`MR`, :class:`MW`, :class:`CQ`,
:class:`CompChannel`, :class:`SRQ`, :class:`AH`, :class:`QP`, attribute objects
(:class:`QPInitAttr`, :class:`QPCap`, :class:`QPAttr`, :class:`AHAttr`,
:class:`GlobalRoute`, :class:`GID`, :class:`SrqAttr`, :class:`SrqInitAttr`), work requests
(:class:`SGE`, :class:`SendWR`, :class:`RecvWR`) and completions (:class:`WC`). Errors are
:class:`PyverbsRDMAError` with an errno. docs/verbs.md lists the differences from pyverbs.
"""

from ..errors import PyverbsError, PyverbsRDMAError, PyverbsUserError
from .ah import AH
from .attr import GID, AHAttr, GlobalRoute, QPAttr, QPCap, QPInitAttr, SrqAttr, SrqInitAttr
from .cq import CQ, CompChannel
from .device import (AsyncEvent, Context, Device, DeviceAttr, PortAttr, add_device,
                     get_backend, get_device_list, get_soft_device, remove_device, set_backend)
from .enums import *  # noqa: F401,F403
from .enums import __all__ as _enum_names
from .mr import MR, MW, MWBind
from .pd import PD
from .qp import QP
from .srq import SRQ
from .wr import SGE, WC, MWBindInfo, RecvWR, SendWR

__all__ = [
    "PyverbsError", "PyverbsRDMAError", "PyverbsUserError", "AH", "GID", "AHAttr",
    "GlobalRoute", "QPAttr", "QPCap", "QPInitAttr", "SrqAttr", "SrqInitAttr", "CQ",
    "CompChannel", "AsyncEvent", "Context", "Device", "DeviceAttr", "PortAttr", "add_device",
    "get_device_list", "get_soft_device", "remove_device", "set_backend", "get_backend", "MR", "MW", "MWBind", "PD", "QP", "SRQ", "SGE", "WC",
    "MWBindInfo", "RecvWR", "SendWR",
] + list(_enum_names)

# the "verbs" trace kind wraps the classes above while it is on (softrdma.trace)
from .. import trace as _trace  # noqa: E402
from . import tracing as _tracing  # noqa: E402

_trace.on_change(_tracing.install)
