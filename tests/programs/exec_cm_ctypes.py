"""A program that calls librdmacm the way a C program does (ctypes: the symbols the
dynamic linker binds, the C structures of rdma_cma.h), for tests/test_exec_cma.py. Run by
Debian's /usr/bin/python3 under ``softrdma exec``; prints one line per step.

    exec_cm_ctypes.py server ADDR PORT     listen, accept one request (no QP), wait for
                                           ESTABLISHED and DISCONNECTED
    exec_cm_ctypes.py client ADDR PORT     resolve, connect (no QP), establish, disconnect
    exec_cm_ctypes.py client-exit ADDR PORT  the same, then exit with the id alive
    exec_cm_ctypes.py channel ADDR         the event channel's descriptor and O_NONBLOCK
    exec_cm_ctypes.py addrinfo ADDR PORT   rdma_getaddrinfo answers
    exec_cm_ctypes.py misuse ADDR          wrong calls and the errno each gets
"""

import ctypes
import errno
import fcntl
import os
import select
import socket
import struct
import sys

lib = ctypes.CDLL(None, use_errno=True)
V = ctypes.c_void_p
lib.rdma_event_str.restype = ctypes.c_char_p
lib.rdma_create_event_channel.restype = V
lib.rdma_get_src_port.restype = ctypes.c_uint16
lib.rdma_get_dst_port.restype = ctypes.c_uint16
lib.rdma_get_devices.restype = ctypes.POINTER(V)


class ConnParam(ctypes.Structure):
    _fields_ = [("private_data", V), ("private_data_len", ctypes.c_uint8),
                ("responder_resources", ctypes.c_uint8), ("initiator_depth", ctypes.c_uint8),
                ("flow_control", ctypes.c_uint8), ("retry_count", ctypes.c_uint8),
                ("rnr_retry_count", ctypes.c_uint8), ("srq", ctypes.c_uint8),
                ("qp_num", ctypes.c_uint32)]


class Event(ctypes.Structure):
    _fields_ = [("id", V), ("listen_id", V), ("event", ctypes.c_int), ("status", ctypes.c_int),
                ("conn", ConnParam)]


class CmId(ctypes.Structure):  # struct rdma_cm_id (rdma_cma.h, x86_64)
    _fields_ = [("verbs", V), ("channel", V), ("context", V), ("qp", V),
                ("src", ctypes.c_ubyte * 128), ("dst", ctypes.c_ubyte * 128),
                ("sgid", ctypes.c_ubyte * 16), ("dgid", ctypes.c_ubyte * 16),
                ("pkey", ctypes.c_uint16), ("path_rec", V), ("num_paths", ctypes.c_int),
                ("_route_end", ctypes.c_int),  # struct rdma_route ends 8-aligned
                ("ps", ctypes.c_int), ("port_num", ctypes.c_uint8), ("event", V),
                ("send_cq_channel", V), ("send_cq", V), ("recv_cq_channel", V),
                ("recv_cq", V), ("srq", V), ("pd", V), ("qp_type", ctypes.c_int)]


class AddrInfo(ctypes.Structure):
    pass


AddrInfo._fields_ = [("ai_flags", ctypes.c_int), ("ai_family", ctypes.c_int),
                     ("ai_qp_type", ctypes.c_int), ("ai_port_space", ctypes.c_int),
                     ("ai_src_len", ctypes.c_uint), ("ai_dst_len", ctypes.c_uint),
                     ("ai_src_addr", V), ("ai_dst_addr", V), ("ai_src_canonname", V),
                     ("ai_dst_canonname", V), ("ai_route_len", ctypes.c_size_t),
                     ("ai_route", V), ("ai_connect_len", ctypes.c_size_t), ("ai_connect", V),
                     ("ai_next", ctypes.POINTER(AddrInfo))]


def sin(ip, port):
    return ctypes.create_string_buffer(struct.pack("<H", 2) + struct.pack(">H", port)
                                       + socket.inet_aton(ip) + bytes(8), 16)


