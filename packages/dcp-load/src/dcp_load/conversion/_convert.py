"""``convert``: a checkpoint into Hugging Face safetensors shards or the native format,
streamed into preallocated files at a memory bound that does not grow with the model.

Call order: the layout of every output file is computed from the source's metadata
(``_convert_layout``); a temporary directory beside ``dst`` receives every file, created,
preallocated and given its final header, under a ``.partial`` name; the files are filled in
place (``_convert_fill``: one load per group of tensors, in this process, or shared with
``workers - 1`` worker processes, ``_convert_workers``); each is renamed to its final name
once all are whole; the index (Hugging Face) or metadata (native) is written last; the
directory is renamed to ``dst``. A conversion killed at any point leaves no complete-looking checkpoint at ``dst``,
and its temporary directory holds only ``.partial`` files until every one is whole.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..run._progress import Progress
from ..run._units import human_bytes
from ._fill import FileResult, fill_files, partial_name
from ._layout import (
    DEFAULT_SHARD_BYTES,
    FLOATING,
    OutFile,
    OutTensor,
    cast_dtype,
    layout_files,
    oversized,
    parse_size,
)
from ._workers import run_workers

__all__ = ["ConvertReport", "convert", "select_names"]

logger = logging.getLogger(__name__)

FORMATS = ("hf", "native")
HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ConvertReport:
    """What ``convert`` did. ``bytes_read``: bytes read from the source; ``bytes_written``:
    bytes of every file written (data files, index or metadata); ``files``: the data files;
    ``skipped``: (name, reason) of each value or tensor left out (non-tensor values in a
    Hugging Face output, values that cannot be stored); ``cast``: tensors cast by
    ``dtype``."""

    src: str
    dst: str
    format: str
    tensors: int
    bytes_read: int
    bytes_written: int
    files: tuple[str, ...]
    seconds: float
    skipped: tuple[tuple[str, str], ...] = ()
    cast: tuple[str, ...] = ()
    workers: int = 1
    values: int = 0


def select_names(names: Sequence[str], keys: Any, what: str = "keys") -> list[str]:
    """The names matching ``keys`` (exact names or ``fnmatch`` globs; None: all), in their
    order; ValueError naming every pattern that matches nothing."""
    if keys is None:
        return list(names)
    patterns = [keys] if isinstance(keys, str) else list(keys)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{what} must be names or glob patterns (str), got {bad[:3]!r}")
    exact = set(names)
    chosen, unmatched = set(), []
    for p in patterns:
        hit = {p} if p in exact else set(fnmatch.filter(names, p))
        if not hit:
            unmatched.append(p)
        chosen |= hit
    if unmatched:
        from ..layouts._keys import missing_advice

        raise ValueError(f"{what}: {len(unmatched)} pattern(s) match no tensor or value of the checkpoint: "
                         f"{', '.join(repr(p) for p in unmatched[:5])}; {missing_advice(unmatched, names)}")
    return [n for n in names if n in chosen]


def _check_dst(src_real: str, dst: str, overwrite: bool) -> str:
    dst_abs = os.path.abspath(dst)
    real = os.path.realpath(dst_abs)
    if real == src_real or real.startswith(src_real + os.sep) or src_real.startswith(real + os.sep):
        raise ValueError(f"dst {dst!r} is the source {src_real!r}, inside it or holds it; convert into "
                         "another directory")
    if os.path.lexists(dst_abs) and not os.path.isdir(dst_abs):
        raise FileExistsError(f"dst {dst!r} exists and is not a directory; remove it or choose another path")
    if os.path.isdir(dst_abs) and os.listdir(dst_abs) and not overwrite:
        raise FileExistsError(f"dst {dst!r} exists and is not empty ({len(os.listdir(dst_abs))} entries); it is "
                              "left untouched. Choose another path, or pass overwrite=True (--overwrite) to "
                              "replace it once the conversion has finished")
    parent = os.path.dirname(dst_abs) or "."
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of dst {dst!r} does not exist: create {parent!r} first")
    return dst_abs


def _out_tensors(meta: Any, names: Sequence[str], dtype: str | None, native: bool,
                 composed: Mapping[str, tuple[tuple[int, ...], str]]) -> list[OutTensor]:
    from dcp_reader import chunk_key

    out = []
    for name in names:
        shape, saved = composed[name] if name in composed else (meta.tensors[name].shape, meta.tensors[name].dtype)
        to = dtype if dtype is not None and saved in FLOATING else saved
        key = chunk_key(name, (0,) * len(shape)) if native else name
        out.append(OutTensor(name, tuple(shape), to, key))
    return out


def _values(reader: Any, names: Sequence[str], native: bool) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(values kept, (name, reason) of values skipped). A Hugging Face output holds tensors
    only; a native one keeps every value that can be read without unpickling arbitrary
    objects and stored as JSON."""
    from dcp_reader import CheckpointError
    from dcp_reader._values import is_storable_value

    if not native:
        return {}, [(n, "a Hugging Face safetensors checkpoint holds tensors only") for n in names]
    kept, skipped = {}, []
    for name in names:
        try:
            value = reader.read_value(name)
        except CheckpointError as exc:
            skipped.append((name, f"unreadable without allow_pickle ({type(exc).__name__}: {str(exc)[:120]})"))
            continue
        if is_storable_value(value):
            kept[name] = value
        else:
            skipped.append((name, f"a {type(value).__name__} cannot be stored as JSON"))
    return kept, skipped


