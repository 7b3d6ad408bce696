"""Modules and classes of pyverbs that softrdma does not implement, built from the manifest.

A program (or rdma-core's test suite) that imports ``pyverbs.providers.mlx5.mlx5dv``,
``pyverbs.xrcd``, ``pyverbs.wq``... gets a module with the real one's names: its enum
values are pyverbs', and its objects fail when made, as pyverbs' fail on Linux rxe:

* provider contexts (``Mlx5Context``, ``EfaContext``...): ``PyverbsUserError`` naming the
  provider, as pyverbs says of a device of another vendor;
* every other object: ``PyverbsRDMAError`` with ``EOPNOTSUPP`` (the verb rxe lacks:
  ``ibv_open_xrcd``, ``ibv_create_wq``, ``ibv_create_flow``, ``ibv_alloc_dm``...).

Attribute objects (``...Attr``, ``...InitAttr``, ``...Caps``) are plain records that take
any keyword, so a test can build them before the verb it skips on.
"""

from __future__ import annotations

import enum
import errno
import types
from typing import Any

from ..errors import PyverbsRDMAError, PyverbsUserError
from . import _manifest as M

_PROVIDER = {"mlx5": "MLX5", "efa": "EFA"}


# one module under two names: rdma-core 50 added libibverbs_enums/librdmacm_enums beside
# enums/cm_enums (the same declarations) and 60 dropped the old names; serve both names
# with the names of either, the newer module's values last (so they win)
SAME_MODULE = {"enums": ("enums", "libibverbs_enums"),
               "libibverbs_enums": ("enums", "libibverbs_enums"),
               "cm_enums": ("cm_enums", "librdmacm_enums"),
               "librdmacm_enums": ("cm_enums", "librdmacm_enums")}


def enum_members(key: str) -> dict[str, dict[str, int]]:
    """pyverbs.<key>'s enum classes {class: {member: value}}, every release's names."""
    classes: dict[str, dict[str, int]] = {}
    for k in SAME_MODULE.get(key, (key,)):
        for cname, (_base, members) in M.ENUMS.get(k, {}).items():
            classes.setdefault(cname, {}).update(members)
    return classes


def enum_ints(key: str) -> dict[str, int]:
    """pyverbs.<key>'s integer constants that are not enum members, every release's."""
    ints: dict[str, int] = {}
    for k in SAME_MODULE.get(key, (key,)):
        ints.update(M.INTS.get(k, {}))
    return ints


def make_enums(mod: types.ModuleType, key: str) -> list[str]:
    """Put the manifest's enum classes and constants of pyverbs.<key> into ``mod``.

    Every name any release 44..64 has (``_manifest.RELEASES``); where a value changed
    between releases, the newest (``_manifest.CHANGED``)."""
    names = []
    for cname, members in enum_members(key).items():
        cls = enum.IntEnum(cname, members, module=mod.__name__) if members else \
            type(cname, (enum.IntEnum,), {"__module__": mod.__name__})
        setattr(mod, cname, cls)
        names.append(cname)
        for m in cls:
            setattr(mod, m.name, m)
            names.append(m.name)
        for alias, v in members.items():  # aliases (same value, another name)
            if not hasattr(mod, alias):
                setattr(mod, alias, cls(v))
                names.append(alias)
    for n, v in enum_ints(key).items():
        if not hasattr(mod, n):
            setattr(mod, n, v)
            names.append(n)
    return names


class _Record:
    """An attribute object softrdma does not use: stores what it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        for k, v in kwargs.items():
            setattr(self, k, v)


def _unsupported_class(name: str, key: str) -> type:
    provider = next((p for k, p in _PROVIDER.items() if f"providers.{k}." in f"{key}."), None)
    if name.endswith(("Attr", "InitAttr", "Caps", "Param", "Info", "Spec")) or \
            name.startswith("Wqe") or (name.endswith("Context") and not provider):
        # attribute objects, and helpers such as ParentDomainContext: pyverbs builds them
        # without a verb; the verb that uses them is the one that fails
        return type(name, (_Record,), {"__module__": f"pyverbs.{key}"})

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if provider and name.endswith("Context"):
            raise PyverbsUserError(f"This is not an {provider} device")
        raise PyverbsRDMAError(f"Failed to create {name}: not supported by softrdma (as by "
                               f"Linux rxe)", errno.EOPNOTSUPP)

    return type(name, (), {"__init__": __init__, "__module__": f"pyverbs.{key}",
                           "__doc__": f"pyverbs.{key}.{name}: not supported (EOPNOTSUPP)."})


def _unsupported_function(name: str, key: str) -> Any:
    def f(*args: Any, **kwargs: Any) -> Any:
        raise PyverbsRDMAError(f"{name}: not supported by softrdma", errno.EOPNOTSUPP)
    f.__name__ = name
    f.__qualname__ = name
    return f


def _shared(name: str) -> Any:
    """A name pyverbs modules import from its common modules (``PyverbsError``,
    ``PyverbsRDMAErrno``, ``gid_str``...): softrdma's own object, or None."""
    import importlib
    for m in ("pyverbs_error", "base", "utils"):
        obj = getattr(importlib.import_module(f"{__package__}.{m}"), name, None)
        if obj is not None and not name.startswith("_"):
            return obj
    return None


def fill_missing(mod: types.ModuleType, key: str) -> None:
    """Give ``mod`` every class and function of pyverbs.<key> it lacks, as unsupported
    (a name it re-exports from pyverbs' common modules is softrdma's own)."""
    for cname in M.CLASSES.get(key, {}):
        if not hasattr(mod, cname):
            setattr(mod, cname, _unsupported_class(cname, key))
    for fname in M.FUNCTIONS.get(key, []):
        if not hasattr(mod, fname):
            shared = _shared(fname) if key not in ("pyverbs_error", "base", "utils") else None
            setattr(mod, fname, shared if shared is not None else
                    _unsupported_function(fname, key))
    for n, v in M.INTS.get(key, {}).items():
        if not hasattr(mod, n):
            setattr(mod, n, v)


def stub_module(fullname: str, key: str) -> types.ModuleType:
    mod = types.ModuleType(fullname, f"pyverbs.{key} (not supported by softrdma: its objects "
                                     f"raise EOPNOTSUPP, as on Linux rxe)")
    make_enums(mod, key)
    fill_missing(mod, key)
    return mod


def is_module(key: str) -> bool:
    """Whether pyverbs.<key> is a module of classes (not a package of modules)."""
    return key in M.CLASSES


def known(key: str) -> bool:
    return key in M.CLASSES or any(k.startswith(key + ".") for k in M.CLASSES)
