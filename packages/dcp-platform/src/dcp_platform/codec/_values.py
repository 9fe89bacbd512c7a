"""The codec for values the ranks of a job exchange over a process group (``all_gather_object``):
plain data in a tagged binary form with explicit sizes, never pickle.

A process group's bytes come from peers over sockets set up through an unauthenticated store,
so what a rank receives is decoded by a codec that cannot run code and is checked (sizes,
nesting, encodings) before use. Only plain data travels: ``None``, ``bool``, ``int``,
``float``, ``str``, ``bytes``, and ``list``, ``tuple`` and ``dict`` of them (exact types: a
subclass such as a named tuple, or a ``bytearray``, is refused, as it would come back as
another type). Each value has one encoding: the decoder refuses any other (a repeated dict
key, an int written long), so that what two ranks decode from the same bytes is the same.

Format: ``VALUES_PREFIX`` (the codec's version), then one value: a one-byte tag and its body,
little-endian. ``N``/``T``/``F``: None/True/False; ``i``: int64; ``I``: u16 length then a
longer signed int; ``f``: float64; ``s``/``b``: u32 length then UTF-8 (lone surrogates kept)
or raw bytes; ``l``/``t``/``d``: u32 count then the items (a dict's as key, value pairs).

A value a rank cannot encode is not raised on that rank alone (its peers would wait in the
collective): ``pack_or_refusal`` sends a refusal instead, which ``unpack`` raises on every
rank as ``UnsendableValueError`` naming the rank and the value's path.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_VALUE_BYTES", "VALUES_PREFIX", "UnsendableValueError", "ValueMessageError",
           "check_lengths", "pack", "pack_or_refusal", "unpack", "unpack_gathered"]

#: The codec's version, the first bytes of every value it writes.
VALUES_PREFIX = b"dcpv1"
_REFUSED = b"dcpv1!"  # then the reason, UTF-8: a value its rank could not encode
#: Deepest nesting written or read (a plan's payload nests 5 deep).
MAX_DEPTH = 64
#: Largest payload one rank may send in one exchange: a load's wants for 100,000 tensors are
#: about 20 MiB; a larger length is refused on every rank before any memory is taken for it.
MAX_VALUE_BYTES = 1 << 30
_MAX_BIG_INT_BYTES = 1024
_MAX_VECTOR = 64
_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
# ``v``: a tuple of 1 to 64 int64s, packed in one call (offsets and sizes, most of a plan's
# payload): decoding 20,000 wants took about half the time with it, measured with
# tests of this codec's speed against pickle on the development machine.
_VECTORS = [struct.Struct(f"<{n}q") for n in range(_MAX_VECTOR + 1)]
_qpack, _dpack, _upack = _Q.pack, _D.pack, _U32.pack
_q_from, _d_from, _u_from, _h_from = _Q.unpack_from, _D.unpack_from, _U32.unpack_from, _U16.unpack_from


class ValueMessageError(RuntimeError):
    """Bytes received from ``source`` (e.g. "rank 3") that are not a value of this codec."""

    def __init__(self, source: str, why: str):
        self.source, self.why = source, why
        super().__init__(f"the value received from {source} is not one dcp sent: {why}; dcp exchanges only "
                         "plain data between ranks (another job may be using the same process group's "
                         "address: give each job its own MASTER_PORT)")

    def __reduce__(self):
        return (ValueMessageError, (self.source, self.why))


class UnsendableValueError(TypeError):
    """A value that ``source`` could not send (a type this codec does not carry)."""

    def __init__(self, source: str, why: str):
        self.source, self.why = source, why
        super().__init__(f"{source} could not send its value: {why}")

    def __reduce__(self):
        return (UnsendableValueError, (self.source, self.why))


def pack(value: Any) -> bytes:
    """``value`` (plain data, see the module docstring) in this codec; ``TypeError`` naming the
    path of the first part that is not plain data, ``ValueError`` when it nests too deep."""
    out = [VALUES_PREFIX]
    _pack(value, out, 0)
    return b"".join(out)


def pack_or_refusal(value: Any) -> bytes:
    """``pack(value)``, or a refusal that ``unpack`` raises on every rank that reads it."""
    try:
        raw = pack(value)
    except Exception as exc:  # noqa: BLE001 - any failure is sent as a refusal: the peers must not wait
        return _REFUSED + f"{type(exc).__name__}: {exc}"[:4096].encode("utf-8", "replace")
    if len(raw) > MAX_VALUE_BYTES:
        return _REFUSED + f"{len(raw)} bytes, more than the {MAX_VALUE_BYTES} one exchange carries".encode()
    return raw


def _all_int(x: tuple[Any, ...]) -> bool:
    for v in x:
        if type(v) is not int:
            return False
    return True


def _pack(x: Any, out: list[bytes], depth: int) -> None:  # noqa: C901 - one branch per tag, most frequent first
    t = type(x)
    if t is str:
        b = x.encode("utf-8", "surrogatepass")
        out += (b"s" + _upack(len(b)), b)
    elif t is int:
        if -(1 << 63) <= x < (1 << 63):
            out.append(b"i" + _qpack(x))
        else:
            out.append(_big_int(x))
    elif t is tuple and 0 < len(x) <= _MAX_VECTOR and _all_int(x):
        try:
            out.append(b"v" + bytes((len(x),)) + _VECTORS[len(x)].pack(*x))
        except struct.error:  # an int beyond int64: item by item
            _pack_items(b"t", x, out, depth)
    elif t is tuple or t is list:
        _pack_items(b"t" if t is tuple else b"l", x, out, depth)
    elif x is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"T" if x else b"F")
    elif t is dict:
        _pack_items(b"d", x, out, depth)
    elif t is float:
        out.append(b"f" + _dpack(x))
    elif t is bytes:
        out += (b"b" + _upack(len(x)), bytes(x))
    else:
        raise TypeError(f"a {t.__module__}.{t.__qualname__} is not plain data (None, bool, int, float, str, bytes, "
                        "list, tuple, dict)")


def _pack_items(tag: bytes, x: Any, out: list[bytes], depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise ValueError(f"a value nested more than {MAX_DEPTH} deep")
    out.append(tag + _upack(len(x)))
    if tag == b"d":
        for k, v in x.items():
            _pack(k, out, depth + 1)
            _pack(v, out, depth + 1)
        return
    append = out.append
    for v in x:  # strings and int64s without a call per item (as _unpack_items reads them)
        t = type(v)
        if t is str:
            b = v.encode("utf-8", "surrogatepass")
            append(b"s" + _upack(len(b)) + b)
        elif t is int and -(1 << 63) <= v < (1 << 63):
            append(b"i" + _qpack(v))
        else:
            _pack(v, out, depth + 1)


def _big_int(x: int) -> bytes:
    n = (x.bit_length() + 8) // 8
    if n > _MAX_BIG_INT_BYTES:
        raise ValueError(f"an int of {x.bit_length()} bits is too large to send")
    return b"I" + _U16.pack(n) + x.to_bytes(n, "little", signed=True)


class _Bad(Exception):
    pass


def unpack(raw: bytes | bytearray | memoryview, *, source: str) -> Any:
    """The value ``raw`` holds; ``ValueMessageError`` naming ``source`` when it is not one of
    this codec's, ``UnsendableValueError`` when ``source`` sent a refusal."""
    data = bytes(raw)
    if data.startswith(_REFUSED):
        raise UnsendableValueError(source, data[len(_REFUSED):].decode("utf-8", "replace"))
    if not data.startswith(VALUES_PREFIX):
        raise ValueMessageError(source, f"it starts {data[:12]!r}, not the codec's prefix {VALUES_PREFIX!r}")
    try:
        value, end = _unpack(data, len(VALUES_PREFIX), 0)
    except _Bad as exc:
        raise ValueMessageError(source, str(exc)) from None
    except (struct.error, IndexError):
        raise ValueMessageError(source, "it ends inside a value") from None
    except UnicodeDecodeError as exc:
        raise ValueMessageError(source, f"a string that is not UTF-8 ({exc.reason})") from None
    except TypeError as exc:  # an unhashable dict key
        raise ValueMessageError(source, f"a dict key that is not hashable ({exc})") from None
    if end != len(data):
        raise ValueMessageError(source, f"{len(data) - end} bytes follow the value")
    return value


