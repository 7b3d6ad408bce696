"""The client side of the socket interop runs (tests/interop/test_socket_hw.py):
softrdma.socket to ADDR PORT, messages of several sizes echoed back and compared;
prints "OK N" (N messages) and exits 0.

    python tests/programs/socket_check.py 10.77.0.11 7600 [--bind 10.77.0.1]
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from softrdma import socket as rsock  # noqa: E402

ip, port = sys.argv[1], int(sys.argv[2])
bind = sys.argv[sys.argv.index("--bind") + 1] if "--bind" in sys.argv else None
rnd = random.Random(11)
sizes = [0, 1, 31, 4095, 4096, 4097, 65536, 1 << 20]
s = rsock.socket()
s.settimeout(120)
if bind:
    s.bind((bind, 0))
s.connect((ip, port))
for size in sizes:
    data = rnd.randbytes(size)
    assert s.send(data) == size
    back = s.recv()
    assert back == data, f"message of {size} bytes came back as {len(back)} bytes"
assert s.getpeername() == (ip, port), s.getpeername()
s.close()
print("OK", len(sizes), flush=True)
