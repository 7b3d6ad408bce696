"""Calls libibverbs' exported functions through ctypes and prints their answers as JSON,
for tests/test_exec_ext.py. Run by Debian's /usr/bin/python3:

* ``pure real|ours ORDER``: the functions that need no device (enum strings, rate
  tables, sysfs path, path-record conversions, fork state), from the real
  libibverbs.so.1 (``real``, no preload) or from whatever the process resolves first
  (``ours``: under ``softrdma exec`` the preload library); ORDER is ``range-first`` or
  ``init-first`` (the fork calls' order);
* ``device``: the GID entry/table and P_Key queries on the first device (only under
  ``softrdma exec``: the machine has no other).
"""

import ctypes
import json
import sys

V = ctypes.c_void_p


def pure(lib: ctypes.CDLL, order: str) -> dict:
    out: dict = {}
    for fn in ("ibv_wc_status_str", "ibv_event_type_str", "ibv_node_type_str",
               "ibv_port_state_str"):
        f = getattr(lib, fn)
        f.restype, f.argtypes = ctypes.c_char_p, [ctypes.c_int]
        out[fn] = [f(i).decode() for i in range(-2, 30)]
    for fn in ("ibv_rate_to_mbps", "ibv_rate_to_mult"):
        f = getattr(lib, fn)
        f.argtypes = [ctypes.c_int]
        out[fn] = [f(i) for i in range(-2, 30)]
    vals = list(range(-1, 500)) + [850000, 1275000, 14062, 56250, 112500, 168750, 25781,
                                   103125, 206250, 309375, 28125, 53125, 425000, 637500,
                                   2500, 5000, 10000, 800000]
    for fn in ("mbps_to_ibv_rate", "mult_to_ibv_rate"):
        f = getattr(lib, fn)
        f.argtypes = [ctypes.c_int]
        out[fn] = [f(i) for i in vals]
    lib.ibv_get_sysfs_path.restype = ctypes.c_char_p
    out["sysfs"] = lib.ibv_get_sysfs_path().decode()
    for fn in ("ibv_copy_path_rec_from_kern", "ibv_copy_path_rec_to_kern",
               "ibv_copy_ah_attr_from_kern", "ibv_copy_qp_attr_from_kern"):
        # a patterned source, a destination of 0xAA: what is copied, and what is not
        src = (ctypes.c_ubyte * 256)(*[(i * 37 + 11) & 0xFF for i in range(256)])
        dst = (ctypes.c_ubyte * 256)(*([0xAA] * 256))
        getattr(lib, fn)(dst, src)
        out[fn] = bytes(dst).hex()
    buf = ctypes.create_string_buffer(8192)
    lib.ibv_dontfork_range.argtypes = lib.ibv_dofork_range.argtypes = [V, ctypes.c_size_t]
    if order == "range-first":
        out["fork"] = [lib.ibv_is_fork_initialized(), lib.ibv_dontfork_range(buf, 100),
                       lib.ibv_fork_init(), lib.ibv_is_fork_initialized(),
                       lib.ibv_dofork_range(buf, 100)]
    else:
        out["fork"] = [lib.ibv_is_fork_initialized(), lib.ibv_fork_init(),
                       lib.ibv_is_fork_initialized(), lib.ibv_fork_init(),
                       lib.ibv_dontfork_range(buf, 100), lib.ibv_dofork_range(buf, 100),
                       lib.ibv_is_fork_initialized()]
    return out


class Entry(ctypes.Structure):
    _fields_ = [("gid", ctypes.c_ubyte * 16), ("gid_index", ctypes.c_uint32),
                ("port_num", ctypes.c_uint32), ("gid_type", ctypes.c_uint32),
                ("ndev_ifindex", ctypes.c_uint32)]

    def row(self) -> list:
        return [bytes(self.gid).hex(), self.gid_index, self.port_num, self.gid_type,
                self.ndev_ifindex]


def device(lib: ctypes.CDLL) -> dict:
    n = ctypes.c_int()
    lib.ibv_get_device_list.restype = ctypes.POINTER(V)
    devs = lib.ibv_get_device_list(ctypes.byref(n))
    lib.ibv_open_device.restype, lib.ibv_open_device.argtypes = V, [V]
    ctx = lib.ibv_open_device(devs[0])
    out: dict = {}
    q = lib._ibv_query_gid_ex
    q.argtypes = [V, ctypes.c_uint32, ctypes.c_uint32, V, ctypes.c_uint32, ctypes.c_size_t]
    for port, idx, flags, size in [(1, 0, 0, 32), (1, 1, 0, 32), (1, 2, 0, 32),
                                   (1, 5000, 0, 32), (2, 0, 0, 32), (1, 1, 1, 32),
                                   (1, 1, 0, 16)]:
        e = Entry()
        rc = q(ctx, port, idx, ctypes.byref(e), flags, size)
        out[f"gid_ex {port} {idx} {flags} {size}"] = [rc] + (e.row() if rc == 0 else [])
    big = (ctypes.c_ubyte * 64)(*([0xAA] * 64))  # a newer caller's longer entry
    out["gid_ex long"] = [q(ctx, 1, 1, big, 0, 64), bytes(big)[32:].hex()]
    t = lib._ibv_query_gid_table
    t.restype, t.argtypes = ctypes.c_ssize_t, [V, V, ctypes.c_size_t, ctypes.c_uint32,
                                               ctypes.c_size_t]
    for mx, flags in ((8, 0), (2, 0), (1, 0), (8, 1)):
        arr = (Entry * 8)()
        rc = t(ctx, arr, mx, flags, ctypes.sizeof(Entry))
        out[f"table {mx} {flags}"] = [rc] + [arr[i].row() for i in range(max(rc, 0))]
    pk = ctypes.c_uint16()
    lib.ibv_query_pkey.argtypes = [V, ctypes.c_uint8, ctypes.c_int, V]
    out["pkey"] = [(lib.ibv_query_pkey(ctx, port, i, ctypes.byref(pk)), pk.value)
                   for port, i in ((1, 0), (1, 1), (1, 63), (1, 64), (2, 0))]
    lib.ibv_get_pkey_index.argtypes = [V, ctypes.c_uint8, ctypes.c_uint16]
    out["pkey_index"] = [lib.ibv_get_pkey_index(ctx, 1, v) for v in (0xFFFF, 0x0000, 0xFF7F)]
    res = lib.ibv_resolve_eth_l2_from_gid
    res.argtypes = [V, V, V, V]
    out["eth_l2"] = []
    for dst, sgid_index, port in (("127.0.2.11", 1, 1), ("198.51.100.77", 1, 1),
                                  ("127.0.2.11", 200, 1), ("127.0.2.11", 1, 2)):
        ah = (ctypes.c_ubyte * 32)()  # struct ibv_ah_attr: grh (dgid first), ..., port_num
        ah[10] = ah[11] = 0xFF
        ah[12:16] = list(bytes(int(x) for x in dst.split(".")))
        ah[20], ah[30] = sgid_index, port  # grh.sgid_index, port_num
        mac, vid = (ctypes.c_ubyte * 6)(*([0xAA] * 6)), ctypes.c_uint16(0)
        rc = res(ctx, ah, mac, ctypes.byref(vid))
        out["eth_l2"].append([rc, bytes(mac).hex(), vid.value])
    return out


if __name__ == "__main__":
    if sys.argv[1] == "pure":
        lib = ctypes.CDLL(None) if sys.argv[2] == "ours" else ctypes.CDLL("libibverbs.so.1")
        print(json.dumps(pure(lib, sys.argv[3])))
    else:
        print(json.dumps(device(ctypes.CDLL(None))))