def addr_of(raw):
    """'ip:port' of a sockaddr_in's bytes."""
    fam, = struct.unpack_from("<H", raw)
    assert fam == socket.AF_INET, fam
    return f"{socket.inet_ntoa(raw[4:8])}:{struct.unpack_from('>H', raw, 2)[0]}"


def check(r, what):
    if r:
        print(what, "failed", errno.errorcode.get(ctypes.get_errno()), flush=True)
        sys.exit(1)


def fd_of(ch):
    return ctypes.cast(ch, ctypes.POINTER(ctypes.c_int))[0]


def get(ch, want):
    r, _, _ = select.select([fd_of(ch)], [], [], 60)
    assert r, "no event in 60 s"
    ev = ctypes.POINTER(Event)()
    check(lib.rdma_get_cm_event(V(ch), ctypes.byref(ev)), "rdma_get_cm_event")
    e = ev.contents
    name = lib.rdma_event_str(e.event).decode()
    n = e.conn.private_data_len
    data = ctypes.string_at(e.conn.private_data, n) if n else b""
    print("event", name, e.status, data.rstrip(b"\0").decode(), n, e.conn.qp_num, flush=True)
    assert name == want, (name, want)
    out = (e.id, e.listen_id)
    check(lib.rdma_ack_cm_event(ev), "rdma_ack_cm_event")
    return out


def show_id(what, cid):
    s = ctypes.cast(cid, ctypes.POINTER(CmId)).contents
    print(what, "verbs", bool(s.verbs), "pd", bool(s.pd), "port_num", s.port_num,
          "src", addr_of(bytes(s.src)), "ps", hex(s.ps), "qp_type", s.qp_type, flush=True)
    return s


def conn(msg, qpn):
    return ConnParam(ctypes.cast(ctypes.c_char_p(msg), V), len(msg), 1, 1, 0, 7, 7, 0, qpn)


def server(addr, port):
    ch = lib.rdma_create_event_channel()
    cid = V()
    check(lib.rdma_create_id(V(ch), ctypes.byref(cid), None, 0x106), "rdma_create_id")
    check(lib.rdma_bind_addr(cid, sin(addr, port)), "rdma_bind_addr")
    s = show_id("bound", cid)
    n = ctypes.c_int()
    devs = lib.rdma_get_devices(ctypes.byref(n))
    print("devices", n.value, "same verbs", devs[0] == s.verbs, flush=True)
    lib.rdma_free_devices(devs)
    check(lib.rdma_listen(cid, 1), "rdma_listen")
    print("listening", flush=True)
    child, listen = get(ch, "RDMA_CM_EVENT_CONNECT_REQUEST")
    print("listen_id is the listener", listen == cid.value, flush=True)
    c = show_id("child", child)
    print("child dst", addr_of(bytes(c.dst)), "src port",
          socket.ntohs(lib.rdma_get_src_port(V(child))), flush=True)
    p = conn(b"hello client", 0x111)
    check(lib.rdma_accept(V(child), ctypes.byref(p)), "rdma_accept")
    get(ch, "RDMA_CM_EVENT_ESTABLISHED")
    get(ch, "RDMA_CM_EVENT_DISCONNECTED")
    check(lib.rdma_destroy_id(V(child)), "rdma_destroy_id")
    check(lib.rdma_destroy_id(cid), "rdma_destroy_id")
    lib.rdma_destroy_event_channel(V(ch))
    print("done", flush=True)


def client(addr, port):
    ch = lib.rdma_create_event_channel()
    cid = V()
    check(lib.rdma_create_id(V(ch), ctypes.byref(cid), None, 0x106), "rdma_create_id")
    check(lib.rdma_resolve_addr(cid, None, sin(addr, port), 2000), "rdma_resolve_addr")
    get(ch, "RDMA_CM_EVENT_ADDR_RESOLVED")
    s = show_id("resolved", cid)
    print("dst", addr_of(bytes(s.dst)), "dst port", socket.ntohs(lib.rdma_get_dst_port(cid)),
          flush=True)
    check(lib.rdma_resolve_route(cid, 2000), "rdma_resolve_route")
    get(ch, "RDMA_CM_EVENT_ROUTE_RESOLVED")
    print("num_paths", s.num_paths, flush=True)
    p = conn(b"hello server", 0x222)
    check(lib.rdma_connect(cid, ctypes.byref(p)), "rdma_connect")
    get(ch, "RDMA_CM_EVENT_CONNECT_RESPONSE")
    check(lib.rdma_establish(cid), "rdma_establish")
    select.select([fd_of(ch)], [], [], 0.5)  # the RTU reaches the server
    check(lib.rdma_disconnect(cid), "rdma_disconnect")
    get(ch, "RDMA_CM_EVENT_DISCONNECTED")
    check(lib.rdma_destroy_id(cid), "rdma_destroy_id")
    lib.rdma_destroy_event_channel(V(ch))
    print("done", flush=True)


