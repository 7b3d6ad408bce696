"""What every part of the preload library shares, and :func:`install`, which defines the
library's functions.

:func:`install` runs once, in the program's process, when it first calls into libibverbs
or librdmacm: each part of :data:`softrdma.exec.build.PARTS` defines its functions with
``ffi.def_extern``, and every function of the ABI that no part implements gets a stub
that fails with EOPNOTSUPP and says so once.

The rules every part follows:

* **A Python exception never reaches C.** :func:`guard` turns it into the verb's failure
  value and errno; an :class:`Errno` is the caller's mistake (no log), anything else is
  softrdma's (one log line per kind, with the traceback).
* **C owns nothing it did not allocate.** Every structure handed to the program is a cffi
  allocation kept alive in :data:`handles` until the verb that destroys it; the program
  gets pointers into it, the Python object it stands for is found by address.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable

from . import abi

__all__ = ["install", "guard", "Errno", "errno_of", "Handles", "handles", "be64", "address", "ffi",
           "read_like_libc", "destroyers"]

log = logging.getLogger("softrdma.exec")

#: the library's cffi FFI (set by :func:`install`)
ffi: Any = None


class Errno(OSError):
    """An error a verb reports with this errno (not logged: the caller's mistake)."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(code, msg)
        self.error_code = code


def errno_of(e: BaseException) -> Errno:
    """A softrdma error (PyverbsRDMAError, OSError) as the Errno the verb reports
    (EINVAL if it carries none)."""
    return Errno(getattr(e, "error_code", None) or getattr(e, "errno", None) or 22, str(e))


def guard(fail: Any, answers: tuple[type[BaseException], ...] = (Errno,)
          ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``fn``'s exceptions become ``fail`` with errno set. An exception of ``answers``
    that carries an errno is the call's answer to the caller (its mistake, or EAGAIN and
    the like for a socket): nothing logged. Anything else is softrdma's fault: logged once
    per kind with its traceback, errno EIO unless it carries one."""
    seen: set[type] = set()

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(*args: Any) -> Any:
            try:
                return fn(*args)
            except Exception as e:
                code = getattr(e, "error_code", None) or getattr(e, "errno", None)
                if not (code and isinstance(e, answers)):
                    if type(e) not in seen:
                        seen.add(type(e))
                        log.error("softrdma exec: %s failed: %r", fn.__name__, e, exc_info=e)
                    code = code or 5  # EIO
                ffi.errno = code
                return code if fail == "errno" else fail
        return guarded
    return wrap


def address(ptr: Any) -> int:
    """A cdata pointer's address (the key of :data:`handles`)."""
    return int(ffi.cast("uintptr_t", ptr))


class Handles:
    """The structures handed to the program, by address: each kept alive with the Python
    object it stands for until :meth:`release`."""

    def __init__(self) -> None:
        self._by_addr: dict[int, tuple[str, Any, Any]] = {}

    def add(self, kind: str, struct: Any, obj: Any) -> Any:
        """Keep ``struct`` (a cffi allocation) alive as a ``kind`` standing for ``obj``;
        returns ``struct``."""
        self._by_addr[address(struct)] = (kind, struct, obj)
        return struct

    def get(self, kind: str, ptr: Any, err: int = 22) -> Any:
        """The object behind ``ptr``; Errno ``err`` (EINVAL) if ``ptr`` is not a ``kind``
        softrdma handed out (NULL, freed, another kind, not ours)."""
        entry = self._by_addr.get(address(ptr)) if ptr != ffi.NULL else None
        if entry is None or entry[0] != kind:
            raise Errno(err, f"not a {kind} of softrdma exec")
        return entry[2]

    def replace(self, kind: str, ptr: Any, obj: Any) -> Any:
        """Let ``ptr`` stand for ``obj`` from now on (``ibv_rereg_mr``: the program keeps
        its structure, softrdma's registration changes); the structure stays the one
        kept alive since :meth:`add` -- ``ptr``, the program's copy of the pointer, owns
        no memory. Returns the previous object."""
        old = self.get(kind, ptr)
        entry = self._by_addr[address(ptr)]
        self._by_addr[address(ptr)] = (kind, entry[1], obj)
        return old

    def release(self, kind: str, ptr: Any) -> Any:
        """Forget ``ptr`` (after its destroy verb); returns its object."""
        obj = self.get(kind, ptr)
        del self._by_addr[address(ptr)]
        return obj

    def of_kind(self, kind: str) -> list[Any]:
        return [e[2] for e in self._by_addr.values() if e[0] == kind]

    def items(self, kind: str) -> list[tuple[Any, Any]]:
        """``(structure, object)`` of every ``kind`` handed out, oldest first."""
        return [(e[1], e[2]) for e in self._by_addr.values() if e[0] == kind]

    def count(self) -> dict[str, int]:
        """How many structures of each kind are handed out (tests, leak checks)."""
        out: dict[str, int] = {}
        for kind, _, _ in self._by_addr.values():
            out[kind] = out.get(kind, 0) + 1
        return out


#: every structure handed out, by address
handles = Handles()

#: kind of handle -> its destroy verb's body (guarded: 0, or the failure value with errno
#: set), filled by the parts: what ``ibv_close_device`` calls for the objects a program
#: left in the context (see :func:`softrdma.exec.devices.destroy_children`)
destroyers: dict[str, Callable[[Any], Any]] = {}


def be64(v: int) -> int:
    """A __be64 field's value: ``v``'s bytes in network order, read as a host integer."""
    return int.from_bytes(v.to_bytes(8, "big"), "little")


_libc: Any = None


def read_like_libc(fd: int, size: int) -> int:
    """One ``read(fd, buf, size)`` of libc, without the GIL, **not retried on EINTR**:
    the number of bytes read, or ``-errno``. This is how a verb blocks where libibverbs
    and librdmacm block in a ``read()`` of a uverbs or rdma_cm file: a signal whose
    handler was installed without SA_RESTART ends the wait with EINTR (a program's
    ``alarm()`` stops ``ibv_get_cq_event``), one with SA_RESTART is restarted by the
    kernel itself. Python's own ``os.read``/``select`` retry after EINTR (PEP 475), so a
    C program under exec would never see it."""
    global _libc
    import ctypes
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.read.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
        _libc.read.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(size)
    n = _libc.read(fd, buf, size)
    return n if n >= 0 else -ctypes.get_errno()


def _stub(name: str, prototype: str, lib_ffi: Any, c_name: str | None = None) -> None:
    fail = abi.fail_value(prototype)
    said: list[bool] = []

    def stub(*args: Any) -> Any:
        if not said:
            said.append(True)
            print(f"softrdma exec: {name} is not supported by softrdma yet "
                  f"(EOPNOTSUPP)", file=sys.stderr)
        lib_ffi.errno = 95  # EOPNOTSUPP
        if fail is ...:
            return None
        return lib_ffi.NULL if fail is None else fail
    lib_ffi.def_extern(name=c_name or name)(stub)


def install(lib_ffi: Any, lib: Any) -> None:
    """Define the library's functions (called by the embedded init code)."""
    global ffi
    ffi = lib_ffi
    os.environ.setdefault("SOFTRDMA_BACKEND", "soft")  # never load libibverbs: it is us
    from .profile import start_from_environment
    start_from_environment()  # SOFTRDMA_EXEC_PROFILE: cProfile from this first call on
    if os.environ.get("SOFTRDMA_NETDEV", "").strip() == "1":
        from ..pyverbs_compat._netdev import install as install_netdev
        install_netdev()
    from .build import implemented, parts
    for mod in parts():
        mod.install(lib_ffi, lib)
    done = implemented()
    decl = abi.declarations(abi.PROTOTYPES)
    for name in abi.ABI_NAMES:
        if name in done:
            continue
        if name == "rfcntl":
            _stub("rfcntl", "long softrdma_rfcntl(int, int, long)", lib_ffi, "softrdma_rfcntl")
            continue
        _stub(name, decl[name], lib_ffi)
