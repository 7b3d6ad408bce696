"""Bad input to any ``softrdma`` command ends with one line on stderr, never a traceback:
status 2 for a usage error (a value the mirrored tool refuses while parsing its options),
status 1 for what fails at run time (the checks the tool makes after parsing, a device that
cannot do what was asked, a file that cannot be written).

The ranges come from the tools mirrored: rdma-core's libibverbs/examples/*_pingpong.c
(``-p`` above 65535, ``-i`` below 1 and an ``-m`` other than 256..4096 are usage errors;
srq_pingpong's ``-s`` below 1 too; after parsing it refuses fewer receives than QPs and 256
QPs or more), perftest 4.5's perftest_parameters.c (CHECK_VALUE_IN_RANGE: ``-n`` 5..1e8,
``-t`` 1..15000, ``-r`` 1..16384 and only 1 on RDMA verbs, ``-Q`` 1..1024, ``-x`` 0..64,
``-q`` 1..16384, ``-I`` 0..1024 and not on READ/atomic, ``-S`` at most 15, ``-i`` at least
1, ``-D`` positive, ``-s`` 1..UINT_MAX/2; ``-o`` only on READ/atomic; ``-D`` not with
``-a``). Every case fails before any connection (none waits on a peer): each runs as a real
process with a short timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

TIMEOUT = 20

# (argv after "softrdma", exit status, what the one line must name)
# Addresses 127.0.0.2xx: devices these cases bring up, away from the other tests' 127.0.0.1;
# one per case, as the cases run four at a time (two on one address raced for UDP 4791 in CI)
CASES = [
    # -- the cases a first user review found -------------------------------------------------------------
    (["devices", "-a", "notip"], 2, "-a/--addr"),
    (["bench", "wire", "--size", "-1"], 2, "--size"),
    (["bench", "wire", "--seconds", "-1"], 2, "--seconds"),
    (["demo", "--pcap", "/nonexistent/dir/x.pcap"], 1, "/nonexistent/dir/x.pcap"),
    (["pingpong", "rc", "-m", "999"], 2, "-m/--mtu"),
    (["pingpong", "rc", "-s", "-5"], 2, "-s/--size"),
    (["pingpong", "rc", "-p", "70000"], 2, "-p/--port"),
    (["demo", "--size", "0"], 2, "--size"),
    (["demo", "--addrs", "127.0.0.203", "127.0.0.203"], 2, "--addrs"),
    # -- top level ------------------------------------------------------------------------
    (["nosuchcommand"], 2, "nosuchcommand"),
    (["pingpong", "rc", "127.0.0.1", "127.0.0.2"], 2, "unrecognized arguments"),
    # -- devices, devinfo -----------------------------------------------------------------
    (["devices", "-a", "999.1.1.1"], 2, "999.1.1.1"),
    (["devinfo", "-a", "notip"], 2, "-a/--addr"),
    # -- pingpong: what rdma-core refuses while parsing (usage) -------------------------------
    (["pingpong", "uc", "-m", "100"], 2, "-m/--mtu"),
    (["pingpong", "rc", "-m", "abc"], 2, "-m/--mtu"),
    (["pingpong", "rc", "-p", "-1"], 2, "-p/--port"),
    (["pingpong", "rc", "-p", "http"], 2, "-p/--port"),
    (["pingpong", "rc", "-i", "0"], 2, "-i/--ib-port"),
    (["pingpong", "srq", "-s", "0"], 2, "-s/--size"),
    # unsigned there (strtoul), non-numeric there reads as 0: refused here
    (["pingpong", "ud", "-s", "abc"], 2, "-s/--size"),
    (["pingpong", "rc", "-s", "99999999999"], 2, "-s/--size"),
    (["pingpong", "rc", "-n", "0"], 2, "-n/--iters"),
    (["pingpong", "rc", "-n", "-3"], 2, "-n/--iters"),
    (["pingpong", "uc", "-r", "0"], 2, "-r/--rx-depth"),
    (["pingpong", "rc", "-l", "16"], 2, "-l/--sl"),
    (["pingpong", "srq", "-q", "0"], 2, "-q/--num-qp"),
    (["pingpong", "rc", "-a", "notip"], 2, "-a/--addr"),
    # -- pingpong: rdma-core's checks after parsing, its messages (status 1) ------------------
    (["pingpong", "srq", "-q", "20", "-r", "10"], 1, "rx_depth 10 is too small for 20 QPs"),
    (["pingpong", "srq", "-q", "256"], 1, "num_qp 256 must be less than 255"),
    (["pingpong", "rc", "-g", "7", "-a", "127.0.0.201"], 1, "can't read sgid of index 7"),
    (["pingpong", "rc", "-r", "20000", "-a", "127.0.0.204"], 1, "Couldn't create QP"),
    (["pingpong", "rc", "-s", "9000000", "-a", "127.0.0.205"], 1, "max_msg_sz"),
    # -- perf: perftest's parse-time ranges (usage) -------------------------------------------
    (["perf", "write", "-s", "0"], 2, "-s/--size"),
    (["perf", "send", "-s", "-1"], 2, "-s/--size"),
    (["perf", "write", "-s", "3G"], 2, "-s/--size"),
    (["perf", "write", "-n", "4"], 2, "-n/--iters"),
    (["perf", "read", "-n", "abc"], 2, "-n/--iters"),
    (["perf", "write", "-D", "0"], 2, "-D/--duration"),
    (["perf", "write", "-D", "-1"], 2, "-D/--duration"),
    (["perf", "write", "-m", "abc"], 2, "-m/--mtu"),
    (["perf", "write", "-x", "65"], 2, "-x/--gid-index"),
    (["perf", "write", "-q", "0"], 2, "-q/--qp"),
    (["perf", "write", "-q", "16385"], 2, "-q/--qp"),
    (["perf", "write", "-t", "0"], 2, "-t/--tx-depth"),
    (["perf", "write", "-t", "15001"], 2, "-t/--tx-depth"),
    (["perf", "send", "-r", "0"], 2, "-r/--rx-depth"),
    (["perf", "write", "-Q", "1025"], 2, "-Q/--cq-mod"),
    (["perf", "write", "-I", "1025"], 2, "-I/--inline_size"),
    (["perf", "write", "-S", "16"], 2, "-S/--sl"),
    (["perf", "write", "-i", "0"], 2, "-i/--ib-port"),
    (["perf", "write", "-p", "70000"], 2, "-p/--port"),
    (["perf", "write", "-u", "32"], 2, "-u/--qp-timeout"),
    (["perf", "write", "--addr", "notip"], 2, "--addr"),
    # -- perf: perftest's checks that depend on the test (status 1) -------------------------
    (["perf", "write", "-r", "2"], 1, "rx depth can be only 1"),
    (["perf", "read", "-I", "64"], 1, "Inline feature not available on READ/Atomic"),
    (["perf", "write", "-o", "4"], 1, "Outstanding reads only available on READ"),
    (["perf", "send", "-A", "CMP_AND_SWAP"], 1, "atomic"),
    (["perf", "write", "-a", "-D", "2"], 1, "Duration mode"),
    (["perf", "write", "-x", "9", "--addr", "127.0.0.202"], 1, "GID index 9"),
    (["perf", "write", "-i", "2", "--addr", "127.0.0.206"], 1, "port 2"),
    # -- bench --------------------------------------------------------------------------------
    (["bench", "wire", "--seconds", "0"], 2, "--seconds"),
    (["bench", "wire", "--seconds", "nan"], 2, "--seconds"),
    (["bench", "wire", "--size", "100000"], 2, "--size"),
    (["bench", "qps", "--depth", "-1"], 2, "--depth"),
    (["bench", "engines", "--seconds", "0"], 2, "--seconds"),
    (["bench", "udp", "--rounds", "0"], 2, "--rounds"),
    (["bench", "udp", "--port", "http"], 2, "--port"),
    (["bench"], 2, "wire,engines,qps,udp"),
    (["bench", "crc"], 2, "crc"),
    # -- demo ---------------------------------------------------------------------------------
    (["demo", "--size", "-1"], 2, "--size"),
    (["demo", "--size", "200000"], 2, "--size"),
    (["demo", "--addrs", "notip", "127.0.0.2"], 2, "--addrs"),
    (["demo", "--pcap", "{tmpdir}"], 1, "{tmpdir}"),
    # -- lab (run with an empty PATH: even a regression cannot boot a lab from here) ------------
    (["lab", "run", "--guests", "0", "--", "true"], 2, "--guests"),
    (["lab", "shell", "--guests", "-1"], 2, "--guests"),
    (["lab", "guest", "-1", "--", "true"], 2, "index"),
    # -- check: a file it cannot read is status 2 (1 means broken rules) --------------------------
    (["check", "/nonexistent/dir/x.pcap"], 2, "/nonexistent/dir/x.pcap: no such file"),
    (["check", "{tmpdir}"], 2, "is a directory"),
    (["check", "--mtu", "1000", "x.pcap"], 2, "--mtu"),
    (["check", "--rules", "NOPE", "--", "x.pcap"], 2, "NOPE"),
]


def _id(case: tuple) -> str:
    return " ".join(case[0])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every case at once (a few at a time): the module takes seconds, not minutes."""
    tmp = tmp_path_factory.mktemp("cli")
    empty = tmp / "empty-path"
    empty.mkdir()
    env = dict(os.environ, PATH=str(empty))
    env.pop("SOFTRDMA_IP", None)
    env.pop("SOFTRDMA_DEBUG", None)

    def run(case: tuple) -> tuple:
        argv = [a.format(tmpdir=tmp) for a in case[0]]
        try:
            r = subprocess.run([sys.executable, "-m", "softrdma", *argv], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=TIMEOUT)
            return r.returncode, r.stderr
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            return "timeout", err

    with ThreadPoolExecutor(max_workers=4) as pool:
        out = dict(zip((_id(c) for c in CASES), pool.map(run, CASES)))
    return out, tmp


