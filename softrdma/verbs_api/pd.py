"""Protection domains."""

from __future__ import annotations

from typing import Any

from .base import Resource

__all__ = ["PD"]


class PD(Resource):
    """``ibv_pd``: MRs, MWs, QPs, SRQs and AHs belong to exactly one PD, and an rkey or lkey
    is only honoured for a QP of the same PD."""

    _kind = "PD"
    _pool = "pd"

    def __init__(self, context: Any) -> None:
        super().__init__(context)

    def __repr__(self) -> str:
        return f"<PD on {self.device.name}>"
