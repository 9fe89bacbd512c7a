"""``convert``: a checkpoint into Hugging Face safetensors shards, the native format or
torch.distributed.checkpoint's own format (``torch-dcp``), streamed into preallocated files at a memory bound that does not grow with the model.

Call order: the source and DST are resolved and checked (``_place``); the outputs (names,
shapes, where each comes from) are computed from the source's metadata through ``prefix=``
and ``sources=`` (``_sources``: load's ``SourceMap`` and ``compose``, every mistake refused
here, before any file exists); the layout of every output file follows (``_layout``); DST
is locked against a second conversion; a temporary directory beside it receives every file,
created, preallocated and given its final header, under a ``.partial`` name; the files are
filled in place (``_fill``: one load per group of tensors, in this process, or shared with
``workers - 1`` worker processes, ``_workers``); each is renamed to its final name once all
are whole; ``config.json`` (when given), then the index (Hugging Face) or metadata (native;
torch-dcp: the values' file, ``dcp-checksums.json`` and ``.metadata``, ``_torch_layout``)
are written last; the directory then replaces DST in one rename (``_place.place``).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
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
from ._place import DestinationLock, fsync_dir, new_temporary, place, resolve_paths, write_json
from ._torch_layout import (
    TorchFile,
    commit_torch,
    layout_torch_files,
    new_save_id,
    planner_keys,
    recorded_keys,
)
from ._workers import run_workers

__all__ = ["ConvertReport", "convert", "select_names"]

logger = logging.getLogger(__name__)

FORMATS = ("hf", "native", "torch-dcp")
#: other spellings of a target (``save(format="torch_dcp")``'s)
_ALIASES = {"torch_dcp": "torch-dcp"}
HF_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


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


def _out_tensors(tensors: Mapping[str, tuple[tuple[int, ...], str]], names: Sequence[str], dtype: str | None,
                 native: bool) -> list[OutTensor]:
    from dcp_reader import chunk_key

    out = []
    for name in names:
        shape, saved = tensors[name]
        to = dtype if dtype is not None and saved in FLOATING else saved
        key = chunk_key(name, (0,) * len(shape)) if native else name
        out.append(OutTensor(name, tuple(shape), to, key))
    return out


def _values(reader: Any, names: Mapping[str, str], native: bool) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(values kept, (name, reason) of values skipped), of ``names`` ({output name: saved
    name}). A Hugging Face output holds tensors only; a native or torch-dcp one keeps every
    value that can be read without unpickling arbitrary objects and stored as JSON."""
    from dcp_reader import CheckpointError
    from dcp_reader._values import is_storable_value

    if not native:
        return {}, [(n, "a Hugging Face safetensors checkpoint holds tensors only") for n in names]
    kept, skipped = {}, []
    for name, saved in names.items():
        try:
            value = reader.read_value(saved)
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
        heads = f.records() if isinstance(f, TorchFile) else [(0, len(f.header).to_bytes(8, "little") + f.header)]
        fd = os.open(os.path.join(root, partial_name(f.name)), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, f.size)
            except OSError as exc:
                import errno

                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, f.size)  # a filesystem without fallocate: a sparse file
            for offset, raw in heads:
                os.pwrite(fd, raw, offset)
        finally:
            os.close(fd)


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
    return write_json(os.path.join(root, HF_INDEX), doc)


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
            prefix: Any = None, config: Any = None, workers: int = 1, overwrite: bool = False,
            quiet: bool = False) -> ConvertReport:
    """Convert the checkpoint ``src`` (any format dcp reads, a directory or ``s3://...``)
    into the local directory ``dst``: ``to="hf"`` (``model-0000i-of-0000N.safetensors`` +
    ``model.safetensors.index.json``), ``"native"`` (dcp's format, block checksums, values
    kept) or ``"torch-dcp"`` (torch.distributed.checkpoint's own format, which torch's
    ``load`` and ``dcp_to_torch_save`` read: values kept, block checksums in
    ``dcp-checksums.json``). See the README, "Converting".

    ``max_shard_bytes``: bytes per file (an int, or ``"5GB"``, ``"2GiB"``; default 5 GB).
    ``dtype``: cast floating tensors to it (integer and bool tensors never). ``prefix``:
    convert only the names under a prefix, renamed: ``"model."`` keeps ``model.*`` without
    it, ``{"model.": "", "ema.": "ema_model."}`` several; ``sources`` and ``keys`` then see
    the renamed names. ``sources``: the ``sources=`` mapping of ``load`` (output names), or
    a path to a JSON or Python file holding it. ``keys``: output names or glob patterns to
    convert (default all). ``config``: a model config (a path to a JSON file, or a dict)
    written as ``config.json`` (``to="hf"``). ``workers``: processes that share the output
    files (this one included). ``overwrite``: replace a non-empty ``dst`` once the new
    checkpoint is complete. ``quiet``: no progress bar.
    """
    t0 = time.perf_counter()
    to = _check_args(to, workers)
    limit = DEFAULT_SHARD_BYTES if max_shard_bytes is None else parse_size(max_shard_bytes)
    dtype, keep = cast_dtype(dtype), to != "hf"
    config_doc = _config(config, to)
    src_root, dst_abs = resolve_paths(src, dst, overwrite)
    out, reads, values, skipped, recorded = _outputs(src_root, sources, prefix, keys, dtype, to)
    for name, reason in skipped:
        logger.warning("skipped %r: %s", name, reason)
    if not out and not keep:
        raise ValueError(f"nothing to convert: no tensor of {src_root} is selected (keys={keys!r}, prefix={prefix!r})")
    save_id = new_save_id()
    files = _layout(out, limit, to, save_id)
    commit = _committer(to, files, values, save_id, planner_keys([*(t.name for t in out), *values], recorded))
    with DestinationLock(dst_abs):
        tmp = new_temporary(dst_abs)
        progress = _Progress(sum(f.data_bytes for f in files), len(files), quiet)
        try:
            results, tail = _write(src_root, tmp, files, progress, commit, reads=reads, keep=keep, workers=workers,
                                   config=config_doc)
            place(tmp, dst_abs, overwrite)
        except BaseException:
            progress.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    report = ConvertReport(
        src=src_root, dst=dst_abs, format=to, tensors=len(out), bytes_read=sum(r.bytes_read for r in results),
        bytes_written=sum(f.size for f in files) + tail, files=tuple(f.name for f in files),
        seconds=time.perf_counter() - t0, skipped=tuple(skipped),
        cast=tuple(sorted({n for r in results for n in r.cast})), workers=min(workers, max(1, len(files))),
        values=len(values))
    logger.info("converted %s -> %s (%s): %d tensor(s) in %d file(s), %s read, %s written in %.2f s on %d "
                "worker(s)%s", src_root, dst_abs, to, report.tensors, len(files), human_bytes(report.bytes_read),
                human_bytes(report.bytes_written), report.seconds, report.workers,
                f"; {len(skipped)} value(s) skipped" if skipped else "")
    return report