def client_exit(addr, port):
    """Connect (no QP), then end without destroying anything, as a program on an error
    path does: its ids must leave the CM at exit."""
    ch = lib.rdma_create_event_channel()
    cid = V()
    check(lib.rdma_create_id(V(ch), ctypes.byref(cid), None, 0x106), "rdma_create_id")
    check(lib.rdma_resolve_addr(cid, None, sin(addr, port), 2000), "rdma_resolve_addr")
    get(ch, "RDMA_CM_EVENT_ADDR_RESOLVED")
    check(lib.rdma_resolve_route(cid, 2000), "rdma_resolve_route")
    get(ch, "RDMA_CM_EVENT_ROUTE_RESOLVED")
    p = conn(b"hello server", 0x222)
    check(lib.rdma_connect(cid, ctypes.byref(p)), "rdma_connect")
    get(ch, "RDMA_CM_EVENT_CONNECT_RESPONSE")
    check(lib.rdma_establish(cid), "rdma_establish")
    print("exiting without rdma_destroy_id", flush=True)
    sys.exit(0)


def channel(addr):
    ch = lib.rdma_create_event_channel()
    fd = fd_of(ch)
    print("fd", fd, "blocking", os.get_blocking(fd), "readable",
          bool(select.select([fd], [], [], 0)[0]), flush=True)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    ev = ctypes.POINTER(Event)()
    r = lib.rdma_get_cm_event(V(ch), ctypes.byref(ev))
    print("empty get", r, errno.errorcode.get(ctypes.get_errno()), flush=True)
    cid = V()
    check(lib.rdma_create_id(V(ch), ctypes.byref(cid), None, 0x106), "rdma_create_id")
    check(lib.rdma_resolve_addr(cid, None, sin(addr, 1), 2000), "rdma_resolve_addr")
    print("readable after resolve", bool(select.select([fd], [], [], 10)[0]), flush=True)
    check(lib.rdma_get_cm_event(V(ch), ctypes.byref(ev)), "rdma_get_cm_event")
    print("got", lib.rdma_event_str(ev.contents.event).decode(), flush=True)
    print("readable after get", bool(select.select([fd], [], [], 0)[0]), flush=True)
    check(lib.rdma_ack_cm_event(ev), "rdma_ack_cm_event")
    # edge-triggered epoll: each event is an edge, even onto a queue not yet drained
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN | select.EPOLLET)
    ids = []
    for _ in range(2):
        i = V()
        check(lib.rdma_create_id(V(ch), ctypes.byref(i), None, 0x106), "rdma_create_id")
        check(lib.rdma_resolve_addr(i, None, sin(addr, 1), 2000), "rdma_resolve_addr")
        print("epoll edge", len(ep.poll(10)), flush=True)
        ids.append(i)
    for _ in ids:
        check(lib.rdma_get_cm_event(V(ch), ctypes.byref(ev)), "rdma_get_cm_event")
        check(lib.rdma_ack_cm_event(ev), "rdma_ack_cm_event")
    print("epoll after draining", len(ep.poll(0)), flush=True)
    for i in ids:
        check(lib.rdma_destroy_id(i), "rdma_destroy_id")
    ep.close()
    check(lib.rdma_destroy_id(cid), "rdma_destroy_id")
    lib.rdma_destroy_event_channel(V(ch))
    try:
        os.fstat(fd)
        print("fd open after destroy", flush=True)
    except OSError:
        print("fd closed after destroy", flush=True)


