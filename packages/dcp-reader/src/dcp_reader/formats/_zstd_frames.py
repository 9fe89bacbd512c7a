"""torch DCP's ``ZStandard`` extension as it is stored: the transform descriptor, the zstd
module it needs, and the frames of a stored item walked before anything is inflated.

torch 2.13's ``FileSystemWriter(path, _extensions=[ZStandard()])`` passes every stored item
(a ``torch.save`` blob: a tensor chunk or a non-tensor value) through
``zstandard.ZstdCompressor().stream_writer`` (through pyzstd's ``ZstdCompressor`` where the
``zstandard`` module is missing) and records ``transform_descriptors=["stream.zstd/1"]`` in
the item's ``_StorageInfo``, whose (offset, length) are then those of the compressed bytes.
zstandard writes one frame per item, without its content size and without a content
checksum; pyzstd may end a frame at each flush, so an item can hold several frames. torch
reads an item with ``ZStandard.from_descriptor``: the name before the ``/`` picks the
extension, and the version's major number must be 1.

``check_frames`` walks the frames and their block headers (the zstd format, RFC 8878):
an item whose bytes end inside a frame, or go on past its last frame, is refused before
anything is inflated (zstd's own streaming decoder stops at the end of its input without a
word, and ignores what follows a frame).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import CheckpointError, MetadataError, short_repr

__all__ = ["PACKAGE", "ZSTD", "ZSTD_DESCRIPTOR", "CodecMissingError", "check_frames", "check_transforms",
           "zstandard_module"]

ZSTD = "stream.zstd"
#: The descriptor torch 2.13 records, and that dcp's writer records.
ZSTD_DESCRIPTOR = f"{ZSTD}/1"
#: The module dcp compresses and inflates with (the one torch prefers), and its package.
PACKAGE = "zstandard"

_MAGIC = 0xFD2FB528
_SKIPPABLE = range(0x184D2A50, 0x184D2A60)
_BLOCK_MAX = 128 * 1024  # no block holds more (RFC 8878, Block_Maximum_Size)


class CodecMissingError(CheckpointError):
    """The checkpoint stores items through torch's ZStandard extension and the ``zstandard``
    module is not installed: install it (``pip install dcp-reader[zstd]``)."""


def zstandard_module(what: str, *, path: str | None = None, key: str | None = None, reading: bool = True) -> Any:
    """The ``zstandard`` module. Missing: ``what`` needs it, and how to install it, as a
    CodecMissingError naming the file and key (``reading``), else a ModuleNotFoundError."""
    try:
        import zstandard
    except ImportError as e:
        message = (f"{what} needs the '{PACKAGE}' package (torch's ZStandard extension, transform "
                   f"{ZSTD_DESCRIPTOR!r}), which is not installed ({e}): pip install 'dcp-reader[zstd]' (or "
                   f"'dcp-load[zstd]', or '{PACKAGE}')")
        if reading:
            raise CodecMissingError(message, path=path, key=key) from None
        raise ModuleNotFoundError(message, name=PACKAGE) from None
    return zstandard


def is_zstd(descriptor: str) -> bool:
    """Whether torch's ``ZStandard.from_descriptor`` takes ``descriptor`` (version 1.x)."""
    name, _, version = descriptor.partition("/")
    return name == ZSTD and version.partition(".")[0] == "1"


def check_transforms(descriptors: Any, *, path: str, file: Any, key: str) -> tuple[str, ...]:
    """An item's ``transform_descriptors`` (None, or a list of str) as a tuple: none, or one
    zstd descriptor. Anything else is a MetadataError naming the descriptor, the data file
    and the key."""
    if not descriptors:
        return ()
    if not isinstance(descriptors, (list, tuple)) or not all(isinstance(d, str) for d in descriptors):
        raise MetadataError(f"{key!r} in {short_repr(file)} has transform_descriptors {short_repr(descriptors)}, not "
                            "a list of str: the metadata is corrupt; re-save the checkpoint", path=path, key=key)
    unknown = [d for d in descriptors if not is_zstd(d)]
    if unknown or len(descriptors) > 1:
        what = f"transform {unknown[0]!r}" if unknown else f"{len(descriptors)} transforms {short_repr(descriptors)}"
        raise MetadataError(f"{key!r} in {short_repr(file)} is stored through {what}, which dcp-reader does not "
                            f"read: it reads items stored through one {ZSTD_DESCRIPTOR!r} (torch's ZStandard "
                            "extension). Re-save the checkpoint without that extension, or with ZStandard() alone",
                            path=path, key=key)
    return tuple(descriptors)


def check_frames(view: memoryview, bad: Callable[[str], CheckpointError]) -> None:
    """Every byte of ``view`` belongs to a whole zstd frame (or a skippable frame), and there
    is at least one: ``bad(reason)`` is raised otherwise. Reads headers only (a few bytes
    per 128 KiB block)."""
    pos, n = 0, len(view)
    if not n:
        raise bad("it holds no zstd frame (0 bytes)")
    while pos < n:
        if n - pos < 4:
            raise bad(f"{n - pos} byte(s) follow the last frame, at byte {pos}")
        magic = int.from_bytes(view[pos:pos + 4], "little")
        if magic in _SKIPPABLE:
            if n - pos < 8:
                raise bad(f"the skippable frame at byte {pos} ends inside its header")
            pos += 8 + int.from_bytes(view[pos + 4:pos + 8], "little")
            if pos > n:
                raise bad(f"a skippable frame runs past the end, to byte {pos}")
        elif magic == _MAGIC:
            pos = _frame_end(view, pos, bad)
        else:
            raise bad(f"no zstd frame starts at byte {pos} (its bytes are {bytes(view[pos:pos + 4]).hex()}, a frame "
                      f"starts {_MAGIC.to_bytes(4, 'little').hex()})")


def _frame_end(view: memoryview, start: int, bad: Callable[[str], CheckpointError]) -> int:
    """Where the zstd frame starting at ``start`` ends, from its header and block headers."""
    n = len(view)
    if start + 5 > n:
        raise bad(f"the frame at byte {start} ends inside its header")
    fhd = view[start + 4]
    if fhd & 0x08:
        raise bad(f"the frame at byte {start} sets a reserved bit of its header ({fhd:#04x})")
    single = bool(fhd & 0x20)
    content_size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    pos = start + 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + content_size
    while True:
        if pos + 3 > n:
            raise bad(f"the frame at byte {start} is cut off: its bytes end at {n}, where a block header should be "
                      "(a truncated file or a torn write)")
        header = int.from_bytes(view[pos:pos + 3], "little")
        kind, size = header >> 1 & 3, header >> 3
        if kind == 3 or size > _BLOCK_MAX:
            raise bad(f"the block header at byte {pos} is invalid (type {kind}, size {size})")
        pos += 3 + (1 if kind == 1 else size)
        if header & 1:  # the frame's last block
            pos += 4 if fhd & 0x04 else 0  # its content checksum
            break
    if pos > n:
        raise bad(f"the frame at byte {start} is cut off: it runs to byte {pos} of {n} (a truncated file or a torn "
                  "write)")
    return pos
