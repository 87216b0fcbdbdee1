"""Declarations for frames: one declaration per field drives encode *and* decode, and one per frame drives the
connection's state machine.

A frame is a ``@message`` class of :class:`Frame` (a part of one, such as ``DeviceInfo``, one of
:class:`Message`) whose fields are declared with :func:`wire`, and whose place in the protocol is declared
with ``@message``'s arguments::

    @message("RELEASE", reply="RELEASED", service=(Service.DAEMON, Service.PEER))
    class Release(Frame):
        id: int = wire(Int(lo=1))
        lease: int = wire(Int(lo=1))

The kind (``Int``, ``Str``, ``Choice``, ``Array`` ...) holds the field's type and limits; the
generic :meth:`Message.to_wire` and :meth:`Message.from_wire` walk the declarations in order,
so the wire map lists fields in declaration order (the golden bytes of docs/protocol.md §8 pin
it). Decoding validates every present field, takes the declared default for an absent one
(``missing=`` when the wire default differs from the constructor's), ignores unknown fields
(schema evolution, docs/protocol.md §2.1) and then runs the class's ``_validate`` for rules that
span fields. Every failure is a :class:`~wcache.errors.RemoteProtocolError` (a receiver decodes what its
peer sent) whose ``details`` name ``frame`` and ``field`` — never a KeyError or TypeError.

The reply, the services that answer a request, the phases a frame travels in and whether it may be
pipelined are the frame's declaration (:func:`message`), and whether it brings descriptors is its
``fd_count``; ``connection.py`` derives its tables from them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar, dataclass_transform

from wcache.errors import RemoteProtocolError
from wcache.proto._record import declared, field, namespace
from wcache.proto.codec import fail
from wcache.proto.limits import INT64_MAX, MAX_BIN, MAX_KEY_CHARS, MAX_KEY_FIELDS, MAX_NAME, MAX_PATH
from wcache.proto.table import TensorTable

if TYPE_CHECKING:  # Enums to the type checker; at run time without enum's class creation (``_symbols.Symbols``)
    from enum import Enum as Symbols
else:
    from wcache.proto._symbols import Symbols

__all__ = [
    "MAX_KEY_CHARS",
    "MAX_KEY_FIELDS",
    "MAX_NAME",
    "MAX_PATH",
    "REGISTRY",
    "Aliases",
    "Array",
    "Bin",
    "Bool",
    "Choice",
    "Float",
    "Frame",
    "Int",
    "Key",
    "KeyMap",
    "Kind",
    "Message",
    "Nested",
    "Phase",
    "Plain",
    "Role",
    "Service",
    "Str",
    "StrMap",
    "Table",
    "fail",
    "message",
    "wire",
]

KeyMap = dict[str, str | int]

_MISSING: Any = dataclasses.MISSING
#: dataclasses.Field.metadata key of a field's declaration
_DECL = "wcache.wire"


# --------------------------------------------------------------------------- kinds


class Kind:
    """A field's wire type and limits. ``decode`` validates one received value (``ctx``: the fields
    of the same map decoded before it); ``encode`` turns the attribute into its wire value."""

    __slots__ = ()

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> Any:
        raise NotImplementedError

    def encode(self, v: Any) -> Any:
        return v


class Int(Kind):
    """An integer in ``[lo, hi]`` (bool is not an integer here)."""

    __slots__ = ("hi", "lo")

    def __init__(self, lo: int = 0, hi: int = INT64_MAX) -> None:
        self.lo, self.hi = lo, hi

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> int:
        if type(v) is not int or not self.lo <= v <= self.hi:
            raise fail(frame, fld, f"expected an integer in [{self.lo}, {self.hi}]")
        return v


class Str(Kind):
    """A string of at most ``max_len`` characters."""

    __slots__ = ("max_len",)

    def __init__(self, max_len: int = MAX_NAME) -> None:
        self.max_len = max_len

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> str:
        if type(v) is not str or len(v) > self.max_len:
            raise fail(frame, fld, f"expected a string of at most {self.max_len} characters")
        return v


class Choice(Kind):
    """One of a fixed set of strings."""

    __slots__ = ("options",)

    def __init__(self, options: Sequence[str]) -> None:
        self.options = tuple(options)

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> str:
        if type(v) is not str or v not in self.options:
            shown = repr(v[:64]) if type(v) is str else type(v).__name__
            raise fail(frame, fld, f"expected one of {list(self.options)}, got {shown}")
        return v


class Bool(Kind):
    __slots__ = ()

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> bool:
        if type(v) is not bool:
            raise fail(frame, fld, "expected a boolean")
        return v


class Float(Kind):
    """A finite number; an integer is accepted and becomes a float."""

    __slots__ = ()

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> float:
        if type(v) is int:
            v = float(v)
        if type(v) is not float or not math.isfinite(v):
            raise fail(frame, fld, "expected a finite number")
        return v


class Bin(Kind):
    """msgpack bin of at most ``max_len`` bytes."""

    __slots__ = ("max_len",)

    def __init__(self, max_len: int = MAX_BIN) -> None:
        self.max_len = max_len

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> bytes:
        if type(v) is not bytes or len(v) > self.max_len:
            raise fail(frame, fld, f"expected bin of at most {self.max_len} bytes")
        return v


def _str_keys(frame: str, fld: str, v: Any) -> dict[str, Any]:
    if type(v) is not dict or any(type(k) is not str for k in v):
        raise fail(frame, fld, "expected a map with string keys")
    return v


class Key(Kind):
    """A WeightCacheKey map: at most MAX_KEY_FIELDS fields, string keys of at most 1024 characters, string
    (same bound) or integer values, MAX_KEY_CHARS characters of names and strings in all. Bounded so that
    what one key costs the daemon (kept with a model, hashed per lookup, listed in STATUS) is bounded too."""

    __slots__ = ()

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> KeyMap:
        m = _str_keys(frame, fld, v)
        if len(m) > MAX_KEY_FIELDS:
            raise fail(frame, fld, f"a key has at most {MAX_KEY_FIELDS} fields, got {len(m)}")
        chars = 0
        for k, x in m.items():
            if len(k) > MAX_NAME or not (type(x) is str or type(x) is int):
                raise fail(frame, fld, f"key field {k[:64]!r} must be a string or integer")
            if type(x) is str:
                if len(x) > MAX_NAME:
                    raise fail(frame, fld, f"key field {k[:64]!r} is too long")
                chars += len(x)
            chars += len(k)
        if chars > MAX_KEY_CHARS:
            raise fail(frame, fld, f"a key's names and strings are at most {MAX_KEY_CHARS} characters, got {chars}")
        return m

    def encode(self, v: Any) -> Any:
        return dict(v)


class StrMap(Kind):
    """A map of strings to strings, each at most 1024 characters."""

    __slots__ = ()

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> dict[str, str]:
        m = _str_keys(frame, fld, v)
        for k, x in m.items():
            if type(x) is not str or len(k) > MAX_NAME or len(x) > MAX_NAME:
                raise fail(frame, fld, "expected a map of strings to strings")
        return m

    def encode(self, v: Any) -> Any:
        return dict(v)


class Plain(Kind):
    """Free-form facts (ERROR details): nested maps (string keys) and arrays of str, int, float, bool,
    nil and bin, at most ``max_depth`` deep. Arrays decode as lists."""

    __slots__ = ("max_depth",)

    def __init__(self, max_depth: int = 8) -> None:
        self.max_depth = max_depth

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> dict[str, Any]:
        m = _str_keys(frame, fld, v)
        out: dict[str, Any] = self._plain(frame, fld, m, 0)
        return out

    def _plain(self, frame: str, fld: str, v: Any, depth: int) -> Any:
        if depth > self.max_depth:
            raise fail(frame, fld, "nested too deeply")
        if v is None or type(v) in (str, int, float, bool, bytes):
            return v
        if type(v) is list or type(v) is tuple:
            return [self._plain(frame, fld, x, depth + 1) for x in v]
        if type(v) is dict:
            if any(type(k) is not str for k in v):
                raise fail(frame, fld, "map keys must be strings")
            return {k: self._plain(frame, fld, x, depth + 1) for k, x in v.items()}
        raise fail(frame, fld, f"unsupported value type {type(v).__name__}")

    def encode(self, v: Any) -> Any:
        return dict(v)


class Nested(Kind):
    """A map decoded as the ``@message`` class ``cls`` (its own fields name its errors)."""

    __slots__ = ("cls",)

    def __init__(self, cls: type[Message]) -> None:
        self.cls = cls

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> Message:
        return self.cls.from_wire(_str_keys(frame, fld, v))

    def encode(self, v: Any) -> Any:
        return v.to_wire()


class Array(Kind):
    """An array of ``min_items``..``max_items`` values of kind ``item`` (no upper bound but the frame
    size when ``max_items`` is None); decodes as a tuple."""

    __slots__ = ("item", "max_items", "min_items")

    def __init__(self, item: Kind, *, min_items: int = 0, max_items: int | None = None) -> None:
        self.item, self.min_items, self.max_items = item, min_items, max_items

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> tuple[Any, ...]:
        if type(v) is not tuple and type(v) is not list:
            raise fail(frame, fld, "expected an array")
        n = len(v)
        if n < self.min_items or (self.max_items is not None and n > self.max_items):
            raise fail(frame, fld, f"expected {self.min_items}..{self.max_items or 'any'} items, got {n}")
        item = self.item.decode
        return tuple([item(frame, fld, x, ctx) for x in v])

    def encode(self, v: Any) -> Any:
        enc = self.item.encode
        return [enc(x) for x in v]


class Table(Kind):
    """A TensorTable field whose tensors lie in the slabs of the field ``slabs`` (decoded before it)."""

    __slots__ = ("preencoded", "slabs")

    def __init__(self, slabs: str = "slabs", *, preencoded: bool = False) -> None:
        """``preencoded``: encode as the table's cached bytes (STATE: the daemon sends one table to many)."""
        self.slabs, self.preencoded = slabs, preencoded

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> TensorTable:
        if type(v) is not dict:
            raise fail(frame, fld, "expected a map")
        return TensorTable.from_wire(v, [s.size for s in ctx.get(self.slabs, ())])

    def encode(self, v: Any) -> Any:
        return v.encoded() if self.preencoded else v.to_wire()


