"""``@record`` behaves like ``@dataclass(frozen=True, slots=True)`` for everything frames use,
and importing the frames compiles nothing per class (the import-time regression it fixes)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import subprocess
import sys
from typing import Any, ClassVar

import pytest

from wcache.proto import ErrorFrame, HelloOk, SlabDescriptor, State, TensorTable
from wcache.proto._record import named_tuple, record
from wcache.proto._symbols import Symbols


@record
class R:
    TYPE: ClassVar[str] = "R"
    a: int
    b: str = "x"
    c: list[int] = dataclasses.field(default_factory=list)
    hidden: list[int] = dataclasses.field(default_factory=list, compare=False, repr=False)


@dataclasses.dataclass(frozen=True, slots=True)
class D:
    TYPE: ClassVar[str] = "R"
    a: int
    b: str = "x"
    c: list[int] = dataclasses.field(default_factory=list)
    hidden: list[int] = dataclasses.field(default_factory=list, compare=False, repr=False)


def test_construction_matches_dataclass() -> None:
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}),
        ((1, "y"), {}),
        ((), {"a": 2, "c": [3]}),
        ((1, "y", [2], [9]), {}),
    ]
    for args, kwargs in cases:
        r, d = R(*args, **kwargs), D(*args, **kwargs)
        assert (r.a, r.b, r.c, r.hidden) == (d.a, d.b, d.c, d.hidden)
        assert repr(r) == repr(d).replace("D(", "R(")
    assert R(1).c is not R(1).c  # a fresh default per instance


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((), {}), ((1, "y", [], [], 5), {}), ((1,), {"a": 2}), ((1,), {"zz": 2})],
)
def test_bad_arguments_raise_type_error_like_dataclass(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        D(*args, **kwargs)
    with pytest.raises(TypeError):
        R(*args, **kwargs)


def test_eq_hash_frozen_slots() -> None:
    assert R(1, hidden=[1]) == R(1, hidden=[2])  # compare=False fields are ignored, as in a dataclass
    assert R(1) != R(2)
    other: object = D(1)
    assert R(1) != other  # only the same class compares equal
    assert R(1).__eq__(other) is NotImplemented
    with pytest.raises(TypeError):
        hash(R(1))  # a list field: unhashable, as a frozen dataclass with a list field
    assert hash(SlabDescriptor(1, "memfd")) == hash(SlabDescriptor(1, "memfd"))
    r = R(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.a = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del r.a
    assert not hasattr(r, "__dict__")
    assert R.__match_args__ == ("a", "b", "c", "hidden")
    assert R.TYPE == "R"


def test_dataclasses_api_and_copy_work_on_frames() -> None:
    s = SlabDescriptor(size=10, kind="memfd", fd=0)
    assert dataclasses.replace(s, fd=3) == SlabDescriptor(size=10, kind="memfd", fd=3)
    assert [f.name for f in dataclasses.fields(s)][:3] == ["size", "kind", "fd"]
    assert copy.copy(s) == s
    assert copy.deepcopy(s) == s
    e = ErrorFrame(id=1, code=1, message="m", details={"a": [1]})
    assert copy.deepcopy(e) == e
    t = TensorTable((), ())
    assert t.encoded() is t.encoded()  # the per-table cache field still works on a frozen record
    assert State(id=1, lease=2, key={}, mode="copy", slabs=(), tensors=t) == State(
        id=1, lease=2, key={}, mode="copy", slabs=(), tensors=TensorTable((), ())
    )


def test_record_refuses_hand_written_dunders() -> None:
    with pytest.raises(TypeError, match="__init__"):

        @record
        class Bad:
            a: int

            def __init__(self) -> None:
                pass


def test_post_init_weakref_slot_and_dataclasses_api() -> None:
    """What the key's, checkpoint's and rank's classes use: __post_init__ (normalising a field through
    object.__setattr__), a __weakref__ slot (weakref.finalize), asdict/replace/fields/is_dataclass."""
    import weakref

    @record(weakref_slot=True)
    class P:
        LIMIT: ClassVar[int] = 3
        path: str
        n: int = 1

        def __post_init__(self) -> None:
            object.__setattr__(self, "path", self.path.rstrip("/"))

    p = P("a/")
    assert p.path == "a" and p.n == 1 and P.LIMIT == 3
    assert dataclasses.is_dataclass(p) and dataclasses.asdict(p) == {"path": "a", "n": 1}
    assert dataclasses.replace(p, n=2) == P("a", 2)
    assert [f.name for f in dataclasses.fields(P)] == ["path", "n"]
    assert weakref.ref(p)() is p
    with pytest.raises(TypeError, match="missing"):
        P()  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="mutable default"):

        @record
        class M:
            a: list[int] = []  # noqa: RUF012

    with pytest.raises(TypeError, match="init=False"):

        @record
        class NoInit:
            a: int = dataclasses.field(init=False, default=1)

    with pytest.raises(TypeError, match="follows default"):

        @record
        class O:  # noqa: E742
            a: int = 1
            b: int  # type: ignore[misc]


def test_frames_import_compiles_nothing_per_class() -> None:
    """@dataclass compiled six functions per frame class at import (16 ms of `import wcache`)."""
    code = (
        "import builtins, dataclasses, sys, wcache.errors, wcache.proto.codec\n"  # the stdlib's modules first
        "n = [0]\n"
        "real = builtins.exec\n"
        "def counting(*a, **k):\n"
        "    n[0] += 1\n"
        "    return real(*a, **k)\n"
        "builtins.exec = counting\n"
        "sys.modules.pop('wcache.proto.frames', None)\n"
        "import wcache.proto.frames\n"
        "print(n[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert int(out.stdout.strip()) < 10, out.stdout


def test_hello_ok_roundtrip_through_wire() -> None:
    h = HelloOk.from_wire(
        {
            "type": "HELLO_OK",
            "id": 0,
            "version": 2,
            "software": "s",
            "backend": "host",
            "device": {"kind": "cpu"},
            "max_frame_size": 1 << 20,
        }
    )
    assert HelloOk.from_wire(h.to_wire()) == h


# ------------------------------------------------------------------------------------------- named_tuple

NT: Any = named_tuple("NT", ("a", "b", "c"), "A doc.", __name__)
Ref = collections.namedtuple("Ref", ("a", "b", "c"))  # the reference behaviour


def test_named_tuple_behaves_like_namedtuple() -> None:
    t, r = NT(1, "x", (2, 3)), Ref(1, "x", (2, 3))
    assert issubclass(NT, tuple) and tuple(t) == tuple(r) and tuple.__eq__(t, (1, "x", (2, 3)))
    assert (t.a, t.b, t.c) == (r.a, r.b, r.c) and t[1] == "x"
    assert hash(t) == hash(r) and NT._fields == Ref._fields and NT.__doc__ == "A doc."
    assert repr(t) == repr(r).replace("Ref(", "NT(")
    assert NT(c=(2, 3), b="x", a=1) == t and NT(1, c=(2, 3), b="x") == t
    assert NT._make([1, "x", (2, 3)]) == t and type(NT._make([1, 2, 3])) is NT
    assert t._replace(b="y") == NT(1, "y", (2, 3)) and t._asdict() == r._asdict()
    assert copy.copy(t) == t and copy.deepcopy(t) == t
    match t:
        case NT(a, b, c):
            assert (a, b, c) == (1, "x", (2, 3))
    with pytest.raises(AttributeError):
        t.a = 2
    with pytest.raises(AttributeError):
        t.d = 2  # no __dict__: slotted, as namedtuple


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 2), {}), ((1, 2, 3, 4), {}), ((1, 2), {"d": 3}), ((1, 2, 3), {"a": 1}), ((), {"a": 1, "b": 2})],
)
def test_named_tuple_refuses_what_namedtuple_refuses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        Ref(*args, **kwargs)
    with pytest.raises(TypeError):
        NT(*args, **kwargs)


def test_named_tuple_make_and_replace_check_the_fields() -> None:
    with pytest.raises(TypeError):
        NT._make([1, 2])
    with pytest.raises((TypeError, ValueError), match="unexpected field names") as ours:
        NT(1, 2, 3)._replace(d=4)
    with pytest.raises((TypeError, ValueError)) as theirs:
        Ref(1, 2, 3)._replace(d=4)  # type: ignore[call-arg]
    assert type(ours.value) is type(theirs.value)  # ValueError before Python 3.13, TypeError since


@pytest.mark.skipif(sys.version_info < (3, 13), reason="copy.replace is Python 3.13's")
def test_named_tuple_supports_copy_replace() -> None:
    assert copy.replace(NT(1, 2, 3), b=5) == NT(1, 5, 3)  # type: ignore[attr-defined,unused-ignore]


def test_named_tuple_takes_namedtuples_field_names_only() -> None:
    for bad in (("a", "a"), ("_a",), ("class",), ("a-b",)):
        with pytest.raises(ValueError):
            collections.namedtuple("Ref", bad)
        with pytest.raises(ValueError):
            named_tuple("X", bad, "", __name__)
    X: Any = named_tuple("X", ("cls", "self"), "", __name__)  # the class and instance are positional-only
    assert X(cls=1, self=2) == (1, 2) and X(1, 2)._replace(self=3) == (1, 3)


def test_the_tables_tuples_are_named_tuples() -> None:
    """TensorEntry, TensorGroup and GroupView are ``named_tuple``'s: fields in their declared order."""
    from wcache.client.mapping import GroupView
    from wcache.proto.table import TensorEntry, TensorGroup

    assert TensorEntry._fields == ("name", "dtype", "shape", "stride", "slab", "offset")
    assert TensorGroup._fields == ("dtype", "shape", "stride", "slab", "offset", "step", "length")
    assert GroupView._fields == ("names", "tensor")
    assert TensorGroup._make(["bfloat16", (2,), (1,), 0, 0, 0, 1]).length == 1


