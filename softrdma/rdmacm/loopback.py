"""Loopback listeners shared by processes (soft devices are per process; Linux's ``lo``
is shared by all of them)."""

from __future__ import annotations

import os
import tempfile
from ipaddress import IPv4Address, IPv6Address, ip_address

__all__ = ["LoopbackListeners", "LOOPBACK"]

IPAddress = IPv4Address | IPv6Address


class LoopbackListeners:
    """Linux holds all of 127/8 on ``lo``, and rdma_cm binds a loopback address to
    whichever device (``cma_bind_loopback``); every process shares that kernel. Soft devices
    are per process, each on its own loopback address, so a listener bound to a loopback
    address its process's device does not hold is entered here (one file per listener,
    under ``SOFTRDMA_RDMACM_DIR``, default ``/dev/shm`` or the temp dir): an id connecting
    to that address and port in another process finds the device address to send to.
    Entries of dead processes are ignored and removed."""

    @property
    def dir(self) -> str:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return os.environ.get("SOFTRDMA_RDMACM_DIR") or \
            os.path.join(base, f"softrdma-rdmacm-{os.getuid()}")

    def _path(self, ps: int, ip: IPAddress, port: int) -> str:
        return os.path.join(self.dir, f"{ps:x}-{ip}-{port}")

    def publish(self, ps: int, ip: IPAddress, port: int, dev_ip: str) -> None:
        """A listener of this process on ``ip``:``port``, reached at ``dev_ip``."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        path = self._path(ps, ip, port)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()} {dev_ip}\n")
        os.replace(tmp, path)

    def withdraw(self, ps: int, ip: IPAddress, port: int) -> None:
        """Remove this process's entry (another process's stays)."""
        path = self._path(ps, ip, port)
        try:
            with open(path) as f:
                if f.read().split()[0] == str(os.getpid()):
                    os.unlink(path)
        except (OSError, IndexError):
            pass

    def lookup(self, ps: int, ip: IPAddress, port: int) -> IPAddress | None:
        """The device address of the live process listening on ``ip``:``port``, or None."""
        path = self._path(ps, ip, port)
        try:
            with open(path) as f:
                pid_s, dev_ip = f.read().split()[:2]
            pid = int(pid_s)
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        except PermissionError:
            pass
        return ip_address(dev_ip)


LOOPBACK = LoopbackListeners()