class Aliases(StrMap):
    """Extra names for tensors of the field ``tensors`` (decoded before it): each a new name (no tensor's)
    for an existing tensor."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: str = "tensors") -> None:
        self.tensors = tensors

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> dict[str, str]:
        aliases = super().decode(frame, fld, v, ctx)
        table = ctx.get(self.tensors)
        known = set(table.names) if aliases and table is not None else set()
        for a, t in aliases.items():
            if a in known or t not in known:
                raise fail(frame, fld, f"alias {a[:64]!r} -> {t[:64]!r} is not a new name for a tensor")
        return aliases


# --------------------------------------------------------------------------- declarations


def wire(
    kind: Kind,
    *,
    default: Any = _MISSING,
    default_factory: Any = _MISSING,
    missing: Any = _MISSING,
    omit_default: bool = False,
) -> Any:
    """Declare a field: its ``kind``; ``default``/``default_factory`` as ``dataclasses.field``'s; ``missing``:
    the value an absent wire field decodes to when it differs from the constructor's default (none: required).
    ``omit_default``: not encoded while it equals the value an absent field decodes to — how a field added
    to an existing frame keeps that frame's bytes for senders that do not use it (docs/protocol.md §2.1)."""
    return field(default=default, default_factory=default_factory, metadata={_DECL: (kind, missing, omit_default)})


