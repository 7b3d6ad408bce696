"""The guardian of a program's connections: what the kernel does for a process that dies.

On Linux a process killed in the middle of a transfer (SIGKILL, a crash) still leaves
the kernel behind: closing its rdma_cm file destroys its ids (``ucma_close``), and an
id that was connected sends a DREQ, so the peer sees RDMA_CM_EVENT_DISCONNECTED at once
(rping's server thread ends, rsocket's peer reads an error). Under ``softrdma exec`` the
CM lives in the program's process and dies with it: a peer that only waits for receives
would wait for ever, as for a host that crashed.

So the first connection a program establishes starts a guardian: this file run as a
script by the program's own Python (stdlib only, in a session of its own so that the
signals of the program's process group leave it alone). Whenever the program's CM
changes (:attr:`softrdma.soft.cm_service.CmService.watchers`), the guardian is told of
each connection that became ESTABLISHED, with the DREQ that would end it ready to send
(``CmAgent.dreq_mad`` in a QP1 packet, its ICRC already computed for the source port
the guardian will use), and of each connection that stopped being ESTABLISHED. When its
stdin ends -- the program is gone, however it went -- the guardian sends the DREQs of
the connections still listed, from the program's address, and exits. A program that
exits normally has disconnected its ids first (:mod:`.cma`'s exit handler), so the list
is empty then.

The DREQ is sent twice (no DREP can come back: the program's port is gone), which a
peer takes as a DREQ and its duplicate, as from a kernel that retransmits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["install", "Reaper", "SPORTS"]

#: the source ports the guardian tries, in order (a DREQ is prepared for each, its ICRC
#: covers the port): QP1's own (rxe's 0xD872), then the RoCEv2 port the program's
#: device listened on, both free once the program is gone
SPORTS = (55410, 4791)
_ROCE_PORT = 4791


class Reaper:
    """The program's side: keeps the guardian's list equal to the connections
    established, starting the guardian at the first one."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.pid = os.getpid()
        self.listed: dict[int, set[str]] = {}  # id(service) -> keys the guardian holds
        self.broken = False

    def watch(self, service: Any) -> None:
        """A :class:`~softrdma.soft.cm_service.CmService` watcher (device lock held)."""
        if self.broken:
            return
        if os.getpid() != self.pid:  # a forked child: a guardian of its own
            self.__init__()
        try:
            self._update(service)
        except Exception as e:  # never let the guardian break the CM
            self.broken = True
            print(f"softrdma exec: the connection guardian stopped: {e!r} (a peer of "
                  f"this program will not be told if it dies)", file=sys.stderr)

    def _update(self, service: Any) -> None:
        now = {f"{id(service):x}.{c.local_id:x}": c for c in service.established()}
        had = self.listed.setdefault(id(service), set())
        lines = [f"- {k}\n" for k in had - now.keys()]
        for key in now.keys() - had:
            lines.append(self._add_line(key, service, now[key]))
        if not lines:
            return
        if self.proc is None:
            self._start()
        os.write(self.proc.stdin.fileno(), "".join(lines).encode())
        had.clear()
        had.update(now)

    @staticmethod
    def _add_line(key: str, service: Any, cm_id: Any) -> str:
        import ipaddress
        from ..cm.qp1 import build_qp1
        from ..soft.cm_service import mad_address
        from ..wire.icrc import icrc_ipv4, icrc_ipv6
        src = bytes(service.device.ip_packed)
        dst_ip, _ = mad_address(cm_id.dest)
        dst = ipaddress.ip_address(dst_ip).packed
        icrc = icrc_ipv4 if len(dst) == 4 else icrc_ipv6
        frames = []
        for sport in SPORTS:
            pkt = build_qp1(service.agent.dreq_mad(cm_id))
            pkt[-4:] = icrc(pkt, src, dst, sport).to_bytes(4, "little")
            frames.append(bytes(pkt).hex())
        return (f"+ {key} {ipaddress.ip_address(src)} {ipaddress.ip_address(dst)} "
                f"{' '.join(frames)}\n")

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONPATH")}
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", __file__],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     env=env, start_new_session=True)


def install() -> None:
    """Watch every CM of this process (called once, by :mod:`.cma`'s install)."""
    from ..soft.cm_service import CmService
    CmService.watchers.append(Reaper().watch)


# ---- the guardian (this file run as a script: stdlib only) ---------------------------

def guardian(lines: Any = None) -> int:
    """Read the program's list from stdin until it ends, then send the DREQs of what is
    left; returns how many connections it ended."""
    held: dict[str, list[str]] = {}
    for line in lines if lines is not None else sys.stdin:
        parts = line.split()
        if parts[:1] == ["+"] and len(parts) == 4 + len(SPORTS):
            held[parts[1]] = parts[2:]
        elif parts[:1] == ["-"] and len(parts) == 2:
            held.pop(parts[1], None)
    for _ in range(2):
        for src, dst, *frames in held.values():
            _send(src, dst, frames)
        time.sleep(0.05)
    return len(held)


def _send(src: str, dst: str, frames: list[str]) -> None:
    fam = socket.AF_INET6 if ":" in src else socket.AF_INET
    for sport, frame in zip(SPORTS, frames):
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            try:
                s.bind((src, sport))
            except OSError:
                continue  # the port is taken: the next one's frame
            try:
                s.sendto(bytes.fromhex(frame), (dst, _ROCE_PORT))
            except OSError:
                pass
            return


if __name__ == "__main__":
    guardian()
