"""What every hardware implementation shares: libibverbs' error conventions and the check
that an argument is an open object of this backend."""

from __future__ import annotations

import ctypes
import errno
from typing import Any

from ..errors import PyverbsRDMAError
from ..verbs_api._check import require

__all__ = ["fail", "null_error", "hw_parent", "hw_impl"]


def fail(what: str, code: int) -> PyverbsRDMAError:
    return PyverbsRDMAError(what, code or errno.EIO)


def null_error(what: str) -> PyverbsRDMAError:
    """The error of a verb that returned NULL: errno says why."""
    return fail(what, ctypes.get_errno())


def hw_parent(obj: Any, cls: type, what: str, field: str) -> Any:
    require(obj, cls, what, field)
    obj._check()
    return obj


def hw_impl(obj: Any, api_cls: type, impl_cls: type, what: str, field: str) -> Any:
    """``obj``'s hardware implementation (an ``impl_cls``): ``obj`` must be an open
    ``api_cls`` made on a libibverbs device (EINVAL naming ``field`` otherwise)."""
    require(obj, api_cls, what, field)
    obj._check()
    impl = obj.impl
    if not isinstance(impl, impl_cls):
        raise PyverbsRDMAError(f"{what}: {field} is on a soft device, not a libibverbs one",
                               errno.EINVAL)
    return impl
