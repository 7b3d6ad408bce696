"""The socket layer's rdma_cm handshake, written once in ``SocketBase`` for both
protocols (softrdma's message socket and rsocket): its deadline handling, the passive
side's answer to a request, and that neither protocol keeps a copy of its own."""

from __future__ import annotations

import errno
import itertools
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from softrdma import socket as rsock
from softrdma.socket import base
from softrdma.socket.base import SocketBase, accept_request, wait_slice
from softrdma.socket.conn import Connection
from softrdma.socket.rsconn import RSConn
from softrdma.socket.rsocket import RSocket


class SilentChannel:
    """A listener's CM event channel on which no request ever comes; it records how
    long each wait was asked to block."""

    def __init__(self) -> None:
        self.waits: list[float | None] = []
        self.fd = -1

    @property
    def channel(self) -> "SilentChannel":  # (the socket layer once reached through here)
        return self

    def pending(self) -> bool:
        return False

    def wait(self, timeout: float | None) -> None:
        self.waits.append(timeout)

    def close(self) -> None:
        pass


def scripted_clock(monkeypatch: pytest.MonkeyPatch, *times: float) -> None:
    """time.monotonic, as the socket layer's modules see it, returns ``times`` and then
    goes on by 0.5 s a call."""
    ticks = itertools.chain(times, itertools.count(times[-1] + 0.5, 0.5))
    fake = SimpleNamespace(monotonic=lambda: next(ticks))
    for name, mod in list(sys.modules.items()):
        if name.startswith("softrdma.socket") and getattr(mod, "time", None) is not None:
            monkeypatch.setattr(mod, "time", fake)


@pytest.mark.parametrize("protocol", ["softrdma", "rsocket"])
def test_accept_whose_deadline_passes_before_the_wait_never_waits_a_negative_time(
        monkeypatch: pytest.MonkeyPatch, protocol: str) -> None:
    s = rsock.socket(protocol=protocol)
    s.settimeout(1.0)
    ch = SilentChannel()
    s._channel, s._listening = ch, True  # a listener, without a device
    # the deadline is 101.0; the timeout check sees 100.9 (not yet), the wait's own
    # reading 101.5: what is left is -0.5 s, which must reach the channel as 0
    scripted_clock(monkeypatch, 100.0, 100.9, 101.5)
    with pytest.raises(TimeoutError) as exc:
        s.accept()
    assert exc.value.errno == errno.ETIMEDOUT
    assert ch.waits and all(w is not None and 0.0 <= w <= base.WAIT_SLICE for w in ch.waits), \
        ch.waits
    s._channel = None
    s.close()


def test_wait_slice_is_bounded_and_never_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    assert wait_slice(None) == base.WAIT_SLICE
    monkeypatch.setattr(base, "time", SimpleNamespace(monotonic=lambda: 50.0))
    assert wait_slice(49.0) == 0.0
    assert wait_slice(50.1) == pytest.approx(0.1)
    assert wait_slice(99.0) == base.WAIT_SLICE


class FakeRequest:
    """The child id of a CONNECT_REQUEST: records what the handshake does to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def set_option(self, level: int, name: int, value: int) -> None:
        self.calls.append(("set_option", value))

    def accept(self, param: Any) -> None:
        self.calls.append(("accept", param))

    def reject(self, data: bytes) -> None:
        self.calls.append(("reject", data))


class FakeConn:
    def __init__(self, bad_data: bool = False) -> None:
        self.bad_data = bad_data
        self.saved: bytes | None = None
        self.req: Any = None

    def save_conn_data(self, data: bytes) -> None:
        if self.bad_data:
            raise ConnectionError(errno.EPROTO, "not our protocol")
        self.saved = data

    def conn_param(self, req: Any = None) -> str:
        self.req = req
        return "our REP"

    def release(self) -> None:
        self.released = True


def test_accept_request_answers_with_our_data_after_taking_the_peers() -> None:
    child, conn = FakeRequest(), FakeConn()
    ev = SimpleNamespace(private_data=b"theirs", param="their REQ")
    assert accept_request(child, ev, 16, lambda cmid: conn) is conn  # type: ignore[arg-type]
    assert conn.saved == b"theirs" and conn.req == "their REQ"
    assert child.calls == [("set_option", 16), ("accept", "our REP")]
    # None keeps rdma_cm's ACK timeout: no option set
    child = FakeRequest()
    accept_request(child, ev, None, lambda cmid: FakeConn())  # type: ignore[arg-type]
    assert [c[0] for c in child.calls] == ["accept"]


def test_accept_request_rejects_what_it_cannot_take() -> None:
    child, conn = FakeRequest(), FakeConn(bad_data=True)
    ev = SimpleNamespace(private_data=b"junk", param=None)
    assert accept_request(child, ev, 16,  # type: ignore[arg-type]
                          lambda cmid: conn) is None
    assert child.calls == [("set_option", 16), ("reject", b"")]
    # the endpoint made for it (its QP and MRs) goes with it: a REQ with a bad hello
    # must not leave a connection behind in its hub
    assert getattr(conn, "released", False)


def test_both_protocols_use_the_one_handshake() -> None:
    for cls in (rsock.socket, RSocket):
        # (accept is redefined by each only to narrow its return type)
        for name in ("_accept_one", "_listener_progress", "connect", "_expect", "listen"):
            assert getattr(cls, name) is getattr(SocketBase, name), \
                f"{cls.__name__}.{name} is a copy of the handshake"
    # one name for each thing the handshake asks of a connection
    for conn in (Connection, RSConn):
        assert callable(conn.save_conn_data) and callable(conn.conn_param)
        assert not hasattr(conn, "set_peer")