def _prepare_files(root: str, files: Sequence[OutFile]) -> None:
    """Create each file under its partial name, reserve its blocks and write its header:
    a full disk fails here, before anything is read (and never as SIGBUS in a mapping)."""
    for f in files:
        fd = os.open(os.path.join(root, partial_name(f.name)), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, f.size)
            except OSError as exc:
                import errno

                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, f.size)  # a filesystem without fallocate: a sparse file
            os.pwrite(fd, len(f.header).to_bytes(8, "little") + f.header, 0)
        finally:
            os.close(fd)


def _fsync_dir(path: str) -> None:
    from dcp_reader.write._writer import _fsync_dir as sync

    sync(path)


def _write_json(path: str, doc: Any) -> int:
    from dcp_reader.write._writer import _atomic_write

    return _atomic_write(path, [json.dumps(doc, indent=2).encode()])


def _commit_native(root: str, files: Sequence[OutFile], results: Mapping[str, FileResult],
                   values: Mapping[str, Any]) -> int:
    from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta

    tensors = {}
    for f in files:
        sums = results[f.name].checksums
        for t, _, _ in f.tensors:
            chunk = ChunkMeta(offsets=(0,) * len(t.shape), sizes=t.shape, file=f.name, key=t.key,
                              checksum=sums.get(t.key))
            tensors[t.name] = TensorMeta(t.name, t.shape, t.dtype, (chunk,))
    writer = NativeWriter(root)
    value_meta = writer.write_values(values)
    meta = CheckpointMetadata(tensors=tensors, values=value_meta, format="native")
    writer.commit(meta)
    from dcp_reader import METADATA_FILE

    return os.path.getsize(os.path.join(root, METADATA_FILE))


def _commit_hf(root: str, files: Sequence[OutFile]) -> int:
    """The index as transformers writes it: metadata.total_size (bytes of the tensors) and
    the weight map, keys sorted."""
    weight_map = {t.name: f.name for f in files for t, _, _ in f.tensors}
    total = sum(t.nbytes for f in files for t, _, _ in f.tensors)
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return _write_json(os.path.join(root, HF_INDEX), doc)


