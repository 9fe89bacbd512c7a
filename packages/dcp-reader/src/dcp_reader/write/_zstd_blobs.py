"""``torch.save`` blobs compressed as torch's ``ZStandard`` extension compresses them, for
``TorchDcpWriter(transforms=("stream.zstd/1",))``.

torch 2.13's ``FileSystemWriter(_extensions=[ZStandard()])`` writes each item through
``zstandard.ZstdCompressor().stream_writer(out)`` (defaults: level 3, no content size, no
content checksum): a tensor chunk by ``torch.save(tensor, stream)``, a value's blob (which
its planner pickled with ``torch.save`` before) by one ``stream.write``; then
``stream.close()`` ends the one frame. The same calls here give the same bytes, which
torch's ``FileSystemReader`` inflates with ``ZstdDecompressor().stream_reader``.
"""

from __future__ import annotations

from typing import Any

from ..formats._zstd_frames import ZSTD_DESCRIPTOR, zstandard_module

__all__ = ["check_transforms_written", "zstd_bytes", "zstd_torch_save"]


class _Sink:
    """A write-only stream keeping what is written to it."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        raw = bytes(data)
        if raw:
            self.parts.append(raw)
        return len(raw)

    def flush(self) -> None:
        pass


def check_transforms_written(transforms: Any) -> tuple[str, ...]:
    """The transforms a writer applies: none, or torch's ZStandard (``("stream.zstd/1",)``),
    whose module must be installed (ModuleNotFoundError naming the package); ValueError for
    anything else."""
    transforms = tuple(transforms or ())
    if transforms not in ((), (ZSTD_DESCRIPTOR,)):
        raise ValueError(f"transforms={transforms!r}: dcp writes items untransformed, or through "
                         f"({ZSTD_DESCRIPTOR!r},) (torch's ZStandard extension)")
    if transforms:
        zstandard_module("writing zstd-compressed items (torch's ZStandard extension)", reading=False)
    return transforms


def _frame(write: Any) -> bytes:
    """The zstd frame of what ``write(stream)`` writes into a compressing stream, as torch
    makes it."""
    zstandard = zstandard_module("writing zstd-compressed items (torch's ZStandard extension)", reading=False)
    sink = _Sink()
    stream = zstandard.ZstdCompressor().stream_writer(sink, closefd=False)
    write(stream)
    stream.close()
    return b"".join(sink.parts)


def zstd_torch_save(obj: Any) -> bytes:
    """The compressed bytes of ``torch.save(obj)`` (a tensor chunk), as torch writes them."""
    import torch

    return _frame(lambda stream: torch.save(obj, stream))


def zstd_bytes(raw: Any) -> bytes:
    """The compressed bytes of a value's blob ``raw``, as torch writes them."""
    return _frame(lambda stream: stream.write(raw))
