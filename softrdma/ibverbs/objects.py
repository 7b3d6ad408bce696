"""The verbs_api classes on a libibverbs device: ``HwContext``, ``HwPD``, ``HwMR``, ``HwMW``,
``HwCQ``, ``HwCompChannel``, ``HwSRQ``, ``HwAH``, and the implementation ``HwQP``.

``HwQP`` is a sibling of the soft backend's ``SoftQP``: the one ``verbs_api.QP`` class
checks the arguments and holds one or the other, taken from ``HwContext.backend``. The
others still subclass the verbs_api class they implement (``HwPD(verbs_api.PD)``) and
override everything that would reach the soft device's engines; what is pure API
(``MR.read``/``write`` over ``mr.mem``, ``CQ.__iter__``, ``Resource.close``'s
EBUSY-if-used rule) is inherited unchanged, so both backends behave alike. Users never
name these classes: ``verbs_api.PD(hw_context)`` returns one (see :mod:`.dispatch`).

Errors are ``PyverbsRDMAError`` with the errno libibverbs reports: a NULL from a
create/alloc/reg verb takes ``errno``; a non-zero ``int`` result is itself the errno
(``modify_qp``, ``post_send``, ``destroy_*``...); ``poll_cq`` < 0 gives ``-rc``.

Two decisions keep one program's meaning on both backends:

* **Immediate data** is a host integer, sent big-endian on the wire (softrdma's meaning:
  ``imm_data=0x11223344`` puts bytes ``11 22 33 44`` in the ImmDt header). verbs.h
  declares it ``__be32``, so the backend stores ``htonl(imm_data)`` when posting
  ``*_WITH_IMM`` and reports ``ntohl`` of it when polling a completion with
  ``IBV_WC_WITH_IMM``. ``invalidate_rkey`` / ``invalidated_rkey`` are host-order
  ``uint32_t`` in C too and are not swapped.
* **An MR's address is its iova.** ``MR(pd, length, access, address=iova, buffer=obj)``
  registers the buffer's real memory with ``ibv_reg_mr_iova2(pd, ptr, len, iova, access)``:
  SGEs, ``remote_addr`` and peers use the iova, as on the soft device. Without ``address``
  the iova is the buffer's real address (``ibv_reg_mr``). Inline sends, which the provider
  copies from the SGE address as a pointer, have their SGE addresses translated back to
  the real memory through the MR named by the lkey.

Lifetime: an MR holds its Python buffer (through a ctypes ``from_buffer`` array, which
pins the object: a registered ``bytearray`` cannot be resized, an ``mmap`` cannot be
closed) until ``ibv_dereg_mr``; memory freed while registered would be silently
overwritten by later RDMA. ``Context.close`` destroys children in the order QP -> SRQ ->
AH -> MW -> MR -> CQ -> channel -> PD, acknowledging CQ events before ``ibv_destroy_cq``
(which would otherwise wait for them forever).
"""

from __future__ import annotations

from typing import Iterable

from ..verbs_api import device as v_device
from ..verbs_api.base import Backend
from . import dispatch
from .completion import HwCompChannel, HwCQ
from .context import HwContext, HwDevice
from .memory import HwMR, HwMW, HwPD
from .queues import HwAH, HwQP, HwSRQ

__all__ = ["HwContext", "HwPD", "HwMR", "HwMW", "HwCQ", "HwCompChannel", "HwSRQ", "HwAH",
           "HwQP", "HwDevice", "BACKEND"]


def _all() -> Iterable[tuple[type, type]]:
    return ((v_device.Context, HwContext),)


dispatch.install(_all())

#: the implementations of this backend (``HwContext.backend``)
BACKEND = Backend("ibverbs", PD=HwPD, MR=HwMR, MW=HwMW, CompChannel=HwCompChannel, CQ=HwCQ,
                  AH=HwAH, SRQ=HwSRQ, QP=HwQP)
