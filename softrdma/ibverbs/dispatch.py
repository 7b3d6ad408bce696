"""How ``verbs_api.Context(name="rxe0")`` becomes a hardware context.

Every verbs object but the context is one verbs_api class holding a soft or hardware
implementation (:class:`softrdma.verbs_api.base.Sibling`). The context is still chosen
when it is made: ``Context.__new__`` looks at the device name and, for a libibverbs
device, makes the object of ``variant(cls)``: ``type(cls.__name__, (cls, HwContext), {})``
for a subclass of ``verbs_api.Context`` (for ``verbs_api.Context`` itself, ``HwContext``),
cached per class. C3 puts ``HwContext`` right above ``verbs_api.Context`` and below any
subclass, so a subclass's methods (the pyverbs-compat layer's) wrap the hardware ones::

    compat.Context on hardware: variant, compat.Context, ..., HwContext, verbs_api.Context

``isinstance(ctx, verbs_api.Context)`` stays true. Python then runs ``__init__`` of the
returned instance with the same arguments. Soft contexts never reach this module.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["variant", "install", "hw_class_of"]

_HW: dict[type, type] = {}  # verbs_api class -> hardware class (filled by objects.py)
_variants: dict[type, type] = {}


def install(pairs: Iterable[tuple[type, type]]) -> None:
    """Register the hardware class of each verbs_api class."""
    _HW.update(pairs)
    _variants.clear()


def hw_class_of(cls: type) -> type:
    """The hardware class implementing ``cls`` (a verbs_api class or a subclass)."""
    if not _HW:
        from . import objects  # noqa: F401  (installs the classes)
    for base in cls.__mro__:
        hw = _HW.get(base)
        if hw is not None:
            return hw
    raise TypeError(f"{cls.__name__} has no libibverbs implementation")


def variant(cls: type) -> type:
    """``cls`` with the hardware implementation mixed in (``cls`` itself if it already
    is one), made once per class."""
    v = _variants.get(cls)
    if v is None:
        hw = hw_class_of(cls)
        # (cls, hw) for a subclass of the verbs_api class; the verbs_api class itself is
        # already hw's base, so (hw,) alone, named as cls so type(obj) reads the same
        bases = (cls,) if issubclass(cls, hw) else (hw,) if issubclass(hw, cls) else (cls, hw)
        v = bases[0] if bases == (cls,) else \
            type(cls.__name__, bases, {"__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _variants[cls] = v
    return v
