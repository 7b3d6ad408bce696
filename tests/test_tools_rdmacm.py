"""``softrdma rping``, ``cmatose`` and ``udaddy`` as real processes on loopback (each
process its own soft device on an address of 127.0.9.0/24), plus their data formats."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest

from softrdma.tools.rping import ping_data
from softrdma.tools.udaddy import ah_attr_from_wc

SOFT = [sys.executable, "-m", "softrdma"]


def _env(ip):
    env = dict(os.environ)
    env["SOFTRDMA_IP"] = ip
    env.pop("SOFTRDMA_PROGRESS", None)
    return env


def _wait_bound(ip, timeout=20.0):
    """Until the server's soft device holds UDP 4791 on ``ip`` (then a moment more for
    its listen)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((ip, 4791))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                time.sleep(0.5)
                return
            raise
        finally:
            s.close()
        time.sleep(0.05)
    raise AssertionError(f"the server never bound {ip}:4791")


def _pair(tool, srv_ip, cli_ip, srv_args, cli_args, timeout=90):
    """Server and client; the server's output goes to files, so a server printing a lot
    (rping -v -S 60000) never blocks on a pipe nobody reads yet."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        srv = subprocess.Popen(SOFT + [tool, *srv_args], env=_env(srv_ip), text=True,
                               stdout=out, stderr=err)
        try:
            _wait_bound(srv_ip)
            cli = subprocess.run(SOFT + [tool, *cli_args], env=_env(cli_ip), text=True,
                                 capture_output=True, timeout=timeout)
            srv.wait(timeout=timeout)
        finally:
            srv.kill()
            srv.wait()
        out.seek(0)
        err.seek(0)
        return cli, SimpleNamespace(returncode=srv.returncode, stdout=out.read(),
                                    stderr=err.read())


# ---- rping ----------------------------------------------------------------------------

def test_ping_data_is_rpings_pattern():
    # rping.c: "rdma-ping-%d: ", then from `start` (65 + ping, wrapping after 122) one
    # character more each byte, wrapping after 122 ('z') to 65 ('A'), NUL at size - 1
    d = ping_data(0, 64)
    assert d == b"rdma-ping-0: " + bytes(range(65, 65 + 50)) + b"\0"
    d = ping_data(57, 30)  # start 122: 'z', then 'A'...
    assert d == b"rdma-ping-57: " + b"zABCDEFGHIJKLMN" + b"\0"
    assert ping_data(58, 30)[14:16] == b"AB"  # start wrapped back to 65
    assert ping_data(3, 26) == b"rdma-ping-3: DEFGHIJKLMNO\0"
    assert len(ping_data(9, 65535)) == 65535 and b"{" not in ping_data(9, 65535)


@pytest.mark.parametrize("size,last", [(26, 1), (64, 2), (1000, 3), (5000, 4), (60000, 5)])
def test_rping_client_and_server(size, last):
    srv_ip, cli_ip = f"127.0.9.{10 + last}", f"127.0.9.{20 + last}"
    port = str(7300 + last)
    cli, srv = _pair("rping", srv_ip, cli_ip,
                     ["-s", "-a", srv_ip, "-p", port, "-S", str(size), "-v"],
                     ["-c", "-a", srv_ip, "-I", cli_ip, "-p", port, "-S", str(size), "-C",
                      "10", "-v", "-V"])
    assert cli.returncode == 0, cli.stderr
    assert srv.returncode == 0, srv.stderr
    want = [ping_data(i, size).split(b"\0")[0].decode() for i in range(10)]
    assert cli.stdout.splitlines() == [f"ping data: {w}" for w in want]
    assert srv.stdout.splitlines() == [f"server ping data: {w}" for w in want]
    assert cli.stdout.splitlines()[3].startswith("ping data: rdma-ping-3: DEFG")
    # the server sees the client's disconnect, as rping reports it
    assert "server DISCONNECT EVENT..." in srv.stderr
    assert "wait for RDMA_READ_ADV state 10" in srv.stderr


def test_rping_wrong_port_is_rejected():
    srv_ip, cli_ip = "127.0.9.31", "127.0.9.32"
    srv = subprocess.Popen(SOFT + ["rping", "-s", "-a", srv_ip, "-p", "7311"],
                           env=_env(srv_ip), text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        _wait_bound(srv_ip)
        cli = subprocess.run(SOFT + ["rping", "-c", "-a", srv_ip, "-p", "7312", "-C", "1"],
                             env=_env(cli_ip), text=True, capture_output=True, timeout=60)
    finally:
        srv.kill()
        srv.wait()
    assert cli.returncode == 1
    # rping: "cma event RDMA_CM_EVENT_REJECTED, error 8" (REJ reason 8: invalid service ID)
    assert cli.stderr.strip() == "softrdma rping: cma event RDMA_CM_EVENT_REJECTED, error 8"
    assert cli.stdout == ""


@pytest.mark.parametrize("argv,needle", [
    (["rping", "-c", "-a", "127.0.9.1", "-S", "25"],
     "Invalid size 25 (valid range is 26 to 65536)"),
    (["rping", "-s", "-S", "65536"], "Invalid size 65536 (valid range is 26 to 65536)"),
    (["rping", "-c", "-a", "127.0.9.1", "-C", "-1"], "Invalid count -1"),
    (["rping", "-a", "127.0.9.1"], "one of -s (server) or -c (client) is required"),
    (["rping", "-c"], "needs the server's address"),
    (["rping", "-s", "-c"], "not allowed with argument"),
    (["udaddy", "-p", "2"], "port space 0x2 is not supported"),
    (["cmatose", "-c", "0"], "-c: 0 is not positive"),
])
def test_usage_errors(argv, needle):
    r = subprocess.run(SOFT + argv, text=True, capture_output=True, timeout=60,
                       env=_env("127.0.9.250"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_help_texts():
    for tool, words in (("rping", ["-S size", "-C count", "validate"]),
                        ("cmatose", ["-c connections", "7471"]),
                        ("udaddy", ["port_space", "7174"])):
        r = subprocess.run(SOFT + [tool, "--help"], text=True, capture_output=True, timeout=60)
        assert r.returncode == 0
        for w in words:
            assert w in r.stdout, (tool, w)


# ---- cmatose and udaddy ---------------------------------------------------------------

def test_cmatose_four_connections():
    srv_ip, cli_ip = "127.0.9.41", "127.0.9.42"
    cli, srv = _pair("cmatose", srv_ip, cli_ip, ["-b", srv_ip, "-c", "4", "-C", "10"],
                     ["-s", srv_ip, "-b", cli_ip, "-c", "4", "-C", "10"])
    assert cli.returncode == 0 and srv.returncode == 0, cli.stdout + srv.stdout + srv.stderr
    assert srv.stdout.splitlines() == [
        "cmatose: starting server", "initiating data transfers", "completing sends",
        "receiving data transfers", "data transfers complete", "cmatose: disconnecting",
        "disconnected", "test complete", "return status 0"]
    assert cli.stdout.splitlines() == [
        "cmatose: starting client", "cmatose: connecting", "receiving data transfers",
        "sending replies", "data transfers complete", "test complete", "return status 0"]


def test_cmatose_rejected_on_wrong_port():
    srv_ip, cli_ip = "127.0.9.43", "127.0.9.44"
    srv = subprocess.Popen(SOFT + ["cmatose", "-b", srv_ip, "-p", "7481"], env=_env(srv_ip),
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_bound(srv_ip)
        cli = subprocess.run(SOFT + ["cmatose", "-s", srv_ip, "-b", cli_ip, "-p", "7482"],
                             env=_env(cli_ip), text=True, capture_output=True, timeout=60)
    finally:
        srv.kill()
        srv.wait()
    assert cli.returncode == 8
    assert cli.stdout.splitlines() == [
        "cmatose: starting client", "cmatose: connecting",
        "cmatose: event: RDMA_CM_EVENT_REJECTED, error: 8", "test complete",
        "return status 8"]


def test_udaddy_two_connections():
    srv_ip, cli_ip = "127.0.9.51", "127.0.9.52"
    cli, srv = _pair("udaddy", srv_ip, cli_ip, ["-b", srv_ip, "-c", "2"],
                     ["-s", srv_ip, "-b", cli_ip, "-c", "2"])
    assert cli.returncode == 0 and srv.returncode == 0, cli.stdout + srv.stdout + srv.stderr
    assert srv.stdout.splitlines() == [
        "udaddy: starting server", "receiving data transfers", "sending replies",
        "data transfers complete", "test complete", "return status 0"]
    assert cli.stdout.splitlines() == [
        "udaddy: starting client", "udaddy: connecting", "initiating data transfers",
        "receiving data transfers", "data transfers complete", "test complete",
        "return status 0"]


def test_udaddy_message_larger_than_mtu():
    srv_ip, cli_ip = "127.0.9.53", "127.0.9.54"
    srv = subprocess.Popen(SOFT + ["udaddy", "-b", srv_ip], env=_env(srv_ip), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_bound(srv_ip)
        cli = subprocess.run(SOFT + ["udaddy", "-s", srv_ip, "-b", cli_ip, "-S", "5000"],
                             env=_env(cli_ip), text=True, capture_output=True, timeout=60)
    finally:
        srv.kill()
        srv.wait()
    assert cli.returncode == 255
    assert "udaddy: message_size 5000 is larger than active mtu 4096" in cli.stdout
    assert cli.stdout.splitlines()[-1] == "return status -1"


def test_reply_ah_from_a_roce_v2_ipv4_grh():
    # what softrdma (and rxe) put in a UD receive's first 40 bytes for RoCEv2 over IPv4:
    # 20 bytes of nothing, then the packet's IPv4 header
    ip = bytes([0x45, 0x02, 0, 100, 0, 0, 0x40, 0, 64, 17, 0, 0]) + \
        socket.inet_aton("127.0.9.62") + socket.inet_aton("127.0.9.61")
    grh = bytes(20) + ip
    gids = [bytes(16), b"\0" * 10 + b"\xff\xff" + socket.inet_aton("127.0.9.61")]
    attr = ah_attr_from_wc(SimpleNamespace(slid=0, sl=0), grh, gids)
    assert attr.is_global == 1
    assert attr.gr.dgid.raw == b"\0" * 10 + b"\xff\xff" + socket.inet_aton("127.0.9.62")
    assert attr.gr.sgid_index == 1 and attr.gr.hop_limit == 0xFF
    assert attr.gr.traffic_class == 2


# ---- against the real ucmatose on the wire ------------------------------------------

_CM_KEYS = ("cm_msg", "cm_ps", "cm_port", "cm_responder_resources", "cm_initiator_depth",
            "cm_retry_count", "cm_rnr_retry_count", "cm_transport_type", "cm_flow_control",
            "cm_srq", "cm_private_data_len", "cma_user_data_used")


def _wire_summary(pcap, client_ip):
    import json
    from collections import Counter
    out = subprocess.run(SOFT + ["dissect", str(pcap), "--json"], text=True,
                         capture_output=True, timeout=60, check=True).stdout
    frames = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    cm = Counter((f["src"] == client_ip,) + tuple(f.get(k) for k in _CM_KEYS)
                 for f in frames if "cm_msg" in f)
    data = Counter((f["src"] == client_ip, f["opcode_name"], f["payload_len"])
                   for f in frames if f["transport"] == "RC"
                   and f["opcode_name"] != "RC_ACKNOWLEDGE")
    return cm, data


def test_cmatose_on_the_wire_is_ucmatoses(tmp_path):
    """``ucmatose -c 2 -C 5`` between two Linux rxe hosts (pcaps/linux-rxe/ucmatose.pcap)
    and ``softrdma cmatose -c 2 -C 5`` put the same CM messages (parameters, private data
    sizes) and the same data messages on the wire."""
    from .conftest import PCAPS
    pcap = tmp_path / "cmatose.pcap"
    srv_ip, cli_ip = "127.0.9.63", "127.0.9.64"
    env = _env(cli_ip)
    env["SOFTRDMA_PCAP"] = str(pcap)
    srv = subprocess.Popen(SOFT + ["cmatose", "-b", srv_ip, "-c", "2", "-C", "5"],
                           env=_env(srv_ip), text=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        _wait_bound(srv_ip)
        cli = subprocess.run(SOFT + ["cmatose", "-s", srv_ip, "-b", cli_ip, "-c", "2", "-C",
                                     "5"], env=env, text=True, capture_output=True,
                             timeout=90)
        assert srv.wait(timeout=90) == 0
    finally:
        srv.kill()
        srv.wait()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    ours = _wire_summary(pcap, cli_ip)
    theirs = _wire_summary(PCAPS / "ucmatose.pcap", "10.77.0.12")
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    assert sum(ours[1].values()) == 20  # 2 connections x 5 messages x both ways


def test_rping_persistent_server_serves_client_after_client():
    srv_ip = "127.0.9.75"
    with tempfile.TemporaryFile("w+") as out:
        srv = subprocess.Popen(SOFT + ["rping", "-s", "-P", "-a", srv_ip, "-v"],
                               env=_env(srv_ip), text=True, stdout=out,
                               stderr=subprocess.DEVNULL)
        try:
            _wait_bound(srv_ip)
            # two at once (the second waits its turn), then a third
            first = [subprocess.Popen(SOFT + ["rping", "-c", "-a", srv_ip, "-C", str(n), "-V"],
                                      env=_env(f"127.0.9.{76 + i}"), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                     for i, n in enumerate((20, 3))]
            rcs = [p.wait(timeout=90) for p in first]
            third = subprocess.run(SOFT + ["rping", "-c", "-a", srv_ip, "-C", "2", "-v"],
                                   env=_env("127.0.9.78"), text=True, capture_output=True,
                                   timeout=90)
            time.sleep(0.5)
            assert srv.poll() is None  # still serving
        finally:
            srv.kill()
            srv.wait()
            for p in first:
                p.kill()
                p.communicate()
        out.seek(0)
        lines = out.read().splitlines()
    assert rcs == [0, 0] and third.returncode == 0, third.stderr
    assert third.stdout.splitlines() == [f"ping data: {ping_data(i, 64)[:-1].decode()}"
                                         for i in range(2)]
    assert len(lines) == 25 and all(ln.startswith("server ping data: rdma-ping-")
                                    for ln in lines)


def test_udaddy_on_the_wire(tmp_path):
    """udaddy's data as udaddy.c sends it: SIDR to UDP:7174, then SEND with immediate of
    -S bytes, the immediate the sender's QPN in network order, Q_Key 0x01234567; the
    server answers to the QPN the immediate named."""
    import json
    pcap = tmp_path / "udaddy.pcap"
    srv_ip, cli_ip = "127.0.9.83", "127.0.9.84"
    env = _env(cli_ip)
    env["SOFTRDMA_PCAP"] = str(pcap)
    srv = subprocess.Popen(SOFT + ["udaddy", "-b", srv_ip, "-C", "3", "-S", "200"],
                           env=_env(srv_ip), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        _wait_bound(srv_ip)
        cli = subprocess.run(SOFT + ["udaddy", "-s", srv_ip, "-b", cli_ip, "-C", "3", "-S",
                                     "200"], env=env, text=True, capture_output=True,
                             timeout=90)
        assert srv.wait(timeout=90) == 0
    finally:
        srv.kill()
        srv.wait()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    out = subprocess.run(SOFT + ["dissect", str(pcap), "--json"], text=True,
                         capture_output=True, timeout=60, check=True).stdout
    frames = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert [f.get("cm_msg") for f in frames[:2]] == ["SIDR_REQ", "SIDR_REP"]
    assert frames[0]["cm_ps"] == "UDP" and frames[0]["cm_port"] == 7174
    data = [f for f in frames if f["opcode_name"] == "UD_SEND_ONLY_WITH_IMMEDIATE"]
    sent = [f for f in data if f["src"] == cli_ip]
    back = [f for f in data if f["src"] == srv_ip]
    assert len(sent) == 3 and len(back) == 3
    for f in data:
        assert f["payload_len"] == 200
        assert f["deth_qkey"] == 0x01234567
    client_qpn = sent[0]["deth_src_qp"]
    assert all(f["imm"] == client_qpn for f in sent)
    assert all(f["qpn"] == client_qpn for f in back)  # the reply goes to the immediate
    assert all(f["imm"] == f["deth_src_qp"] for f in back)


_CORRUPTING_CLIENT = """
import sys
import softrdma.tools.rping as r
orig = r._Rping.post_info
def post_info(self, mr):
    if mr is not None and mr is self.rdma_mr:  # the server has READ the start buffer
        self.start_mr.write(b"X", 1, 20)       # so what comes back differs from it
    orig(self, mr)
