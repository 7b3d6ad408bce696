"""pyverbs.base: PyverbsObject, PyverbsCM, PyverbsRDMAErrno, inc_rkey, close_weakrefs."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Iterable

from ..errors import PyverbsError, PyverbsRDMAError, PyverbsUserError  # noqa: F401

__all__ = ["PyverbsObject", "PyverbsCM", "PyverbsRDMAErrno", "PyverbsRDMAError", "inc_rkey",
           "close_weakrefs", "LOG_FORMAT"]

LOG_FORMAT = "[%(levelname)s] %(asctime)s %(filename)s:%(lineno)s: %(message)s"


def PyverbsRDMAErrno(msg: str) -> PyverbsRDMAError:  # noqa: N802 (pyverbs' name)
    """A PyverbsRDMAError carrying the calling thread's errno (as pyverbs reads errno)."""
    return PyverbsRDMAError(msg, ctypes.get_errno())


def inc_rkey(rkey: int) -> int:
    """ibv_inc_rkey: the index (upper 24 bits) stays, the key byte moves on."""
    return (rkey & 0xFFFFFF00) | ((rkey + 1) & 0xFF)


class PyverbsObject:
    def __init__(self) -> None:
        self.logger = logging.getLogger(self.__class__.__name__)

    def set_log_level(self, val: int) -> None:
        self.logger.setLevel(val)


class PyverbsCM(PyverbsObject):
    """A context manager that closes the object on exit (pyverbs' base class)."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


def close_weakrefs(iterables: Iterable[Iterable[Any]]) -> None:
    for it in iterables:
        for obj in list(it):
            obj.close()