@dataclass_transform(frozen_default=True, field_specifiers=(wire, dataclasses.field, dataclasses.Field))
class _Record(type):
    """Message's metaclass: a subclass's class statement builds the frozen record (``_record.namespace``) in one
    class creation — ``@record`` on a finished class creates it a second time, with the slots, and that was a
    third of a frame class's import."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kwargs: Any) -> _Record:
        if bases:  # Message itself is the base, not a record
            ns = namespace(name, ns.get("__qualname__", name), bases, ns)
        return super().__new__(mcls, name, bases, ns, **kwargs)


class Message(metaclass=_Record):
    """Base of every ``@message`` class: the generic encoder and decoder over its declared fields. Every subclass
    is a frozen record (``_record.py``) from its class statement on; ``@message`` gives it the codec."""

    __slots__ = ()
    #: the wire value of the ``type`` field ("" for parts of frames)
    TYPE: ClassVar[str] = ""
    #: per field: (attribute, kind, value for an absent field or _MISSING, factory for it or _MISSING)
    _SPEC: ClassVar[tuple[tuple[str, Kind, Any, Any], ...]] = ()
    #: fields declared ``omit_default``: left off the wire while they equal their absent value
    _OMIT: ClassVar[frozenset[str]] = frozenset()
    _NAME: ClassVar[str] = ""
    #: every field is on the wire, in the record's order: the decoder builds the record positionally (the
    #: record's fast ``__init__``: a DEPOSIT of 11,000 tensors decodes in 47 ms instead of 85 by keyword)
    _POSITIONAL: ClassVar[bool] = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE} if self.TYPE else {}
        omit = self._OMIT
        for name, kind, absent, factory in self._SPEC:
            v = getattr(self, name)
            if name in omit and v == (absent if absent is not _MISSING else factory()):
                continue
            out[name] = kind.encode(v)
        return out

    @classmethod
    def from_wire(cls, m: Any) -> Self:
        """Decode and validate one map (docs/protocol.md §4); RemoteProtocolError naming frame and field."""
        frame = cls._NAME
        if type(m) is not dict:
            raise RemoteProtocolError(f"{frame}: expected a map, got {type(m).__name__}", details={"frame": frame})
        values: dict[str, Any] = {}
        for name, kind, absent, factory in cls._SPEC:
            v = m.get(name, _MISSING)
            if v is not _MISSING:
                values[name] = kind.decode(frame, name, v, values)
            elif absent is not _MISSING:
                values[name] = absent
            elif factory is not _MISSING:
                values[name] = factory()
            else:
                raise fail(frame, name, "missing")
        out = cls(*values.values()) if cls._POSITIONAL else cls(**values)
        out._validate()
        return out

    def _validate(self) -> None:
        """Rules that span fields (a frame overrides it); raise ``fail(...)``."""


# --------------------------------------------------------------------------- a frame's place in the protocol


class Role(Symbols):
    """An end of a connection: the client sends requests, the server answers them."""

    CLIENT = "client"
    SERVER = "server"


class Service(Symbols):
    """What a server speaks for: a daemon serves weights, a keeper holds slabs for daemons (§4.11), a peer
    channel offers a daemon's slabs to other daemons of a fleet over TCP (§10)."""

    DAEMON = "daemon"
    KEEPER = "keeper"
    PEER = "peer"