r._Rping.post_info = post_info
from softrdma.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_rping_validate_reports_a_mismatch():
    srv_ip, cli_ip = "127.0.9.85", "127.0.9.86"
    with tempfile.TemporaryFile("w+") as out:
        srv = subprocess.Popen(SOFT + ["rping", "-s", "-a", srv_ip], env=_env(srv_ip),
                               stdout=out, stderr=subprocess.DEVNULL)
        try:
            _wait_bound(srv_ip)
            base = [sys.executable, "-c", _CORRUPTING_CLIENT, "rping", "-c", "-a", srv_ip,
                    "-C", "3"]
            cli = subprocess.run(base + ["-V"], env=_env(cli_ip), text=True,
                                 capture_output=True, timeout=90)
            assert srv.wait(timeout=60) == 0
        finally:
            srv.kill()
            srv.wait()
    assert cli.returncode == 1
    assert cli.stderr.splitlines()[0] == "data mismatch!"
    assert "rping client failed: -1" in cli.stderr
    assert cli.stdout == ""  # stopped at the first ping


def test_reply_ah_from_an_ipv6_grh_keeps_tclass_and_flow_label_and_refuses_a_stranger():
    from softrdma.errors import PyverbsRDMAError
    from softrdma.verbs_api.ah import ah_attr_from_wc as from_wc
    src, dst = socket.inet_pton(socket.AF_INET6, "fd00::2"), \
        socket.inet_pton(socket.AF_INET6, "fd00::1")
    word = (6 << 28) | (0x2A << 20) | 0xBEEF5
    grh = word.to_bytes(4, "big") + bytes(4) + src + dst
    attr = from_wc(SimpleNamespace(slid=0, sl=0), grh, [bytes(16), dst])
    assert attr.gr.dgid.raw == src and attr.gr.sgid_index == 1
    assert (attr.gr.traffic_class, attr.gr.flow_label) == (0x2A, 0xBEEF5)
    with pytest.raises(PyverbsRDMAError) as ei:
        from_wc(SimpleNamespace(slid=0, sl=0), grh, [bytes(16)])
    assert ei.value.error_code == 22 and "GID table" in str(ei.value)
