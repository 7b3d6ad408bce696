"""The tests' main programs (perftest's write_bw.c, send_bw.c, read_bw.c, atomic_bw.c and
the _lat ones): connect, exchange, run the loops, print the tables, in perftest's order."""

from __future__ import annotations

import argparse

from ...verbs_api import SGE, RecvWR
from ..common import open_device, resolve, tcp_connect, tcp_listen
from . import check, loops, report
from .cm import CmLink
from .communication import BwReport, Dest, PerftestComm
from .parameters import check_device, force_dependencies, set_mtu
from .report import RESULT_LINE
from .resources import Perf, cache_line_size, page_size

__all__ = ["run"]


def run(a: argparse.Namespace) -> int:
    force_dependencies(a)
    server = a.servername is None
    peer = resolve(a.servername) if a.servername else None
    dev = open_device(a.ib_dev, a.addr, peer=peer, mtu=None)
    perf: Perf | None = None
    try:
        check_device(a, dev)
        if a.rdma_cm:
            perf = Perf(a, dev, server)
            run_rdma_cm(a, perf, server, peer)
            if a.counters:
                for k, v in dev.counters.as_dict().items():
                    print(f"{k}: {v}")
            return 0
        if server:
            print("\n************************************\n* Waiting for client to connect... *\n"
                  "************************************", flush=True)
            ls = tcp_listen(dev.ip, a.port)
            try:
                conn, _ = ls.accept()
            finally:
                ls.close()
        else:
            conn = tcp_connect(peer, a.port, timeout=5.0)
        perf = Perf(a, dev, server)
        perf.tcp = conn
        comm = PerftestComm(conn, client=not server, pump=perf.pump)
        perf.comm = comm
        try:
            run_test(a, perf, comm, server)
        finally:
            comm.close()
        if a.counters:
            for k, v in dev.counters.as_dict().items():
                print(f"{k}: {v}")
        return 0
    finally:
        if perf is not None:
            perf.close()
        dev.detach()


def run_rdma_cm(a: argparse.Namespace, perf: Perf, server: bool, peer: str | None) -> None:
    """-R: the exchange on an rdma_cm connection, the test's QPs connected by rdma_cm."""
    link = CmLink(perf, server, peer, a.port)
    perf.link = link
    try:
        if server:
            print("\n************************************\n* Waiting for client to connect... *\n"
                  "************************************", flush=True)
            comm = link.control_accept()
        else:
            comm = link.control_connect()
        perf.comm = comm
        run_test(a, perf, comm, server, link)
    finally:
        link.close()


def run_test(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool,
             link: CmLink | None = None) -> None:
    comm.exchange_versions()
    cycle_buffer, cache_line = comm.check_sys_data(page_size(), cache_line_size())
    curr_mtu = comm.check_mtu(set_mtu(perf.dev, a.mtu))
    out_reads = 1
    if a.verb in ("read", "atomic"):
        mx = perf.dev.limits.max_qp_rd_atom
        out_reads = mx if not a.outs or a.outs <= 0 or a.outs > mx else a.outs
    buff = max(a.size, cycle_buffer)
    my = perf.setup(a.size, buff, cycle_buffer, cache_line, curr_mtu, out_reads,
                    make_qps=link is None)
    if link is not None:
        link.connect_data(comm)  # create_rdma_cm_connection
        my = perf.make_dests()
    report.print_test_info(perf)
    if a.duration and not server:
        print(" WARNING: BW peak won't be measured in this run.")
    sizes = [1 << i for i in range(1, 24)] if a.all else [a.size]
    if a.lat:
        lat(a, perf, comm, server, my, sizes)
    elif a.verb == "send":
        send_bw(a, perf, comm, server, my, sizes)
    else:
        rdma_bw(a, perf, comm, server, my, sizes)
    report.print_checks(perf)


