"""One name per device, everywhere (issue 31, point 1; the rule is in docs/device.md, "Names").

A soft device has two spellings: ``softrdma0``, the default device (in a tool: the device
the tool picks with no ``-d``), and ``softrdma-<IP>``, the device on address IP. Every
place that takes a device name takes both (the API's ``Context(name=...)``, pingpong's and
perf's ``-d``, ``devinfo -d``, ``bench verbs -d``), any name a tool prints is accepted by
the others, and ``devices`` and ``devinfo`` describe one device the same way even while
another process holds its address.

The tests that need the default address (127.0.0.1) run their processes in a network
namespace of their own (``unshare -n``, loopback brought up), so the host's 127.0.0.1 is
not touched; the others use 127.0.1.x. Expected GIDs and GUIDs are worked out here from
the address, as rxe derives them from its netdev: GID index 0 is ``fe80::`` + the
modified EUI-64 of the MAC, index 1 ``::ffff:a.b.c.d``, the node GUID is the EUI-64, and a
loopback address's MAC is ``02:00:a.b.c.d`` (docs/device.md, "Addresses and GIDs").
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import subprocess
import sys

SOFT = [sys.executable, "-m", "softrdma"]

# Runs inside the namespace: the background processes (servers), waits until each of the
# addresses in "held" has UDP 4791 bound (read from /proc/net/udp: probing the port by
# binding it would race the server for it), then the foreground commands one by one, then
# collects the background ones.
_DRIVER = r'''
import json, socket, subprocess, sys, time
spec = json.loads(sys.argv[1])
ip_link = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
assert ip_link.returncode == 0, ip_link.stderr
bg = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for a in spec["bg"]]
want = {socket.inet_aton(ip)[::-1].hex().upper() + ":12B7" for ip in spec["held"]}
deadline = time.monotonic() + 20
while want and time.monotonic() < deadline:
    with open("/proc/net/udp") as f:
        bound = {line.split()[1] for line in f.readlines()[1:]}
    if want <= bound:
        break
    time.sleep(0.05)
fg = [subprocess.run(a, capture_output=True, text=True, timeout=30) for a in spec["fg"]]
res = []
for p in bg:
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    res.append([p.returncode, out, err])
print(json.dumps({"bg": res, "fg": [[r.returncode, r.stdout, r.stderr] for r in fg]}))
'''


def in_netns(bg: list[list[str]], fg: list[list[str]], held: tuple[str, ...] = ()) -> tuple[
        list[tuple[int, str, str]], list[tuple[int, str, str]]]:
    """Run servers ``bg`` and then commands ``fg`` in a fresh network namespace; their
    (status, stdout, stderr), servers first."""
    r = subprocess.run(["unshare", "-n", sys.executable, "-c", _DRIVER,
                        json.dumps({"bg": bg, "fg": fg, "held": list(held)})],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return [tuple(x) for x in out["bg"]], [tuple(x) for x in out["fg"]]


def soft(*args: str) -> list[str]:
    return SOFT + list(args)


def mac_of(ip: str) -> bytes:
    """The MAC softrdma gives a loopback address: locally administered, 02:00:a.b.c.d."""
    return b"\x02\x00" + ipaddress.IPv4Address(ip).packed


def eui64(ip: str) -> bytes:
    """The modified EUI-64 of the address's MAC: the node GUID, and GID 0's low half."""
    m = mac_of(ip)
    return bytes([m[0] ^ 0x02]) + m[1:3] + b"\xff\xfe" + m[3:]


def gid_text(ip: str, index: int) -> str:
    """GID ``index`` of the device on ``ip`` as the tools print it (inet_ntop)."""
    raw = b"\xfe\x80" + bytes(6) + eui64(ip) if index == 0 else \
        bytes(10) + b"\xff\xff" + ipaddress.IPv4Address(ip).packed
    return socket.inet_ntop(socket.AF_INET6, raw)


def guid_devinfo(ip: str) -> str:
    h = eui64(ip).hex()
    return ":".join(h[i:i + 4] for i in range(0, 16, 4))


def local_gid(out: str) -> str:
    m = re.search(r"local address: .* GID (\S+)", out)
    assert m, out
    return m.group(1)


def test_pingpong_takes_both_spellings_and_a_gid_index():
    """``pingpong -d softrdma0`` is the device pingpong picks with no -d (127.0.0.1, or the
    next free loopback address when a server holds it), ``-d softrdma-<IP>`` the device on
    IP; ``-g`` picks among that device's GIDs (0: link-local, 1: the address)."""
    (srv,), (cli,) = in_netns([soft("pingpong", "rc", "-d", "softrdma0", "-n", "3", "-p", "21101")],
                              [soft("pingpong", "rc", "-d", "softrdma-127.0.0.9", "-g", "0",
                                    "-n", "3", "-p", "21101", "127.0.0.1")], held=("127.0.0.1",))
    assert srv[0] == 0 and cli[0] == 0, (srv, cli)
    assert local_gid(srv[1]) == gid_text("127.0.0.1", 1)
    assert local_gid(cli[1]) == gid_text("127.0.0.9", 0)
    # a server with no -d, a client with -d softrdma0: the client moves on, as with no -d
    (srv,), (cli,) = in_netns([soft("pingpong", "ud", "-n", "3", "-p", "21102")],
                              [soft("pingpong", "ud", "-d", "softrdma0", "-n", "3", "-p", "21102",
                                    "127.0.0.1")], held=("127.0.0.1",))
    assert srv[0] == 0 and cli[0] == 0, (srv, cli)
    assert local_gid(srv[1]) == gid_text("127.0.0.1", 1)
    assert local_gid(cli[1]) == gid_text("127.0.0.2", 1)


