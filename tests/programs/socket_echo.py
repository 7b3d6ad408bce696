"""An echo server for tests/test_socket.py: softrdma.socket on ADDR PORT; each message
comes back; prints READY once listening; serves one client, then exits 0 at its EOF.

    python tests/programs/socket_echo.py 127.0.12.1 9000 [--die-after N]

``--die-after N`` kills the process (os._exit, no goodbye) after echoing N messages:
the client's side of a peer that vanished."""

import os
import sys

from softrdma import socket as rsock
from softrdma.verbs_api import add_device

ip, port = sys.argv[1], int(sys.argv[2])
die_after = int(sys.argv[sys.argv.index("--die-after") + 1]) if "--die-after" in sys.argv else -1
add_device(ip, name="echo")
with rsock.create_server((ip, port)) as srv:
    print("READY", flush=True)
    conn, peer = srv.accept()
    n = 0
    try:
        while True:
            msg = conn.recv()
            conn.send(msg)
            n += 1
            if n == die_after:
                os._exit(3)
    except EOFError:
        pass
    conn.close()
print("ECHOED", n, flush=True)
