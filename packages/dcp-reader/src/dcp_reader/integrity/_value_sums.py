"""Checksums of non-tensor values (native format): ``ValueMeta.checksum = "xxh3-64:<hex>"``.

- An inline JSON value: XXH3-64 of its canonical JSON text (``encode_value``, compact
  separators, ASCII): decoding and encoding again gives the same text, so a reader
  recomputes it from the value it parsed.
- A pickled value: XXH3-64 of the bytes of the file that holds it (``values.pkl``: one
  pickle of every such value), checked before anything is unpickled.

Block checksums cover tensors only; these close the gap the fuzzer found (one changed byte
in the metadata's JSON or in ``values.pkl`` changed a loaded value without an error).
In the metadata file they sit in one top-level map ``"value_checksums": {name: checksum}``,
apart from the values, so that a corrupted value entry cannot take its checksum with it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .._errors import ChecksumError, MetadataError
from .._values import encode_value

ALGORITHM = "xxh3-64"


def _xxh3(data: Any) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def canonical_json(value: Any) -> bytes:
    """The bytes an inline value's checksum is taken over."""
    return json.dumps(encode_value(value), separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def value_checksum(value: Any) -> str:
    """The checksum string of an inline (JSON) value."""
    return f"{ALGORITHM}:{_xxh3(canonical_json(value)):016x}"


def bytes_checksum(raw: Any) -> str:
    """The checksum string of a file's bytes (pickled values)."""
    return f"{ALGORITHM}:{_xxh3(raw):016x}"


def parse(text: str, *, path: str | None, name: str) -> int:
    """The digest in ``text``; MetadataError naming value ``name`` when it is malformed or
    uses an algorithm this version does not know."""
    algorithm, _, digest = text.partition(":")
    if algorithm != ALGORITHM or not re.fullmatch(r"[0-9a-f]{16}", digest):
        raise MetadataError(f"checksum {text[:80]!r} of value {name!r} is not '{ALGORITHM}:<16 hex digits>' "
                            "(corrupt metadata, or written by a newer dcp-reader: upgrade it)", path=path, key=name)
    return int(digest, 16)


def check_value(name: str, value: Any, checksum: str, *, path: str | None) -> None:
    """ChecksumError naming value ``name`` when the inline ``value`` parsed from the
    metadata is not the one saved."""
    want = parse(checksum, path=path, name=name)
    try:
        got = _xxh3(canonical_json(value))
    except (TypeError, ValueError) as e:  # not storable as written: it was not saved like this
        got, why = None, f"it cannot be encoded again ({type(e).__name__}: {str(e)[:100]})"
    else:
        why = f"its {ALGORITHM} is {got:016x}"
    if got != want:
        raise ChecksumError(f"value {name!r} in the metadata does not match the checksum recorded when it was saved "
                            f"({why}, {want:016x} was recorded): the metadata file is corrupt (storage or copy "
                            "error, or edited). Re-copy or re-save the checkpoint", path=path, key=name)


def check_bytes(name: str, file: str, raw: Any, checksum: str, *, path: str | None,
                at: tuple[int, int] | None = None) -> None:
    """ChecksumError naming value ``name`` and ``file`` when ``raw`` (the bytes of the file
    holding it, or those at ``at`` = (offset, length) in it: a torch DCP blob) is not what
    was saved; before anything in it is unpickled."""
    want = parse(checksum, path=path, name=name)
    got = _xxh3(raw)
    if got != want:
        where = f"in {file!r}, whose" if at is None else f"at bytes [{at[0]}, {at[0] + at[1]}) of {file!r}, which"
        raise ChecksumError(f"value {name!r} is stored {where} {len(raw)} bytes have {ALGORITHM} "
                            f"{got:016x} but {want:016x} was recorded when it was saved: the file is corrupt "
                            "(storage or copy error). Re-copy or re-save the checkpoint", path=path, key=name)
