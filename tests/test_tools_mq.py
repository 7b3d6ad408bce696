"""``softrdma mq recv`` and ``softrdma mq send``: three processes on 127.0.22.x, the
receiver printing each frame with its sender; a run of frames stays together."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import ROOT

ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "softrdma", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT, **kw)


def test_two_senders_feed_one_receiver():
    rx = cli("mq", "recv", "127.0.22.1:7500", "--count", "3", "--timeout", "30")
    try:
        assert rx.stdout.readline().strip() == "receiving on 127.0.22.1:7500"
        a = cli("mq", "send", "127.0.22.1:7500", "--bind", "127.0.22.2", "hello", "second one")
        assert a.wait(60) == 0, a.stderr.read()
        b = cli("mq", "send", "127.0.22.1:7500", "--bind", "127.0.22.3", "--frames",
                "x", "y", "z")
        assert b.wait(60) == 0, b.stderr.read()
        out, err = rx.communicate(timeout=60)
        assert rx.returncode == 0, err
        lines = [line.split(" ", 1) for line in out.splitlines()]
        assert [(s.split(":")[0], t) for s, t in lines] == [
            ("127.0.22.2", "hello"), ("127.0.22.2", "second one"),
            ("127.0.22.3", "x"), ("127.0.22.3", "y"), ("127.0.22.3", "z")]
        assert [s.endswith("+") for s, _ in lines] == [False, False, True, True, False]
    finally:
        rx.kill()


def test_send_to_a_port_nobody_receives_on_is_one_line_and_exit_1():
    rx = cli("mq", "recv", "127.0.22.11:7502", "--timeout", "30")
    try:
        assert rx.stdout.readline().strip() == "receiving on 127.0.22.11:7502"
        p = cli("mq", "send", "127.0.22.11:7503", "--bind", "127.0.22.12", "lost")
        out, err = p.communicate(timeout=60)
        assert p.returncode == 1
        assert err.count("\n") == 1 and "nobody receives on 127.0.22.11:7503" in err
    finally:
        rx.kill()
