"""The one codec for control messages read from a key-value store: versioned JSON, never pickle.

Any process that reaches a store's port can write any of its keys (a TCPStore has no
authentication), so a value read from the store is foreign input: it is decoded by a codec
that cannot run code and checked (size, encoding, type, range) before use. A value that fails
a check is a ``ControlMessageError`` naming the key and, where the value says it, its writer:
never a crash, never code.

Format: ``PREFIX`` (``b"dcp1:"``, the codec's version), then compact ASCII JSON of
``{"k": kind, "v": body}``; ``kind`` names the exchange (``"abort"``, ``"errors"``,
``"outcome"``, ...), so a value written for one exchange is refused by another. Values that
start with a pickle opcode are named as written by a dcp version before this codec.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_MESSAGE_BYTES", "PREFIX", "ControlMessageError", "decode", "decode_failures", "decode_ints",
           "decode_strings", "encode", "encode_failures"]

#: The codec's version, the first bytes of every value it writes.
PREFIX = b"dcp1:"
#: The largest control message read back: an abort of 32 ranks with a few causes each is a
#: few KiB; larger is not a message of ours, and is refused before it is parsed.
MAX_MESSAGE_BYTES = 1 << 20
#: At most this many causes per rank and characters per cause are kept from a message.
MAX_CAUSES = 64
MAX_CAUSE_CHARS = 16 * 1024
MAX_RANK = 1 << 31


class ControlMessageError(RuntimeError):
    """A store value that is not a well-formed control message of the expected kind
    (``key``: the store key; ``writer``: who wrote it, when known)."""

    def __init__(self, key: str, why: str, *, writer: str | None = None):
        self.key, self.why, self.writer = key, why, writer
        by = f" (written by {writer})" if writer else ""
        super().__init__(f"store key {key!r}{by}: {why}; dcp reads only control messages it wrote itself "
                         "(another job or an unrelated process may be using the same store: give each job its "
                         "own MASTER_PORT / transfer-group port)")

    def __reduce__(self):
        return (_rebuild, (self.key, self.why, self.writer))


def _rebuild(key: str, why: str, writer: str | None) -> ControlMessageError:
    return ControlMessageError(key, why, writer=writer)


def encode(kind: str, body: Any) -> bytes:
    """``body`` (JSON types only) as a control message of ``kind``."""
    return PREFIX + json.dumps({"k": kind, "v": body}, separators=(",", ":"), allow_nan=False).encode("ascii")


def _writer_of(raw: bytes) -> str | None:
    if raw[:1] == b"\x80":  # pickle protocol 2 and later start with the PROTO opcode
        return "a dcp version before control messages were JSON (a pickle, not read)"
    if raw[:1] in (b"{", b"["):  # OPEN_KEY, greetings and ``missing`` before the codec
        return "a dcp version before control messages had a version prefix (plain JSON)"
    if raw[:3] == b"dcp" and raw[3:4].isdigit() and not raw.startswith(PREFIX):
        return f"a dcp version with control codec {raw[:raw.find(b':')].decode('ascii', 'replace')!r}"
    return None


def decode(raw: Any, *, key: str, kind: str) -> Any:
    """The body of the control message ``raw`` of ``kind`` read from ``key``;
    ``ControlMessageError`` when it is not one."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ControlMessageError(key, f"expected bytes, the store returned {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ControlMessageError(key, f"{len(raw)} bytes, more than a control message's {MAX_MESSAGE_BYTES}")
    if not raw.startswith(PREFIX):
        raise ControlMessageError(key, f"not a control message (it starts {raw[:12]!r})", writer=_writer_of(raw))
    try:
        doc = json.loads(raw[len(PREFIX):].decode("ascii"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ControlMessageError(key, f"not valid ASCII JSON after the prefix ({type(exc).__name__}: "
                                       f"{str(exc)[:120]})") from None
    if not isinstance(doc, dict) or set(doc) != {"k", "v"}:
        raise ControlMessageError(key, "the JSON is not an object with exactly the fields 'k' and 'v'")
    if doc["k"] != kind:
        raise ControlMessageError(key, f"a message of kind {str(doc['k'])[:40]!r}, expected {kind!r}")
    return doc["v"]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def encode_failures(kind: str, failures: Mapping[int, Sequence[str]]) -> bytes:
    """rank -> causes as a control message of ``kind``."""
    return encode(kind, {str(int(r)): [str(c) for c in causes] for r, causes in failures.items()})


def decode_failures(raw: Any, *, key: str, kind: str, world: int | None = None) -> dict[int, tuple[str, ...]]:
    """rank -> causes from a control message of ``kind`` (``encode_failures``); each rank a
    decimal in ``[0, world)`` (``world`` None: any rank >= 0), each cause a string."""
    body = decode(raw, key=key, kind=kind)
    if not isinstance(body, dict):
        raise ControlMessageError(key, f"expected an object of rank -> causes, got {type(body).__name__}")
    limit = MAX_RANK if world is None else world
    out: dict[int, tuple[str, ...]] = {}
    for r, causes in body.items():
        if not (r.isascii() and r.isdigit() and len(r) <= 10) or not 0 <= int(r) < limit:
            raise ControlMessageError(key, f"rank {r[:20]!r} is not a rank in [0, {limit})")
        out[int(r)] = tuple(decode_strings(causes, key=key, what=f"the causes of rank {r}"))
    return out


def decode_strings(value: Any, *, key: str, what: str = "the value") -> list[str]:
    """``value`` checked to be a list of at most ``MAX_CAUSES`` strings, each cut to
    ``MAX_CAUSE_CHARS`` characters."""
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise ControlMessageError(key, f"{what} must be a list of strings")
    if len(value) > MAX_CAUSES:
        raise ControlMessageError(key, f"{what}: {len(value)} entries, more than {MAX_CAUSES}")
    return [c[:MAX_CAUSE_CHARS] for c in value]


def decode_ints(raw: Any, *, key: str, kind: str, low: int = 0, high: int = MAX_RANK,
                max_items: int = 1 << 16) -> list[int]:
    """A list of ints in ``[low, high)`` from a control message of ``kind``."""
    body = decode(raw, key=key, kind=kind)
    if not isinstance(body, list) or len(body) > max_items:
        raise ControlMessageError(key, f"expected a list of at most {max_items} integers")
    for v in body:
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v < high:
            raise ControlMessageError(key, f"{str(v)[:40]!r} is not an integer in [{low}, {high})")
    return body

