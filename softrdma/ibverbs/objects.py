"""The libibverbs backend's implementations: ``HwPD``, ``HwMR``, ``HwMW``, ``HwCQ``,
``HwCompChannel``, ``HwSRQ``, ``HwAH``, ``HwQP`` (:data:`BACKEND`), and ``HwContext``.

Each implementation is a sibling of the soft one (``HwQP`` beside ``SoftQP``): the one
verbs_api class (``verbs_api.QP``) checks what both backends check and holds the one its
context's ``backend`` names, so what is pure API (``QP.to_rts``'s masks,
``MR.read``/``write`` over ``mr.mem``, ``CQ.poll_all``, ``Resource.close``'s
EBUSY-if-used rule) is the same code on both. Users never name these classes:
``verbs_api.PD(hw_context)`` is a ``verbs_api.PD`` holding an ``HwPD``. So is the context:
``verbs_api.Context(name="rxe0")`` holds an ``HwContext``.

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

from ..verbs_api.base import Backend
from .completion import HwCompChannel, HwCQ
from .context import HwContext, HwDevice
from .memory import HwMR, HwMW, HwPD
from .queues import HwAH, HwQP, HwSRQ

__all__ = ["HwContext", "HwPD", "HwMR", "HwMW", "HwCQ", "HwCompChannel", "HwSRQ", "HwAH",
           "HwQP", "HwDevice", "BACKEND"]


#: the implementations of this backend (``HwContext.backend``)
BACKEND = Backend("ibverbs", PD=HwPD, MR=HwMR, MW=HwMW, CompChannel=HwCompChannel, CQ=HwCQ,
                  AH=HwAH, SRQ=HwSRQ, QP=HwQP)
