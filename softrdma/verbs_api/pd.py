"""Protection domains."""

from __future__ import annotations

from typing import Any

from .base import Sibling

__all__ = ["PD", "SoftPD"]


class PD(Sibling):
    """``ibv_pd``: MRs, MWs, QPs, SRQs and AHs belong to exactly one PD, and an rkey or lkey
    is only honoured for a QP of the same PD."""

    _kind = "PD"
    _pool = "pd"

    def __init__(self, context: Any) -> None:
        self._create(context, "PD")

    def __repr__(self) -> str:
        return f"<PD on {self.device.name}>"


class SoftPD:
    """A soft device's PD is its identity: the key table compares the PD objects."""

    extras: frozenset[str] = frozenset()

    def __init__(self, owner: PD) -> None:
        pass

    def destroy(self) -> None:
        pass
