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
        return int.from_bytes(d.guid.to_bytes(8, "big"), "little") if d is not None else 0
