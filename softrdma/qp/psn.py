"""24-bit packet sequence number arithmetic (rxe_verbs.h ``psn_compare``)."""

from __future__ import annotations

PSN_MASK = 0xFFFFFF


def psn_diff(a: int, b: int) -> int:
    """Signed distance a - b in the 24-bit PSN space, in [-2^23, 2^23)."""
    d = (a - b) & PSN_MASK
    return d - 0x1000000 if d & 0x800000 else d


def psn_compare(a: int, b: int) -> int:
    """<0, 0, >0 as a is before, equal to, after b (modulo 2^24)."""
    return psn_diff(a, b)


def psn_add(a: int, n: int) -> int:
    return (a + n) & PSN_MASK
