"""A message-queue sender for tests/test_socket.py: connects to a Receiver and sends
COUNT messages, each a run of 1..4 frames of random sizes (seeded by ID), every frame
tagged b"ID:message:frame:frames:"; with LOSS > 0 its device drops that fraction of what
it sends once connected (seeded), so RC recovery runs under the protocol.

    python tests/programs/mq_sender.py MY_IP RX_IP RX_PORT ID COUNT LOSS"""

import random
import sys

from softrdma import socket as rsock
from softrdma.verbs_api import add_device

my_ip, rx_ip, rx_port, ident, count, loss = sys.argv[1:7]
ident, count, loss = int(ident), int(count), float(loss)
dev = add_device(my_ip, name="sender", seed=1000 + ident)
rnd = random.Random(ident)
with rsock.socket() as s:
    s.bind((my_ip, 0))
    s.connect((rx_ip, int(rx_port)))
    dev.faults.tx.random.loss = loss  # from here on: data, ACKs, the goodbye
    for i in range(count):
        frames = rnd.randint(1, 4)
        for f in range(frames):
            size = rnd.choice([16, 200, 3000, 9000, 70000])
            tag = f"{ident}:{i}:{f}:{frames}:".encode()
            s.send(tag.ljust(size, bytes([65 + ident % 26])), more=f < frames - 1)
print("SENT", count, flush=True)
