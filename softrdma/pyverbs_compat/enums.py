"""pyverbs.enums (named libibverbs_enums from rdma-core 50 on): every enum class and constant of
rdma-core 44..64 with its C value, from the manifest (scripts/gen_pyverbs_manifest.py)."""

from .unsupported import make_enums as _make
import sys as _sys

__all__ = _make(_sys.modules[__name__], "enums")