def _unpack(data: bytes, pos: int, depth: int) -> tuple[Any, int]:  # noqa: C901 - one branch per tag
    tag = data[pos]
    pos += 1
    if tag == 0x73:  # s
        end = pos + 4 + _u_from(data, pos)[0]
        if end > len(data):
            raise _Bad(f"a string longer than the {len(data) - pos - 4} bytes left, at byte {pos}")
        return data[pos + 4:end].decode("utf-8", "surrogatepass"), end
    if tag == 0x69:  # i
        return _q_from(data, pos)[0], pos + 8
    if tag == 0x76:  # v
        n = data[pos]
        if not 0 < n <= _MAX_VECTOR:
            raise _Bad(f"an int vector of {n} items, at byte {pos}")
        return _VECTORS[n].unpack_from(data, pos + 1), pos + 1 + 8 * n
    if tag in (0x74, 0x6C, 0x64):  # t l d
        return _unpack_items(tag, data, pos, depth)
    if tag in (0x4E, 0x54, 0x46):  # N T F
        return (None if tag == 0x4E else tag == 0x54), pos
    if tag == 0x66:  # f
        return _d_from(data, pos)[0], pos + 8
    if tag == 0x62:  # b
        end = pos + 4 + _u_from(data, pos)[0]
        if end > len(data):
            raise _Bad(f"bytes longer than the {len(data) - pos - 4} left, at byte {pos}")
        return data[pos + 4:end], end
    if tag == 0x49:  # I
        n = _h_from(data, pos)[0]
        if not 0 < n <= _MAX_BIG_INT_BYTES or pos + 2 + n > len(data):
            raise _Bad(f"an int of {n} bytes, at byte {pos}")
        value = int.from_bytes(data[pos + 2:pos + 2 + n], "little", signed=True)
        if -(1 << 63) <= value < (1 << 63) or n != (value.bit_length() + 8) // 8:
            raise _Bad(f"an int in a form pack never writes, at byte {pos}")
        return value, pos + 2 + n
    raise _Bad(f"unknown tag {bytes((tag,))!r} at byte {pos - 1}")


