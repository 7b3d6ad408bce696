"""pyverbs.pyverbs_error: the error classes (softrdma.errors)."""

from ..errors import PyverbsError, PyverbsRDMAError, PyverbsUserError

__all__ = ["PyverbsError", "PyverbsRDMAError", "PyverbsUserError"]
