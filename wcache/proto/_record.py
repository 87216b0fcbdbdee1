"""``@record``: a frozen, slotted dataclass built without ``dataclasses`` processing, for hot imports.

``@dataclass(frozen=True, slots=True)`` compiles six small functions per class from source
(``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``), and even
without them its class processing (string-annotation parsing, a second class built for the slots,
a ``dataclasses.Field`` per field) costs ~40 µs a class: for the frame classes and the key's and
checkpoint's classes that was most of an engine restart's ``import wcache``. ``record`` reads the
class's own annotations, builds the slotted class once and attaches shared closures with a frozen
dataclass's behaviour:

- ``__init__``: positional and keyword arguments, defaults and ``default_factory``; the same
  ``TypeError`` for a missing, unexpected or repeated argument; then ``__post_init__`` if the class
  defines one (it may set fields with ``object.__setattr__``, as on a frozen dataclass);
- ``__repr__``/``__eq__``/``__hash__`` over the ``repr``/``compare`` fields, as a frozen
  dataclass's (``__eq__`` only between instances of the same class, else NotImplemented);
- assignment and deletion raise ``dataclasses.FrozenInstanceError``; ``copy.copy`` and
  ``copy.deepcopy`` work.

``dataclasses.fields``, ``replace``, ``asdict`` and ``is_dataclass`` work as on a dataclass: the
class's ``__dataclass_fields__`` holds real ``dataclasses.Field`` objects, made when it is first read
(a descriptor: an engine's import reads none). Fields are declared as annotations, with a plain
default, ``dataclasses.field(...)`` or :func:`field` (the same options, without a ``dataclasses.Field``
made at import: ``wcache.proto.fields.wire`` uses it). Rules kept from dataclasses: fields are the
class's annotations except ``ClassVar[...]`` ones (spelled ``ClassVar`` or ``typing.ClassVar``), a
field without a default may not follow one with a default, and a mutable default (list, dict, set)
is a ValueError. ``record(weakref_slot=True)`` adds ``__weakref__``. Not supported (TypeError):
``field(init=False)``, and the hand-written dunders ``record`` provides.

:func:`named_tuple` is the same idea for ``typing.NamedTuple``: a tuple subclass with the same behaviour for what
wcache uses of one (fields by name and position, ``_fields``, ``_make``, ``_replace``, ``_asdict``, the repr,
equality and hashing as tuples, pickling and copying), built without ``collections.namedtuple``'s ``eval`` of a
``__new__`` (~0.1 ms a class at import, ~0.2 ms in a fresh process; three are on an engine's restart path).

``_symbols.Symbols`` is the same idea for a string-valued ``enum.Enum`` (the protocol's ``Role``, ``Service`` and
``Phase``, which only the declarations use).
"""

from __future__ import annotations

import dataclasses
import keyword
import sys
import typing
from collections import _tuplegetter  # type: ignore[attr-defined]  # namedtuple's field getters (or its fallback)
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, dataclass_transform, overload

__all__ = [
    "Declared",
    "Subscriptable",
    "declared",
    "field",
    "field_defaults",
    "named_tuple",
    "namespace",
    "record",
]

T = TypeVar("T")

_MISSING: Any = dataclasses.MISSING
_set = object.__setattr__
#: the marker dataclasses.fields() keeps a Field by (its ``_field_type``; private, stable 3.7-3.13:
#: tests/proto/test_record.py pins fields/replace/asdict on records)
_FIELD_TYPE: Any = dataclasses._FIELD  # type: ignore[attr-defined]
_CLASSVAR_NAMES = ("ClassVar", "typing.ClassVar")
_CLASSVAR_OPEN = ("ClassVar[", "typing.ClassVar[")
_NO_METADATA: Any = {}


class Declared:
    """One field of a record as declared: what ``dataclasses.Field`` holds of it, without its cost (a
    ``dataclasses.Field`` is made from it only when ``__dataclass_fields__`` is read)."""

    __slots__ = ("compare", "default", "default_factory", "metadata", "name", "repr", "type")

    def __init__(
        self,
        default: Any,
        default_factory: Any,
        repr: bool,
        compare: bool,
        metadata: Any,
        name: str = "",
        type: Any = None,
    ) -> None:
        self.default, self.default_factory, self.repr, self.compare = default, default_factory, repr, compare
        self.metadata, self.name, self.type = metadata, name, type

    def as_field(self) -> dataclasses.Field[Any]:
        f: dataclasses.Field[Any] = dataclasses.field(
            default=self.default,
            default_factory=self.default_factory,
            repr=self.repr,
            compare=self.compare,
            metadata=self.metadata or None,
        )
        f.name, f.type = self.name, self.type
        f._field_type = _FIELD_TYPE  # type: ignore[attr-defined]
        return f


