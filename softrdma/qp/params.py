"""rxe's protocol constants (rxe_param.h, rxe_comp.c) and the timer formulas."""

from __future__ import annotations

RXE_MAX_UNACKED_PSNS = 128  # requester stops when req.psn runs this far ahead of comp.psn
RXE_MAX_PKT_PER_ACK = 64  # AckReq at least every ~66 packets of a long message
RXE_ROCE_V2_SPORT = 0xC000
GOLDEN_RATIO_32 = 0x61C88647

# IBTA RNR NAK timer field -> microseconds (rxe_comp.c rnrnak_usec; 61410 is rxe's value
# for code 25, a typo of 61440 that we keep for wire fidelity of timing).
RNR_NAK_USEC = (655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
                2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61410, 81920, 122880,
                163840, 245760, 327680, 491520)


def rnr_nak_seconds(code: int) -> float:
    return RNR_NAK_USEC[code & 0x1F] * 1e-6


def qp_timeout_seconds(timeout: int) -> float | None:
    """Local ACK timeout: 4.096 us * 2^timeout; 0 means no retransmit timer."""
    return None if timeout == 0 else 4096e-9 * (1 << timeout)


def hash_32(val: int, bits: int) -> int:
    return ((val * GOLDEN_RATIO_32) & 0xFFFFFFFF) >> (32 - bits)


def udp_sport_for_qpn(qpn: int) -> int:
    """rxe_qp_init: the source port of a QP without a path (UD, or before RTR)."""
    return RXE_ROCE_V2_SPORT + (hash_32(qpn, 14) & 0x3FFF)


def calc_flow_label(lqpn: int, rqpn: int) -> int:
    v = lqpn * rqpn
    v ^= v >> 20
    v ^= v >> 40
    return v & 0xFFFFF


def udp_sport_for_path(flow_label: int, lqpn: int, rqpn: int) -> int:
    """rdma_get_udp_sport: connected QPs hash the flow label (or both QPNs when it is 0)."""
    fl = flow_label or calc_flow_label(lqpn, rqpn)
    return ((fl & 0x3FFF) ^ ((fl & 0xFC000) >> 14)) | RXE_ROCE_V2_SPORT
