"""``softrdma perf``: every test between two real processes on loopback with the data checked,
and its out-of-band exchange against the bytes Debian 12's perftest 4.5 put on the wire
(pcaps/linux-rxe/with-oob), in both roles.

The exchange tests replay one side of a capture to a real ``softrdma perf`` process: a tiny
fake peer sends the captured records verbatim (version "6.06", page and cache-line size, MTU,
the reports, "done"), except the 108-byte key records, whose QPN/PSN/rkey/address/GID are
rewritten to a real QP in the test process, so the RDMA traffic between the handshakes
happens for real (perftest's data phase: writes, reads, atomics, sends, the write_lat
counter-byte ping-pong). It records what softrdma sends and compares it record by record
with what the real tool sent in the capture.
"""

from __future__ import annotations

import itertools
import random
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from softrdma.tools.perf.resources import cache_line_size, page_size, pattern
from softrdma.tools.perf.communication import HANDSHAKES, Dest, version_value

ROOT = Path(__file__).resolve().parent.parent
OOB = ROOT / "pcaps" / "linux-rxe" / "with-oob"
SOFT = [sys.executable, "-m", "softrdma"]
CAP_SERVER, CAP_CLIENT = "10.77.0.11", "10.77.0.12"

_ports = itertools.count(20515)
_ips = (f"127.0.0.{i}" for i in itertools.count(60))

KEY_RE = re.compile(rb"^([0-9a-f]{4}):([0-9a-f]{4}):([0-9a-f]{6}):([0-9a-f]{6}):([0-9a-f]{8}):"
                    rb"([0-9a-f]{16}):((?:[0-9a-f]{2}:){16})([0-9a-f]{8}):\0$")
REPORT_RE = re.compile(r"^ (\d+)\s+(\d+)\s+(\d+\.\d\d(?:\d{4})?)\s+(\d+\.\d\d(?:\d{4})?)\s+(\d+\.\d{6})$")
LAT_RE = re.compile(r"^ (\d+)\s+(\d+)" + r"\s+(\d+\.\d\d)" * 7 + r"\s*$")


def _addr_line(side: str, rdma: bool, read: bool) -> re.Pattern[str]:
    extra = (r" OUT 0x[0-9a-f]{2}" if read else "") + \
        (r" RKey 0x[0-9a-f]{6,8} VAddr 0x[0-9a-f]{14}" if rdma else "")
    return re.compile(rf"^ {side} address: LID 0000 QPN 0x[0-9a-f]{{4,6}} PSN (?:0x[0-9a-f]{{4,6}}|000000)"
                      rf"{extra}$")


# -- two softrdma processes --------------------------------------------------------------------

