"""Argument checks at the verbs boundary.

Every value a user hands to the verbs API is checked here, where it is passed (create,
modify, post), so that nothing malformed can reach the engines: a bad value fails the call
with ``PyverbsRDMAError`` (EINVAL unless said otherwise) and a message naming the field,
instead of failing later, inside the data path, when a packet is built.

The rules mirror the C structures libibverbs passes to the kernel: an integer field takes
an ``int`` (``IntEnum``/``IntFlag`` members and objects with ``__index__``, such as numpy
integers, are fine; ``bool``, ``float``, ``str`` and ``None`` are not) that fits the C
field's width (``uint32_t rkey``: 0..2^32-1; ``uint64_t remote_addr``: 0..2^64-1...); an
object field takes an object of the expected class (a ``CQ`` where ``ibv_cq *`` is
expected, not a ``PD``).

    >>> as_int(1 << 64, "Failed to post send", "wr[0].remote_addr", U64)
    Traceback (most recent call last):
    ...
    softrdma.errors.PyverbsRDMAError: Failed to post send: wr[0].remote_addr 18446744073709551616 is not a 64-bit value. Errno: 22, Invalid argument
"""

from __future__ import annotations

import errno
import operator
from typing import Any

from ..errors import PyverbsRDMAError

__all__ = ["U8", "U16", "U24", "U32", "U64", "as_int", "as_flag", "as_bits", "require", "show",
           "kind"]

U8, U16, U24, U32, U64 = (1 << 8) - 1, (1 << 16) - 1, (1 << 24) - 1, (1 << 32) - 1, (1 << 64) - 1
_WIDTH = {U8: "an 8-bit value", U16: "a 16-bit value", U24: "a 24-bit value",
          U32: "a 32-bit value", U64: "a 64-bit value"}


def show(v: Any) -> str:
    """A short, safe rendering of a user value for an error message (repr can raise, or be
    megabytes long)."""
    try:
        r = repr(v)
    except Exception:
        return f"<{type(v).__name__} object>"
    return r if len(r) <= 60 else r[:57] + "..."


def _a(name: str) -> str:
    """``a PD``, ``an SGE``, ``an int``: acronyms take the article of their letter's sound."""
    vowel = name[:1] in "AEFHILMNORSX" if name[:2].isupper() else name[:1].lower() in "aeiou"
    return f"{'an' if vowel else 'a'} {name}"


def kind(v: Any) -> str:
    """``None``, ``an int``, ``a PD``: what a value is, for an error message."""
    return "None" if v is None else _a(type(v).__name__)


_kind = kind


def as_int(v: Any, what: str, field: str, hi: int, lo: int = 0, *, allow_bool: bool = False,
           desc: str | None = None, code: int = errno.EINVAL) -> int:
    """``v`` as a plain ``int`` in ``lo..hi``, or PyverbsRDMAError naming ``field``.

    ``what`` is the verb's prefix ("Failed to post send"); ``desc`` replaces the default
    range wording ("is not a 64-bit value") when there is a better one; ``code`` is the
    errno of an out-of-range value (a wrong type is always EINVAL).
    """
    if type(v) is not int:  # the common case costs one type() call
        iv = _coerce(v, allow_bool)
        if iv is None:
            raise PyverbsRDMAError(f"{what}: {field} must be an int, not {_kind(v)} "
                                   f"({show(v)})", errno.EINVAL)
        v = iv
    if not lo <= v <= hi:
        if desc is None:
            desc = _WIDTH[hi] if lo == 0 and hi in _WIDTH else f"outside {lo}..{hi}"
        raise PyverbsRDMAError(f"{what}: {field} {v} is {desc}", code)
    return v


def _coerce(v: Any, allow_bool: bool) -> int | None:
    """The int an int-like object stands for, or None if it is not one."""
    if isinstance(v, bool):
        # True is an int to Python, but a bool where an address or a key is expected is
        # a mistake; flags-as-booleans (sq_sig_all, is_global) allow it.
        return int(v) if allow_bool else None
    if isinstance(v, int):
        return int(v)  # IntEnum / IntFlag members
    if not hasattr(type(v), "__index__"):  # float, str, bytes, None, lists...
        return None
    try:
        return operator.index(v)  # numpy integers
    except Exception:  # a broken __index__ is the caller's bad value, not our crash
        return None


def as_flag(v: Any, what: str, field: str) -> bool:
    """A C ``int`` used as a boolean (``sq_sig_all``, ``is_global``): an int or a bool."""
    return bool(as_int(v, what, field, hi=(1 << 31) - 1, lo=-(1 << 31), allow_bool=True,
                       desc="not a C int"))


def as_bits(v: Any, what: str, field: str, known: int, *, code: int = errno.EINVAL,
            noun: str = "bits") -> int:
    """A flags word: an int with no bit outside ``known`` (plain-int arithmetic, so bits an
    ``IntFlag`` complement would miss, such as 1 << 40, are caught too)."""
    iv = as_int(v, what, field, hi=U64, desc="not a set of flags")
    extra = iv & ~int(known)
    if extra:
        raise PyverbsRDMAError(f"{what}: {field} has unknown {noun} 0x{extra:x}", code)
    return iv


def require(obj: Any, cls: type | tuple[type, ...], what: str, field: str, *,
            optional: bool = False, noun: str | None = None) -> Any:
    """``obj`` if it is an instance of ``cls`` (or None when ``optional``), else EINVAL
    naming the field: ``init_attr.scq is a PD, not a CQ``."""
    if obj is None and optional:
        return obj
    if not isinstance(obj, cls):
        if noun is None:
            names = [c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,))]
            noun = " or ".join(_a(n) for n in names)
        raise PyverbsRDMAError(f"{what}: {field} is {_kind(obj)}, not {noun}", errno.EINVAL)
    return obj
