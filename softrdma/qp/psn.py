"""24-bit packet sequence number arithmetic (rxe_verbs.h ``psn_compare``)."""

from __future__ import annotations

from ..wire.headers import PSN_MASK

__all__ = ["PSN_MASK", "psn_add", "psn_diff"]


def psn_diff(a: int, b: int) -> int:
    """Signed distance a - b in the 24-bit PSN space, in [-2^23, 2^23)."""
    d = (a - b) & PSN_MASK
    return d - (PSN_MASK + 1) if d & 0x800000 else d


def psn_add(a: int, n: int) -> int:
    """``a + n`` modulo 2^24 (``n`` may be negative)."""
    return (a + n) & PSN_MASK
