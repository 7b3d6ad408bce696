"""Errors, shaped like pyverbs' and libibverbs'.

A failed verb raises :class:`PyverbsRDMAError` carrying an errno (``EINVAL``, ``ENOMEM``,
``EPERM``, ``EBUSY``...) as ``error_code``/``errno`` and a message that names the offending
attribute, e.g. ``Failed to modify QP: IBV_QP_PATH_MTU is required for INIT->RTR on RC.
Errno: 22, Invalid argument``. It is also an ``OSError``, so ``except OSError`` works.
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = ["PyverbsError", "PyverbsRDMAError", "PyverbsUserError"]


class PyverbsError(Exception):
    """Base of every softrdma verbs error."""


class PyverbsRDMAError(PyverbsError, OSError):
    """A verb failed with an errno, as libibverbs reports it."""

    def __init__(self, msg: str, error_code: int = _errno.EINVAL) -> None:
        text = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        OSError.__init__(self, error_code, text)
        self.args = (text,)  # as pyverbs: args[0] is the whole message
        self.error_code = error_code
        self.msg = msg

    def __str__(self) -> str:
        return self.strerror


class PyverbsUserError(PyverbsError):
    """A misuse caught before any verb ran (a wrong type, a missing argument)."""
