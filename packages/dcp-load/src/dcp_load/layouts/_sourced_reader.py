"""The checkpoint as the destinations see it through ``sources=``: virtual tensors whose
chunks read the real saved bytes, narrowed.

``apply_sources`` is called by every rank once the reader is open. It builds the virtual
tensors of every destination name the ``sources`` entries can compose from the
checkpoint's names (``SourceMap.enumerate``): a function of the checkpoint and the
argument alone, so every rank plans from the same metadata and the digests and gathered
plans that compare it agree, whichever destinations a rank holds (pipeline stages). The
reader is then wrapped (``SourcedReader``): its ``metadata.tensors`` holds the virtual
tensors under the destination names, and its reads of a virtual chunk go to the saved
chunk it came from. Planning (derived or gathered), validation, execution and reports use
it unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dcp_reader import ChunkMeta, TensorMeta

from ._keys import missing_advice
from ._sources import SourceError, SourceMap, compose, describe, leaves
from ._targets import Target

__all__ = ["Applied", "SourcedMetadata", "SourcedReader", "VirtualChunk", "apply_sources", "virtual_tensor",
           "virtual_tensors"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VirtualChunk(ChunkMeta):
    """A chunk of a composed tensor: the box ``[offsets, offsets+sizes)`` of the destination,
    held by saved chunk ``real`` of checkpoint tensor ``source``. Real dimension ``d`` is
    virtual dimension ``axes[d]`` with ``real = virtual + shift[d]``; the other virtual
    dimensions were added by ``Stack`` (size 1). ``file`` and ``key`` are the real ones."""

    source: str = ""
    real: Any = None
    axes: tuple[int, ...] = ()
    shift: tuple[int, ...] = ()

    def real_box(self, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The saved box of ``source`` that holds the virtual box (which must lie inside)."""
        for o, s, co, cs in zip(offsets, sizes, self.offsets, self.sizes, strict=True):
            if o < co or o + s > co + cs:
                raise ValueError(f"box offsets={tuple(offsets)} sizes={tuple(sizes)} is not inside the composed "
                                 f"chunk offsets={self.offsets} sizes={self.sizes} (from {self.source!r})")
        return (tuple(offsets[a] + s for a, s in zip(self.axes, self.shift, strict=True)),
                tuple(sizes[a] for a in self.axes))

    @property
    def added(self) -> tuple[int, ...]:
        """Virtual dimensions no real one maps to (``Stack``'s new dimension)."""
        return tuple(d for d in range(len(self.offsets)) if d not in self.axes)

    @property
    def origin(self) -> tuple[Any, ...]:
        """The saved side of this chunk, for the metadata digests ranks compare."""
        return (self.source, tuple(self.real.offsets), self.axes, self.shift)


class SourcedMetadata:
    """The checkpoint's metadata with the virtual tensors laid over its own (by name)."""

    def __init__(self, inner: Any, virtual: Mapping[str, TensorMeta]):
        self.inner = inner
        self.tensors = {**inner.tensors, **virtual}
        self.virtual = dict(virtual)

    def __getattr__(self, name: str) -> Any:  # values, format, partial, schema_version
        return getattr(self.inner, name)