def addrinfo(addr, port):
    res = ctypes.POINTER(AddrInfo)()
    hints = AddrInfo(ai_flags=1, ai_port_space=0x106)  # RAI_PASSIVE
    check(lib.rdma_getaddrinfo(addr.encode(), str(port).encode(), ctypes.byref(hints),
                               ctypes.byref(res)), "rdma_getaddrinfo")
    a = res.contents
    print("passive flags", a.ai_flags, "family", a.ai_family, "qp_type", a.ai_qp_type,
          "ps", hex(a.ai_port_space), "src", addr_of(ctypes.string_at(a.ai_src_addr, a.ai_src_len)),
          "dst_len", a.ai_dst_len, flush=True)
    lib.rdma_freeaddrinfo(res)
    hints = AddrInfo(ai_port_space=0x111, ai_qp_type=4)
    check(lib.rdma_getaddrinfo(addr.encode(), str(port).encode(), ctypes.byref(hints),
                               ctypes.byref(res)), "rdma_getaddrinfo")
    a = res.contents
    print("active flags", a.ai_flags, "family", a.ai_family, "qp_type", a.ai_qp_type,
          "ps", hex(a.ai_port_space), "dst", addr_of(ctypes.string_at(a.ai_dst_addr, a.ai_dst_len)),
          "src_len", a.ai_src_len, flush=True)
    lib.rdma_freeaddrinfo(res)
    r = lib.rdma_getaddrinfo(b"no.such.host.invalid", b"1", None, ctypes.byref(res))
    print("bad name", r, flush=True)


def misuse(addr):
    ch = lib.rdma_create_event_channel()
    cid = V()
    check(lib.rdma_create_id(V(ch), ctypes.byref(cid), None, 0x106), "rdma_create_id")

    def say(what, r):
        print(what, r, errno.errorcode.get(ctypes.get_errno()) if r else "", flush=True)
    ctypes.set_errno(0)
    say("resolve_route before resolve_addr", lib.rdma_resolve_route(cid, 2000))
    say("bind AF_UNIX", lib.rdma_bind_addr(cid, ctypes.create_string_buffer(
        struct.pack("<H", 1) + bytes(14), 16)))
    say("bind unknown address", lib.rdma_bind_addr(cid, sin("192.0.2.1", 1)))
    say("listen on a freed id", lib.rdma_listen(V(12345), 1))
    say("connect without QP or param", lib.rdma_connect(cid, None))
    say("disconnect unconnected", lib.rdma_disconnect(cid))
    say("ack of a non-event", lib.rdma_ack_cm_event(V(4096)))
    say("get_request on an async id", lib.rdma_get_request(cid, ctypes.byref(V())))
    say("join multicast", lib.rdma_join_multicast(cid, sin("239.1.1.1", 0), None))
    tos = ctypes.c_uint8(32)
    say("set TOS", lib.rdma_set_option(cid, 0, 0, ctypes.byref(tos), 1))
    say("set TOS, optlen 4", lib.rdma_set_option(cid, 0, 0, ctypes.byref(tos), 4))
    say("set option of level 7", lib.rdma_set_option(cid, 7, 0, ctypes.byref(tos), 1))
    ece = (ctypes.c_uint32 * 3)(0, 5, 0)
    say("set local ECE without vendor", lib.rdma_set_local_ece(cid, ece))
    ece[0] = 0x15B3
    say("set local ECE", lib.rdma_set_local_ece(cid, ece))
    say("get remote ECE", lib.rdma_get_remote_ece(cid, ece))
    print("remote ECE", list(ece), flush=True)
    check(lib.rdma_destroy_id(cid), "rdma_destroy_id")
    lib.rdma_destroy_event_channel(V(ch))
    print("alive", flush=True)


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    {"server": lambda: server(rest[0], int(rest[1])),
     "client": lambda: client(rest[0], int(rest[1])),
     "client-exit": lambda: client_exit(rest[0], int(rest[1])),
     "channel": lambda: channel(rest[0]),
     "addrinfo": lambda: addrinfo(rest[0], int(rest[1])),
     "misuse": lambda: misuse(rest[0])}[role]()
