"""What softrdma's pytest fixtures (:mod:`softrdma.pytest_plugin`) stand on, usable without
pytest: live soft devices on free loopback addresses, a connected QP pair over the
simulated network or over real UDP with one way to wait on both, and an in-memory packet
tap that becomes a pcap only when asked (a failed test).

    from softrdma.harness.fixtures import make_pair
    pair = make_pair("RC", transport="udp", seed=0)
    a, b = pair
    b.post_recv(b.buf_sge(0, 64), wr_id=1)
    a.post_send(IBV_WR_SEND, a.buf_sge(0, 64), wr_id=2)
    assert pair.run_until(lambda: a.ncomp() and b.ncomp(), timeout=5)
    pair.close()
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..data import find_capture
from ..soft.device import SoftDevice
from ..verbs_api import Context, QPCap
from ..verbs_api.device import find_device, register_device, unregister_device
from ..wire.frames import encode_frame
from ..wire.pcap import PcapWriter
from .replay import load_capture, replay_side
from .replaydiff import ReplayDiff, ReplayMismatch, diff_replay
from .sim import SimNetwork
from .testing import Endpoint, connect, connected_pair

__all__ = ["PacketTap", "TappedSimNetwork", "QpPair", "Replay", "live_device", "make_pair",
           "close_device", "device_names"]

# Each process starts in its own block of 127.64.0.0/10 (by PID), so concurrent test
# processes rarely probe the same addresses; a taken one is skipped by the device itself
# (auto_address: the next address up), so a collision costs a retry, never a failure.
_LOOPBACK_BASE = int(ipaddress.ip_address("127.64.0.0")) + (os.getpid() % 16384) * 256
_loopback_seq = itertools.count()
_name_seq = itertools.count()


def _next_loopback() -> str:
    """The next address of this process's block (.1 to .254, then around again: by then
    the first devices are long closed, and one still bound is stepped over)."""
    return str(ipaddress.ip_address(_LOOPBACK_BASE + 1 + next(_loopback_seq) % 254))


def device_names(prefix: str = "pytest") -> Iterator[str]:
    """Device names not in the registry yet (``pytest0``, ``pytest1``, ...)."""
    while True:
        name = f"{prefix}{next(_name_seq)}"
        if find_device(name) is None:
            yield name


class PacketTap:
    """Every packet the tapped devices send, and what they receive from untapped senders,
    kept in memory as Ethernet frames; :meth:`write` makes a pcap of them.

    A device's ``capture`` slot is the hook (the one ``SOFTRDMA_PCAP`` fills): the device
    records each packet it sends and each it receives. A packet between two tapped devices
    is kept once, as its sender sent it (on a simulated network, before loss or corruption);
    a device's packets to itself (rxe's loopback) appear twice, sent and received.
    """

    def __init__(self) -> None:
        self.frames: list[tuple[float, bytes]] = []
        self.ips: set[bytes] = set()

    def attach(self, dev: SoftDevice, clock: Callable[[], float] = time.time) -> None:
        self.ips.add(dev.ip_packed)
        dev.capture = _DeviceTap(self, dev, clock)

    def write(self, path: str | os.PathLike[str]) -> int:
        """Write the frames to ``path`` (directories made); how many were written."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with PcapWriter(str(path), nanosecond=True) as w:
            for ts, frame in self.frames:
                w.write(frame, ts=ts)
        return len(self.frames)


class _DeviceTap:
    """The ``capture`` object one device records into (PacketCapture's interface)."""

    def __init__(self, tap: PacketTap, dev: SoftDevice, clock: Callable[[], float]) -> None:
        self.tap, self.dev, self.clock = tap, dev, clock
        self.count = 0

    def record(self, roce: bytes, src: bytes, dst: bytes, sport: int, ip_id: int = 0,
               tos: int = 0) -> None:
        if src != self.dev.ip_packed and src in self.tap.ips:
            return  # its tapped sender already recorded it
        self.tap.ips.add(self.dev.ip_packed)  # an auto-addressed device may have moved
        frame = encode_frame(roce, src=src, dst=dst, sport=sport, ip_id=ip_id, ttl=64,
                             tos=tos, fill_icrc=False)
        self.tap.frames.append((self.clock(), frame))
        self.count += 1

    def close(self) -> None:
        pass  # the frames outlive the device: the test's end decides whether they are kept


