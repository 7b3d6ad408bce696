"""``softrdma mq``: watch several senders feed one receiver (softrdma.socket's message
queue) across processes.

    softrdma mq recv 127.0.0.1:7500                       # prints what arrives
    softrdma mq send 127.0.0.1:7500 hello "second one"    # each word a message
    softrdma mq send 127.0.0.1:7500 --frames a b c        # one message in three frames

``recv`` prints one line per frame, ``<sender ip>:<port> <text>`` (with ``+`` after the
sender while more frames of the same message follow), and stops after ``--count``
messages or ``--timeout`` seconds of silence. ``send`` takes ``--bind`` for its own
address (else the default device).
"""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any

from .argtypes import int_range, positive_float
from .common import ToolError, add_fault_option, cm_device_for

__all__ = ["add_parser"]


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        p = int(port)
        if not sep or not 0 < p <= 0xFFFF:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not IP:PORT") from None
    return host.strip("[]"), p


#: the help page's text (the module docstring is for readers of the code)
DESCRIPTION = """\
Watch several senders feed one receiver (the message queue of softrdma.socket) across
processes.

    softrdma mq recv 127.0.0.1:7500                       # prints what arrives
    softrdma mq send 127.0.0.1:7500 hello "second one"    # each word a message
    softrdma mq send 127.0.0.1:7500 --frames a b c        # one message in three frames

recv prints one line per frame, "<sender ip>:<port> <text>" (with "+" after the sender
while more frames of the same message follow), and stops after --count messages or
--timeout seconds of silence. send takes --bind for its own address (else the default
device)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("mq", help="the many-senders message queue of softrdma.socket: recv "
                                  "and send", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_subparsers(dest="mq_cmd", metavar="{recv,send}", required=True)
    r = m.add_parser("recv", help="be the receiver: print every message, with its sender")
    r.add_argument("address", type=_address, help="IP:PORT to bind (a soft device's address)")
    r.add_argument("--count", type=int_range(1, None), help="stop after this many messages")
    r.add_argument("--timeout", type=positive_float, default=None,
                   help="stop after this many seconds without a message")
    add_fault_option(r)
    r.set_defaults(func=_recv)
    s = m.add_parser("send", help="be a sender: send each MESSAGE")
    s.add_argument("address", type=_address, help="the receiver's IP:PORT")
    s.add_argument("messages", nargs="+", metavar="MESSAGE")
    s.add_argument("--frames", action="store_true",
                   help="send the MESSAGEs as the frames of one message")
    s.add_argument("--bind", help="local address (a soft device is made for it)")
    add_fault_option(s)
    s.set_defaults(func=_send)


def _recv(a: argparse.Namespace) -> int:
    from ..socket import Receiver
    cm_device_for(a.address[0])
    got = 0
    try:
        with Receiver(a.address) as rx:
            print(f"receiving on {a.address[0]}:{a.address[1]}", flush=True)
            while a.count is None or got < a.count:
                try:
                    m = rx.recv(timeout=a.timeout)
                except TimeoutError:
                    break
                text = m.data.decode("utf-8", "backslashreplace")
                print(f"{m.sender[0]}:{m.sender[1]}{'+' if m.more else ''} {text}", flush=True)
                got += 0 if m.more else 1
    except OSError as e:
        raise ToolError(f"mq recv: {e}") from None
    return 0


def _send(a: argparse.Namespace) -> int:
    from .. import socket as rsock
    if a.bind:
        cm_device_for(a.bind)
    try:
        with rsock.socket() as s:
            s.settimeout(30)
            if a.bind:
                s.bind((a.bind, 0))
            s.connect(a.address)
            last = len(a.messages) - 1
            for i, msg in enumerate(a.messages):
                s.send(msg.encode(), more=a.frames and i < last)
    except ConnectionRefusedError as e:
        raise ToolError(f"mq send: nobody receives on {a.address[0]}:{a.address[1]} ({e})") \
            from None
    except OSError as e:
        raise ToolError(f"mq send: {e}") from None
    return 0