def _check_args(to: Any, workers: Any) -> str:
    """``to`` as one of ``FORMATS`` (ValueError naming them), ``workers`` an int >= 1."""
    to = _ALIASES.get(to, to) if isinstance(to, str) else to
    if to not in FORMATS:
        raise ValueError(f"to must be one of {', '.join(FORMATS)}, got {to!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    return to


def _config(config: Any, to: str) -> dict[str, Any] | None:
    """``config=`` as the JSON object written as ``config.json``: a dict, or a path to one."""
    if config is None:
        return None
    if to != "hf":
        raise ValueError(f"config= (--config) is written for a Hugging Face output only (to='hf'); a {to} "
                         "checkpoint holds no model config")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config {path!r} is not JSON ({exc}); pass the model's config.json") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a JSON object (a dict, or a path to a .json file holding one), got "
                         f"{type(config).__name__}")
    doc = dict(config)
    try:
        json.dumps(doc)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config cannot be written as JSON: {exc}") from None
    if "model_type" not in doc:
        logger.warning("config has no 'model_type': transformers' Auto classes cannot tell the model from it")
    return doc


def _layout(out: Sequence[OutTensor], limit: int, to: str, save_id: str) -> list[OutFile]:
    """The output files of ``to``, every byte placed (a tensor larger than ``limit``: a file
    of its own, with a warning)."""
    if not out:
        return []
    if to == "torch-dcp":
        files: list[OutFile] = list(layout_torch_files(out, limit, save_id))
    else:
        files = layout_files(out, limit, {"format": "pt"} if to == "hf" else _native_meta())
    for fname, tname, size in oversized(files, limit):
        logger.warning("%s holds only %r, %s: larger than the shard size %s (a tensor is never split)", fname,
                       tname, human_bytes(size), human_bytes(limit))
    return files