def _unpack_items(tag: int, data: bytes, pos: int, depth: int) -> tuple[Any, int]:
    n = _u_from(data, pos)[0]
    pos += 4
    if depth >= MAX_DEPTH:
        raise _Bad(f"nested more than {MAX_DEPTH} deep, at byte {pos}")
    if n > len(data) - pos:  # every item takes at least one byte
        raise _Bad(f"a count of {n} items, more than the {len(data) - pos} bytes left, at byte {pos}")
    if tag == 0x64:
        out: dict[Any, Any] = {}
        for _ in range(n):
            key, pos = _unpack(data, pos, depth + 1)
            out[key], pos = _unpack(data, pos, depth + 1)
        if len(out) != n:
            raise _Bad(f"a dict with {n - len(out)} repeated keys, before byte {pos}")
        return out, pos
    # Grown item by item, never sized by the count: nested counts that each claim the bytes
    # left would otherwise take hundreds of times the payload's size before failing. Strings
    # and int64s, most of a payload's items, are read here without a call per item (3,000
    # wants decoded in 38 ms instead of 55, benchmarks/transfer/bench_codec.py on the busy
    # development machine).
    items: list[Any] = []
    append = items.append
    end = len(data)
    for _ in range(n):
        kind = data[pos]
        if kind == 0x73:  # s
            stop = pos + 5 + _u_from(data, pos + 1)[0]
            if stop > end:
                raise _Bad(f"a string longer than the {end - pos - 5} bytes left, at byte {pos + 1}")
            append(data[pos + 5:stop].decode("utf-8", "surrogatepass"))
            pos = stop
        elif kind == 0x69:  # i
            append(_q_from(data, pos + 1)[0])
            pos += 9
        else:
            item, pos = _unpack(data, pos, depth + 1)
            append(item)
    return (tuple(items) if tag == 0x74 else items), pos


def check_lengths(lengths: Sequence[int]) -> None:
    """Raise ``ValueMessageError`` naming the first rank whose announced payload length is not
    one this codec sends (every rank sees the same lengths, so every rank raises alike)."""
    for r, n in enumerate(lengths):
        if not len(VALUES_PREFIX) <= n <= MAX_VALUE_BYTES:
            raise ValueMessageError(f"rank {r}", f"a payload of {n} bytes announced (at most {MAX_VALUE_BYTES})")


def unpack_gathered(payloads: Sequence[bytes | bytearray | memoryview]) -> list[Any]:
    """Every rank's value of an all-gather, in rank order (``unpack`` of each)."""
    return [unpack(p, source=f"rank {r}") for r, p in enumerate(payloads)]
