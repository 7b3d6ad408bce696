"""What the command-line tools share: choosing the local device, the TCP side channel."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import time
from typing import Any, Iterator

from ..soft.faults import ENV_FAULTS
from ..soft.udp import TransportError
from ..verbs_api.device import (
    DEFAULT_NAME, NAME_RULE, add_device, address_of_name, device_name_for, find_device,
    unregister_device,
)
from .argtypes import fault_spec

__all__ = ["ToolError", "UsageError", "open_device", "unknown_device", "tcp_listen",
           "tcp_connect", "recv_exact", "local_address_towards", "add_fault_option",
           "apply_fault_options", "DEVICE_HELP"]

#: the ``-d`` help of every tool that takes a device name
DEVICE_HELP = "use this device: softrdma0 (the default: the device picked with no -d) or " \
              "softrdma-<IP> (the device on address IP, as --addr IP)"


class ToolError(Exception):
    """A problem to report in one line (exit status 1), e.g. a peer that cannot be reached."""


class UsageError(Exception):
    """An error to report in one line, exit status 2: a usage error found after parsing
    (options that do not go together), or an unreadable capture file."""


@contextlib.contextmanager
def capture_file_errors(path: Any) -> Iterator[None]:
    """Turn the ways a capture file cannot be read into one-line UsageErrors naming it
    (``softrdma dissect`` and ``softrdma check`` read captures the same way)."""
    from ..wire.pcap import PcapError
    try:
        yield
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory") from None
    except PermissionError:
        raise UsageError(f"{path}: permission denied") from None
    except PcapError as e:  # path None: the error names its file already
        raise UsageError(f"{e}" if path is None else f"{path}: {e}") from None


def add_fault_option(p: Any) -> None:
    """``--fault SPEC`` (repeatable) for a tool that runs live soft devices: faults on the
    tool's own devices (docs/faults.md). :func:`apply_fault_options` puts it to work."""
    p.add_argument("--fault", action="append", default=[], type=fault_spec, metavar="SPEC",
                   help="inject faults on this side's device, e.g. 'tx:loss=0.05;seed=7' or "
                        "'rx:drop(READ_RESPONSE_FIRST)' (repeatable; docs/faults.md)")


def apply_fault_options(args: Any) -> None:
    """Hand the tool's ``--fault`` specs to the devices it will bring up: they join
    SOFTRDMA_FAULTS (after what the environment already says), which every soft device
    reads when it goes live. Called by ``softrdma``'s main before the tool runs."""
    specs = list(getattr(args, "fault", None) or [])
    if not specs:
        return
    before = os.environ.get(ENV_FAULTS, "").strip()
    os.environ[ENV_FAULTS] = ";".join(([before] if before else []) + specs)


def local_address_towards(host: str) -> str:
    """The local IP the kernel would use to reach ``host`` (no packet is sent)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        s.connect((host, 4791))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except socket.gaierror as e:
        raise ToolError(f"cannot resolve {host}: {e.strerror}") from None


def open_device(name: str | None, addr: str | None, peer: str | None = None,
                mtu: int | None = None) -> Any:
    """The soft device the tool runs on, bound to UDP 4791 in manual (no-thread) mode.

    ``name`` is the tool's ``-d``, spelled as everywhere in softrdma (docs/device.md,
    "Names"): ``softrdma0`` is the device the tool picks by itself, as with no ``-d``;
    ``softrdma-<IP>`` is the device on IP, as ``--addr IP``. The tool picks ``addr`` (its
    ``--addr``), else SOFTRDMA_IP, else the address towards the peer, else 127.0.0.1; a
    loopback address it picked that is taken by another softrdma (two processes on one
    host) moves on to the next one, 127.0.0.2, 127.0.0.3... Unknown names are a ToolError
    naming the name and the two spellings.
    """
    if name is not None and name != DEFAULT_NAME:
        ip = address_of_name(name)
        if ip is None:
            dev = find_device(name)  # a device made in this process (a test's, a program's)
            if dev is None:
                raise unknown_device(name)
            _bind(dev)
            return dev
        if addr is not None and ipaddress.ip_address(addr) != ipaddress.ip_address(ip):
            raise UsageError(f"-d {name} is the device on {ip}, the address option says "
                             f"{addr}: give one of them")
        addr = ip
    explicit = addr is not None
    if addr is None:
        addr = os.environ.get("SOFTRDMA_IP")
        explicit = addr is not None
    if addr is None:
        addr = local_address_towards(peer) if peer else "127.0.0.1"
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        raise ToolError(f"{addr!r} is not an IP address") from None
    tries = 1 if explicit or not ip.is_loopback or ip.version == 6 else 16
    last: Exception | None = None
    for i in range(tries):
        cand = str(ipaddress.ip_address(int(ip) + i)) if i else str(ip)
        dname = device_name_for(cand)
        dev = find_device(dname) or add_device(cand, name=dname, mtu=mtu)
        try:
            _bind(dev)
            return dev
        except TransportError as e:
            unregister_device(dname)
            last = e
            if e.errno != errno.EADDRINUSE:
                break
    raise ToolError(str(last.args[1] if last and len(last.args) > 1 else last))


def unknown_device(name: str) -> ToolError:
    """The one-line error for a ``-d`` that names no device: the name and the spellings."""
    return ToolError(f"unknown device {name!r}; softrdma's devices are {NAME_RULE}")


def _bind(dev: Any) -> None:
    if dev.udp is None:
        dev.attach_udp(thread=False)


def tcp_listen(addr: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
    except OSError as e:
        s.close()
        raise ToolError(f"cannot listen on {addr}:{port}: {e.strerror}") from None
    s.listen(1)
    return s


def tcp_connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    """Connect, retrying while the server is not up yet (like a user starting both tools)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            s.settimeout(60)
            return s
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise ToolError(f"Couldn't connect to {host}:{port}") from None
            time.sleep(0.1)
        except OSError as e:
            raise ToolError(f"Couldn't connect to {host}:{port}: {e.strerror}") from None


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except OSError as e:  # reset by the peer, timed out: one line, not a traceback
            raise ToolError(f"Couldn't read from the peer after {len(buf)} of {n} bytes: "
                            f"{e.strerror or e}") from None
        if not chunk:
            raise ToolError(f"the peer closed the connection after {len(buf)} of {n} bytes "
                            f"(is it the same tool and version?)")
        buf += chunk
    return bytes(buf)


def cm_device_for(addr: str | None) -> None:
    """The rdma_cm tools (rping, cmatose, udaddy): make sure a soft device holds the local
    address ``addr`` the tool binds to, before rdma_cm looks for one. The default device
    takes it when nothing pinned it yet (as ``SOFTRDMA_IP=addr`` would), else a device
    ``softrdma-<addr>`` is added for it. None or the wildcard: nothing to do (the default
    device, on its usual address)."""
    if not addr:
        return
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        raise ToolError(f"{addr!r} is not an IP address") from None
    if ip.is_unspecified:
        return
    from ..verbs_api.device import soft_devices
    # pins the default device there unless it exists already (then the loop below adds one)
    os.environ.setdefault("SOFTRDMA_IP", str(ip))
    for dev in soft_devices():
        if ipaddress.ip_address(dev.ip) == ip:
            return
    add_device(str(ip), name=device_name_for(str(ip)))