def test_perf_takes_both_spellings_and_its_device_name_is_accepted_elsewhere():
    """``perf -d softrdma0`` / ``-d softrdma-<IP>`` with ``-x`` choose device and GID; the
    device name perf prints (``Device : softrdma-127.0.0.1``) is one devinfo takes."""
    (srv,), (cli, info) = in_netns(
        [soft("perf", "write", "-d", "softrdma0", "-x", "0", "-n", "5", "-s", "64",
              "-p", "21103")],
        [soft("perf", "write", "-d", "softrdma-127.0.0.5", "-x", "0", "-n", "5", "-s", "64",
              "-p", "21103", "127.0.0.1"),
         soft("devinfo", "-d", "softrdma-127.0.0.1")], held=("127.0.0.1",))
    assert srv[0] == 0 and cli[0] == 0, (srv, cli)
    assert re.search(r"^ 64\s+5\s", cli[1], re.M), cli[1]
    m = re.search(r"Device\s+: (\S+)", srv[1])
    assert m and m.group(1) == "softrdma-127.0.0.1", srv[1]
    assert info[0] == 0, info
    assert re.search(rf"hca_id:\s+{re.escape(m.group(1))}$", info[1], re.M), info[1]
    assert re.search(rf"node_guid:\s+{guid_devinfo('127.0.0.1')}$", info[1], re.M), info[1]


def test_devices_and_devinfo_agree_while_another_process_holds_the_address():
    """With a pingpong server holding 127.0.0.1, ``devices`` and ``devinfo`` (no -d, -d
    softrdma0, -d softrdma-127.0.0.1, no -a) all describe the device on 127.0.0.1: same
    name for the default, its node GUID, its GIDs; devinfo does not make a device of its
    own on the next free address (and so leaves the server alone: the pair still runs)."""
    (srv,), (devices, info, info0, info_ip, verbose, cli) = in_netns(
        [soft("pingpong", "rc", "-n", "2", "-p", "21104")],
        [soft("devices"), soft("devinfo"), soft("devinfo", "-d", "softrdma0"),
         soft("devinfo", "-d", "softrdma-127.0.0.1"),
         soft("devinfo", "-v", "-d", "softrdma-127.0.0.1"),
         soft("pingpong", "rc", "-n", "2", "-p", "21104", "127.0.0.1")], held=("127.0.0.1",))
    for r in (srv, devices, info, info0, info_ip, verbose, cli):
        assert r[0] == 0 and r[2] == "", r
    guid = eui64("127.0.0.1")
    assert re.search(rf"^\s+softrdma0\s+{guid.hex()}$", devices[1], re.M), devices[1]
    for out, name in ((info[1], "softrdma0"), (info0[1], "softrdma0"),
                      (info_ip[1], "softrdma-127.0.0.1"), (verbose[1], "softrdma-127.0.0.1")):
        assert re.search(rf"^hca_id:\s+{name}$", out, re.M), out
        assert re.search(rf"node_guid:\s+{guid_devinfo('127.0.0.1')}$", out, re.M), out
    assert f"GID[  0]:\t\t{gid_text('127.0.0.1', 0)}, RoCE v2" in verbose[1]
    assert f"GID[  1]:\t\t{gid_text('127.0.0.1', 1)}, RoCE v2" in verbose[1]
    assert local_gid(cli[1]) == gid_text("127.0.0.2", 1)


