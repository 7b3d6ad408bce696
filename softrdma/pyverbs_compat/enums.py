"""pyverbs.enums (rdma-core 44's libibverbs_enums): every enum class and constant, with the
C values, as generated from real pyverbs (scripts/gen_pyverbs_manifest.py)."""

from .unsupported import make_enums as _make
import sys as _sys

__all__ = _make(_sys.modules[__name__], "enums")
