"""softrdma.readiness: waits that work for any descriptor number.

A device keeps up to 4,096 source-port sockets, so a softrdma process holds descriptors of
1024 and more in ordinary use, where ``select.select`` raises ValueError (FD_SETSIZE)."""

from __future__ import annotations

import os
import resource
import select

import pytest

from softrdma.readiness import readable


@pytest.fixture
def high_pipe():
    """A pipe whose read end is descriptor 1024 or more (what select() refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        if hard != resource.RLIM_INFINITY and hard < 1100:
            pytest.fail(f"RLIMIT_NOFILE hard limit {hard} is below 1100")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    r, w = os.pipe()
    hi_r, hi_w = os.dup2(r, 1050), os.dup2(w, 1051)
    os.close(r)
    os.close(w)
    yield hi_r, hi_w
    os.close(hi_r)
    os.close(hi_w)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_descriptor_past_fd_setsize_is_waited_on(high_pipe):
    r, w = high_pipe
    with pytest.raises(ValueError):  # the premise: select() cannot take it
        select.select([r], [], [], 0)
    assert readable([r], 0) == []
    os.write(w, b"x")
    assert readable([r], None) == [r]


class _File:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def test_objects_with_fileno_come_back_as_given_and_in_order():
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    try:
        a, b = _File(r1), _File(r2)
        os.write(w2, b"x")
        assert readable([a, b], 0) == [b]
        os.write(w1, b"x")
        assert readable([a, b], 1.0) == [a, b]
        os.close(w2)  # a closed writer reads as ready (EOF), as with select()
        os.read(r2, 1)
        assert b in readable([b], 0)
    finally:
        for fd in (r1, w1, r2):
            os.close(fd)