@pytest.mark.parametrize("argv,status,needle", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_is_one_line(results, argv, status, needle):
    out, tmp = results
    rc, err = out[_id((argv, status, needle))]
    needle = needle.format(tmpdir=tmp)
    assert "Traceback" not in err, err
    assert rc == status, f"status {rc}, stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]
    assert lines[0].startswith("softrdma"), lines[0]


def test_help_still_shows_the_usage():
    r = subprocess.run([sys.executable, "-m", "softrdma", "pingpong", "--help"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and "usage:" in r.stdout and "--mtu" in r.stdout


def test_numbers_read_as_strtol_reads_them():
    """rdma-core and perftest read numbers with strtol(optarg, NULL, 0)."""
    import argparse

    from softrdma.tools.argtypes import c_int, perftest_size

    assert [c_int(s) for s in ("4096", "0x1000", "0X10", "010", "0", "-7", "+5")] == \
        [4096, 4096, 16, 8, 0, -7, 5]
    for bad in ("", "abc", "1.5", "0x", "09", "12abc", "- 1"):
        with pytest.raises(argparse.ArgumentTypeError):
            c_int(bad)
    # perftest's -s: K and M suffixes, 1 .. UINT_MAX/2
    assert perftest_size("64K") == 65536 and perftest_size("2M") == 2 << 20
    assert perftest_size("0x10") == 16
    for bad in ("0", "-1", "2048M", "1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            perftest_size(bad)


def test_unexpected_exception_is_one_line(monkeypatch, capsys):
    """The last resort: an exception nobody anticipated is one line and status 1."""
    from softrdma import cli
    from softrdma.tools import devinfo

    def boom(a):
        raise RuntimeError("something nobody validated")

    monkeypatch.setattr(devinfo, "run_devices", boom)
    monkeypatch.delenv("SOFTRDMA_DEBUG", raising=False)
    assert cli.main(["devices"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: something nobody validated" in err
    assert err.startswith("softrdma devices: ")
