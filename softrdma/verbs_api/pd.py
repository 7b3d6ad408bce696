"""Protection domains."""

from __future__ import annotations

import errno
from typing import Any

from ..errors import PyverbsRDMAError
from .base import Resource

__all__ = ["PD"]


class PD(Resource):
    """``ibv_pd``: MRs, MWs, QPs, SRQs and AHs belong to exactly one PD, and an rkey or lkey
    is only honoured for a QP of the same PD."""

    _kind = "PD"

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        with self.device.lock:
            if self.device.pd_count >= self.device.limits.max_pd:
                self.context.children.pop(self, None)
                raise PyverbsRDMAError("Failed to alloc PD: too many PDs", errno.ENOMEM)
            self.device.pd_count += 1

    def _destroy(self) -> None:
        if not self.closed:
            self.device.pd_count -= 1
        super()._destroy()

    def __repr__(self) -> str:
        return f"<PD on {self.device.name}>"