class Phase(Symbols):
    """Where a connection stands (docs/protocol.md §5.1); the values travel in UNEXPECTED_FRAME's details."""

    START = "start"  # nothing exchanged yet
    HELLO_SENT = "hello_sent"  # client: HELLO out, awaiting HELLO_OK
    HELLO_RECEIVED = "hello_received"  # server: HELLO in, must answer HELLO_OK or fatal ERROR
    AUTH = "auth"  # peer channel, shared-secret mode: HELLO_OK sent, proofs not yet exchanged (§10.2)
    OPEN = "open"  # requests and replies flow
    CLOSED = "closed"  # a fatal ERROR went either way, or the stream ended


class Frame(Message):
    """A message that travels on its own, tagged by its ``type``: every frame of docs/protocol.md §4.

    Its ``@message`` declares its place in the protocol, once, and the connection's tables are derived from
    these declarations (``connection.py``: ``TRANSITIONS``, ``SERVES``, ``CARRIES_FDS``, the request unions).
    """

    __slots__ = ()
    #: the frames that answer this request, by type (an ERROR answers any request); empty: not a request
    REPLIES: ClassVar[tuple[str, ...]] = ()
    #: the services that answer this request; a server of another service answers it NOT_FOUND (§4.11)
    SERVICES: ClassVar[frozenset[Service]] = frozenset()
    #: the end that sends it: the client a request (and HELLO), the server every other frame
    SENDER: ClassVar[Role] = Role.SERVER
    #: the phases it may travel in, each with the phase it leaves the connection in, in the client's view (the
    #: server's is the mirror: HELLO_RECEIVED for HELLO_SENT)
    MOVES: ClassVar[tuple[tuple[Phase, Phase], ...]] = ()
    #: a request a client may send right behind HELLO, before HELLO_OK is back (docs/protocol.md §5.1)
    PIPELINED: ClassVar[bool] = False

    @property
    def fd_count(self) -> int:
        """How many file descriptors travel with this frame (SCM_RIGHTS, docs/protocol.md §2.2). A frame that
        brings descriptors overrides this, and that is its declaration: no other frame may bring any."""
        return 0

    @classmethod
    def carries_fds(cls) -> bool:
        """Whether this frame brings descriptors (it counts them: ``fd_count``)."""
        return cls.fd_count is not Frame.fd_count