class SourcedReader:
    """A ``CheckpointReader`` whose ``metadata`` holds virtual tensors; reads of their
    chunks are narrowed reads of the saved chunks they came from. One thread at a time,
    like the reader it wraps (``sibling`` wraps the inner reader's sibling)."""

    def __init__(self, inner: Any, metadata: SourcedMetadata):
        self.inner, self.metadata = inner, metadata

    def __getattr__(self, name: str) -> Any:  # path, format, read_value, torch_save_reads, ...
        return getattr(self.inner, name)

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def sibling(self) -> SourcedReader:
        return SourcedReader(self.inner.sibling(), self.metadata)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> SourcedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def chunk_dtype(self, name: str, chunk: Any) -> str:
        """The dtype ``chunk``'s bytes are saved in: a part of a composed tensor keeps its own
        (the composed tensor takes its first part's), so staging must not round through it."""
        if isinstance(chunk, VirtualChunk):
            return self.inner.metadata.tensors[chunk.source].dtype
        return self.metadata.tensors[name].dtype

    def check_chunk(self, name: str, chunk: Any) -> None:
        if isinstance(chunk, VirtualChunk):
            return self.inner.check_chunk(chunk.source, chunk.real)
        return self.inner.check_chunk(name, chunk)

    def read(self, name: str, chunk: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], *,
             framework: str = "torch", verify: bool = True) -> Any:
        if not isinstance(chunk, VirtualChunk):
            return self.inner.read(name, chunk, offsets, sizes, framework=framework, verify=verify)
        real_offsets, real_sizes = chunk.real_box(offsets, sizes)
        data = self.inner.read(chunk.source, chunk.real, real_offsets, real_sizes, framework=framework, verify=verify)
        return data.reshape(tuple(sizes)) if chunk.added else data  # inserting size-1 dims: a view

    def read_into(self, name: str, chunk: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], out: Any, *,
                  verify: bool = True) -> None:
        if not isinstance(chunk, VirtualChunk):
            return self.inner.read_into(name, chunk, offsets, sizes, out, verify=verify)
        real_offsets, real_sizes = chunk.real_box(offsets, sizes)
        if self.inner.metadata.tensors[chunk.source].dtype != _dtype_name(out):
            # ``out`` of another dtype than the part's saved one: read, then cast (``_execute``
            # stages in the part's own dtype, ``chunk_dtype``, so this is the rare path)
            data = self.inner.read(chunk.source, chunk.real, real_offsets, real_sizes,
                                   framework="numpy" if _is_numpy(out) else "torch", verify=verify)
            data = data.reshape(tuple(sizes))
            if _is_numpy(out):
                import numpy as np

                np.copyto(out, data, casting="unsafe")
            else:
                out.copy_(data)
            return None
        if chunk.added:
            out = _without(out, chunk.added, real_sizes)
        return self.inner.read_into(chunk.source, chunk.real, real_offsets, real_sizes, out, verify=verify)


