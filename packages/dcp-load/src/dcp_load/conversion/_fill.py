"""Filling preallocated output files in place: conversion is a load into files.

Each output file is mapped shared (``mmap``); every tensor of it becomes a torch tensor
viewing its byte range, and ``load(no_dist=True)`` reads each saved piece narrowed in the
source straight into that view (casting piece by piece when the dtype differs). The pages
written are the output file's own page-cache pages, so the process's anonymous memory stays
at the load's per-piece bound whatever the size of the model.

A worker process (``--workers N``) runs ``fill_files`` over its share of the files with a
reader of its own; it reads only the saved chunks its tensors need.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._layout import OutFile
from ._torch_layout import TorchFile, patch_crcs

__all__ = ["FileResult", "fill_files", "partial_name"]

logger = logging.getLogger(__name__)

#: Bytes of output tensors filled by one ``load`` call: the progress bar advances once per
#: call, and each call costs a few milliseconds of planning, so groups are large.
GROUP_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class FileResult:
    """What filling one file did: bytes read from the source, seconds, and (native and
    torch-dcp outputs) each tensor's block checksum."""

    name: str
    bytes_read: int
    seconds: float
    checksums: Mapping[str, str]
    cast: tuple[str, ...]


def partial_name(name: str) -> str:
    """The name a file has until every file is whole: no loader takes it for a data file."""
    return name + ".partial"


def _views(mm: mmap.mmap, f: OutFile) -> dict[str, Any]:
    """{output name: a torch tensor over its bytes in the mapping}, keyed by the output's
    own name: two outputs read from one saved tensor (an embedding untied) are two views."""
    import torch

    out = {}
    for t, begin, _ in f.tensors:
        dtype = getattr(torch, t.dtype)
        numel = math.prod(t.shape)
        if numel == 0:
            out[t.name] = torch.empty(t.shape, dtype=dtype)
            continue
        out[t.name] = torch.frombuffer(mm, dtype=dtype, count=numel, offset=f.data_start + begin).view(t.shape)
    return out


def _groups(f: OutFile) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for t, begin, end in f.tensors:
        if groups[-1] and size + end - begin > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(t.name)
        size += end - begin
    return groups


def _reader_for(reader: Any, f: OutFile, reads: Mapping[str, Any]) -> Any:
    """``reader``, or (when some outputs of ``f`` are not read under their own names) the
    reader that ``load(sources=)`` uses, showing each such output as the virtual tensor its
    source composes (``layouts/_sourced_reader.py``), reading the real saved bytes."""
    mine = {t.name: reads[t.name] for t, _, _ in f.tensors if t.name in reads}
    if not mine:
        return reader
    from ..layouts._sourced_reader import SourcedMetadata, SourcedReader, virtual_tensor

    saved = reader.metadata.tensors
    virtual = {name: virtual_tensor(name, src, saved) for name, src in mine.items()}
    return SourcedReader(reader, SourcedMetadata(reader.metadata, virtual))


def fill_file(reader: Any, root: str, f: OutFile, *, reads: Mapping[str, Any], native: bool,
              on_bytes: Callable[[int], None] | None = None) -> FileResult:
    """Fill ``root/partial_name(f.name)`` (created, preallocated and headed already).
    ``reads``: {output name: source over saved names} of the outputs not read under their
    own name (``_sources.Outputs.reads``)."""
    from .._load import load

    t0 = time.perf_counter()
    path = os.path.join(root, partial_name(f.name))
    fd = os.open(path, os.O_RDWR)
    bytes_read, cast, sums = 0, [], {}
    try:
        if os.fstat(fd).st_size != f.size:
            raise RuntimeError(f"{path} has {os.fstat(fd).st_size} bytes, expected {f.size}: it was changed "
                               "during the conversion")
        mm = mmap.mmap(fd, f.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        views: dict[str, Any] | None = None
        try:
            views = _views(mm, f)
            sizes = {t.name: end - begin for t, begin, end in f.tensors}
            source = _reader_for(reader, f, reads)
            for names in _groups(f):
                report = load({n: views[n] for n in names}, storage_reader=source, no_dist=True)
                bytes_read += report.bytes_read
                cast.extend(report.cast)
                if on_bytes is not None:
                    on_bytes(sum(sizes[n] for n in names))
            views = None  # no tensor may view the mapping when it is closed
            if isinstance(f, TorchFile):
                patch_crcs(mm, f)  # each blob's CRC-32, of the bytes just filled
            if native:
                sums = _checksums(mm, f)
        finally:
            views = None
            try:
                mm.close()
            except BufferError:
                pass  # a traceback still holds a view of it: the mapping closes when that goes
        os.fsync(fd)  # the data is on disk before the index or metadata names the file
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    return FileResult(f.name, bytes_read, seconds, sums, tuple(cast))


def _checksums(mm: mmap.mmap, f: OutFile) -> dict[str, str]:
    """Block checksums of each tensor, hashed from the mapping (file pages, no copy)."""
    from dcp_reader.integrity._checksum import block_digests

    view = memoryview(mm)
    try:
        return {t.key: block_digests(view[f.data_start + b:f.data_start + e]) for t, b, e in f.tensors}
    finally:
        view.release()


def fill_files(src: str, root: str, files: Sequence[OutFile], *, reads: Mapping[str, Any], native: bool,
               on_bytes: Callable[[int], None] | None = None,
               on_file: Callable[[FileResult], None] | None = None,
               claim: Callable[[], int | None] | None = None) -> list[FileResult]:
    """Fill ``files`` one after the other with one reader of ``src``: all of them, or, with
    ``claim``, each index it hands out until it returns None (workers sharing the files)."""
    from dcp_reader import open_checkpoint

    out = []
    order = iter(range(len(files))) if claim is None else iter(claim, None)
    with open_checkpoint(src) as reader:
        for i in order:
            result = fill_file(reader, root, files[i], reads=reads, native=native, on_bytes=on_bytes)
            out.append(result)
            if on_file is not None:
                on_file(result)
    return out


def claimer(counter: Any, n: int) -> Callable[[], int | None]:
    """Hands out 0, 1, ..., n - 1 once each across processes sharing ``counter`` (a
    ``multiprocessing.Value``), then None."""
    def claim() -> int | None:
        with counter.get_lock():
            i = counter.value
            if i >= n:
                return None
            counter.value = i + 1
            return i

    return claim


def worker_main(src: str, root: str, files: Sequence[OutFile], counter: Any, reads: Mapping[str, Any], native: bool,
                queue: Any, threads: int = 1) -> None:
    """A worker process: fill the files it claims from ``counter``, telling the parent bytes
    done and each file finished, and at the end either ``("done",)`` or ``("error", text)``.
    ``threads``: its share of the parent's torch threads (the reading threads of each load)."""
    try:
        import torch

        torch.set_num_threads(threads)
        queue.put(("started",))
        fill_files(src, root, files, reads=reads, native=native, claim=claimer(counter, len(files)),
                   on_bytes=lambda n: queue.put(("bytes", n)), on_file=lambda r: queue.put(("file", r)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    queue.put(("done",))