def test_devinfo_takes_any_local_address_without_a():
    """``devinfo -d softrdma-<IP>`` describes the device on any address of this host with
    no ``-a``; an address the host does not hold is one line naming it, status 1."""
    r = subprocess.run(soft("devinfo", "-v", "-d", "softrdma-127.0.1.20"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^hca_id:\s+softrdma-127\.0\.1\.20$", r.stdout, re.M), r.stdout
    assert re.search(rf"node_guid:\s+{guid_devinfo('127.0.1.20')}$", r.stdout, re.M), r.stdout
    assert f"GID[  1]:\t\t{gid_text('127.0.1.20', 1)}, RoCE v2" in r.stdout
    r = subprocess.run(soft("devinfo", "-d", "softrdma-192.0.2.1"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and "softrdma-192.0.2.1" in r.stderr, r.stderr


def test_unknown_name_is_one_line_naming_it_and_the_spellings():
    """A name that is neither spelling: one line on stderr, status 1, naming the name and
    both valid spellings, from every tool that takes -d and from the API."""
    api = ("from softrdma.verbs_api import Context\n"
           "try:\n    Context(name='mlx5_9')\n"
           "except Exception as e:\n    raise SystemExit(str(e))\n")
    for argv in (soft("pingpong", "rc", "-d", "mlx5_9"), soft("perf", "write", "-d", "mlx5_9"),
                 soft("devinfo", "-d", "mlx5_9"), soft("bench", "verbs", "-d", "mlx5_9"),
                 [sys.executable, "-c", api]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, (argv, r)
        lines = r.stderr.splitlines()
        assert len(lines) == 1, (argv, r.stderr)
        assert "mlx5_9" in lines[0] and "softrdma0" in lines[0] and "softrdma-<IP>" in lines[0], \
            (argv, lines)


def test_api_opens_both_spellings():
    """``Context(name="softrdma-<IP>")`` opens the device on IP (made there if needed, and
    the same device when opened again); ``softrdma-<default's address>`` is the default
    device once it is open; every name get_device_list gives opens."""
    prog = (
        "from softrdma.verbs_api import Context, get_device_list\n"
        "with Context(name='softrdma-127.0.1.21') as c:\n"
        "    with Context(name='softrdma-127.0.1.21') as again:\n"
        "        assert again.device is c.device\n"
        "    print(c.device.ip, c.query_gid(1, 1).gid)\n"
        "    names = [d.name.decode() for d in get_device_list()]\n"
        "    assert 'softrdma-127.0.1.21' in names, names\n"
        "    for n in names:\n"
        "        with Context(name=n):\n"
        "            pass\n"
        "with Context(name='softrdma0') as d:\n"
        "    with Context(name='softrdma-' + d.device.ip) as e:\n"
        "        print(e.device is d.device)\n")
    env = {"SOFTRDMA_IP": "127.0.1.23", "PATH": "/usr/bin:/bin"}

    env.update({k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HOME")})
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first == "127.0.1.21 0000:0000:0000:0000:0000:ffff:7f00:0115", first
    assert second == "True"


def test_bench_verbs_takes_an_address_name():
    """``bench verbs -d softrdma-<IP>``: the loop runs on the device on IP (its row has
    numbers, not n/a)."""
    r = subprocess.run(soft("bench", "verbs", "-d", "softrdma-127.0.1.22", "--small-iters", "2",
                            "--big-iters", "2"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("softrdma ("))
    assert "n/a" not in row and re.search(r"\d", row), r.stdout
    assert "on softrdma-127.0.1.22" in r.stdout, r.stdout
