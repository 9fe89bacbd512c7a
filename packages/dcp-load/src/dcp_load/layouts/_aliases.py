"""Tied weights: one tensor under several state dict keys (an embedding shared with the
output projection, for example).

Keys alias when their destinations share memory exactly: the same storage, storage offset,
shape, stride and dtype (torch), or the same object (other frameworks). A group of aliases
is loaded once, through one key. Before anything is written, the checkpoint's values of
every key of a group that it holds are read (the boxes this rank holds) and compared: when
they differ the load fails, naming the keys, unless ``tied_weights`` says which key's value
the others take. A key the checkpoint lacks is filled through an alias it holds (a
Hugging Face checkpoint often stores a tied ``lm_head.weight`` only as the embedding).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ._boxes import intersect
from ._targets import Box, Target

__all__ = ["alias_key", "resolve_aliases"]

logger = logging.getLogger(__name__)


def alias_key(target: Target) -> Any:
    """What two targets share exactly when they are the same memory (None: never shared)."""
    if getattr(target, "flat", False):
        return None  # flat views never tie: one overlapping another is refused (``_flat_target``)
    if not getattr(target, "ties", True):
        return None  # a ShardedTensor of several local shards is no one tensor (``_sharded``)
    local = target.local
    if target.adapter.name == "torch":
        if local.numel() == 0:
            return None  # empty tensors may share a null storage without being tied
        storage = local.untyped_storage()
        return ("torch", local.device.type, storage.data_ptr(), local.storage_offset(),
                tuple(local.shape), tuple(local.stride()), local.dtype)
    return ("object", id(local))


def _groups(targets: Sequence[Target]) -> list[list[Target]]:
    by_key: dict[Any, list[Target]] = {}
    for t in targets:
        key = alias_key(t)
        if key is not None:
            by_key.setdefault(key, []).append(t)
    return [g for g in by_key.values() if len(g) > 1]


def _check_tied_argument(tied: Mapping[str, str], groups: list[list[Target]]) -> list[str]:
    group_of = {t.name: i for i, g in enumerate(groups) for t in g}
    bad = [f"{k!r}: {v!r}" for k, v in tied.items()
           if k == v or k not in group_of or v not in group_of or group_of[k] != group_of[v]]
    if not bad:
        return []
    known = [tuple(t.name for t in g) for g in groups]
    return [f"tied_weights: {', '.join(bad)} do not name two keys of one tensor in the state dict "
            f"(tied keys found: {known or 'none'}); map each key to the key whose value it takes, "
            "both holding the same tensor"]


def _box_values(reader: Any, name: str, box: Box, framework: str) -> Any:
    """The checkpoint's values of ``name`` over ``box``, assembled from its saved chunks."""
    meta = reader.metadata.tensors[name]
    out = None
    for chunk, offsets, sizes in intersect(meta.chunks, box.offsets, box.sizes):
        data = reader.read(name, meta.chunks[chunk], offsets, sizes, framework=framework)
        if out is None:
            out = data.new_empty(box.sizes) if framework == "torch" else _np_empty(box.sizes, data.dtype)
        index = tuple(slice(o - b, o - b + n) for o, b, n in zip(offsets, box.offsets, sizes, strict=True))
        out[index] = data
    return out


def _np_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    import numpy as np

    return np.empty(shape, dtype)


def _same_bits(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if hasattr(a, "untyped_storage"):  # torch: compare bytes, so NaNs and -0.0 count as values
        import torch

        return a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                  b.contiguous().view(-1).view(torch.uint8))
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _differs(reader: Any, primary: Target, other: Target) -> bool:
    tensors = reader.metadata.tensors
    a, b = tensors[primary.name], tensors[other.name]
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return True
    framework = primary.adapter.read_framework
    return any(not _same_bits(_box_values(reader, primary.name, box, framework),
                              _box_values(reader, other.name, box, framework)) for box in primary.boxes)


def _resolve_group(group: list[Target], reader: Any, tied: Mapping[str, str], errors: list[str]
                   ) -> tuple[Target | None, list[tuple[str, str]]]:
    """(the target that loads the group, (key, key whose value it takes) for the others)."""
    tensors = reader.metadata.tensors
    # A key saved with another shape stays a target of its own, so that check_targets names it.
    odd = {t.name for t in group if t.name in tensors and tuple(tensors[t.name].shape) != t.global_shape}
    saved = [t for t in group if t.name in tensors and t.name not in odd]
    if not saved:
        return None, []  # none is in the checkpoint: check_targets reports them as missing
    sources = {tied[t.name] for t in group if t.name in tied}
    primary = next((t for t in saved if t.name in sources), saved[0])
    names = [t.name for t in group]
    disagree = []
    for t in saved:
        if t is primary or tied.get(t.name) == primary.name:
            continue
        try:
            if _differs(reader, primary, t):
                disagree.append(t.name)
        except Exception as exc:  # noqa: BLE001 - reported to every rank through the exchange
            errors.append(f"tied keys {names}: comparing {primary.name!r} with {t.name!r} in the checkpoint "
                          f"failed: {type(exc).__name__}: {exc}")
            return primary, []
    if disagree:
        errors.append(f"tied keys {names} hold one tensor, but the checkpoint's values of {primary.name!r} and "
                      f"{', '.join(repr(n) for n in disagree)} differ; say which value wins, for example "
                      f"tied_weights={{{disagree[0]!r}: {primary.name!r}}} (or the reverse)")
    return primary, [(t.name, primary.name) for t in group if t is not primary and t.name not in odd]


def resolve_aliases(targets: Sequence[Target], reader: Any, tied: Mapping[str, str] | None
                    ) -> tuple[list[str], list[Target], list[tuple[str, str]]]:
    """(errors, targets to load: one per alias group, (key, key it is loaded through)).

    Reads, for each alias group, the checkpoint's values of every key it holds over this
    rank's boxes, and compares them; nothing is written.
    """
    if tied is not None and not (isinstance(tied, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in tied.items())):
        return [f"tied_weights must map str keys to str keys ({{key: key_whose_value_it_takes}}), "
                f"got {tied!r}"], list(targets), []
    tied = dict(tied or {})
    groups = _groups(targets)
    errors = _check_tied_argument(tied, groups)
    if errors:
        return errors, list(targets), []
    dropped: set[str] = set()
    through: list[tuple[str, str]] = []
    for group in groups:
        primary, others = _resolve_group(group, reader, tied, errors)
        if primary is not None:
            dropped.update(name for name, _ in others)
            through.extend(others)
    if through:
        logger.debug("tied keys loaded through another key: %s", through)
    return errors, [t for t in targets if t.name not in dropped], through