def _pair(verb: str, args: list[str], sargs: tuple = (), cargs: tuple = (), ips=None):
    ips = ips or _ips
    srv_ip, cli_ip, port = next(ips), next(ips), str(next(_ports))
    srv = subprocess.Popen(SOFT + ["perf", verb, *args, *sargs, "--addr", srv_ip, "-p", port],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cli = subprocess.run(SOFT + ["perf", verb, *args, *cargs, "--addr", cli_ip, "-p", port,
                                     srv_ip], capture_output=True, text=True, timeout=90)
        out, err = srv.communicate(timeout=60)
    finally:
        srv.kill()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert srv.returncode == 0, out + err
    return cli.stdout, out, (cli_ip, srv_ip)


def _report_lines(out: str, rx: re.Pattern[str]) -> list[re.Match[str]]:
    return [m for m in (rx.match(ln) for ln in out.splitlines()) if m]


@pytest.mark.parametrize("verb,extra", [
    ("write", []), ("send", []), ("read", []), ("atomic", []),
    ("atomic", ["-A", "CMP_AND_SWAP"]), ("write", ["-q", "2", "-s", "3000"]),
])
def test_bw_between_two_processes(verb, extra):
    cli, srv, (cli_ip, srv_ip) = _pair(verb, ["-n", "200", "--check", *extra])
    title = {"write": "RDMA_Write", "send": "Send", "read": "RDMA_Read", "atomic": "Atomic"}[verb]
    if verb == "atomic":
        title += " " + (extra[1] if extra else "FETCH_AND_ADD")
    nq = 2 if "-q" in extra else 1
    for out, me, peer in ((cli, cli_ip, srv_ip), (srv, srv_ip, cli_ip)):
        lines = out.splitlines()
        assert f"                    {title} BW Test" in lines
        assert f" Number of qps   : {nq}\t\tTransport type : IB" in lines
        assert " Link type       : Ethernet" in lines and " GID index       : 1" in lines
        loc = _addr_line("local", verb in ("write", "read"), verb == "read")
        rem = _addr_line("remote", verb in ("write", "read"), verb == "read")
        assert sum(bool(loc.match(ln)) for ln in lines) == nq
        assert sum(bool(rem.match(ln)) for ln in lines) == nq
        gid = lambda ip: " GID: 00:00:00:00:00:00:00:00:00:00:255:255:" + \
            ":".join(f"{int(x):02d}" for x in ip.split("."))
        assert gid(me) in lines and gid(peer) in lines
        assert (" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   "
                "MsgRate[Mpps]") in lines
        reps = _report_lines(out, REPORT_RE)
        assert len(reps) == 1, out
        size = 8 if verb == "atomic" else (3000 if "-s" in extra else 65536)
        assert int(reps[0][1]) == size and int(reps[0][2]) == 200 * nq
        assert float(reps[0][4]) > 0
    # who checks: the server checks what was written, sent or added; the client what it read
    checker = cli if verb == "read" else srv
    assert " Data check      : OK" in checker, checker
    if verb in ("write", "read", "atomic"):  # the server prints the client's report
        assert _report_lines(cli, REPORT_RE)[0].groups() == _report_lines(srv, REPORT_RE)[0].groups()


@pytest.mark.parametrize("verb", ["send", "write", "read", "atomic"])
def test_lat_between_two_processes(verb):
    args = ["-n", "50", "--lat"] + (["--check"] if verb != "atomic" else [])
    cli, srv, _ = _pair(verb, args)
    title = {"write": "RDMA_Write", "send": "Send", "read": "RDMA_Read",
             "atomic": "Atomic FETCH_AND_ADD"}[verb]
    for out in (cli, srv):
        assert f"                    {title} Latency Test" in out.splitlines()
    measured = (cli, srv) if verb in ("send", "write") else (cli,)  # read/atomic: client only
    for out in measured:
        assert any(ln.startswith(" #bytes #iterations    t_min[usec]") for ln in out.splitlines())
        m = _report_lines(out, LAT_RE)
        assert len(m) == 1, out
        size = 8 if verb == "atomic" else 2
        assert int(m[0][1]) == size and int(m[0][2]) == 50
        tmin, tmax, typ = (float(m[0][i]) for i in (3, 4, 5))
        assert 0 < tmin <= typ <= tmax
        if verb != "atomic":
            assert " Data check      : OK" in out
    if verb in ("read", "atomic"):
        assert not _report_lines(srv, LAT_RE)


def test_duration_all_sizes_and_gbits():
    cli, srv, _ = _pair("write", ["-D", "1", "--check", "-s", "8192"])
    rep = _report_lines(cli, REPORT_RE)[0]
    assert int(rep[2]) > 10 and float(rep[3]) == 0.0  # -D: no peak, as perftest
    assert " WARNING: BW peak won't be measured in this run." in cli
    assert " Data check      : OK" in srv
    cli, srv, _ = _pair("send", ["-a", "-n", "5", "--check", "--report_gbits"])
    sizes = [int(m[1]) for m in _report_lines(cli, REPORT_RE)]
    assert sizes == [1 << i for i in range(1, 24)]
    assert len(_report_lines(srv, REPORT_RE)) == 23 and srv.count("Data check      : OK") == 23
    assert "BW peak[Gb/sec]    BW average[Gb/sec]" in cli


# -- the exchange against the captures -----------------------------------------------------------

def _capture(name: str) -> tuple[list[tuple[str, bytes, float]], float]:
    """The TCP payloads of a capture (source, bytes, time) and the time of its first RoCE frame."""
    from softrdma.wire.pcap import read_pcap
    recs, first_roce = [], None
    for r in read_pcap(OOB / name):
        d = r.data
        if d[12:14] != b"\x08\x00":
            continue
        ihl = (d[14] & 15) * 4
        ip = d[14:]
        src = ".".join(str(b) for b in ip[12:16])
        l4 = ip[ihl:]
        t = r.timestamp
        if ip[9] == 17 and struct.unpack("!H", l4[2:4])[0] == 4791:
            first_roce = t if first_roce is None else first_roce
        elif ip[9] == 6:
            total = struct.unpack("!H", ip[2:4])[0]
            payload = l4[(l4[12] >> 4) * 4:total - ihl]
            if payload:
                recs.append((src, bytes(payload), t))
    return recs, first_roce


def test_capture_sizes_and_data_phase_positions():
    """The README's record sizes, and where the RDMA traffic sits among the handshakes."""
    sizes = {"write_bw": [16, 16] + [4] * 4 + [2, 2] + [108] * 8 + [8] * 10 + [108, 108, 5, 5],
             "send_bw": [16, 16] + [4] * 4 + [2, 2] + [108] * 10 + [5, 5],
             "write_lat": [16, 16] + [4] * 4 + [2, 2] + [108] * 8}
    sizes["read_bw"] = sizes["atomic_bw"] = sizes["write_bw"]
    sizes["send_lat"] = sizes["send_bw"]
    for test, want in sizes.items():
        recs, roce = _capture(f"{test}.pcap")
        assert [len(b) for _, b, _ in recs] == want, test
        # client and server alternate, the client first, in every exchange
        assert [s for s, _, _ in recs[:-2]] == [CAP_CLIENT, CAP_SERVER] * ((len(recs) - 2) // 2)
        pre, reports, close = HANDSHAKES[test]
        keys = [i for i, (_, b, _) in enumerate(recs) if len(b) == 108]
        before = [i for i in keys if recs[i][2] < roce]
        assert len(before) == 2 * pre, test
        assert (len(keys) - len(before)) // 2 == (1 if reports else 0) + (1 if close else 0)
        assert any(len(b) == 8 for _, b, _ in recs) == reports
        assert (recs[-1][1] == b"done\0") == close
        assert recs[0][1] == b"6.06" + bytes(12) and version_value(recs[0][1]) == 6.06
        assert recs[2][1] == b"\x00\x00\x10\x00" and recs[4][1] == b"\x00\x00\x00\x40"
        assert recs[6][1] == b"3\0"  # IBV_MTU_1024: rxe on a 1500-byte NIC
        for _, b, _ in recs:
            if len(b) == 108:
                assert KEY_RE.match(b) and Dest.parse(b).encode() == b  # byte for byte


class FakeRdma:
    """The RDMA side of a fake perftest peer: one RC QP in this process, progress thread on."""

    def __init__(self, ip: str, size: int, recvs: int = 0) -> None:
        from softrdma.verbs_api import (
            CQ, MR, PD, QP, SGE, Context, IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_ATOMIC,
            IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE, IBV_QPT_RC, QPAttr, QPCap,
            QPInitAttr, RecvWR, add_device,
        )
        self.ip, self.size = ip, size
        self.dev = add_device(ip, name=f"fake-{ip}")
        self.dev.attach_udp(thread=True)
        self.ctx = Context(name=f"fake-{ip}")
        pd = PD(self.ctx)
        self.buff = max(size, 4096)
        acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
            IBV_ACCESS_REMOTE_ATOMIC
        self.mr = MR(pd, 2 * self.buff, acc)
        self.mr.mem[:self.buff] = pattern(self.buff)  # what it writes and sends
        self.mr.mem[self.buff:] = pattern(self.buff)  # what it lets be read
        self.scq, self.rcq = CQ(self.ctx, 64), CQ(self.ctx, 64)
        self.qp = QP(pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self.scq, rcq=self.rcq,
                                    cap=QPCap(max_send_wr=16, max_recv_wr=16, max_inline_data=64)))
        self.qp.to_init(QPAttr(port_num=1, qp_access_flags=int(acc)))
        for _ in range(recvs):  # perftest's receiver posts before the last handshake
            self.qp.post_recv(RecvWR(1, sg=[SGE(self.mr.buf + self.buff, self.buff, self.mr.lkey)]))
        self.psn = random.getrandbits(24)
        self.rem: Dest | None = None

    def key_record(self, captured: bytes) -> bytes:
        from softrdma.verbs_api import GID
        d = Dest.parse(captured)
        d.qpn, d.psn, d.rkey = self.qp.qp_num, self.psn, self.mr.rkey
        d.vaddr, d.gid = self.mr.buf + self.buff, GID(self.ip).raw
        return d.encode()

    def connect(self, rem: Dest) -> None:
        from softrdma.verbs_api import AHAttr, GlobalRoute, QPAttr
        self.rem = rem
        at = QPAttr(port_num=1, path_mtu=3, dest_qp_num=rem.qpn, rq_psn=rem.psn,
                    max_dest_rd_atomic=128, min_rnr_timer=12, sq_psn=self.psn, timeout=14,
                    retry_cnt=7, rnr_retry=7, max_rd_atomic=128)
        at.ah_attr = AHAttr(is_global=1, port_num=1,
                            gr=GlobalRoute(dgid=rem.gid, sgid_index=1, hop_limit=64))
        self.qp.to_rtr(at)
        self.qp.to_rts(at)

    def _wait(self, cq) -> None:
        deadline = time.monotonic() + 20
        while True:
            n, wcs = cq.poll(1)
            if n:
                assert wcs[0].status == 0, wcs[0]
                return
            assert time.monotonic() < deadline, "no completion"
            time.sleep(0.0005)

    def _post(self, opcode: int, length: int, k: int = 0, remote_off: int = 0) -> None:
        from softrdma.verbs_api import SGE, SendWR, IBV_WR_ATOMIC_FETCH_AND_ADD
        wr = SendWR(wr_id=k, opcode=opcode, sg=[SGE(self.mr.buf, length, self.mr.lkey)])
        if opcode == IBV_WR_ATOMIC_FETCH_AND_ADD:
            wr.set_wr_atomic(self.rem.rkey, self.rem.vaddr + remote_off, 1)
        else:
            wr.set_wr_rdma(self.rem.rkey, self.rem.vaddr + remote_off)
        self.qp.post_send(wr)
        self._wait(self.scq)

    def data_phase(self, test: str, active: bool, server: bool, n: int) -> None:
        """What perftest's side of the test does between the handshakes."""
        from softrdma.verbs_api import (IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ,
                                        IBV_WR_RDMA_WRITE, IBV_WR_SEND)
        size = self.size
        if test.endswith("_bw") and active:
            op = {"write_bw": IBV_WR_RDMA_WRITE, "read_bw": IBV_WR_RDMA_READ,
                  "atomic_bw": IBV_WR_ATOMIC_FETCH_AND_ADD, "send_bw": IBV_WR_SEND}[test]
            for k in range(n):
                self._post(op, size, k, (k * 64) % 4096 if test == "atomic_bw" else 0)
        elif test == "send_bw" and not active:
            for _ in range(n):
                self._wait(self.rcq)
        elif test == "write_lat":  # run_iter_lat_write: the server writes first
            mem = self.mr.mem
            for k in range(1, n + 1):
                if not (server and k == 1):
                    deadline = time.monotonic() + 20
                    while mem[self.buff + size - 1] != (k - 1 if server else k) & 0xFF:
                        assert time.monotonic() < deadline
                        time.sleep(0.0002)
                mem[size - 1] = k & 0xFF
                self._post(IBV_WR_RDMA_WRITE, size)
            if server:
                while mem[self.buff + size - 1] != n & 0xFF:
                    time.sleep(0.0002)
        elif test == "send_lat":  # run_iter_lat_send: the client sends first
            for k in range(n):
                if not (not server and k == 0):
                    self._wait(self.rcq)
                self._post(IBV_WR_SEND, size)
            if not server:
                self._wait(self.rcq)

    def close(self) -> None:
        from softrdma.verbs_api import remove_device
        self.ctx.close()
        self.dev.detach()
        remove_device(f"fake-{self.ip}")


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"softrdma closed the connection after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def _replay(test: str, fake_is_server: bool, sock: socket.socket, fake: FakeRdma) -> list[bytes]:
    """Play the fake side of the capture; return what softrdma sent, record by record."""
    recs, _ = _capture(f"{test}.pcap")
    me = CAP_SERVER if fake_is_server else CAP_CLIENT
    pre = HANDSHAKES[test][0]
    active = not fake_is_server or test in ("write_lat", "send_lat")
    got, keys, done_data = [], 0, False
    for src, rec, _ in recs:
        if keys == 2 * pre and not done_data:
            fake.data_phase(test, active, fake_is_server, 5)
            done_data = True
        if src == me:
            sock.sendall(fake.key_record(rec) if len(rec) == 108 else rec)
        else:
            r = _recv_exact(sock, len(rec))
            got.append(r)
            if len(rec) == 108 and fake.rem is None:
                fake.connect(Dest.parse(r))
        keys += len(rec) == 108
    if not done_data:
        fake.data_phase(test, active, fake_is_server, 5)
    sock.settimeout(20)
    try:
        tail = sock.recv(100)
    except ConnectionResetError:
        tail = b""
    assert tail == b"", f"softrdma sent more than the real tool: {tail!r}"
    return got


CASES = {  # capture -> (verb, softrdma's options: those of the capture's command, and -m 1024)
    "write_bw": ("write", ["-x", "1", "-n", "5", "-s", "4096", "-F", "-m", "1024"]),
    "read_bw": ("read", ["-x", "1", "-n", "5", "-s", "4096", "-F", "-m", "1024"]),
    "send_bw": ("send", ["-x", "1", "-n", "5", "-s", "4096", "-F", "-m", "1024"]),
    "atomic_bw": ("atomic", ["-x", "1", "-n", "5", "-F", "-m", "1024"]),
    "write_lat": ("write", ["--lat", "-x", "1", "-n", "5", "-s", "64", "-F", "-m", "1024"]),
    "send_lat": ("send", ["--lat", "-x", "1", "-n", "5", "-s", "64", "-F", "-m", "1024"]),
}


def _compare(test: str, got: list[bytes], soft_is_client: bool, soft_ip: str) -> None:
    recs, _ = _capture(f"{test}.pcap")
    theirs = [b for s, b, _ in recs if s == (CAP_CLIENT if soft_is_client else CAP_SERVER)]
    assert [len(b) for b in got] == [len(b) for b in theirs]
    assert got[0] == theirs[0] == b"6.06" + bytes(12)
    assert got[1] == struct.pack("!i", page_size()) and got[2] == struct.pack("!i", cache_line_size())
    assert got[3] == theirs[3] == b"3\0"
    keys = [b for b in got if len(b) == 108]
    assert len(set(keys)) == 1  # every handshake after the first resends the same record
    m, ref = KEY_RE.match(keys[0]), KEY_RE.match([b for b in theirs if len(b) == 108][0])
    assert m, keys[0]
    assert m[1] == ref[1] == b"0000" and m[2] == ref[2]  # LID, out_reads (0x80 for read/atomic)
    assert m[8] == ref[8] == b"00000000"  # SRQ number
    gid = bytes(int(x, 16) for x in m[7].split(b":")[:-1])
    assert gid == bytes(10) + b"\xff\xff" + socket.inet_aton(soft_ip)
    if test.startswith("send"):
        assert ref[5] == b"00000000"  # rxe: no rkey for a local-only MR (softrdma gives one)
    reports = [b for b in got if len(b) == 8]
    if reports and soft_is_client:
        size, iters = struct.unpack("!QQ", reports[0] + reports[1])
        peak, avg, rate = (struct.unpack("!d", r)[0] for r in reports[2:5])
        assert size == (8 if test == "atomic_bw" else 4096) and iters == 5
        assert peak > 0 and avg > 0 and rate > 0
    if HANDSHAKES[test][2]:
        assert got[-1] == theirs[-1] == b"done\0"


@pytest.mark.parametrize("test", list(CASES))
def test_softrdma_client_against_replayed_perftest_server(test):
    verb, args = CASES[test]
    fake_ip, soft_ip, port = next(_ips), next(_ips), next(_ports)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((fake_ip, port))
    ls.listen(1)
    size = 8 if verb == "atomic" else int(args[args.index("-s") + 1])
    fake = FakeRdma(fake_ip, size, recvs=5 if verb == "send" else 0)
    check = ["--check"] if test in ("read_bw", "write_lat", "send_lat") else []
    cli = subprocess.Popen(SOFT + ["perf", verb, *args, *check, "--addr", soft_ip, "-p",
                                   str(port), fake_ip],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ls.settimeout(20)
        conn, _ = ls.accept()
        conn.settimeout(20)
        got = _replay(test, True, conn, fake)
        conn.close()
        out, err = cli.communicate(timeout=30)
    finally:
        cli.kill()
        ls.close()
        fake.close()
    assert cli.returncode == 0, out + err
    _compare(test, got, True, soft_ip)
    if check:
        assert " Data check      : OK" in out


@pytest.mark.parametrize("test", list(CASES))
def test_softrdma_server_against_replayed_perftest_client(test):
    verb, args = CASES[test]
    fake_ip, soft_ip, port = next(_ips), next(_ips), next(_ports)
    size = 8 if verb == "atomic" else int(args[args.index("-s") + 1])
    check = [] if test == "read_bw" else ["--check"]
    srv = subprocess.Popen(SOFT + ["perf", verb, *args, *check, "--addr", soft_ip, "-p",
                                   str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fake = FakeRdma(fake_ip, size, recvs=5 if test == "send_lat" else 0)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                sock = socket.create_connection((soft_ip, port), timeout=20,
                                                source_address=(fake_ip, 0))
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        got = _replay(test, False, sock, fake)
        sock.close()
        out, err = srv.communicate(timeout=30)
    finally:
        srv.kill()
        fake.close()
    assert srv.returncode == 0, out + err
    _compare(test, got, False, soft_ip)
    if test in ("write_bw", "read_bw", "atomic_bw"):
        # the server prints the client's report: the captured client's numbers, decoded
        rep = _report_lines(out, REPORT_RE)[0]
        want_size = "8" if test == "atomic_bw" else "4096"
        recs, _ = _capture(f"{test}.pcap")
        vals = [struct.unpack("!d", b)[0] for s, b, _ in recs if s == CAP_CLIENT and len(b) == 8][2:]
        assert rep.groups() == (want_size, "5", f"{vals[0]:.2f}", f"{vals[1]:.2f}", f"{vals[2]:.6f}")
    if check:
        assert " Data check      : OK" in out, out


# -- errors ----------------------------------------------------------------------------------------

def test_unreachable_server_is_one_line():
    r = subprocess.run(SOFT + ["perf", "write", "-p", str(next(_ports)), "--addr", next(_ips),
                               next(_ips)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert re.search(r"^softrdma perf: Couldn't connect to 127\.0\.0\.\d+:\d+$", r.stderr, re.M)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_pingpong_client_against_perf_server():
    """The other exchange: ibv_rc_pingpong's 52-byte record where perftest's version goes."""
    srv_ip, cli_ip, port = next(_ips), next(_ips), str(next(_ports))
    srv = subprocess.Popen(SOFT + ["perf", "write", "--addr", srv_ip, "-p", port],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cli = subprocess.run(SOFT + ["pingpong", "rc", "-a", cli_ip, "-p", port, srv_ip],
                             capture_output=True, text=True, timeout=60)
        out, err = srv.communicate(timeout=30)
    finally:
        srv.kill()
    assert srv.returncode == 1 and cli.returncode == 1
    assert "does not speak perftest's exchange" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in cli.stderr


def test_perf_client_against_a_server_speaking_another_format():
    ip, port = next(_ips), next(_ports)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((ip, port))
    ls.listen(1)
    cli = subprocess.Popen(SOFT + ["perf", "send", "--addr", next(_ips), "-p", str(port), ip],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    conn, _ = ls.accept()
    assert _recv_exact(conn, 16) == b"6.06" + bytes(12)
    conn.sendall(b"0000:000011:a1b2c3:" + b"0" * 32 + bytes(1))  # a pingpong record
    out, err = cli.communicate(timeout=30)
    conn.close()
    ls.close()
    assert cli.returncode == 1
    assert "does not speak perftest's exchange" in err and "Traceback" not in err


def test_old_perftest_is_refused():
    ip, port = next(_ips), next(_ports)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((ip, port))
    ls.listen(1)
    cli = subprocess.Popen(SOFT + ["perf", "read", "--addr", next(_ips), "-p", str(port), ip],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    conn, _ = ls.accept()
    _recv_exact(conn, 16)
    conn.sendall(b"5.60" + bytes(12))
    out, err = cli.communicate(timeout=30)
    conn.close()
    ls.close()
    assert cli.returncode == 1 and "not compatible with versions older than 5.70" in err


# -- -R: rdma_cm (softrdma.tools.perf.cm) -----------------------------------------------------

_cm_ips = (f"127.0.10.{i}" for i in itertools.count(1))


def test_rdma_cm_key_record_is_perftests_56_byte_struct():
    from softrdma.tools.perf.cm import DEST_SIZE, decode_dest, encode_dest
    d = Dest(lid=0, out_reads=16, qpn=0x123456, psn=0xABCDEF, rkey=0xDEADBEEF,
             vaddr=0x7F0012345000, gid=bytes(10) + b"\xff\xff" + bytes([10, 77, 0, 1]), srqn=0)
    raw = encode_dest(d, gid_index=1)
    assert DEST_SIZE == len(raw) == 56
    # lid, out_reads, qpn, psn, rkey as big-endian 32-bit, 4 bytes of padding, vaddr
    # big-endian 64-bit, the GID, srqn, gid_index (rdma_write_keys with HAVE_ENDIAN)
    assert raw[:20] == bytes.fromhex("00000000" "00000010" "00123456" "00abcdef" "deadbeef")
    assert raw[24:32] == bytes.fromhex("00007f0012345000")
    assert raw[32:48] == d.gid and raw[48:56] == bytes.fromhex("00000000" "00000001")
    assert decode_dest(raw) == d


@pytest.mark.parametrize("verb,extra", [
    ("send", []), ("write", []), ("read", []), ("write", ["-q", "2", "-s", "3000"]),
])
def test_rdma_cm_bw_between_two_processes(verb, extra):
    cli, srv, (cli_ip, srv_ip) = _pair(verb, ["-R", "-n", "200", "--check", *extra],
                                       ips=_cm_ips)
    nq = 2 if "-q" in extra else 1
    for out in (cli, srv):
        lines = out.splitlines()
        assert " rdma_cm QPs\t : ON" in lines and " Data ex. method : rdma_cm" in lines
        loc = _addr_line("local", verb in ("write", "read"), verb == "read")
        rem = _addr_line("remote", verb in ("write", "read"), verb == "read")
        assert sum(bool(loc.match(ln)) for ln in lines) == nq
        assert sum(bool(rem.match(ln)) for ln in lines) == nq
        reps = _report_lines(out, REPORT_RE)
        assert len(reps) == 1, out
        assert int(reps[0][1]) == (3000 if "-s" in extra else 65536)
        assert int(reps[0][2]) == 200 * nq and float(reps[0][4]) > 0
    assert " Waiting for client rdma_cm QP to connect" in srv.splitlines()
    # the QPNs each side printed for the other are the ones rdma_cm connected
    qpns = lambda out, side: re.findall(rf"^ {side} address: LID 0000 QPN (0x[0-9a-f]+)", out,
                                        re.M)
    assert qpns(cli, "local") == qpns(srv, "remote") and qpns(srv, "local") == qpns(cli, "remote")
    checker = cli if verb == "read" else srv
    assert " Data check      : OK" in checker, checker
    if verb in ("write", "read"):
        assert _report_lines(cli, REPORT_RE)[0].groups() == _report_lines(srv, REPORT_RE)[0].groups()


def test_rdma_cm_write_lat_between_two_processes():
    cli, srv, _ = _pair("write", ["-R", "-n", "50", "--lat", "--check"], ips=_cm_ips)
    for out in (cli, srv):
        m = _report_lines(out, LAT_RE)
        assert len(m) == 1 and int(m[0][2]) == 50, out
        assert " Data ex. method : rdma_cm" in out and " Data check      : OK" in out


def test_rdma_cm_client_against_a_tcp_server_is_one_line():
    """-R on one side only: nobody accepts the connection (no listener: a REJ, or no answer
    at all); the client tries for 5 s and says so in one line."""
    srv_ip, cli_ip, port = next(_cm_ips), next(_cm_ips), str(next(_ports))
    srv = subprocess.Popen(SOFT + ["perf", "write", "--addr", srv_ip, "-p", port],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        cli = subprocess.run(SOFT + ["perf", "write", "-R", "--addr", cli_ip, "-p", port, srv_ip],
                             capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    finally:
        srv.kill()
        srv.communicate()
    assert cli.returncode == 1, cli.stdout + cli.stderr
    err = cli.stderr.strip()
    assert "rdma_connect" in err and "with -R" in err and "Traceback" not in err
    assert "\n" not in err
    assert took < 20


def test_rdma_cm_wire_sequence_of_read_bw(tmp_path):
    """What a -R ib_read_bw client puts on the wire (the client's capture): the control
    connection's REQ (responder resources and initiator depth 0, retry and RNR retry 7,
    service ID TCP/port), the exchange as SENDs of each record's size (version 16, page
    size 4, cache line 4, MTU 2, a 56-byte zero record), the test QP's REQ (out_reads
    both ways), then the 56-byte records, the five 8-byte reports and the closing record;
    at the end the client disconnects the test QP."""
    from softrdma.cm.messages import parse_cm
    from softrdma.wire.frames import decode_frame
    from softrdma.wire.packet import parse
    from softrdma.wire.pcap import read_pcap
    srv_ip, cli_ip, port = next(_cm_ips), next(_cm_ips), next(_ports)
    args = ["perf", "read", "-R", "-n", "20", "-s", "4096", "-p", str(port)]
    srv = subprocess.Popen(SOFT + args + ["--addr", srv_ip], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        # {name}: the capture of this device only (rdma_cm may open the default device too)
        env = dict(__import__("os").environ, SOFTRDMA_PCAP=str(tmp_path / "{name}.pcap"))
        cli = subprocess.run(SOFT + args + ["--addr", cli_ip, srv_ip], capture_output=True,
                             text=True, timeout=60, env=env)
        srv.communicate(timeout=30)
    finally:
        srv.kill()
    assert cli.returncode == 0 and srv.returncode == 0, cli.stdout + cli.stderr
    seq = []
    for r in read_pcap(tmp_path / f"softrdma-{cli_ip}.pcap"):
        f = decode_frame(r.data, r.linktype)
        p = parse(f.payload)
        if str(f.src) != cli_ip:
            continue
        if p.dest_qp == 1:
            seq.append(parse_cm(bytes(p.payload)))
        elif p.opcode == 4:  # RC SEND_ONLY: the control connection's records
            seq.append(len(p.payload))
    # the REQs that got connected (each followed by our RTU); an attempt made before the
    # server was up goes unanswered and is given up with a REJ, then made again
    seq = [x for i, x in enumerate(seq) if isinstance(x, int) or x.name != "REQ" or
           next((y.name for y in seq[i + 1:] if not isinstance(y, int)), "") == "RTU"]
    cm = [m for m in seq if not isinstance(m, int) and m.name != "REJ"]
    assert [m.name for m in cm][:4] == ["REQ", "RTU", "REQ", "RTU"], [m.name for m in cm]
    ctl, data = cm[0], cm[2]
    assert ctl.service_id == data.service_id == (0x0106 << 16) | port
    assert (ctl.responder_resources, ctl.initiator_depth) == (0, 0)
    assert data.responder_resources == data.initiator_depth > 0
    for m in (ctl, data):
        assert (m.retry_count, m.rnr_retry_count) == (7, 7)
    assert {"DREQ", "DREP"} & {m.name for m in cm[4:]}
    sizes = [x if isinstance(x, int) else x.name for x in seq
             if isinstance(x, int) or x.name == "REQ"]
    assert sizes == ["REQ", 16, 4, 4, 2, 56, "REQ", 56, 56, 56, 56, 56,
                     8, 8, 8, 8, 8, 56], sizes
