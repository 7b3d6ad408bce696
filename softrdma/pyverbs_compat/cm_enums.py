"""pyverbs.cm_enums: librdmacm's enums with their C values (rdma_cm itself is not provided)."""

from ._stub import make_enums as _make
import sys as _sys

__all__ = _make(_sys.modules[__name__], "cm_enums")