#: frame type -> class, for every ``@message`` with a TYPE (the decoder's registry)
REGISTRY: dict[str, type[Frame]] = {}

M = TypeVar("M", bound=Message)


@dataclass_transform(frozen_default=True, field_specifiers=(wire, dataclasses.field, dataclasses.Field))
def message(
    type_: str = "",
    *,
    reply: str | tuple[str, ...] = (),
    service: Service | tuple[Service, ...] = (),
    phase: Phase | tuple[Phase, ...] = (),
    moves: Mapping[Phase, Phase] | None = None,
    sender: Role | None = None,
    pipelined: bool = False,
) -> Callable[[type[M]], type[M]]:
    """Give a record (every Message subclass is one) the generic codec.

    ``type_``: the frame type of a :class:`Frame` subclass (registered for ``decode_frame``), or "" for a part
    of a frame (a plain Message). A frame's place in the protocol, declared here once:

    - ``reply``: a request's reply frame type(s) (an ERROR answers any request too), and ``service``: the
      service(s) that answer it. A frame with a reply is a request, sent by the client;
    - ``phase``: the phase(s) it travels in, the connection staying there (default OPEN); ``moves`` instead
      for a frame that moves the connection on ({phase: next phase}, in the client's view);
    - ``sender``: the end that sends it, where that is not the default (the client a request, else the server);
    - ``pipelined``: a request the client may send before HELLO_OK is back (docs/protocol.md §5.1).

    Descriptors are declared by the frame's ``fd_count`` (:meth:`Frame.carries_fds`).
    """
    replies = (reply,) if isinstance(reply, str) else tuple(reply)
    services = frozenset((service,) if isinstance(service, Service) else service)
    phases = (phase,) if isinstance(phase, Phase) else tuple(phase)
    if moves is not None and phases:
        raise TypeError(f"{type_}: declare phase= or moves=, not both")
    if bool(replies) != bool(services) or (pipelined and not replies):
        raise TypeError(f"{type_}: a request declares its reply and service (and only a request is pipelined)")
    if not type_ and (replies or phases or moves or sender or pipelined):
        raise TypeError("a part of a frame has no place in the protocol of its own: declare it on the frame")
    steps = tuple(moves.items()) if moves is not None else tuple((p, p) for p in phases or (Phase.OPEN,))
    if pipelined:
        steps += ((Phase.HELLO_SENT, Phase.HELLO_SENT),)

    def build(cls: type[M]) -> type[M]:
        out = cls  # a record already (Message's metaclass)
        if bool(type_) != issubclass(out, Frame):
            raise TypeError(f"{cls.__qualname__}: a frame (a Frame subclass) has a type, a part (a Message) none")
        spec = []
        omit = set()
        for f in declared(out):
            decl = f.metadata.get(_DECL)
            if decl is None:
                continue  # not on the wire (a cache, say)
            kind, missing, omit_default = decl
            absent = missing if missing is not _MISSING else f.default
            factory = f.default_factory if absent is _MISSING else _MISSING
            if omit_default:
                if absent is _MISSING and factory is _MISSING:
                    raise TypeError(f"{cls.__qualname__}.{f.name}: omit_default needs a default")
                omit.add(f.name)
            spec.append((f.name, kind, absent, factory))
        out._SPEC = tuple(spec)
        out._POSITIONAL = tuple(name for name, *_ in spec) == out.__match_args__
        out._OMIT = frozenset(omit)
        out.TYPE = type_
        out._NAME = type_ or out.__name__
        if issubclass(out, Frame):
            if type_ in REGISTRY:
                raise TypeError(f"frame type {type_} declared twice")
            out.REPLIES, out.SERVICES, out.MOVES, out.PIPELINED = replies, services, steps, pipelined
            out.SENDER = sender or (Role.CLIENT if replies else Role.SERVER)
            REGISTRY[type_] = out
        return out

    return build
