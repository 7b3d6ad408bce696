"""A sender in an endless run, for tests/test_socket_limits.py: connects from SRC to
DST:PORT, then sends COUNT frames of FRAME bytes, all with ``more=True`` (a run that never
ends); prints CONNECTED, then ``SENT n`` or ``ERR <exception class> <message>``.

    python tests/programs/mq_endless.py SRC DST PORT FRAME COUNT [--blind]

``--blind`` makes a sender that does not look at the limits in the receiver's hello (as
one that predates them): it sends what the receiver said it would refuse."""

import sys
import time

from softrdma import socket as rsock
from softrdma.socket.conn import Connection
from softrdma.verbs_api import add_device


class BlindConnection(Connection):
    def check_size(self, n: int) -> None:
        pass  # the receiver's limits are ignored


class BlindSocket(rsock.socket):
    def _make_conn(self, hub, cmid):
        return BlindConnection(hub, cmid, self.options)


src, dst, port, frame, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
add_device(src, name="endless")
s = (BlindSocket if "--blind" in sys.argv else rsock.socket)()
s.settimeout(60)
s.bind((src, 0))
s.connect((dst, port))
print("CONNECTED", flush=True)
n = 0
try:
    for n in range(count):
        s.send(b"r" * frame, more=True)
    n = count
    # the receiver's error (an ABORT) may come after the last send went out
    s.settimeout(10)
    s.recv()
    print("SENT", n, flush=True)
except BaseException as e:
    print("ERR", type(e).__name__, e, "after", n, flush=True)
time.sleep(0.5)
s.close()
