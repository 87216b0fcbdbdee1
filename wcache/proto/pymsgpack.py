"""msgpack in Python, for an engine's small frames: an engine's restart need not import msgpack (docs/performance.md).

msgpack's own import, its C extension's load included, was ~1 ms of the ~5 ms an engine's restart spent importing
wcache; decoding a dense checkpoint's STATE (15 KB, 291 names) here takes ~0.2 ms. So an engine encodes its
requests (HELLO, GET_STATE, RELEASE) with :func:`packb` and decodes frames up to :data:`SMALL_BODY` bytes with
:func:`unpack_body`; a larger frame (a 50,000-tensor STATE) goes to msgpack, whose C decoder it is worth loading
for.

Neither function is a whole msgpack, and neither decides anything msgpack does not: each handles the formats
wcache's frames use and raises :class:`Unsupported` for anything else — a type it does not encode, an ext type,
an integer past 64 bits, a string that is not UTF-8, a map key that is not a string, a body cut short or followed
by more bytes, nesting deeper than :data:`MAX_DEPTH` — and the caller hands the value to msgpack itself
(``wcache.proto.codec``, the reference), which encodes or decodes it, or raises the error docs/protocol.md §2
names. So whatever these functions return is what msgpack returns: ``packb(v) == msgpack.packb(v,
use_bin_type=True)``, and ``unpack_body(b) == codec.decode_body(b)`` (a map with string keys, arrays as tuples);
tests/proto/test_pymsgpack.py checks both against msgpack on arbitrary values and bytes.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["MAX_DEPTH", "SMALL_BODY", "Unsupported", "packb", "unpack_body"]

#: frame bodies up to this size are decoded here; a larger one is worth msgpack's import (its C decoder takes a
#: 2 MB, 50,000-name STATE in ~5 ms, this one would take ~25 times that)
SMALL_BODY = 64 * 1024
#: containers nested deeper than this are msgpack's to decode (an engine's frames nest 4 deep, ERROR details 9)
MAX_DEPTH = 32


class Unsupported(Exception):
    """The value or body is not one this module handles: hand it to msgpack."""


_BE16 = struct.Struct(">H")
_BE32 = struct.Struct(">I")
_FLOAT = {0xCA: struct.Struct(">f"), 0xCB: struct.Struct(">d")}
#: first byte -> (size of the length or value that follows, signed) for the fixed-width integers
_INTS = {
    0xCC: (1, False),
    0xCD: (2, False),
    0xCE: (4, False),
    0xCF: (8, False),
    0xD0: (1, True),
    0xD1: (2, True),
    0xD2: (4, True),
    0xD3: (8, True),
}
#: first byte -> size of the length that follows: str 8/16/32, bin 8/16/32, array 16/32, map 16/32
_LENGTHS = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}


# --------------------------------------------------------------------------- encode


def packb(value: Any) -> bytes:
    """``msgpack.packb(value, use_bin_type=True)``, for dicts, lists, tuples, str, int (64 bits), bool, None and
    bytes; Unsupported for anything else (a subclass of these included)."""
    out = bytearray()
    _pack(value, out, 0)
    return bytes(out)


def _header(out: bytearray, n: int, fix: int, fix_max: int, wide: bytes) -> None:
    """A str/bin/array/map header: the fix form below ``fix_max`` (``fix`` | n; bin has none: fix_max 0), else the
    8- (str and bin only), 16- and 32-bit forms, whose first bytes ``wide`` lists (0 for a form that does not
    exist)."""
    if n < fix_max:
        out.append(fix | n)
    elif n < 0x100 and wide[0]:
        out.append(wide[0])
        out.append(n)
    elif n < 0x10000:
        out.append(wide[1])
        out += _BE16.pack(n)
    elif n < 0x100000000:
        out.append(wide[2])
        out += _BE32.pack(n)
    else:
        raise Unsupported(f"a container of {n} items")


def _pack(v: Any, out: bytearray, depth: int) -> None:
    t = type(v)
    if t is str:
        try:
            data = v.encode()
        except UnicodeEncodeError:
            raise Unsupported("a string that is not UTF-8") from None
        _header(out, len(data), 0xA0, 32, b"\xd9\xda\xdb")
        out += data
    elif t is int:
        if 0 <= v < 0x80:
            out.append(v)
        else:
            _pack_int(v, out)
    elif v is None:
        out.append(0xC0)
    elif t is bool:
        out.append(0xC3 if v else 0xC2)
    elif t is bytes:
        _header(out, len(v), 0, 0, b"\xc4\xc5\xc6")
        out += v
    elif depth >= MAX_DEPTH:
        raise Unsupported("nested too deeply")
    elif t is dict:
        _header(out, len(v), 0x80, 16, b"\x00\xde\xdf")
        for k, x in v.items():
            _pack(k, out, depth + 1)
            _pack(x, out, depth + 1)
    elif t is list or t is tuple:
        _header(out, len(v), 0x90, 16, b"\x00\xdc\xdd")
        for x in v:
            _pack(x, out, depth + 1)
    else:
        raise Unsupported(f"a {t.__name__}")


#: msgpack's integer forms past the fixints, smallest first: (bound, first byte, size) — unsigned for v >= 0
#: (v < bound), signed below (v >= bound)
_UINT_FORMS = ((0x100, 0xCC, 1), (0x10000, 0xCD, 2), (0x100000000, 0xCE, 4), (0x10000000000000000, 0xCF, 8))
_INT_FORMS = ((-0x80, 0xD0, 1), (-0x8000, 0xD1, 2), (-0x80000000, 0xD2, 4), (-0x8000000000000000, 0xD3, 8))


def _pack_int(v: int, out: bytearray) -> None:
    """The smallest form msgpack gives ``v`` (its own choice: unsigned for v >= 0, signed below), picked by range."""
    if -32 <= v < 0x80:
        out.append(v & 0xFF)
        return
    if v >= 0:
        for bound, first, size in _UINT_FORMS:
            if v < bound:
                out.append(first)
                out += v.to_bytes(size, "big")
                return
    else:
        for bound, first, size in _INT_FORMS:
            if v >= bound:
                out.append(first)
                out += v.to_bytes(size, "big", signed=True)
                return
    raise Unsupported(f"an integer of {v.bit_length()} bits")


# --------------------------------------------------------------------------- decode


def unpack_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """``codec.decode_body(body)`` for a body this module decodes: one map with string keys, arrays as tuples.
    Unsupported for anything else (the reference then decodes it, or refuses it)."""
    data = bytes(body)
    if not data or not (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF)):
        raise Unsupported("not a map")
    try:
        value, end = _unpack(data, 0, 0)
    except IndexError:  # a read past the end (slices are checked where they are cut)
        raise Unsupported("the body ends inside a value") from None
    except UnicodeDecodeError:
        raise Unsupported("a string that is not UTF-8") from None
    if end != len(data):
        raise Unsupported("trailing bytes")
    out: dict[str, Any] = value
    return out


def _unpack(data: bytes, pos: int, depth: int) -> tuple[Any, int]:
    """The value at ``pos`` and the position after it (IndexError or UnicodeDecodeError: see unpack_body)."""
    first = data[pos]
    pos += 1
    if first <= 0x7F:
        return first, pos
    if first >= 0xE0:
        return first - 0x100, pos
    if first == 0xD9 or 0xA0 <= first <= 0xBF:  # str8, fixstr: most of a STATE (its names)
        if first == 0xD9:
            n = data[pos]
            pos += 1
        else:
            n = first & 0x1F
        end = pos + n
        if end > len(data):
            raise Unsupported("the body ends inside a string")
        return data[pos:end].decode(), end
    if first <= 0x8F:  # fixmap
        return _map(data, pos, first & 0x0F, depth)
    if first <= 0x9F:  # fixarray
        return _array(data, pos, first & 0x0F, depth)
    if first == 0xC0:
        return None, pos
    if first == 0xC2:
        return False, pos
    if first == 0xC3:
        return True, pos
    width = _LENGTHS.get(first)
    if width is not None:
        if pos + width > len(data):
            raise Unsupported("the body ends inside a length")
        n = int.from_bytes(data[pos : pos + width], "big")
        pos += width
        if first >= 0xDC:
            return (_array if first <= 0xDD else _map)(data, pos, n, depth)
        end = pos + n
        if end > len(data):
            raise Unsupported("the body ends inside a string or bin")
        return (data[pos:end].decode() if first >= 0xD9 else data[pos:end]), end
    signed = _INTS.get(first)
    if signed is not None:
        size, is_signed = signed
        end = pos + size
        if end > len(data):
            raise Unsupported("the body ends inside an integer")
        return int.from_bytes(data[pos:end], "big", signed=is_signed), end
    fmt = _FLOAT.get(first)
    if fmt is not None:
        if pos + fmt.size > len(data):
            raise Unsupported("the body ends inside a float")
        return fmt.unpack_from(data, pos)[0], pos + fmt.size
    raise Unsupported(f"format 0x{first:02x}")  # ext types, 0xc1


def _array(data: bytes, pos: int, n: int, depth: int) -> tuple[tuple[Any, ...], int]:
    if n > len(data) - pos or depth >= MAX_DEPTH:
        raise Unsupported("an array longer than the body, or nested too deeply")
    items: list[Any] = []
    append = items.append
    size = len(data)
    for _ in range(n):
        first = data[pos]
        if first == 0xD9:  # str8, inline: a STATE's names are most of its bytes
            end = pos + 2 + data[pos + 1]
            if end > size:
                raise Unsupported("the body ends inside a string")
            append(data[pos + 2 : end].decode())
            pos = end
        else:
            value, pos = _unpack(data, pos, depth + 1)
            append(value)
    return tuple(items), pos


def _map(data: bytes, pos: int, n: int, depth: int) -> tuple[dict[str, Any], int]:
    if 2 * n > len(data) - pos or depth >= MAX_DEPTH:
        raise Unsupported("a map longer than the body, or nested too deeply")
    out: dict[str, Any] = {}
    for _ in range(n):
        key, pos = _unpack(data, pos, depth + 1)
        if type(key) is not str:
            raise Unsupported("a map key that is not a string")
        out[key], pos = _unpack(data, pos, depth + 1)
    return out, pos