def _committer(to: str, files: Sequence[OutFile], values: Mapping[str, Any], save_id: str,
               keys: Mapping[str, tuple[Any, ...]]) -> Callable[[str, Mapping[str, FileResult]], int]:
    """What writes the index or metadata of ``to`` into a directory once every data file is
    whole (given each file's result): the bytes it wrote."""
    if to == "hf":
        return lambda root, results: _commit_hf(root, files)
    if to == "native":
        return lambda root, results: _commit_native(root, files, results, values)
    return lambda root, results: commit_torch(root, files, {n: r.checksums for n, r in results.items()}, values,
                                              save_id, keys)


def _outputs(src_root: str, sources: Any, prefix: Any, keys: Any, dtype: str | None, to: str
             ) -> tuple[list[OutTensor], dict[str, Any], dict[str, Any], list[tuple[str, str]], dict[str, Any]]:
    """(output tensors, {output: source over saved names} of those not read under their own
    name, values kept, (name, reason) skipped, {output name: keys} the source recorded for
    the outputs kept under their saved names), from the source's metadata, ``prefix``,
    ``sources`` and ``keys``: every mapping mistake is raised here, before any file exists."""
    from dcp_reader import open_checkpoint

    from ._sources import load_sources_file, map_outputs

    if isinstance(sources, (str, os.PathLike)):
        sources = load_sources_file(sources)
    keep = to != "hf"
    with open_checkpoint(src_root) as reader:
        mapped = map_outputs(reader.metadata, sources, prefix)
        chosen = set(select_names(list(mapped.tensors) + list(mapped.values), keys))
        out = _out_tensors(mapped.tensors, [n for n in mapped.tensors if n in chosen], dtype, keep)
        values, skipped = _values(reader, {n: s for n, s in mapped.values.items() if n in chosen}, keep)
        recorded = recorded_keys(src_root, reader.metadata) if to == "torch-dcp" else {}
    reads = {t.name: mapped.reads[t.name] for t in out if t.name in mapped.reads}
    same = {t.name for t in out if t.name not in mapped.reads} | {n for n in values if mapped.values[n] == n}
    return out, reads, values, skipped, {n: k for n, k in recorded.items() if n in same}


def _write(src_root: str, tmp: str, files: Sequence[OutFile], progress: _Progress,
           commit: Callable[[str, Mapping[str, FileResult]], int], *, reads: Mapping[str, Any], keep: bool,
           workers: int, config: Mapping[str, Any] | None) -> tuple[list[FileResult], int]:
    """Every file of ``tmp`` written, fsynced and renamed to its final name, then
    ``config.json`` and the index or metadata last (``commit``): (per-file results, bytes of
    those). ``keep``: block checksums of every tensor are computed (native, torch-dcp)."""
    _prepare_files(tmp, files)
    by_name = {f.name: f for f in files}

    def on_file(r: FileResult) -> None:
        progress.file(r, by_name[r.name])

    if workers == 1 or len(files) < 2:
        results = fill_files(src_root, tmp, files, reads=reads, native=keep, on_bytes=progress.advance,
                             on_file=on_file)
    else:
        results = run_workers(src_root, tmp, files, workers, reads=reads, native=keep,
                              on_bytes=progress.advance, on_file=on_file)
    progress.close()
    for f in files:
        os.rename(os.path.join(tmp, partial_name(f.name)), os.path.join(tmp, f.name))
    fsync_dir(tmp)
    tail = write_json(os.path.join(tmp, CONFIG), config) if config is not None else 0
    return results, tail + commit(tmp, {r.name: r for r in results})


def _native_meta() -> dict[str, str]:
    from dcp_reader.formats._native import MARKER_KEY, MARKER_VALUE

    return {MARKER_KEY: MARKER_VALUE, "format": "pt"}