def field(
    *,
    default: Any = _MISSING,
    default_factory: Any = _MISSING,
    repr: bool = True,
    compare: bool = True,
    metadata: Any = None,
) -> Any:
    """``dataclasses.field`` for a record (those options), without making a ``dataclasses.Field`` at import."""
    if default is not _MISSING and default_factory is not _MISSING:
        raise ValueError("cannot specify both default and default_factory")
    return Declared(default, default_factory, repr, compare, metadata or _NO_METADATA)


def _declared(name: str, annotation: Any, value: Any, qualname: str) -> Declared:
    if type(value) is Declared:  # as dataclasses does with its Field: named in place
        value.name, value.type = name, annotation
        return value
    if isinstance(value, dataclasses.Field):
        if not value.init:
            raise TypeError(f"@record {qualname}.{name}: field(init=False) is not supported")
        return Declared(
            value.default,
            value.default_factory,
            bool(value.repr),
            bool(value.compare),
            value.metadata,
            name,
            annotation,
        )
    if value is not _MISSING and value.__class__.__hash__ is None:
        raise ValueError(f"mutable default {type(value)} for field {name} is not allowed: use default_factory")
    return Declared(value, _MISSING, True, True, _NO_METADATA, name, annotation)


class _DataclassFields:
    """``__dataclass_fields__`` of a record, made on first read (``dataclasses.fields`` and friends) and then
    kept on the class in its place."""

    def __init__(self, fields: tuple[Declared, ...]) -> None:
        self.fields = fields
        self.owner: type[Any] | None = None

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.owner = owner

    def __get__(self, obj: object, cls: type[Any] | None = None) -> dict[str, dataclasses.Field[Any]]:
        out = {d.name: d.as_field() for d in self.fields}
        if self.owner is not None:
            type.__setattr__(self.owner, "__dataclass_fields__", out)
        return out


_PARAMS: dict[bool, Any] = {}


def _params(weakref_slot: bool) -> Any:
    """``__dataclass_params__`` of a frozen slotted dataclass: a @dataclass subclass reads it (frozen bases)."""
    params = _PARAMS.get(weakref_slot)
    if params is None:
        cls: Any = dataclasses._DataclassParams  # type: ignore[attr-defined]
        code = cls.__init__.__code__
        given = {"init": True, "repr": True, "eq": True, "order": False, "unsafe_hash": False, "frozen": True}
        given |= {"match_args": True, "kw_only": False, "slots": True, "weakref_slot": weakref_slot}
        params = _PARAMS[weakref_slot] = cls(**{n: given[n] for n in code.co_varnames[1 : code.co_argcount]})
    return params


def _frozen_setattr(self: object, name: str, value: object) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: object, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _is_classvar(annotation: Any) -> bool:
    if isinstance(annotation, str):
        if "ClassVar" not in annotation:  # the common case, decided without building a string
            return False
        a = annotation.strip()
        return a in _CLASSVAR_NAMES or a.startswith(_CLASSVAR_OPEN)
    return getattr(annotation, "__origin__", annotation) is typing.ClassVar


def _inherited(bases: tuple[type, ...]) -> dict[str, Declared]:
    out: dict[str, Declared] = {}
    for base in bases:
        if base is object:
            continue
        every = getattr(base, "__record_all__", None)
        if every is not None:  # a record (or a subclass of one): its fields, inherited ones included
            out.update((d.name, d) for d in every)
            continue
        for klass in base.__mro__[::-1]:
            if "__dataclass_fields__" in klass.__dict__:  # a dataclass base
                for f in klass.__dict__["__dataclass_fields__"].values():
                    if f._field_type is _FIELD_TYPE:
                        out[f.name] = _declared(f.name, f.type, f, klass.__qualname__)
    return out


def _fields(qualname: str, bases: tuple[type, ...], ns: dict[str, Any]) -> tuple[tuple[Declared, ...], int]:
    """The fields, inherited ones first (as dataclasses orders them), and how many are inherited; pops their
    defaults from ``ns``."""
    out = _inherited(bases)
    inherited = len(out)
    for name, annotation in ns.get("__annotations__", {}).items():
        if _is_classvar(annotation):
            continue
        out[name] = _declared(name, annotation, ns.pop(name, _MISSING), qualname)
    seen_default = False
    for d in out.values():
        has = d.default is not _MISSING or d.default_factory is not _MISSING
        if seen_default and not has:
            raise TypeError(f"non-default argument {d.name!r} follows default argument")
        seen_default = seen_default or has
    return tuple(out.values()), inherited


