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
    path-record conversions (what is copied, what is left alone) and the fork state
    machine (a range call before ibv_fork_init makes it EINVAL; after it, ENABLED): the
    same calls from the same probe, once into the real libibverbs.so.1 without softrdma,
    once into the preload library under ``softrdma exec``, give the same answers."""
    env = {"SYSFS_PATH": "/tmp/sysfs-of-the-probe//"}
    for order in ("range-first", "init-first"):
        real = _probe_json(_run("/usr/bin/python3", PROBE, "pure", "real", order, env=env))
        ours = _probe_json(_exec("/usr/bin/python3", PROBE, "pure", "ours", order, env=env))
        assert ours == real
    assert real["sysfs"] == "/tmp/sysfs-of-the-probe"
    assert real["fork"] == [0, 0, 1, 0, 0, 0, 1]  # init-first: DISABLED, 0, ENABLED, ...


def test_gid_entries_table_and_pkeys_are_the_devices():
    """ibv_query_gid_ex / ibv_query_gid_table (verbs.h's inlines over _ibv_query_gid_ex
    and _ibv_query_gid_table) give the device's two RoCE v2 GIDs with the netdev they
    sit on (127/8: lo), and the kernel's errors: EINVAL for a bad port, index, flag or
    a too short entry, ENODATA for an empty entry, -EINVAL for a table that does not
    fit; a longer entry's tail is zeroed. ibv_query_pkey / ibv_get_pkey_index read the
    default P_Key table (0xffff, then zeros; -1 past its end)."""
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


def test_ibv_devinfo_reads_the_extended_device_and_port_attributes():
    """ibv_devinfo -v calls ibv_query_device_ex (the context's query_device_ex slot) and
    verbs.h's inline ibv_query_port (the query_port slot): the extended attributes carry
    the capability flags (device_cap_flags_ex equals device_cap_flags, where the legacy
    fallback leaves 0) and the port is active, with the device's GIDs."""
    r = _exec("ibv_devinfo", "-v")
    assert r.returncode == 0, r.stderr
    fields = {}
    for line in r.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        fields.setdefault(key, value.strip())
    assert int(fields["device_cap_flags_ex"], 16) == int(fields["device_cap_flags"], 16) != 0
    assert fields["state"] == "PORT_ACTIVE (4)"
    assert "::ffff:127.0.2.10, RoCE v2" in r.stdout
