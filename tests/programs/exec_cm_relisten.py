"""A server that listens, destroys its listener and listens again on the same port, as
perftest's -R server does between its control and its data connections; for
tests/test_exec_misuse.py. Run by Debian's /usr/bin/python3 under ``softrdma exec``
(librdmacm through ctypes, with exec_cm_ctypes.py's structures).

    exec_cm_relisten.py ADDR PORT

1. listens, accepts one connection (no QP), sees it established and disconnected,
   binds another id (which stays, as perftest's control connection does), destroys the
   listener and prints "no listener";
2. waits for a line on stdin (meanwhile a client's request finds no listener: rejected);
3. listens again on the same port, prints "listening again", accepts the next client,
   sees it established and disconnected, and prints "done".
"""

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exec_cm_ctypes import V, check, conn, get, lib, sin  # noqa: E402


def listen(ch, addr, port):
    cid = V()
    check(lib.rdma_create_id(V(ch), ctypes.byref(cid), None, 0x106), "rdma_create_id")
    check(lib.rdma_bind_addr(cid, sin(addr, port)), "rdma_bind_addr")
    check(lib.rdma_listen(cid, 1), "rdma_listen")
    return cid


def accept_one(ch):
    child, _ = get(ch, "RDMA_CM_EVENT_CONNECT_REQUEST")
    p = conn(b"hello client", 0x111)
    check(lib.rdma_accept(V(child), ctypes.byref(p)), "rdma_accept")
    get(ch, "RDMA_CM_EVENT_ESTABLISHED")
    return child


def main(addr, port):
    ch = lib.rdma_create_event_channel()
    first = listen(ch, addr, port)
    print("listening", flush=True)
    child = accept_one(ch)
    get(ch, "RDMA_CM_EVENT_DISCONNECTED")
    check(lib.rdma_destroy_id(V(child)), "rdma_destroy_id")  # (the DREP)
    # an id that stays through the gap, as perftest's control connection does
    keep = V()
    check(lib.rdma_create_id(V(ch), ctypes.byref(keep), None, 0x106), "rdma_create_id")
    check(lib.rdma_bind_addr(keep, sin(addr, port + 1)), "rdma_bind_addr")
    check(lib.rdma_destroy_id(first), "rdma_destroy_id")
    print("no listener", flush=True)
    sys.stdin.readline()
    again = listen(ch, addr, port)
    print("listening again", flush=True)
    child = accept_one(ch)
    get(ch, "RDMA_CM_EVENT_DISCONNECTED")
    check(lib.rdma_destroy_id(V(child)), "rdma_destroy_id")
    check(lib.rdma_destroy_id(again), "rdma_destroy_id")
    check(lib.rdma_destroy_id(keep), "rdma_destroy_id")
    lib.rdma_destroy_event_channel(V(ch))
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
