"""rdma_cm's view of one soft device (cma.c ``struct cma_device``).

A :class:`CmaDevice` holds a verbs context open while ids use the device, the device's
IB CM (:class:`~softrdma.soft.cm_service.CmService`, on QP1) and the listeners by
service ID, and hands each CM event to the rdma_cm id it belongs to.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol, runtime_checkable

from ..cm.messages import RejectReason, SidrStatus
from ..cm.state import CmEvent, CmEventType, IbCmId
from ..soft.cm_service import CmService
from ..verbs_api import Context
from .enums import RdmaCmState

__all__ = ["CmaDevice", "CmEventOwner", "Listener"]


@runtime_checkable
class CmEventOwner(Protocol):
    """An rdma_cm id that owns IB CM ids: their events go to it (device lock held)."""

    def on_cm_event(self, ev: CmEvent) -> None:
        ...


class Listener(Protocol):
    """A listening rdma_cm id: REQs and SIDR_REQs for its service ID go to it."""

    state: RdmaCmState

    def on_request(self, ev: CmEvent, cdev: "CmaDevice") -> None:
        ...


class CmaDevice:
    """rdma_cm's view of one soft device (``struct cma_device``): a verbs context kept
    open while ids use the device, its :class:`CmService` (the IB CM on QP1), and the
    listeners by service ID. Made on first use and closed with the last id."""

    _all: dict[int, "CmaDevice"] = {}
    _lock = threading.Lock()

    def __init__(self, device: Any) -> None:
        self.device = device
        self.ctx = Context(name=device.name)  # the context makes a live device live
        self.service = CmService(device, on_event=self._on_cm_event)
        self.refs = 0
        self.listeners: dict[int, Listener] = {}  # service ID -> listening id
        lim = device.limits
        self.max_responder_resources = lim.max_qp_rd_atom
        self.max_initiator_depth = lim.max_qp_init_rd_atom

    @classmethod
    def acquire(cls, device: Any) -> "CmaDevice":
        with cls._lock:
            cdev = cls._all.get(id(device))
            if cdev is None:
                cdev = cls._all[id(device)] = CmaDevice(device)
            cdev.refs += 1
            return cdev

    def ref(self) -> "CmaDevice":
        """One more user of a device already in use (no construction, so safe with the
        device lock held)."""
        with CmaDevice._lock:
            self.refs += 1
        return self

    def release(self) -> None:
        with CmaDevice._lock:
            self.refs -= 1
            if self.refs > 0:
                return
            CmaDevice._all.pop(id(self.device), None)
        self.service.close()
        self.ctx.close()

    @property
    def ip(self) -> str:
        return self.device.ip

    @property
    def now(self) -> float:
        return self.device.now

    def _on_cm_event(self, ev: CmEvent) -> None:
        """A CM event (device lock held): to the rdma_cm id it belongs to."""
        if ev.type in (CmEventType.REQ_RECEIVED, CmEventType.SIDR_REQ_RECEIVED):
            listener = self.listeners.get(ev.cm_id.service_id)
            if listener is None or listener.state != RdmaCmState.LISTEN:
                if ev.type == CmEventType.REQ_RECEIVED:
                    self.service.reject(ev.cm_id, RejectReason.INVALID_SERVICE_ID)
                else:
                    self.sidr_answer(ev.cm_id, SidrStatus.UNSUPPORTED)
                self.service.destroy(ev.cm_id)  # answered: nobody holds the id
                return
            listener.on_request(ev, self)
            return
        owner = ev.cm_id.context
        if isinstance(owner, CmEventOwner):
            owner.on_cm_event(ev)

    def sidr_answer(self, cm_id: IbCmId, status: int) -> None:
        """A SIDR_REP with ``status`` and nothing else (no QP, no Q_Key)."""
        self.service.sidr_reply(cm_id, status=int(status))


def _after_fork_in_child() -> None:
    """A forked child starts with no rdma_cm devices (its soft devices are fresh too:
    softrdma.verbs_api.device): the parent's stay the parent's."""
    CmaDevice._all = {}
    CmaDevice._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