def keys_connect_print(perf: Perf, comm: PerftestComm, my: list[Dest], single_before: bool,
                        single_after_connect: bool) -> list[Dest]:
    """The handshakes that carry the keys, the connection of the QPs and the address lines."""
    if single_before:
        comm.hand_shake(my[0])  # "shaking hands and gather the other side info" (lat tests)
    rem = [comm.hand_shake(d) for d in my]
    if perf.a.rdma_cm:
        perf.rem = rem  # rdma_cm connected the QPs; no ctx_connect, no GID type check
    else:
        perf.connect(rem)
    if single_after_connect:
        comm.hand_shake(my[0])  # send_bw's handshake after ctx_connect
    for d in my:
        report.print_dest(perf, d, "local")
    for i, d in enumerate(my):
        r = comm.hand_shake(d)
        report.print_dest(perf, r, "remote")
    return rem


def rdma_bw(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool,
                 my: list[Dest], sizes: list[int]) -> None:
    """write_bw.c / read_bw.c / atomic_bw.c, not duplex."""
    keys_connect_print(perf, comm, my, False, False)
    comm.hand_shake(my[0])  # "An additional handshake is required after moving qp to RTR"
    report.print_bw_header(perf)
    if server:
        comm.hand_shake(my[0])  # the server waits here for the client to finish
        rep = comm.xchg_bw_reports(BwReport())
        report.print_bw_report(perf, rep)
        if a.check and perf.verb in ("write", "atomic"):
            check.check_remote_region(perf, rep.size, rep.iters)
        comm.close_connection(my[0])
        print(RESULT_LINE)
        return
    rep = BwReport()
    for size in sizes:
        rep = loops.run_bw_client(perf, size, a.iters, a.duration)
        report.print_bw_report(perf, rep)
        if a.check and perf.verb == "read":
            check.check_read_data(perf, size)
    print(RESULT_LINE)
    comm.hand_shake(my[0])
    comm.xchg_bw_reports(rep)
    comm.close_connection(my[0])


def send_bw(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool,
                 my: list[Dest], sizes: list[int]) -> None:
    """send_bw.c, not duplex: both sides measure, nobody exchanges reports."""
    keys_connect_print(perf, comm, my, False, True)
    report.print_bw_header(perf)
    iters = 0 if a.duration else a.iters
    for size in sizes:
        if server:
            perf.post_recvs(size, iters)
        comm.hand_shake(my[0])  # every receive is posted before the first send
        if server:
            rep = loops.run_bw_server_send(perf, size, a.iters, bool(a.duration))
        else:
            rep = loops.run_bw_client(perf, size, a.iters, a.duration)
        report.print_bw_report(perf, rep)
        if server and a.check:
            check.check_remote_region(perf, size, rep.iters)
        if a.all:
            comm.hand_shake(my[0])
    print(RESULT_LINE)
    comm.close_connection(my[0])


def lat(a: argparse.Namespace, perf: Perf, comm: PerftestComm, server: bool,
             my: list[Dest], sizes: list[int]) -> None:
    """write_lat.c, read_lat.c, atomic_lat.c, send_lat.c."""
    keys_connect_print(perf, comm, my, True, False)
    if perf.verb == "send":
        n = min(a.rx_depth, a.iters)
        rsge = SGE(perf.mr.buf + perf.buff, perf.buff, perf.mr.lkey)
        for _ in range(n):
            perf.qps[0].post_recv(RecvWR(1, sg=[rsge]))
        perf.recv_left = a.iters * len(sizes) - n
    comm.hand_shake(my[0])  # after RTR (send: receives posted)
    if perf.verb in ("read", "atomic") and server:
        comm.close_connection(my[0])  # the server waits here while the client reads
        print(RESULT_LINE)
        return
    report.print_lat_header()
    for size in sizes:
        if perf.verb == "write":
            tp = loops.run_lat_write(perf, size, a.iters)
        elif perf.verb == "send":
            tp = loops.run_lat_send(perf, size, a.iters)
        else:
            tp = loops.run_lat_read(perf, size, a.iters)
        report.print_lat_report(perf, size, a.iters, tp)
    print(RESULT_LINE)
    if perf.verb == "write":
        return  # write_lat.c ends without ctx_close_connection
    comm.close_connection(my[0])