class TappedSimNetwork(SimNetwork):
    """A :class:`SimNetwork` whose devices record into a :class:`PacketTap` (stamped with
    the virtual clock) when one is given."""

    def __init__(self, seed: int = 0, tap: PacketTap | None = None, **profile: Any) -> None:
        super().__init__(seed=seed, **profile)
        self.tap = tap

    def attach(self, dev: SoftDevice) -> None:
        super().attach(dev)
        if self.tap is not None:
            self.tap.attach(dev, clock=lambda: self.now)


def live_device(*, seed: int | None = None, mtu: int | None = 1500,
                tap: PacketTap | None = None, name: str | None = None) -> tuple[SoftDevice, Context]:
    """A registered live soft device bound to UDP 4791 on a free loopback address, and the
    context that holds it open (closing it, or :func:`close_device`, unbinds it)."""
    name = name or next(device_names())
    dev = SoftDevice(name, _next_loopback(), mtu=mtu, seed=seed, live=True, auto_address=True)
    register_device(dev)
    try:
        ctx = Context(name=name)  # binds: a taken address moves the device up
    except BaseException:
        unregister_device(name)
        raise
    if tap is not None:
        tap.attach(dev)
    return dev, ctx


def close_device(dev: SoftDevice, *ctxs: Context) -> None:
    """Close ``ctxs``, stop the device whatever contexts remain, and unregister it."""
    for c in ctxs:
        c.close()
    dev.detach()
    unregister_device(dev.name)


class QpPair:
    """Two connected endpoints (:class:`~softrdma.harness.testing.Endpoint`: context, PD,
    CQ, an MR with every access right, a QP in RTS) over ``transport`` ``"sim"`` or
    ``"udp"``. ``a, b = pair`` unpacks them; :meth:`run_until` waits the same way on both."""

    def __init__(self, a: Endpoint, b: Endpoint, transport: str, net: SimNetwork | None,
                 devices: list[SoftDevice]) -> None:
        self.a, self.b = a, b
        self.transport = transport
        self.net = net
        self.devices = devices

    def __iter__(self) -> Iterator[Endpoint]:
        return iter((self.a, self.b))

    def run_until(self, cond: Callable[[], Any], timeout: float = 10.0) -> bool:
        """Until ``cond()`` is true; False if ``timeout`` seconds pass first. On ``sim``
        they are virtual seconds (the network runs events until then, instantly); on
        ``udp`` wall-clock seconds, while the devices' progress threads move packets."""
        if self.net is not None:
            return self.net.run_until(lambda: bool(cond()), timeout=timeout)
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                return bool(cond())
            time.sleep(0.0005)
        return True

    def close(self) -> None:
        """Close both endpoints and unregister their devices (idempotent)."""
        for e in (self.a, self.b):
            e.close()
        for dev in self.devices:
            if self.transport == "udp":
                dev.detach()
            unregister_device(dev.name)
        self.devices = []

    def __repr__(self) -> str:
        return f"<QpPair {self.a.qp_type} over {self.transport}: {self.a.device.ip} <-> " \
               f"{self.b.device.ip}>"


