"""``softrdma exec`` beyond the core objects (softrdma.exec.misc, softrdma.exec.extended):
libibverbs' pure functions answered exactly as Debian's libibverbs answers them, the GID
and P_Key queries, the extended context slots (ibv_devinfo), and perftest's binaries run
end to end on softrdma. Real binaries only, each process under ``softrdma exec``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from .exec_pair import device_up, exec_argv, pair, tcp_port

PROBE = str(Path(__file__).parent / "programs" / "exec_abi_probe.py")
IP = "127.0.2.10"  # these tests' own device addresses (helper 2's range of loopback)
SERVER_IP, CLIENT_IP = "127.0.2.11", "127.0.2.12"


def _run(*argv: str, env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _exec(*argv: str, addr: str = IP, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess:
    return _run(sys.executable, "-m", "softrdma", "exec", "--addr", addr, "--", *argv,
                env=env, timeout=timeout)


def _probe_json(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_pure_functions_answer_what_debians_libibverbs_answers():
    """The enum strings (ibv_wc_status_str ... over every value and beyond), the rate
    tables both ways, ibv_get_sysfs_path (SYSFS_PATH with its trailing slashes), the
    path-record, AH and QP attribute conversions from the kernel's structures (what is
    copied, what is left alone) and the fork state machine (a range call before
    ibv_fork_init makes it EINVAL; after it, ENABLED; RDMAV_FORK_SAFE enables it when
    the device list initialises the library): the
    same calls from the same probe, once into the real libibverbs.so.1 without softrdma,
    once into the preload library under ``softrdma exec``, give the same answers."""
    env = {"SYSFS_PATH": "/tmp/sysfs-of-the-probe//"}
    for order in ("range-first", "init-first", "fork-safe"):
        if order == "fork-safe":  # initialisation (the device list) enables it
            env["RDMAV_FORK_SAFE"] = "1"
        real = _probe_json(_run("/usr/bin/python3", PROBE, "pure", "real", order, env=env))
        ours = _probe_json(_exec("/usr/bin/python3", PROBE, "pure", "ours", order, env=env))
        assert ours == real, order
        if order == "init-first":
            assert real["fork"] == [0, 0, 1, 0, 0, 0, 1]  # DISABLED, 0, ENABLED, ...
    assert real["fork"] == [0, True, 1, 0]
    assert real["sysfs"] == "/tmp/sysfs-of-the-probe"


def test_gid_entries_table_and_pkeys_are_the_devices():
    """ibv_query_gid_ex / ibv_query_gid_table (verbs.h's inlines over _ibv_query_gid_ex
    and _ibv_query_gid_table) give the device's two RoCE v2 GIDs with the netdev they
    sit on (127/8: lo), and the kernel's errors: EINVAL for a bad port, index, flag or
    a too short entry, ENODATA for an empty entry, -EINVAL for a table that does not
    fit; a longer entry's tail is zeroed. ibv_query_pkey / ibv_get_pkey_index read the
    default P_Key table (0xffff, then zeros; -1 past its end). Bad pointers are errors."""
    out = _probe_json(_exec("/usr/bin/python3", PROBE, "device"))
    lo = socket.if_nametoindex("lo")
    mapped = "00000000000000000000ffff7f00020a"  # ::ffff:127.0.2.10
    gid0 = out["gid_ex 1 0 0 32"]
    assert gid0[0] == 0 and gid0[1].startswith("fe80") and gid0[2:] == [0, 1, 2, lo]
    assert out["gid_ex 1 1 0 32"] == [0, mapped, 1, 1, 2, lo]
    assert out["gid_ex 1 2 0 32"] == [61]  # ENODATA
    for bad in ("1 5000 0 32", "2 0 0 32", "1 1 1 32", "1 1 0 16"):
        assert out[f"gid_ex {bad}"] == [22], bad
    assert out["gid_ex long"] == [0, "00" * 32]
    assert out["table 8 0"] == [2, gid0[1:], [mapped, 1, 1, 2, lo]]
    assert out["table 2 0"] == out["table 8 0"]
    assert out["table 1 0"] == [-22] and out["table 8 1"] == [-22]
    assert out["pkey"] == [[0, 0xFFFF], [0, 0], [0, 0], [-1, 0], [-1, 0]]
    assert out["pkey_index"] == [0, 1, -1]
    # ibv_resolve_eth_l2_from_gid: a destination of this host is reached through the
    # loopback device (no MAC, no VLAN); an off-link one through the default gateway's
    # ARP entry (or EHOSTUNREACH without one); an empty source GID is EINVAL, a bad port
    # ibv_query_gid's -1
    local, offlink, empty, badport = out["eth_l2"]
    assert local == [0, "000000000000", 0xFFFF]
    gateway = _gateway_mac()
    assert offlink == ([0, gateway, 0xFFFF] if gateway else [-113, "aa" * 6, 0])
    assert empty == [-22, "aa" * 6, 0] and badport == [-1, "aa" * 6, 0]
    # pointers softrdma never handed out: NULL from ibv_qp_to_qp_ex, EINVAL (as an errno
    # return, -EINVAL from the table, -1 from ibv_get_pkey_index), never a crash;
    # ibv_query_qp_data_in_order has no error to give (0: "not in order")
    assert out["bad"] == [None, None, 22, 22, 22, 0, 22, 22, -22, -1]


def _gateway_mac() -> str | None:
    """The MAC of the default route's gateway in the kernel's ARP table, if any."""
    with open("/proc/net/route") as f:
        gws = [ln.split()[2] for ln in f.readlines()[1:] if ln.split()[1] == "00000000"]
    if not gws:
        return None
    gw = socket.inet_ntoa(bytes.fromhex(gws[0])[::-1])
    with open("/proc/net/arp") as f:
        for ln in f.readlines()[1:]:
            if ln.split()[0] == gw and int(ln.split()[2], 16) & 2:
                return ln.split()[3].replace(":", "")
    return None


def test_ibv_devinfo_reads_the_extended_device_and_port_attributes():
    """ibv_devinfo -v calls ibv_query_device_ex (the context's query_device_ex slot) and
    verbs.h's inline ibv_query_port (the query_port slot): the extended attributes carry
    the capability flags (device_cap_flags_ex is device_cap_flags plus bits 38-40, FLUSH
    global and persistent and ATOMIC WRITE, as 6.12's rxe reports them; the legacy
    fallback leaves 0) and the port is active, with the device's GIDs."""
    r = _exec("ibv_devinfo", "-v")
    assert r.returncode == 0, r.stderr
    fields = {}
    for line in r.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        fields.setdefault(key, value.strip())
    flags = int(fields["device_cap_flags"], 16)
    assert flags != 0 and int(fields["device_cap_flags_ex"], 16) == flags | (7 << 38)
    assert fields["state"] == "PORT_ACTIVE (4)"
    assert "::ffff:127.0.2.10, RoCE v2" in r.stdout


# ---- the extended verbs ---------------------------------------------------------------

def test_pyverbs_drives_the_extended_cq_qp_and_memory_windows():
    """Debian's compiled pyverbs, whose CQEX/QPEx are verbs.h's inlines over the slots:
    ibv_create_cq_ex (a timestamp CQ is EOPNOTSUPP, as rxe), ibv_create_qp_ex and the
    ibv_wr_* builders (SEND with an SGE, SEND_WITH_IMM with inline data copied at the
    call, one batch of RDMA WRITE_WITH_IMM, READ, FETCH_ADD and CMP_SWP), ibv_start_poll
    / ibv_next_poll and the read_* slots (immediate data in network order), ENOSPC for
    inline data past the limit, and both kinds of memory window (type 2 bound by
    ibv_wr_bind_mw and by ibv_post_send's IBV_WR_BIND_MW, type 1 by ibv_bind_mw with its
    rkey moved) admitting a write inside and refusing one outside; a UD send addressed by
    ibv_wr_set_ud_addr. What rxe lacks is
    answered as rxe answers it: ibv_query_ece/ibv_set_ece EOPNOTSUPP,
    ibv_query_qp_data_in_order 0."""
    prog = str(Path(__file__).parent / "programs" / "exec_pyverbs_ext.py")
    out = _probe_json(_exec("/usr/bin/python3", prog, addr="127.0.2.40"))
    assert out["ts_cq"] == 95  # EOPNOTSUPP
    assert out["query_ece"] == out["set_ece"] == 95 and out["data_in_order"] == 0
    # [wr_id, status, opcode, byte_len, wc_flags, imm_data]
    assert out["send_cqes"] == [[1, 0, 0, 25, 0, None], [2, 0, 0, 12, 2, 0]]
    assert out["recv_cqes"] == [[100, 0, 128, 25, 1, None], [101, 0, 128, 12, 3, 0x78563412]]
    assert out["recv_data"] == ["hello through ibv_wr_send", "inline bytes"]
    assert out["batch_cqes"] == [[3, 0, 1, 7, 2, 0], [4, 0, 2, 7, 0, None],
                                 [5, 0, 4, 8, 0, None], [6, 0, 3, 8, 0, None]]
    assert out["imm_cqe"] == [[200, 0, 129, 7, 3, 0xFECA0000]]
    assert out["batch_data"] == ["written", "read me", 40, 42, 7, 99]
    assert out["list_cqes"] == [[16, 0, 0, 12, 0, None], [17, 0, 0, 6, 0, None],
                                [400, 0, 128, 12, 1, None], [401, 0, 128, 6, 1, None]]
    assert out["list_data"] == ["first+second", "inline"]  # ibv_wr_set_sge_list / _inline_data_list
    assert out["complete_too_long"] == 28  # ENOSPC
    assert out["mw1_rkey_moved"] is True
    assert out["bind_cqes"] == [[8, 0, 5, 0, 0, None], [9, 0, 5, 0, 0, None],
                                [13, 0, 5, 0, 0, None]]  # IBV_WC_BIND_MW
    assert out["mw_write_cqes"] == [[10, 0, 1, 8, 0, None], [11, 0, 1, 8, 0, None],
                                    [14, 0, 1, 8, 0, None]]
    assert out["mw_data"] == ["via mw2!", "via mw1!", "via mw2!"]
    assert out["mw_outside_cqe"] == [[12, 10, 1, 8, 0, None]]  # IBV_WC_REM_ACCESS_ERR
    # UD through ibv_wr_set_ud_addr: the datagram after its 40-byte GRH
    assert out["ud_send_cqe"] == [[15, 0, 0, 16, 0, None]]
    assert out["ud_recv_cqe"] == [[300, 0, 128, 56, 1, None]]
    assert out["ud_data"] == "datagram by wr_*"


def _pair(argv: list[str], port: int, server_ip: str, client_ip: str,
          rdma_cm: bool = False) -> tuple[subprocess.CompletedProcess, ...]:
    """A server and a client of the same binary, each under softrdma exec. The client
    starts once the server listens on its TCP port (their out-of-band exchange); with
    ``rdma_cm`` once the server's device is up. A client that came before the server's
    rdma_listen is rejected at once: then both start again (a few times at most; the
    rejected perftest client gives up and its server waits for ever for its data
    connection, so that server is killed at once -- perftest's, see docs/exec.md)."""
    rejected = lambda r: rdma_cm and ("Unexpected CM event" in r.stdout + r.stderr  # noqa: E731
                                      or "REJECTED" in r.stdout + r.stderr)
    for attempt in range(5 if rdma_cm else 1):
        ready = device_up(server_ip, 0.5 * (attempt + 1)) if rdma_cm else tcp_port(port)
        client, server = pair(exec_argv(server_ip, *argv), exec_argv(client_ip, *argv, server_ip),
                              ready, abandon=rejected)
        said = client.stdout + client.stderr
        if rejected(client):
            continue
        return server, client
    raise AssertionError(f"{argv[0]}: the client was rejected every time: {said}")


def test_ibv_rc_pingpong_with_the_new_post_send_api():
    """ibv_rc_pingpong -N creates its QP with ibv_create_qp_ex (IBV_QP_EX_WITH_SEND)
    and sends with ibv_wr_start / ibv_wr_send / ibv_wr_set_sge / ibv_wr_complete; -e
    also waits on completion events: both ends finish their exchanges. With -t it asks
    ibv_query_device_ex for a completion timestamp mask, which rxe (and softrdma) does
    not have, and says so."""
    argv = ["ibv_rc_pingpong", "-d", "softrdma0", "-g", "1", "-p", "18551", "-n", "5", "-N",
            "-e", "-s", "64"]
    server, client = _pair(argv, 18551, "127.0.2.41", "127.0.2.42")
    assert server.returncode == 0 and client.returncode == 0, server.stderr + client.stderr
    assert "5 iters in" in server.stdout and "5 iters in" in client.stdout
    r = _exec("ibv_rc_pingpong", "-d", "softrdma0", "-t", "-p", "18552", addr="127.0.2.43")
    assert "The device isn't completion timestamp capable" in r.stdout + r.stderr


# ---- perftest ---------------------------------------------------------------------------

def _perftest(prog: str, port: int, *args: str) -> str:
    argv = [prog, "-d", "softrdma0", "-p", str(port), *args]
    server, client = _pair(argv, port, SERVER_IP, CLIENT_IP, rdma_cm="-R" in args)
    assert client.returncode == 0, client.stdout + client.stderr
    assert server.returncode == 0, server.stdout + server.stderr
    # the client always prints the result table (a passive READ/atomic server does not)
    assert "#bytes" in client.stdout, client.stdout
    return client.stdout


def _result_row(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    i = max(n for n, line in enumerate(lines) if line.strip().startswith("#bytes"))
    return lines[i + 1].split()


def test_perftest_bandwidth_tests_finish_with_their_result_table():
    """perftest 4.5's ib_write_bw, ib_send_bw, ib_read_bw and ib_atomic_bw, server and
    client each under softrdma exec (the old post-send path perftest takes on a device
    it does not know; CQs through ibv_create_cq_ex where perftest asks for it): every
    run exits 0 and prints its result row for the requested iterations."""
    for n, (prog, size) in enumerate((("ib_write_bw", "65536"), ("ib_send_bw", "65536"),
                                      ("ib_read_bw", "65536"), ("ib_atomic_bw", "8"))):
        row = _result_row(_perftest(prog, 18560 + n, "-n", "50"))
        assert row[:2] == [size, "50"], row


def test_perftest_latency_tests_finish_with_their_result_table():
    """ib_write_lat, ib_send_lat, ib_read_lat and ib_atomic_lat (ping-pong through
    busy polling, or RDMA READ/atomic round trips): each exits 0 with its latency row."""
    for n, (prog, size) in enumerate((("ib_write_lat", "2"), ("ib_send_lat", "2"),
                                      ("ib_read_lat", "2"), ("ib_atomic_lat", "8"))):
        row = _result_row(_perftest(prog, 18570 + n, "-n", "20"))
        assert row[:2] == [size, "20"], row


def test_perftest_with_four_qps():
    """ib_write_bw -q 4: four QPs per side, all over one device and its CQ."""
    row = _result_row(_perftest("ib_write_bw", 18580, "-n", "50", "-q", "4"))
    assert row[0] == "65536" and int(row[1]) == 200, row  # 4 QPs x 50 iterations


def test_perftest_connected_by_librdmacm():
    """ib_write_bw -R and ib_send_lat -R: the QPs connected by librdmacm (rdma_cm QPs:
    ON) instead of perftest's TCP exchange, on softrdma's CM."""
    out = _perftest("ib_write_bw", 18590, "-n", "50", "-R")
    assert "rdma_cm QPs	 : ON" in out
    assert _result_row(out)[:2] == ["65536", "50"]
    assert _result_row(_perftest("ib_send_lat", 18591, "-n", "20", "-R"))[:2] == ["2", "20"]


def test_perftest_transports_srq_events_and_both_directions():
    """perftest's other paths: UD sends (-c UD: AHs, GRH room in each receive), an SRQ
    with completion events (--use-srq -e: ibv_get_cq_event on the channel), UC writes in
    both directions at once (-c UC -b)."""
    assert _result_row(_perftest("ib_send_bw", 18583, "-n", "20", "-c", "UD"))[1] == "20"
    assert _result_row(_perftest("ib_send_bw", 18584, "-n", "20", "--use-srq", "-e"))[1] \
        == "20"
    assert _result_row(_perftest("ib_write_bw", 18585, "-n", "20", "-c", "UC", "-b"))[1] \
        == "20"