def _move_into_place(tmp: str, dst: str) -> None:
    """Rename the finished directory to ``dst``; an existing ``dst`` (empty, or replaced with
    overwrite) is moved aside first and removed only once the new one is in place."""
    old = None
    if os.path.lexists(dst):
        old = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.dcp-convert-old-{uuid.uuid4().hex[:8]}")
        os.rename(dst, old)
    os.rename(tmp, dst)
    _fsync_dir(os.path.dirname(dst) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class _Progress:
    """The bar in bytes (on a terminal), an INFO line per file otherwise, and the summary."""

    def __init__(self, total: int, files: int, quiet: bool):
        # shown when this module's logger passes INFO (the CLI sets it up), as load's bar does
        self.bar = Progress(0, enabled=not quiet and logger.isEnabledFor(logging.INFO), label="dcp convert")
        self.bar.total = total
        self.files, self.done_files, self.quiet = files, 0, quiet
        self.tty = self.bar._bar  # a bar will be drawn: no per-file lines then

    def advance(self, n: int) -> None:
        self.bar.advance(n)

    def file(self, r: FileResult, f: OutFile) -> None:
        self.done_files += 1
        if not self.tty:
            logger.info("wrote %s (%d/%d): %d tensor(s), %s in %.2f s", f.name, self.done_files, self.files,
                        len(f.tensors), human_bytes(f.size), r.seconds)

    def close(self) -> None:
        self.bar.close()


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, to: str = "hf",
            max_shard_bytes: int | str | None = None, dtype: Any = None, keys: Any = None, sources: Any = None,
            workers: int = 1, overwrite: bool = False, quiet: bool = False) -> ConvertReport:
    """Convert the checkpoint ``src`` (any format dcp reads) into ``dst``: ``to="hf"``
    (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``) or
    ``"native"`` (dcp's format, block checksums, values kept). See the README, "dcp convert".

    ``max_shard_bytes``: bytes per file (an int, or ``"5GB"``, ``"2GiB"``; default 5 GB).
    ``dtype``: cast floating tensors to it (integer and bool tensors never). ``keys``: names
    or glob patterns to convert (default all). ``sources``: the ``sources=`` mapping of
    ``load`` (destination names), or a path to a JSON or Python file holding it.
    ``workers``: processes that share the output files (this one included). ``overwrite``: replace a non-empty
    ``dst`` once the new checkpoint is complete. ``quiet``: no progress bar.
    """
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise ValueError(f"to must be one of {FORMATS}, got {to!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    limit = DEFAULT_SHARD_BYTES if max_shard_bytes is None else parse_size(max_shard_bytes)
    dtype = cast_dtype(dtype)
    native = to == "native"
    src_real = os.path.realpath(os.fspath(src))
    dst_abs = _check_dst(src_real, os.fspath(dst), overwrite)
    out, values, skipped, sources = _outputs(src_real, sources, keys, dtype, native)
    for name, reason in skipped:
        logger.warning("skipped %r: %s", name, reason)
    if not out and not native:
        raise ValueError(f"nothing to convert: no tensor of {src_real} is selected (keys={keys!r})")
    files = layout_files(out, limit, {"format": "pt"} if not native else _native_meta()) if out else []
    for fname, tname, size in oversized(files, limit):
        logger.warning("%s holds only %r, %s: larger than the shard size %s (a tensor is never split)", fname,
                       tname, human_bytes(size), human_bytes(limit))
    tmp = os.path.join(os.path.dirname(dst_abs), f".{os.path.basename(dst_abs)}.dcp-convert-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    progress = _Progress(sum(f.data_bytes for f in files), len(files), quiet)
    try:
        results, tail = _write(src_real, tmp, files, values, progress, sources=sources, native=native,
                               workers=workers)
        _move_into_place(tmp, dst_abs)
    except BaseException:
        progress.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written = sum(f.size for f in files) + tail
    report = ConvertReport(
        src=src_real, dst=dst_abs, format=to, tensors=len(out), bytes_read=sum(r.bytes_read for r in results),
        bytes_written=written, files=tuple(f.name for f in files), seconds=time.perf_counter() - t0,
        skipped=tuple(skipped), cast=tuple(sorted({n for r in results for n in r.cast})),
        workers=min(workers, max(1, len(files))), values=len(values))
    logger.info("converted %s -> %s (%s): %d tensor(s) in %d file(s), %s read, %s written in %.2f s on %d "
                "worker(s)%s", src_real, dst_abs, to, report.tensors, len(files), human_bytes(report.bytes_read),
                human_bytes(report.bytes_written), report.seconds, report.workers,
                f"; {len(skipped)} value(s) skipped" if skipped else "")
    return report


def _outputs(src_real: str, sources: Any, keys: Any, dtype: str | None, native: bool
             ) -> tuple[list[OutTensor], dict[str, Any], list[tuple[str, str]], Any]:
    """(output tensors, values kept, (name, reason) skipped, what the fill passes to load),
    from the source's metadata, ``sources`` and ``keys``."""
    from dcp_reader import open_checkpoint

    if isinstance(sources, (str, os.PathLike)):
        from ._sources import load_sources_file

        sources = load_sources_file(sources)
    with open_checkpoint(src_real) as reader:
        meta = reader.metadata
        composed, consumed, renames = {}, set(), {}
        if sources:
            from ._sources import composed_tensors

            composed, consumed, renames = composed_tensors(meta, sources)
            sources = _load_sources(sources, renames)
        tensor_names = sorted([n for n in meta.tensors if n not in consumed and n not in composed] + list(composed))
        value_names = sorted(meta.values)
        chosen = set(select_names(tensor_names + value_names, keys))
        out = _out_tensors(meta, [n for n in tensor_names if n in chosen], dtype, native, composed)
        values, skipped = _values(reader, [n for n in value_names if n in chosen], native)
    return out, values, skipped, sources


def _write(src_real: str, tmp: str, files: Sequence[OutFile], values: Mapping[str, Any], progress: _Progress, *,
           sources: Any, native: bool, workers: int) -> tuple[list[FileResult], int]:
    """Every file of ``tmp`` written, fsynced and renamed to its final name, then the index
    or metadata last: (per-file results, bytes of the index or metadata)."""
    _prepare_files(tmp, files)
    by_name = {f.name: f for f in files}

    def on_file(r: FileResult) -> None:
        progress.file(r, by_name[r.name])

    if workers == 1 or len(files) < 2:
        results = fill_files(src_real, tmp, files, sources=sources, native=native, on_bytes=progress.advance,
                             on_file=on_file)
    else:
        results = run_workers(src_real, tmp, files, workers, sources=sources, native=native,
                              on_bytes=progress.advance, on_file=on_file)
    progress.close()
    for f in files:
        os.rename(os.path.join(tmp, partial_name(f.name)), os.path.join(tmp, f.name))
    _fsync_dir(tmp)
    by_result = {r.name: r for r in results}
    return results, _commit_native(tmp, files, by_result, values) if native else _commit_hf(tmp, files)


def _load_sources(sources: Mapping[str, Any], renames: Mapping[str, str]) -> Any:
    """What the fill passes on: renames alone are done here (each output tensor loads from
    its saved name), composed sources go to ``load(sources=...)``."""
    if all(isinstance(v, str) for v in sources.values()):
        return {"renames": dict(renames)}
    return {"load": dict(sources)}


def _native_meta() -> dict[str, str]:
    from dcp_reader.formats._native import MARKER_KEY, MARKER_VALUE

    return {MARKER_KEY: MARKER_VALUE, "format": "pt"}