def make_pair(qp_type: str = "RC", transport: str = "sim", *, net: SimNetwork | None = None,
              seed: int = 0, tap: PacketTap | None = None, mr_size: int = 1 << 20,
              cap: QPCap | None = None, cqe: int = 4096,
              psns: tuple[int, int] = (100, 0xFFFFF0), mtu: int = 1500,
              a_attrs: dict | None = None, b_attrs: dict | None = None,
              **profile: Any) -> QpPair:
    """Two connected endpoints of ``qp_type`` (``RC``, ``UC``, ``UD``) with
    :func:`~softrdma.harness.testing.connected_pair`'s attributes. ``sim``: on ``net``, or on
    a new network from ``seed`` and the link ``profile`` (``loss=0.05``...); ``udp``: on two
    new live devices on loopback (``profile`` is refused there: loopback loses nothing)."""
    if qp_type not in ("RC", "UC", "UD"):
        raise ValueError(f"qp_type {qp_type!r}: expected 'RC', 'UC' or 'UD'")
    kw = dict(mr_size=mr_size, cap=cap, cqe=cqe, psns=psns, mtu=mtu, a_attrs=a_attrs,
              b_attrs=b_attrs)
    if transport == "sim":
        if net is None:
            net = TappedSimNetwork(seed=seed, tap=tap, **profile)
        elif profile:
            raise TypeError(f"link settings {sorted(profile)} go to the network, not the pair")
        before = set(net.devices)
        a, b = connected_pair(net, qp_type, **kw)
        devs = [d for ip, d in net.devices.items() if ip not in before]
        return QpPair(a, b, "sim", net, devs)
    if transport != "udp":
        raise ValueError(f"transport {transport!r}: expected 'sim' or 'udp'")
    if profile or net is not None:
        raise TypeError("link settings and net= are for transport='sim'")
    rng = random.Random(seed)
    made: list[tuple[SoftDevice, Context]] = []
    try:
        for _ in range(2):
            made.append(live_device(seed=rng.randrange(1 << 30), mtu=mtu, tap=tap))
        qcap = cap or QPCap(max_send_wr=256, max_recv_wr=256, max_send_sge=4,
                            max_recv_sge=4, max_inline_data=64)
        (da, ca), (db, cb) = made
        a = Endpoint(ca, qp_type, mr_size, qcap, cqe)
        b = Endpoint(cb, qp_type, mr_size, qcap, cqe)
        connect(a, b, psns[0], psns[1], **(a_attrs or {}))
        connect(b, a, psns[1], psns[0], **(b_attrs or {}))
    except BaseException:
        for dev, ctx in made:
            close_device(dev, ctx)
        raise
    return QpPair(a, b, "udp", None, [da, db])


class Replay:
    """Replays of real captures with softrdma standing in for one endpoint
    (:func:`~softrdma.harness.replay.replay_side`), judged by
    :func:`~softrdma.harness.replaydiff.diff_replay`."""

    def run(self, pcap: str | os.PathLike[str], ip: str, **kw: Any) -> ReplayDiff:
        """Replay softrdma as ``ip`` in ``pcap``; the :class:`ReplayDiff` (``.ok``,
        ``.packets``, ``.format()``). ``kw`` go to ``replay_side`` (``inline``, ``rx_depth``,
        ``max_rd_atomic``, ``max_dest_rd_atomic``)."""
        pcap = find_capture(pcap)  # a path, or the name of a capture installed with softrdma
        res = replay_side(load_capture(str(pcap)), ip, device_name=next(device_names("replay")),
                          **kw)
        return diff_replay(res, ip, str(pcap))

    def assert_matches(self, pcap: str | os.PathLike[str], ip: str, *, limit: int = 3,
                       **kw: Any) -> ReplayDiff:
        """Raise :class:`ReplayMismatch` (an AssertionError) unless softrdma, as ``ip``,
        sends exactly the packets ``pcap`` shows ``ip`` sending; its message shows the first
        ``limit`` differing packets field by field."""
        __tracebackhide__ = True  # pytest: the failure points at the caller's line
        diff = self.run(pcap, ip, **kw)
        if not diff.ok:
            raise ReplayMismatch(diff, limit)
        return diff
