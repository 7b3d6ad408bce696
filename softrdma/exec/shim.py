"""The functions the preload library defines, written in Python.

:func:`install` runs once, in the program's process, when it first calls into libibverbs:
it defines every function of :data:`softrdma.exec.build.EXPORTS` with ``ffi.def_extern``.
Objects handed to C (device structures, the list) are kept alive here for as long as C may
use them. A Python exception never reaches C: it becomes the verb's error value and one
log line (the ``_guard`` wrapper).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

__all__ = ["install"]

log = logging.getLogger("softrdma.exec")
_keep: dict[int, Any] = {}  # C address -> the cffi object that owns it


def _guard(fail: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``fn``'s exceptions become ``fail`` (and errno EIO), logged once per kind."""
    seen: set[type] = set()

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(*args: Any) -> Any:
            try:
                return fn(*args)
            except _Errno as e:
                _ffi.errno = e.error_code
                return fail
            except Exception as e:
                if type(e) not in seen:
                    seen.add(type(e))
                    log.error("softrdma exec: %s failed: %r", fn.__name__, e, exc_info=e)
                _ffi.errno = getattr(e, "error_code", None) or 5  # EIO
                return fail
        return guarded
    return wrap


_ffi: Any = None


def install(ffi: Any, lib: Any) -> None:
    """Define the library's functions (called by the embedded init code)."""
    global _ffi
    _ffi = ffi
    os.environ.setdefault("SOFTRDMA_BACKEND", "soft")  # never load libibverbs: it is us
    from ..verbs_api import device as vdev

    devices: dict[int, Any] = {}  # address of a struct ibv_device -> its softrdma Device

    @ffi.def_extern(name="ibv_get_device_list")
    @_guard(ffi.NULL)
    def get_device_list(num: Any) -> Any:
        found = vdev.get_device_list()
        structs = []
        for d in found:
            s = ffi.new("struct ibv_device *")
            s.node_type = ffi.cast("enum ibv_node_type", int(d.node_type))
            s.transport_type = ffi.cast("enum ibv_transport_type", int(d.transport_type))
            s.name = d.name
            s.dev_name = b"uverbs" + str(d.index).encode()
            addr = int(ffi.cast("uintptr_t", s))
            _keep[addr] = s
            devices[addr] = d
            structs.append(s)
        lst = ffi.new("struct ibv_device *[]", structs + [ffi.NULL])
        _keep[int(ffi.cast("uintptr_t", lst))] = (lst, structs)
        if num != ffi.NULL:
            num[0] = len(structs)
        return lst

    @ffi.def_extern(name="ibv_free_device_list")
    @_guard(None)
    def free_device_list(lst: Any) -> None:
        # the devices stay valid after the list goes (libibverbs keeps them too: a
        # program may use a device it picked after freeing the list)
        _keep.pop(int(ffi.cast("uintptr_t", lst)), None)

    @ffi.def_extern(name="ibv_get_device_name")
    @_guard(ffi.NULL)
    def get_device_name(dev: Any) -> Any:
        return dev.name

    @ffi.def_extern(name="ibv_get_device_guid")
    @_guard(0)
    def get_device_guid(dev: Any) -> int:
        d = devices.get(int(ffi.cast("uintptr_t", dev)))
        # __be64: the GUID's bytes in network order, whatever the host's
        return _be64(d.guid) if d is not None else 0

    # ---- contexts -------------------------------------------------------------------
    # A context is a plain struct ibv_context (abi_compat NULL: not a verbs_context), so
    # verbs.h's inline helpers take their fallbacks into the exported functions below
    # (ibv_query_port, ibv_query_device for ibv_query_device_ex). The data path's ops
    # table comes with the objects that use it.
    contexts: dict[int, Any] = {}  # address of a struct ibv_context -> (Context, struct)

    def _context(ctx: Any) -> Any:
        entry = contexts.get(int(ffi.cast("uintptr_t", ctx)))
        if entry is None:
            raise _Errno(22, "not a context of softrdma exec")  # EINVAL
        return entry[0]

    @ffi.def_extern(name="ibv_open_device")
    @_guard(ffi.NULL)
    def open_device(dev: Any) -> Any:
        d = devices.get(int(ffi.cast("uintptr_t", dev)))
        if d is None:
            raise _Errno(19, "not a device of softrdma exec")  # ENODEV
        from ..verbs_api import Context
        c = Context(name=d.name.decode())
        s = ffi.new("struct ibv_context *")
        s.device = dev
        s.abi_compat = ffi.NULL
        s.num_comp_vectors = 1
        r, w = os.pipe()  # cmd_fd / async_fd: real descriptors (poll on them works)
        s.cmd_fd, s.async_fd = r, w
        contexts[int(ffi.cast("uintptr_t", s))] = (c, s, (r, w))
        return s

    @ffi.def_extern(name="ibv_close_device")
    @_guard(-1)
    def close_device(ctx: Any) -> int:
        entry = contexts.pop(int(ffi.cast("uintptr_t", ctx)), None)
        if entry is None:
            raise _Errno(22, "not a context of softrdma exec")
        c, _, fds = entry
        c.close()
        for fd in fds:
            os.close(fd)
        return 0

    @ffi.def_extern(name="ibv_query_device")
    @_guard(5)
    def query_device(ctx: Any, attr: Any) -> int:
        a = _context(ctx).query_device()
        for name, _ in ffi.typeof("struct ibv_device_attr").fields:
            if name == "fw_ver":
                attr.fw_ver = a.fw_ver.encode()[:63]
            elif name in ("node_guid", "sys_image_guid"):
                setattr(attr, name, _be64(getattr(a, name)))
            elif name == "atomic_cap":
                attr.atomic_cap = int(a.atomic_caps)
            elif hasattr(a, name):
                setattr(attr, name, int(getattr(a, name)))
        return 0

    @ffi.def_extern(name="ibv_query_port")
    @_guard(5)
    def query_port(ctx: Any, port: int, attr: Any) -> int:
        p = _context(ctx).query_port(port)
        out = ffi.cast("struct ibv_port_attr *", attr)
        # the fields every release's ibv_port_attr has: a caller of the exported symbol
        # may pass the older, shorter structure (_compat_ibv_port_attr)
        for name, _ in ffi.typeof("struct ibv_port_attr").fields:
            setattr(out, name, int(getattr(p, name)))
        return 0

    @ffi.def_extern(name="ibv_query_gid")
    @_guard(-1)
    def query_gid(ctx: Any, port: int, index: int, gid: Any) -> int:
        g = _context(ctx).query_gid(port, index)
        raw = bytes.fromhex(g.gid.replace(":", ""))
        ffi.memmove(gid.raw, raw, 16)
        return 0

    @ffi.def_extern(name="ibv_query_gid_type")
    @_guard(-1)
    def query_gid_type(ctx: Any, port: int, index: int, typ: Any) -> int:
        _context(ctx)
        typ[0] = 1  # IBV_GID_TYPE_SYSFS_ROCE_V2: every softrdma GID is RoCE v2
        return 0

    @ffi.def_extern(name="ibv_read_sysfs_file")
    @_guard(-1)
    def read_sysfs_file(d: Any, f: Any, buf: Any, size: int) -> int:
        return -1  # a soft device has no sysfs files: the caller's "not there"


class _Errno(OSError):
    """An error a verb reports with this errno (not logged: the caller's mistake)."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(code, msg)
        self.error_code = code


def _be64(v: int) -> int:
    """A __be64 field's value: ``v``'s bytes in network order, read as a host integer."""
    return int.from_bytes(v.to_bytes(8, "big"), "little")
