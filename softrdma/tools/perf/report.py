"""The result tables perftest prints (print_report_bw, print_report_lat, the test header
and the address lines), byte for byte."""

from __future__ import annotations

import math

from ...enums import mtu_to_bytes
from .communication import BwReport, Dest
from .parameters import TESTS
from .resources import Perf

__all__ = ["RESULT_LINE", "cx", "compute_peak", "print_test_info", "print_dest",
           "print_bw_header", "print_bw_report", "bw_report", "print_lat_header",
           "print_lat_report", "print_checks"]

LAT_MEASURE_TAIL = 2
RESULT_LINE = "-" * 87
RESULT_FMT = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
RESULT_FMT_G = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
RESULT_FMT_LAT = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    "
                  "t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ")


def cx(v: int, width: int) -> str:
    """C's ``%#0<width>x``: "0x" and zero padding to ``width``, except 0 which has no "0x"."""
    if v == 0:
        return "0" * width
    return "0x" + format(v, "x").rjust(width - 2, "0")



def compute_peak(tposted: list[float], tcompleted: list[float], n: int, cq_mod: int) -> float:
    """print_report_bw's peak: the shortest time per message over any run of messages
    i..j ending at a completion. Exact up to ~200k steps, sampled beyond."""
    if n <= 0:
        return 0.0
    best = tcompleted[n - 1] - tposted[0]
    best /= n
    steps = n * max(1, n // cq_mod)
    stride = max(1, int(steps // 200_000))
    for i in range(0, n, stride):
        j = ((i + 1 + cq_mod - 1) // cq_mod) * cq_mod - 1
        ti = tposted[i]
        while j < n:
            t = (tcompleted[j] - ti) / (j - i + 1)
            if t < best:
                best = t
            j += cq_mod * stride
        if n % cq_mod:
            t = (tcompleted[n - 1] - ti) / (n - i)
            if t < best:
                best = t
    return best


def print_test_info(perf: Perf) -> None:
    a = perf.a
    title = f"{TESTS[perf.verb]} "
    if perf.verb == "atomic":
        title += f"{a.atomic_type} "
    title += "Latency " if perf.lat else "BW "
    lines = [RESULT_LINE, "                    " + title + "Test",
             f" Dual-port       : OFF\t\tDevice         : {perf.dev.name}",
             f" Number of qps   : {a.qp}\t\tTransport type : IB",
             " Connection type : RC\t\tUsing SRQ      : OFF",
             " PCIe relax order: ON",
             " ibv_wr* API     : OFF"]
    if not perf.server:
        lines.append(f" TX depth        : {a.tx_depth}")
    if perf.verb == "send" and perf.server:
        lines.append(f" RX depth        : {a.rx_depth}")
    if not perf.lat:
        lines.append(f" CQ Moderation   : {a.cq_mod}")
    lines += [f" Mtu             : {mtu_to_bytes(perf.curr_mtu)}[B]",
              " Link type       : Ethernet",
              f" GID index       : {a.gid_index}"]
    if perf.verb in ("read", "atomic"):
        lines.append(f" Outstand reads  : {perf.out_reads}")
    else:
        lines.append(f" Max inline data : {a.inline_size}[B]")
    if a.rdma_cm:
        lines += [" rdma_cm QPs\t : ON", " Data ex. method : rdma_cm"]
        if perf.server:
            lines += [RESULT_LINE.rstrip("\n"), " Waiting for client rdma_cm QP to connect",
                      " Please run the same command with the IB/RoCE interface IP"]
    else:
        lines += [" rdma_cm QPs\t : OFF", " Data ex. method : Ethernet"]
    lines.append(RESULT_LINE)
    print("\n".join(lines))


def print_dest(perf: Perf, d: Dest, side: str) -> None:
    s = f" {side} address: LID {cx(d.lid, 4)} QPN {cx(d.qpn, 6)} PSN {cx(d.psn, 6)}"
    if perf.verb == "read":
        s += f" OUT {cx(d.out_reads, 4)}"
    if perf.verb in ("read", "write"):
        s += f" RKey {cx(d.rkey, 8)} VAddr {cx(d.vaddr, 16)}"
    print(s)
    print(" GID: " + ":".join(f"{b:02d}" for b in d.gid))


def print_bw_header(perf: Perf) -> None:
    print(RESULT_LINE)
    print(RESULT_FMT_G if perf.a.report_gbits else RESULT_FMT)


def print_bw_report(perf: Perf, r: BwReport) -> None:
    gbs = perf.a.report_gbits
    if gbs and r.bw_avg < 0.1:
        print(f" {r.size:<7d}    {r.iters:<d}           {r.bw_peak:<7.6f}            "
              f"{r.bw_avg:<7.6f}            {r.msg_rate:<7.6f}")
    else:
        print(f" {r.size:<7d}    {r.iters:<10d}       {r.bw_peak:<7.2f}            "
              f"{r.bw_avg:<7.2f}\t\t   {r.msg_rate:<7.6f}")


def bw_report(perf: Perf, size: int, n: int, tposted: list[float], tcompleted: list[float],
              cq_mod: int, no_peak: bool, t_total: float | None = None) -> BwReport:
    """print_report_bw: MB/s are MiB (0x100000) per second, Gb/s 10^9 bits."""
    factor = 125000000 if perf.a.report_gbits else 0x100000
    if t_total is None:
        t_total = (tcompleted[n - 1] - tposted[0]) if n else 0.0
    t_total = max(t_total, 1e-9)
    bw_avg = size * n / t_total / factor
    rate = n / t_total / 1e6
    peak = 0.0
    if not no_peak and n:
        opt = compute_peak(tposted, tcompleted, n, cq_mod)
        peak = size / max(opt, 1e-12) / factor
    return BwReport(size, n, peak, bw_avg, rate)


def print_lat_header() -> None:
    print(RESULT_LINE)
    print(RESULT_FMT_LAT)


def print_lat_report(perf: Perf, size: int, iters: int, tposted: list[float]) -> None:
    """print_report_lat: the gaps between consecutive posts, / 2 for ping-pongs."""
    rtt = 1 if perf.verb in ("read", "atomic") else 2
    cnt = iters - 1
    delta = sorted((tposted[i + 1] - tposted[i]) * 1e6 / rtt for i in range(cnt))
    cnt -= LAT_MEASURE_TAIL
    if cnt < 1:
        cnt = 1
    median = (delta[cnt // 2] + delta[cnt // 2 - 1]) / 2 if (cnt - 1) % 2 else delta[cnt // 2]
    avg = sum(delta[:cnt]) / cnt
    stdev = math.sqrt(sum((avg - d) ** 2 for d in delta[:cnt]) / cnt)
    i99 = min(math.ceil(cnt * 0.99), len(delta) - 1)
    i999 = min(math.ceil(cnt * 0.999), len(delta) - 1)
    tmax = delta[min(cnt, len(delta) - 1)]
    print(f" {size:<7d} {iters:d}          {delta[0]:<7.2f}        {tmax:<7.2f}      "
          f"{median:<7.2f}  \t       {avg:<7.2f}     \t{stdev:<7.2f}\t\t{delta[i99]:<7.2f} "
          f"\t\t{delta[i999]:<7.2f}")


def print_checks(perf: Perf) -> None:
    for m in perf.check_msgs:
        print(f" Data check      : OK, {m}")
