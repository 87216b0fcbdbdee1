"""``Symbols``: a string-valued enumeration without ``enum``'s class machinery, for the protocol's ``Role``,
``Service`` and ``Phase`` (``fields``): ``enum``'s class creation cost the three 0.44-0.79 ms in a fresh process on the
CPU VM, as ``Symbols`` 0.15-0.22 ms. Declare the class on ``enum.Enum`` for type checkers and on ``Symbols`` at run
time (see its docstring). Only the declarations use it: an engine's restart, which speaks through
``wcache.proto.engine``, never loads this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

__all__ = ["Symbols"]

_set = object.__setattr__


class _SymbolsMeta(type):
    """The class of a :class:`Symbols` class: its members by value (``Phase("open")``), in order (iteration)."""

    _members_: dict[Any, Any]

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> _SymbolsMeta:
        values = {
            k: v
            for k, v in ns.items()
            if not k.startswith("_") and not callable(v) and not hasattr(type(v), "__get__")  # methods, properties
        }
        for k in values:
            del ns[k]
        ns.setdefault("__slots__", ())
        cls = super().__new__(mcls, name, bases, ns)
        members: dict[Any, Any] = {}
        for k, v in values.items():
            if type(v) is not str:
                raise TypeError(f"{name}.{k}: a Symbols member's value is a string, got {type(v).__name__}")
            if v in members:
                raise ValueError(f"{name}.{k}: value {v!r} is {members[v].name}'s already")
            member: Any = object.__new__(cast(Any, cls))
            _set(member, "name", k)
            _set(member, "value", v)
            members[v] = member
            type.__setattr__(cls, k, member)
        type.__setattr__(cls, "_members_", members)
        return cls

    def __call__(cls, value: Any) -> Any:
        """The member whose value is ``value``; ValueError for none (as an Enum's)."""
        try:
            return cls._members_[value]
        except (KeyError, TypeError):
            raise ValueError(f"{value!r} is not a valid {cls.__qualname__}") from None

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls._members_.values())

    def __len__(cls) -> int:
        return len(cls._members_)

    def __contains__(cls, member: object) -> bool:
        return isinstance(member, cls)

    def __setattr__(cls, name: str, value: Any) -> None:
        if name in cls.__dict__ and isinstance(cls.__dict__[name], cls):
            raise AttributeError(f"cannot reassign member {name!r}")
        type.__setattr__(cls, name, value)

    @property
    def __members__(cls) -> dict[str, Any]:
        return {m.name: m for m in cls._members_.values()}


class Symbols(metaclass=_SymbolsMeta):
    """A string-valued enumeration, built without ``enum``'s class machinery: what wcache uses of an
    ``enum.Enum`` of strings. Members are the class's public attributes but its methods and other descriptors
    (each a string, no two alike), made its only instances: ``name`` and ``value``, identity equality and hashing,
    ``Cls(value)`` for the member (ValueError for none), iteration in definition order, ``len``, ``in``,
    ``__members__``, Enum's ``repr`` and ``str``, copying to the same member (``__reduce__``), and no assignment to
    a member or its attributes. Declare it so that type checkers see an Enum::

        if TYPE_CHECKING:
            from enum import Enum as Symbols
        else:
            from wcache.proto._symbols import Symbols

        class Phase(Symbols):
            OPEN = "open"
    """

    __slots__ = ("name", "value")
    name: str
    value: str

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__}.{self.name}: {self.value!r}>"

    def __str__(self) -> str:
        return f"{type(self).__qualname__}.{self.name}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return type(self), (self.value,)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to {name!r} of {self!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete {name!r} of {self!r}")