def _without(out: Any, added: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
    """``out`` without its size-1 dims ``added``, as a view (writes land in ``out``). A
    contiguous one is reshaped, which gives it the strides of its new shape: squeezing
    keeps a removed dim's stride on the one left (a (1, 1) box of a (2, 2) tensor squeezed
    at dim 1 is a (1,) view with stride 2), which readers cannot view as raw bytes."""
    contiguous = out.is_contiguous() if hasattr(out, "is_contiguous") else out.flags.c_contiguous
    return out.reshape(sizes) if contiguous else out.squeeze(added)


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy"


def _dtype_name(array: Any) -> str:
    """``array``'s dtype as the checkpoint names it ("float32", "bfloat16", ...)."""
    return array.dtype.name if _is_numpy(array) else str(array.dtype).removeprefix("torch.")


def virtual_tensor(name: str, source: Any, saved: Mapping[str, Any]) -> TensorMeta:
    """The tensor ``source`` composes from the checkpoint's tensors ``saved``, named ``name``
    (SourceError when its parts do not fit)."""
    shape, dtypes, pieces = compose(source, saved, f"destination {name!r}")
    chunks = tuple(VirtualChunk(p.offsets, p.sizes, p.real.file, p.real.key, p.real.checksum, p.real.storage,
                                source=p.source, real=p.real, axes=p.axes, shift=p.shift) for p in pieces)
    return TensorMeta(name, shape, dtypes[0], chunks)


def virtual_tensors(source_map: SourceMap, saved: Mapping[str, Any]) -> dict[str, TensorMeta]:
    """Every destination name the entries compose from the checkpoint, as a virtual tensor
    (names whose parts do not fit are left out: a destination holding one is refused)."""
    out = {}
    for name, source in source_map.enumerate(saved).items():
        try:
            out[name] = virtual_tensor(name, source, saved)
        except SourceError:
            continue
    return out


def _shape_error(where: str, source: Any, shape: tuple[int, ...], wanted: tuple[int, ...]) -> str:
    dims = [d for d in range(max(len(shape), len(wanted)))
            if d >= len(shape) or d >= len(wanted) or shape[d] != wanted[d]]
    detail = ""
    if dims and hasattr(source, "parts") and len(shape) == len(wanted) and getattr(source, "dim", None) == dims[0]:
        detail = f"; along dim {dims[0]} the parts ({', '.join(describe(p) for p in source.parts[:4])}" \
                 f"{', ...' if len(source.parts) > 4 else ''}) add up to {shape[dims[0]]}"
    return (f"{where}: {describe(source)} gives shape {shape} but the destination's global shape is {wanted} "
            f"(dim {', '.join(map(str, dims))} differs){detail}; fix the sources entry or the model's shape")


def _dtype_errors(where: str, source: Any, target: Target, saved: Mapping[str, Any], nominal: str,
                  allow_cast: bool) -> tuple[list[str], bool]:
    """Parts whose dtype differs from the destination's: each must be castable to it as
    ``check_dtypes`` rules, each refusal naming its part (the first part's too, whose dtype
    the composed tensor takes). (errors, cast needed beyond the composed tensor's own)."""
    errors, cast = [], False
    for part in dict.fromkeys(leaves(source)):
        dtype = saved[part].dtype
        if dtype == target.dtype:
            continue
        if allow_cast and dtype.startswith("complex") == target.dtype.startswith("complex"):
            cast = cast or dtype != nominal
        else:
            why = "allow_dtype_cast=False refuses casts" if not allow_cast else "complex and real do not mix"
            errors.append(f"{where}: part {part!r} is {dtype} but the destination is {target.dtype} ({why}); "
                          "cast the destination or the checkpoint")
    return errors, cast


@dataclass
class Applied:
    """What ``apply_sources`` found on this rank: ``errors``; the wrapped ``reader``; the
    ``targets`` to load; ``composed``: (destination, number of saved tensors it reads);
    ``cast``: destinations cast because a part's dtype differs from the composed tensor's;
    ``missing``: destinations skipped (``strict=False``) because a source is missing;
    ``tied``: (key, key) of such a skipped destination that shares its memory with one
    that loads, and so is filled through it."""

    errors: list[str]
    reader: SourcedReader
    targets: list[Target]
    composed: list[tuple[str, int]]
    cast: list[str]
    missing: list[str]
    tied: list[tuple[str, str]]


def apply_sources(reader: Any, targets: Sequence[Target], source_map: SourceMap, allow_cast: bool,
                  strict: bool = True, values: Sequence[str] = (), whole: bool = False) -> Applied:
    """Wrap ``reader`` in the virtual tensors of ``source_map`` and check every target that
    an entry matches against them (module docstring). ``values``: the state dict's
    non-tensor keys, which ``sources`` does not map (one that an entry matches is refused
    rather than loaded from its own name behind the caller's back). ``whole``: this state
    dict is the whole job's (no process group), so an entry that matches none of its keys
    is a mistake (``_unmatched``)."""
    saved = reader.metadata.tensors
    virtual = virtual_tensors(source_map, saved)
    errors = _value_errors(source_map, values)
    keep: list[Target] = []
    composed: list[tuple[str, int]] = []
    cast: list[str] = []
    missing: list[str] = []
    matched: set[str] = set()
    for t in targets:
        try:
            found = source_map.match(t.name)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if found is None:
            keep.append(t)
            continue
        key, source = found
        matched.add(key)
        where = f"destination {t.name!r} (sources[{key!r}])"
        meta = virtual.get(t.name)
        if meta is None:
            if not strict and any(n not in saved for n in leaves(source)):
                missing.append(t.name)  # listed in the report like any key the checkpoint lacks
            else:
                errors.append(_compose_error(where, source, saved, getattr(reader.metadata, "values", ())))
            continue
        if tuple(meta.shape) != tuple(t.global_shape):
            errors.append(_shape_error(where, source, tuple(meta.shape), tuple(t.global_shape)))
            continue
        errs, needs_cast = _dtype_errors(where, source, t, saved, meta.dtype, allow_cast)
        if errs:
            errors.extend(errs)
            continue
        if needs_cast:
            cast.append(t.name)
        keep.append(t)
        composed.append((t.name, len(set(leaves(source)))))
    logger.debug("sources: %d virtual tensor(s) from the checkpoint, %d destination(s) of this rank composed",
                 len(virtual), len(composed))
    if strict:
        lost = [t.name for t in keep if t.name not in saved and source_map.match(t.name) is None]
        errors.extend(_unmatched(source_map, matched, [t.name for t in targets], lost, whole))
    missing, tied = _through_aliases(missing, targets, keep)
    if missing:
        logger.warning("strict=False: %d destination(s) whose sources the checkpoint lacks keep their current "
                       "values: %s", len(missing), ", ".join(repr(n) for n in missing[:5]))
    return Applied(errors, SourcedReader(reader, SourcedMetadata(reader.metadata, virtual)), keep, composed, cast,
                   missing, tied)


def _value_errors(source_map: SourceMap, values: Sequence[str]) -> list[str]:
    """A non-tensor value of the state dict that an entry matches is refused."""
    errors = []
    for name in values:
        try:
            found = source_map.match(name) is not None
        except ValueError:  # two entries match it: refused all the same
            found = True
        if found:
            errors.append(f"sources= matches {name!r}, a non-tensor value of the state dict; sources= maps "
                          "tensors only: make the key not match it (values load from their own names)")
    return errors


def _unmatched(source_map: SourceMap, matched: set[str], names: Sequence[str], lost: Sequence[str],
               whole: bool) -> list[str]:
    """An entry of ``sources`` that matches no destination key: a typo (``layer.{i}`` for
    ``layers.{i}``) would otherwise be ignored, and the destination it meant would be
    reported missing with the typo's virtual tensor as its nearest checkpoint key. Refused
    when this state dict is the whole job's, or when a destination of it (``lost``) is
    found neither in the checkpoint nor through an entry (a pipeline stage may hold none of
    an entry's destinations, and is told only when it misses one)."""
    unmatched = [key for key, _, _, _ in source_map.entries if key not in matched]
    if not unmatched or not (whole or lost):
        return []
    import difflib

    pool = list(lost) or list(names)
    out = []
    for key in unmatched:
        near = difflib.get_close_matches(key, pool, n=3, cutoff=0.5)
        hint = (f"nearest destination keys: {', '.join(repr(n) for n in near)}" if near else
                f"the state dict holds {len(names)} tensor key(s), for example "
                f"{', '.join(repr(n) for n in sorted(names)[:3])}")
        out.append(f"{source_map.owner}: sources[{key!r}] matches no destination key of the state dict; {hint}; "
                   "fix the key (a placeholder matches one dot-free segment) or remove the entry")
    return out


def _through_aliases(missing: list[str], targets: Sequence[Target], keep: Sequence[Target]
                     ) -> tuple[list[str], list[tuple[str, str]]]:
    """(still missing, (key, key it is filled through)): a skipped destination that shares
    its memory with a destination that loads (tied weights) is written all the same."""
    from ._aliases import alias_key

    loaded = {}
    for t in keep:
        loaded.setdefault(alias_key(t), t.name)
    loaded.pop(None, None)
    skipped = {t.name: alias_key(t) for t in targets if t.name in missing}
    tied = [(n, loaded[skipped[n]]) for n in missing if skipped[n] in loaded]
    return [n for n in missing if skipped[n] not in loaded], tied


def _compose_error(where: str, source: Any, saved: Mapping[str, Any], checkpoint_values: Any = ()) -> str:
    """Why ``source`` cannot be composed (a missing part with the nearest saved names, or
    parts that do not fit)."""
    missing = [n for n in dict.fromkeys(leaves(source)) if n not in saved]
    if missing:
        values = [n for n in missing if n in checkpoint_values]
        advice = (f"{', '.join(repr(n) for n in values[:5])} {'is a non-tensor value' if len(values) == 1 else 'are non-tensor values'} "
                  "there; sources= composes tensors only") if values else missing_advice(missing, list(saved))
        return (f"{where}: source(s) {', '.join(repr(n) for n in missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} of {describe(source)} are not tensors of the checkpoint"
                f"{'; ' + advice if advice else ''}")
    try:
        compose(source, saved, where)
    except SourceError as exc:
        return str(exc.args[0])
    return f"{where}: {describe(source)} is composed by an earlier sources entry; make the keys match one each"