# ---------------------------------------------------------------------------------------------- Symbols


class Colour(Symbols):
    """A Symbols class, and its twin on enum.Enum below: what wcache uses of one behaves as the other's."""

    RED = "red"
    GREEN = "green"

    def shout(self) -> str:  # a method is no member
        return self.value.upper()

    @property
    def loud(self) -> str:  # nor a property
        return self.shout() + "!"


class EnumColour(enum.Enum):
    RED = "red"
    GREEN = "green"

    def shout(self) -> str:
        return str(self.value).upper()

    @property
    def loud(self) -> str:
        return self.shout() + "!"


@pytest.mark.parametrize("cls", [Colour, EnumColour])
def test_symbols_behave_as_an_enum_of_strings(cls: Any) -> None:
    red, green = cls.RED, cls.GREEN
    assert [m.name for m in cls] == ["RED", "GREEN"] and [m.value for m in cls] == ["red", "green"]
    assert len(cls) == 2 and list(cls.__members__) == ["RED", "GREEN"]
    assert cls("red") is red and red in cls and isinstance(red, cls)
    assert red != green
    assert red != "red"  # a member is not its value (no StrEnum)
    assert hash(red) == hash(cls("red"))
    assert {red: 1}[cls.RED] == 1
    assert red.shout() == "RED" and red.loud == "RED!"
    assert repr(red) == f"<{cls.__name__}.RED: 'red'>" and str(red) == f"{cls.__name__}.RED"
    assert copy.copy(red) is red and copy.deepcopy(red) is red
    with pytest.raises(ValueError, match="not a valid"):
        cls("blue")
    with pytest.raises(ValueError):
        cls(["unhashable"])
    with pytest.raises(AttributeError):
        red.value = "blue"
    with pytest.raises(AttributeError):
        cls.RED = "blue"
    assert cls.RED is red and red.value == "red"


def test_symbols_refuse_what_a_string_enum_would_not_have() -> None:
    with pytest.raises(TypeError, match="a string"):

        class Numbered(Symbols):
            ONE = 1

    with pytest.raises(ValueError, match="RED's already"):

        class Twice(Symbols):
            RED = "red"
            ROUGE = "red"


def test_the_protocols_enumerations_are_symbols() -> None:
    """Role, Service and Phase: Symbols at run time (no enum class creation on an engine's import)."""
    from wcache.proto.fields import Phase, Role, Service

    for cls in (Role, Service, Phase):
        assert issubclass(cls, Symbols) and not issubclass(cls, enum.Enum)
    assert Phase("hello_sent") is Phase.HELLO_SENT and [r.value for r in Role] == ["client", "server"]
