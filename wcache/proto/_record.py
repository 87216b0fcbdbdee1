"""``@record``: a frozen, slotted dataclass built without ``dataclasses`` processing, for hot imports.

``@dataclass(frozen=True, slots=True)`` compiles six small functions per class from source
(``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``), and even
without them its class processing (string-annotation parsing, a second class built for the slots)
costs ~40 µs a class: for the ~30 frame classes and the key's and checkpoint's classes that was most
of an engine restart's ``import wcache`` (issue 20). ``record`` reads the class's own annotations,
builds the slotted class once and attaches shared closures with a frozen dataclass's behaviour:

- ``__init__``: positional and keyword arguments, defaults and ``default_factory``; the same
  ``TypeError`` for a missing, unexpected or repeated argument; then ``__post_init__`` if the class
  defines one (it may set fields with ``object.__setattr__``, as on a frozen dataclass);
- ``__repr__``/``__eq__``/``__hash__`` over the ``repr``/``compare`` fields, as a frozen
  dataclass's (``__eq__`` only between instances of the same class, else NotImplemented);
- assignment and deletion raise ``dataclasses.FrozenInstanceError``; ``copy.copy`` and
  ``copy.deepcopy`` work.

``dataclasses.fields``, ``replace``, ``asdict`` and ``is_dataclass`` work as on a dataclass: the
class carries ``__dataclass_fields__`` of real ``dataclasses.Field`` objects. Rules kept from
dataclasses: fields are the class's annotations except ``ClassVar[...]`` ones (spelled ``ClassVar``
or ``typing.ClassVar``), a field without a default may not follow one with a default, and a mutable
default (list, dict, set) is a ValueError. ``record(weakref_slot=True)`` adds ``__weakref__``. Not
supported (TypeError): ``field(init=False)``, and the hand-written dunders ``record`` provides.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from types import FunctionType
from typing import Any, TypeVar, dataclass_transform, overload

__all__ = ["record"]

T = TypeVar("T")

_MISSING: Any = dataclasses.MISSING
_set = object.__setattr__
#: the marker dataclasses.fields() keeps a Field by (its ``_field_type``; private, stable 3.7-3.13:
#: tests/proto/test_record.py pins fields/replace/asdict on records)
_FIELD_TYPE: Any = dataclasses._FIELD  # type: ignore[attr-defined]
_CLASSVAR = ("ClassVar", "typing.ClassVar", "ClassVar[", "typing.ClassVar[")


def _params(weakref_slot: bool) -> Any:
    """``__dataclass_params__`` of a frozen slotted dataclass: a @dataclass subclass reads it (frozen bases)."""
    cls: Any = dataclasses._DataclassParams  # type: ignore[attr-defined]
    code = cls.__init__.__code__
    given = {"init": True, "repr": True, "eq": True, "order": False, "unsafe_hash": False, "frozen": True}
    given |= {"match_args": True, "kw_only": False, "slots": True, "weakref_slot": weakref_slot}
    return cls(**{n: given[n] for n in code.co_varnames[1 : code.co_argcount]})


def _frozen_setattr(self: object, name: str, value: object) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: object, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _is_classvar(annotation: Any) -> bool:
    if isinstance(annotation, str):
        a = annotation.strip()
        return a in _CLASSVAR[:2] or a.startswith(_CLASSVAR[2:])
    return getattr(annotation, "__origin__", annotation) is typing.ClassVar


def _fields(cls: type[Any], ns: dict[str, Any]) -> dict[str, dataclasses.Field[Any]]:
    """The fields, inherited ones first (as dataclasses orders them); pops their defaults from ``ns``."""
    out: dict[str, dataclasses.Field[Any]] = {}
    for base in cls.__mro__[-1:0:-1]:
        out.update(getattr(base, "__dataclass_fields__", {}))
    for name, annotation in ns.get("__annotations__", {}).items():
        if _is_classvar(annotation):
            continue
        default = ns.pop(name, _MISSING)
        if isinstance(default, dataclasses.Field):
            f = default
        else:
            if default is not _MISSING and default.__class__.__hash__ is None:
                raise ValueError(
                    f"mutable default {type(default)} for field {name} is not allowed: use default_factory"
                )
            f = dataclasses.field(default=default)
        if not f.init:
            raise TypeError(f"@record {cls.__qualname__}.{name}: field(init=False) is not supported")
        f.name = name
        f.type = annotation
        f._field_type = _FIELD_TYPE  # type: ignore[attr-defined]
        out[name] = f
    seen_default = False
    for f in out.values():
        has = f.default is not _MISSING or f.default_factory is not _MISSING
        if seen_default and not has and f.init:
            raise TypeError(f"non-default argument {f.name!r} follows default argument")
        seen_default = seen_default or has
    return out


def _methods(qualname: str, fields: list[dataclasses.Field[Any]], post_init: bool) -> dict[str, Any]:
    init_fields = [f for f in fields if f.init]
    names = tuple(f.name for f in init_fields)
    all_names = tuple(f.name for f in fields)
    position = {n: i for i, n in enumerate(names)}
    n = len(names)
    # per position: (default, factory); _MISSING for none
    defaults: tuple[tuple[Any, Any], ...] = tuple((f.default, f.default_factory) for f in init_fields)
    shown = tuple(f.name for f in fields if f.repr)
    compared = tuple(f.name for f in fields if f.compare)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) == n and not kwargs:
            for name, v in zip(names, args, strict=True):
                _set(self, name, v)
            if post_init:
                self.__post_init__()
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
        if post_init:
            self.__post_init__()

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
        return [getattr(self, name) for name in all_names]

    def __setstate__(self: Any, state: list[Any]) -> None:
        for name, v in zip(all_names, state, strict=True):
            _set(self, name, v)

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


def _build(cls: type[T], weakref_slot: bool) -> type[T]:
    for name in ("__init__", "__repr__", "__eq__", "__hash__"):
        if name in cls.__dict__:
            raise TypeError(f"@record {cls.__qualname__} defines {name}; use @dataclass for that")
    ns = dict(cls.__dict__)
    ns.pop("__dict__", None)
    ns.pop("__weakref__", None)
    fields = _fields(cls, ns)
    inherited: set[str] = set()
    for base in cls.__mro__[1:]:
        inherited.update(base.__dict__.get("__dataclass_fields__", ()))
    own = tuple(name for name in fields if name not in inherited)
    ns["__slots__"] = own + (("__weakref__",) if weakref_slot else ())
    ns["__dataclass_fields__"] = fields
    ns["__dataclass_params__"] = _params(weakref_slot)
    post_init = hasattr(cls, "__post_init__")
    for name, fn in _methods(cls.__qualname__, list(fields.values()), post_init).items():
        if isinstance(fn, FunctionType):
            fn.__qualname__ = f"{cls.__qualname__}.{name}"
        ns[name] = fn
    meta: Any = type(cls)
    out: type[T] = meta(cls.__name__, cls.__bases__, ns)
    return out


@overload
def record(cls: type[T], /) -> type[T]: ...
@overload
def record(*, weakref_slot: bool = ...) -> Callable[[type[T]], type[T]]: ...


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def record(cls: type[T] | None = None, /, *, weakref_slot: bool = False) -> type[T] | Callable[[type[T]], type[T]]:
    """Make ``cls`` a frozen, slotted dataclass-alike (see the module docstring)."""
    if cls is not None:
        return _build(cls, weakref_slot)

    def wrap(c: type[T]) -> type[T]:
        return _build(c, weakref_slot)

    return wrap
