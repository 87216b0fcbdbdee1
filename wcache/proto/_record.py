"""``@record``: a frozen, slotted dataclass without generated code, for the frame classes.

``@dataclass(frozen=True, slots=True)`` compiles six small functions per class from source
(``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``): for
the ~30 frame classes that was 16 ms of every process's ``import wcache`` (75% of
``wcache.proto.frames``), paid again by each engine restart. ``record`` lets ``dataclasses``
collect the fields and build the slotted class (no methods generated), then attaches shared
closures with the same behaviour:

- ``__init__``: positional and keyword arguments, defaults and ``default_factory``; the same
  ``TypeError`` for a missing, unexpected or repeated argument;
- ``__repr__``/``__eq__``/``__hash__`` over the ``repr``/``compare`` fields, as a frozen
  dataclass's (``__eq__`` only between instances of the same class, else NotImplemented);
- assignment and deletion raise ``dataclasses.FrozenInstanceError``; ``copy`` works.

``dataclasses.fields`` and ``dataclasses.replace`` work as on a dataclass (they read
``__dataclass_fields__``). A construction costs ~1-2 µs more than a generated ``__init__``;
frames are built a few per request, so that is noise against the 16 ms saved.
"""

from __future__ import annotations

import dataclasses
from types import FunctionType
from typing import Any, TypeVar, dataclass_transform

__all__ = ["record"]

T = TypeVar("T")

_MISSING: Any = dataclasses.MISSING
_set = object.__setattr__


def _frozen_setattr(self: object, name: str, value: object) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: object, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _methods(cls: type[Any]) -> dict[str, Any]:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = tuple(f.name for f in fields)
    position = {n: i for i, n in enumerate(names)}
    n = len(names)
    # per position: (default, factory); _MISSING for none
    defaults: tuple[tuple[Any, Any], ...] = tuple((f.default, f.default_factory) for f in fields)
    shown = tuple(f.name for f in fields if f.repr)
    compared = tuple(f.name for f in fields if f.compare)
    qualname = cls.__qualname__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) == n and not kwargs:
            for name, v in zip(names, args, strict=True):
                _set(self, name, v)
            return
        if len(args) > n:
            raise TypeError(f"{qualname}.__init__() takes {n + 1} positional arguments but {len(args) + 1} were given")
        values = list(args) + [_MISSING] * (n - len(args))
        for k, v in kwargs.items():
            i = position.get(k)
            if i is None:
                raise TypeError(f"{qualname}.__init__() got an unexpected keyword argument {k!r}")
            if i < len(args):
                raise TypeError(f"{qualname}.__init__() got multiple values for argument {k!r}")
            values[i] = v
        for i in range(len(args), n):
            if values[i] is _MISSING:
                default, factory = defaults[i]
                if default is not _MISSING:
                    values[i] = default
                elif factory is not _MISSING:
                    values[i] = factory()
                else:
                    raise TypeError(f"{qualname}.__init__() missing required argument: {names[i]!r}")
        for name, v in zip(names, values, strict=True):
            _set(self, name, v)

    def __repr__(self: Any) -> str:
        body = ", ".join(f"{name}={getattr(self, name)!r}" for name in shown)
        return f"{type(self).__qualname__}({body})"

    def _key(self: Any) -> tuple[Any, ...]:
        return tuple([getattr(self, name) for name in compared])

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _key(self) == _key(other)

    def __hash__(self: Any) -> int:
        return hash(_key(self))

    def __getstate__(self: Any) -> list[Any]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def __setstate__(self: Any, state: list[Any]) -> None:
        for f, v in zip(dataclasses.fields(self), state, strict=True):
            _set(self, f.name, v)

    return {
        "__init__": __init__,
        "__repr__": __repr__,
        "__eq__": __eq__,
        "__hash__": __hash__,
        "__setattr__": _frozen_setattr,
        "__delattr__": _frozen_delattr,
        "__getstate__": __getstate__,
        "__setstate__": __setstate__,
        "__match_args__": names,
    }


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def record(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen, slotted dataclass-alike (see the module docstring)."""
    for name in ("__init__", "__repr__", "__eq__", "__hash__", "__post_init__"):
        if name in cls.__dict__:
            raise TypeError(f"@record {cls.__qualname__} defines {name}; use @dataclass for that")
    # fields and slots only: nothing compiled (init/repr/eq off, not frozen: frozen compiles setattr)
    out: type[T] = dataclasses.dataclass(init=False, repr=False, eq=False, match_args=False, slots=True)(cls)
    for name, fn in _methods(out).items():
        if isinstance(fn, FunctionType):
            fn.__qualname__ = f"{out.__qualname__}.{name}"
        setattr(out, name, fn)
    return out