def _init(qualname: str, fields: tuple[Declared, ...], post_init: bool) -> Callable[..., None]:
    """The class's ``__init__`` (a closure over its fields: the one method that is not shared)."""
    names = tuple([d.name for d in fields])
    position = {n: i for i, n in enumerate(names)}
    n = len(names)
    # per position: (default, factory); _MISSING for none
    defaults: tuple[tuple[Any, Any], ...] = tuple([(d.default, d.default_factory) for d in fields])

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

    __init__.__qualname__ = f"{qualname}.__init__"
    return __init__


# The methods every record shares: they read the class's field names (``namespace`` sets them).


def _repr(self: Any) -> str:
    body = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__record_shown__)
    return f"{type(self).__qualname__}({body})"


def _key(self: Any) -> tuple[Any, ...]:
    return tuple([getattr(self, name) for name in self.__record_compared__])


def _eq(self: Any, other: object) -> Any:  # bool, or NotImplemented for another class
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _key(self) == _key(other)


def _hash(self: Any) -> int:
    return hash(_key(self))


def _getstate(self: Any) -> list[Any]:
    return [getattr(self, name) for name in self.__match_args__]


def _setstate(self: Any, state: list[Any]) -> None:
    for name, v in zip(self.__match_args__, state, strict=True):
        _set(self, name, v)


_SHARED = {
    "__repr__": _repr,
    "__eq__": _eq,
    "__hash__": _hash,
    "__getstate__": _getstate,
    "__setstate__": _setstate,
    "__setattr__": _frozen_setattr,
    "__delattr__": _frozen_delattr,
}


def namespace(
    name: str, qualname: str, bases: tuple[type, ...], ns: dict[str, Any], *, weakref_slot: bool = False
) -> dict[str, Any]:
    """The namespace of the record class ``name`` (``ns``: a class body's, taken over), for one ``type()`` call:
    what ``record`` builds from a class statement's namespace, and what a metaclass can build before the class
    exists (``wcache.proto.fields``: the frames, one class creation each)."""
    for dunder in ("__init__", "__repr__", "__eq__", "__hash__"):
        if dunder in ns:
            raise TypeError(f"@record {qualname} defines {dunder}; use @dataclass for that")
    ns.pop("__dict__", None)
    ns.pop("__weakref__", None)
    fields, inherited = _fields(qualname, bases, ns)
    names = tuple([d.name for d in fields])
    ns["__slots__"] = names[inherited:] + (("__weakref__",) if weakref_slot else ())
    ns["__record_all__"] = fields
    ns["__dataclass_fields__"] = _DataclassFields(fields)
    ns["__dataclass_params__"] = _params(weakref_slot)
    ns["__match_args__"] = names
    ns["__record_shown__"] = tuple([d.name for d in fields if d.repr])
    ns["__record_compared__"] = tuple([d.name for d in fields if d.compare])
    ns.update(_SHARED)
    post_init = "__post_init__" in ns or any(hasattr(b, "__post_init__") for b in bases)
    ns["__init__"] = _init(qualname, fields, post_init)
    return ns


def declared(cls: type[Any]) -> tuple[Declared, ...]:
    """Every field of the record class ``cls`` as declared, in order (inherited ones first)."""
    fields: tuple[Declared, ...] = cls.__record_all__
    return fields


def field_defaults(cls: type[Any]) -> dict[str, Any]:
    """Field name -> its default (``dataclasses.MISSING`` for none) of the record class ``cls``, in order, without
    making its ``dataclasses.Field`` objects."""
    return {d.name: d.default for d in declared(cls)}


def _build(cls: type[T], weakref_slot: bool) -> type[T]:
    ns = namespace(cls.__name__, cls.__qualname__, cls.__bases__, dict(cls.__dict__), weakref_slot=weakref_slot)
    meta: Any = type(cls)
    out: type[T] = meta(cls.__name__, cls.__bases__, ns)
    return out


@overload
def record(cls: type[T], /) -> type[T]: ...
@overload
def record(*, weakref_slot: bool = ...) -> Callable[[type[T]], type[T]]: ...


