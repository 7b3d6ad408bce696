"""perftest_parameters: the options of ``softrdma perf``, their defaults and the checks
perftest makes of them (while parsing: usage errors; after: ``force_dependencies``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..argtypes import c_int, int_range, ip_address, perftest_size
from ..common import DEVICE_HELP, ToolError, add_fault_option

__all__ = ["add_arguments", "force_dependencies", "check_device", "set_mtu"]

# perftest_parameters.h
DEF_PORT = 18515
DEF_SIZE_BW = 65536
DEF_SIZE_LAT = 2
DEF_SIZE_ATOMIC = 8
DEF_ITERS = 1000
DEF_ITERS_WB = 5000
DEF_TX_BW = 128
DEF_TX_LAT = 1
DEF_RX_SEND = 512
DEF_CQ_MOD = 100
DEF_QP_TIME = 14
MIN_ITER = 5
MAX_ITER = 100000000
MIN_TX, MAX_TX = 1, 15000
MIN_RX, MAX_RX = 1, 16384
MIN_GID_IX, MAX_GID_IX = 0, 64
MIN_QP_NUM, MAX_QP_NUM = 1, 16384
MIN_CQ_MOD, MAX_CQ_MOD = 1, 1024
MAX_INLINE = 1024
MIN_IB_PORT = 1
MAX_SL = 15
DEF_RX_RDMA = 1
MAX_SIZE = 8388608
MSG_SIZE_CQ_MOD_LIMIT = 8192
DEF_INLINE_WRITE = 220
DEF_INLINE_SEND_RC_UC = 236
MIN_RNR_TIMER = 12
DEF_HOP_LIMIT = 64
TESTS = {"send": "Send", "write": "RDMA_Write", "read": "RDMA_Read", "atomic": "Atomic"}


def add_arguments(sub: Any) -> argparse.ArgumentParser:
    """The ``perf`` subcommand's parser, with perftest's options (the caller sets ``func``)."""
    p = sub.add_parser(
        "perf", help="perftest's ib_{send,write,read,atomic}_{bw,lat}",
        description="Bandwidth (default) or latency (--lat) of SEND, RDMA WRITE, RDMA READ or "
                    "atomics over RC, compatible with perftest 4.5's ib_*_bw and ib_*_lat in both "
                    "roles (same options, exchange and output). Without SERVER, wait for a "
                    "client.")
    p.add_argument("verb", choices=["send", "write", "read", "atomic"])
    p.add_argument("servername", nargs="?", help="connect to this server (else: be the server)")
    p.add_argument("--lat", action="store_true", help="latency test (ib_*_lat), not bandwidth")
    # perftest's parser (perftest_parameters.c, CHECK_VALUE_IN_RANGE and friends) checks
    # these while parsing: a usage error (status 1 there, 2 here like any usage error)

    def rng(lo: int, hi: int | None, name: str) -> Any:
        return int_range(lo, hi, f"{name} should be between {{lo}} and {{hi}} (got {{v}})")

    p.add_argument("-p", "--port", type=int_range(1, 65535), default=DEF_PORT,
                   help=f"listen on/connect to port (default {DEF_PORT})")
    p.add_argument("-d", "--ib-dev", metavar="NAME", help=DEVICE_HELP)
    p.add_argument("--addr", type=ip_address,
                   help="local IP address for the soft device (perftest has none; its -a is "
                        "--all)")
    p.add_argument("-i", "--ib-port", default=1, help="port of the device (1)",
                   type=int_range(MIN_IB_PORT, 255, "IB Port can't be less than {lo} (got {v})"))
    p.add_argument("-s", "--size", type=perftest_size,
                   help=f"message size (bw {DEF_SIZE_BW}, lat {DEF_SIZE_LAT}, atomic 8 only)")
    p.add_argument("-n", "--iters", type=rng(MIN_ITER, MAX_ITER, "Iteration num"),
                   help=f"exchanges, at least {MIN_ITER} (write bw {DEF_ITERS_WB}, else {DEF_ITERS})")
    p.add_argument("-D", "--duration", help="BW tests: run for this many seconds",
                   type=int_range(1, None, "Duration period must be positive (got {v})"))
    p.add_argument("-m", "--mtu", type=c_int, default=0, help="path MTU 256..4096 (port MTU)")
    p.add_argument("-x", "--gid-index", type=rng(MIN_GID_IX, MAX_GID_IX, "Gid index"), default=1,
                   help="GID index, as softrdma devinfo -v lists the device's GIDs (default "
                        "1: the device's IP address; 0: its link-local GID)")
    p.add_argument("-F", "--CPU-freq", action="store_true", help="ignored (perftest compatibility)")
    p.add_argument("-a", "--all", action="store_true", help="run sizes 2 .. 2^23")
    p.add_argument("-t", "--tx-depth", type=rng(MIN_TX, MAX_TX, "Tx depth"),
                   help=f"send queue depth (bw {DEF_TX_BW}, lat 1)")
    p.add_argument("-r", "--rx-depth", type=rng(MIN_RX, MAX_RX, "Rx depth"),
                   help=f"send: receives posted ({DEF_RX_SEND})")
    p.add_argument("-q", "--qp", type=rng(MIN_QP_NUM, MAX_QP_NUM, "num of Qps"), default=1,
                   help="BW tests: number of QPs (1)")
    p.add_argument("-Q", "--cq-mod", type=rng(MIN_CQ_MOD, MAX_CQ_MOD, "CQ moderation"),
                   help=f"a completion every N sends ({DEF_CQ_MOD})")
    p.add_argument("-I", "--inline_size", type=rng(0, MAX_INLINE, "Max inline"),
                   help="max size sent inline")
    p.add_argument("-A", "--atomic_type", choices=["CMP_AND_SWAP", "FETCH_AND_ADD"],
                   help="atomic: operation (FETCH_AND_ADD)")
    p.add_argument("-o", "--outs", type=c_int, help="read/atomic: outstanding (device max)")
    p.add_argument("-u", "--qp-timeout", type=int_range(0, 31), default=DEF_QP_TIME,
                   help="QP timeout 0..31 (14)")
    p.add_argument("-S", "--sl", type=int_range(0, MAX_SL, f"Only {MAX_SL + 1} Service levels "
                                                "(got {v})"), default=0,
                   help="service level (0)")
    p.add_argument("-N", "--noPeak", action="store_true", help="BW tests: no peak BW")
    p.add_argument("--report_gbits", action="store_true", help="BW in Gb/s, not MB/s")
    p.add_argument("-R", "--rdma_cm", action="store_true", help="connect the QPs with rdma_cm and exchange over rdma_cm "
                        "(perftest -R; both sides)")
    p.add_argument("--check", action="store_true",
                   help="verify the data (softrdma on both sides, both with --check)")
    p.add_argument("--counters", action="store_true", help="print the device's counters")
    add_fault_option(p)
    return p


def set_mtu(dev: Any, user_mtu: int) -> int:
    """perftest's set_mtu: the port's active MTU, or the user's (not above the port's)."""
    active = int(dev.active_mtu)
    if not user_mtu:
        return active
    table = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
    if user_mtu not in table:
        print(f" Invalid MTU - {user_mtu} ")
        print(" Please choose mtu from {256,512,1024,2048,4096}")
        print(f" Will run with the port active mtu - {active}")
        return active
    m = table[user_mtu]
    if m > active:
        print("Requested mtu is higher than active mtu ")
        print(f"Changing to active mtu - {active}")
        m = active
    return m



def force_dependencies(a: argparse.Namespace) -> None:
    """init_perftest_params and force_dependecies."""
    if a.lat and (a.qp != 1):
        raise ToolError("-q is for the BW tests (latency tests use one QP)")
    if a.lat and a.duration:
        raise ToolError("-D is supported for the BW tests only")
    # perftest's checks of options that depend on the test (its parser, force_dependecies)
    if a.inline_size is not None and a.verb in ("read", "atomic"):
        raise ToolError("Inline feature not available on READ/Atomic verbs")
    if a.outs is not None and a.verb not in ("read", "atomic"):
        raise ToolError("Setting Outstanding reads only available on READ verb")
    if a.rx_depth is not None and a.verb != "send" and a.rx_depth > DEF_RX_RDMA:
        raise ToolError("On RDMA verbs rx depth can be only 1")
    if a.atomic_type is not None and a.verb != "atomic":
        raise ToolError("You are not running the atomic_lat/bw test! To change the atomic "
                        "action type, you must run one of the atomic tests")
    if a.atomic_type is None:
        a.atomic_type = "FETCH_AND_ADD"
    if a.duration and a.all:
        raise ToolError("Duration mode currently doesn't support running on all sizes.")
    if a.verb == "atomic":
        if a.size is not None and a.size != DEF_SIZE_ATOMIC:
            raise ToolError("Message size cannot be changed for Atomic tests ")
        if a.all:
            raise ToolError("-a is not available for the atomic tests (8-byte messages only)")
        a.size = DEF_SIZE_ATOMIC
    if a.size is None:
        a.size = DEF_SIZE_LAT if a.lat else DEF_SIZE_BW
    if not 1 <= a.size <= MAX_SIZE:
        raise ToolError(f" Message Size should be between 1 and {MAX_SIZE}")
    if a.iters is None:
        a.iters = DEF_ITERS_WB if (a.verb == "write" and not a.lat) else DEF_ITERS
    if a.tx_depth is None:
        a.tx_depth = DEF_TX_LAT if a.lat else DEF_TX_BW
    if a.rx_depth is None:
        a.rx_depth = DEF_RX_SEND if a.verb == "send" else 1
    req_cq_mod = a.cq_mod is not None
    if a.cq_mod is None:
        a.cq_mod = DEF_CQ_MOD
    if not a.duration:
        a.tx_depth = min(a.tx_depth, a.iters)
        if a.verb == "send":
            a.rx_depth = min(a.rx_depth, a.iters)
    if a.size > MSG_SIZE_CQ_MOD_LIMIT and not a.all and not req_cq_mod:
        a.cq_mod = 1
    a.cq_mod = max(1, min(a.cq_mod, a.tx_depth))
    if a.inline_size is None:
        if a.lat and a.verb == "write":
            a.inline_size = DEF_INLINE_WRITE
        elif a.lat and a.verb == "send":
            a.inline_size = DEF_INLINE_SEND_RC_UC
        else:
            a.inline_size = 0
    if a.verb in ("read", "atomic"):
        a.inline_size = 0
    if a.all:
        a.size = MAX_SIZE



def check_device(a: argparse.Namespace, dev: Any) -> None:
    """What perftest learns from the device before it connects (the port, the GID)."""
    if a.ib_port != 1:
        raise ToolError(f"Unable to query port {a.ib_port}: the device has port 1 only")
    g = a.gid_index
    if g >= len(dev.gid_table) or not any(dev.gid_table[g]):
        raise ToolError(f"Failed to query GID index {g}: the entry is empty (the device's GIDs "
                        f"are 0..{len(dev.gid_table) - 1})")
