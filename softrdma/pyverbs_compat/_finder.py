"""The opt-in: make ``import pyverbs...`` resolve to softrdma's modules.

:func:`install` puts a meta-path finder first on ``sys.meta_path``; from then on, in this
process, ``pyverbs`` is ``softrdma.pyverbs_compat`` and ``pyverbs.X`` is
``softrdma.pyverbs_compat.X`` (or, for what softrdma does not implement, a module built
from the manifest of real pyverbs' names). Nothing does this on import of softrdma: only
``softrdma run`` / ``python -m softrdma.run`` call it, so a real pyverbs installation is
never shadowed otherwise.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

PKG = "softrdma.pyverbs_compat"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec):  # noqa: ANN001
        self._spec = getattr(self.module, "__spec__", None)
        return self.module

    def exec_module(self, module) -> None:  # noqa: ANN001
        # keep the module's own spec, so its relative imports resolve in softrdma
        if self._spec is not None:
            module.__spec__ = self._spec


class PyverbsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname != "pyverbs" and not fullname.startswith("pyverbs."):
            return None
        key = fullname[len("pyverbs."):] if fullname != "pyverbs" else ""
        mod = self._module(fullname, key)
        if mod is None:
            return None
        is_pkg = hasattr(mod, "__path__")
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(mod), is_package=is_pkg)
        if is_pkg:
            spec.submodule_search_locations = list(mod.__path__)
        return spec

    @staticmethod
    def _module(fullname: str, key: str) -> types.ModuleType | None:
        from . import unsupported
        target = PKG + ("." + key if key else "")
        try:
            if importlib.util.find_spec(target) is not None:
                mod = importlib.import_module(target)
                # names a later (or earlier) release added that softrdma's module lacks
                # exist too, failing as on rxe (unsupported.py)
                unsupported.fill_missing(mod, key)
                return mod
        except ModuleNotFoundError:
            pass
        if unsupported.known(key):
            if unsupported.is_module(key):
                return unsupported.stub_module(fullname, key)
            pkg = types.ModuleType(fullname, f"pyverbs.{key} (softrdma)")
            pkg.__path__ = []  # a package: its submodules come through this finder
            return pkg
        return None


_finder = PyverbsFinder()


def install() -> None:
    """Route ``import pyverbs`` to softrdma in this process (idempotent)."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        if not getattr(sys.modules[name], "__name__", "").startswith(PKG) and \
                "(softrdma" not in (sys.modules[name].__doc__ or ""):
            del sys.modules[name]  # a real pyverbs imported earlier: not ours to mix with


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        del sys.modules[name]