@dataclass_transform(frozen_default=True, field_specifiers=(field, dataclasses.field, dataclasses.Field))
def record(cls: type[T] | None = None, /, *, weakref_slot: bool = False) -> type[T] | Callable[[type[T]], type[T]]:
    """Make ``cls`` a frozen, slotted dataclass-alike (see the module docstring)."""
    if cls is not None:
        return _build(cls, weakref_slot)

    def wrap(c: type[T]) -> type[T]:
        return _build(c, weakref_slot)

    return wrap


# ---------------------------------------------------------------------------------------------- named_tuple


def _nt_new(cls: Any, /, *args: Any, **kwargs: Any) -> Any:
    if kwargs or len(args) != len(cls._fields):
        args = _nt_arguments(cls, args, kwargs)
    return tuple.__new__(cls, args)


def _nt_arguments(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The positional and keyword arguments of ``cls(...)`` in field order, or namedtuple's TypeError."""
    fields: tuple[str, ...] = cls._fields
    if len(args) > len(fields):
        raise TypeError(f"{cls.__name__}() takes {len(fields)} positional arguments but {len(args)} were given")
    values = list(args)
    for name in fields[len(args) :]:
        if name not in kwargs:
            raise TypeError(f"{cls.__name__}() missing required argument: {name!r}")
        values.append(kwargs.pop(name))
    if kwargs:
        name = next(iter(kwargs))
        problem = "multiple values for" if name in fields else "an unexpected keyword"
        raise TypeError(f"{cls.__name__}() got {problem} argument {name!r}")
    return tuple(values)


def _nt_make(cls: Any, iterable: Iterable[Any]) -> Any:
    out = tuple.__new__(cls, iterable)
    if len(out) != len(cls._fields):
        raise TypeError(f"expected {len(cls._fields)} arguments, got {len(out)}")
    return out


#: what namedtuple's ``_replace`` raises for a name that is no field (ValueError before Python 3.13)
_REPLACE_ERROR: type[Exception] = TypeError if sys.version_info >= (3, 13) else ValueError


def _nt_replace(self: Any, /, **changes: Any) -> Any:
    out = self._make(map(changes.pop, self._fields, self))
    if changes:
        raise _REPLACE_ERROR(f"got unexpected field names: {list(changes)!r}")
    return out


def _nt_asdict(self: Any) -> dict[str, Any]:
    return dict(zip(self._fields, self, strict=True))


def _nt_repr(self: Any) -> str:
    body = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self, strict=True))
    return f"{type(self).__name__}({body})"


def _nt_getnewargs(self: Any) -> tuple[Any, ...]:
    return tuple(self)


def named_tuple(name: str, fields: tuple[str, ...], doc: str, module: str) -> type[tuple[Any, ...]]:
    """A ``typing.NamedTuple`` class named ``name`` with ``fields`` (no defaults), for the runtime: declare the
    class for type checkers with ``typing.NamedTuple`` under ``TYPE_CHECKING`` and bind this at run time.
    Field names follow namedtuple's rules: identifiers, not keywords, unique, none starting with an underscore."""
    for f in fields:
        if not f.isidentifier() or keyword.iskeyword(f) or f.startswith("_"):
            raise ValueError(f"{name}: {f!r} cannot be a field name")
    if len(set(fields)) != len(fields):
        raise ValueError(f"{name}: a field name repeats in {fields!r}")
    ns: dict[str, Any] = {
        "__slots__": (),
        "__doc__": doc,
        "__module__": module,
        "__match_args__": fields,
        "_fields": fields,
        "_field_defaults": {},
        "__new__": _nt_new,
        "_make": classmethod(_nt_make),
        "_replace": _nt_replace,
        "__replace__": _nt_replace,  # copy.replace (Python 3.13)
        "_asdict": _nt_asdict,
        "__repr__": _nt_repr,
        "__getnewargs__": _nt_getnewargs,
    }
    for i, f in enumerate(fields):
        ns[f] = _tuplegetter(i, f"{name}.{f}: field {i}")
    return type(name, (tuple,), ns)


class Subscriptable:
    """The run-time base of a class that is generic to the type checker only (declare ``typing.Generic`` under
    ``TYPE_CHECKING`` and this otherwise, as ``wcache.channel.Channel`` does): ``C[X]`` is ``C``. ``typing.Generic``'s
    subscription, the ``TypeVar`` (a bound's ``ForwardRef`` compiles its string) and a ``Protocol`` class cost an
    engine's import ~0.25 ms in a fresh process on the CPU VM, for nothing it uses at run time."""

    __slots__ = ()

    def __class_getitem__(cls, item: Any) -> Any:
        return cls
