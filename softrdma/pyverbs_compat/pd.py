"""pyverbs.pd: PD (closing it closes its QPs, SRQs, AHs, MWs and MRs first, as pyverbs)."""

from ..verbs_api.pd import PD as _PD
from . import unsupported
from ._close import CascadeClose
import sys as _sys

__all__ = ["PD"]


class PD(CascadeClose, _PD):
    def __init__(self, creator, **kwargs):  # noqa: ANN001
        super().__init__(creator)

    @property
    def ctx(self):  # noqa: ANN201
        return self.context

    @property
    def handle(self) -> int:
        """The object's handle (uverbs' id); importing it into another context
        (``Context(cmd_fd=...)``) is EOPNOTSUPP."""
        return id(self) & 0xFFFFFFFF


unsupported.fill_missing(_sys.modules[__name__], "pd")  # ParentDomain...: EOPNOTSUPP, as rxe
