"""Find every problem before any destination changes, and fail together across ranks.

Local checks (``check_targets``, ``check_reads``) collect messages instead of raising, so
that one report lists every offender. ``exchange`` all-gathers the messages: when any rank
has one, every rank raises the same ``LoadError`` naming the ranks and causes.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ._errors import LoadError
from ._plan import ReadItem, intersect
from ._state import Leaf
from ._targets import Target

__all__ = ["check_reads", "check_targets", "exchange", "summarise"]

logger = logging.getLogger(__name__)


def summarise(items: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def check_targets(targets: Sequence[Target], values: Sequence[Leaf], metadata: Any, strict: bool
                  ) -> tuple[list[str], list[Target], list[Leaf], list[str]]:
    """Compare the state dict with the checkpoint's metadata.

    Returns (errors, targets to load, values to load, names skipped because missing and
    ``strict`` is False).
    """
    errors: list[str] = []
    missing: list[str] = []
    shape_bad: list[str] = []
    dtype_bad: list[str] = []
    kind_bad: list[str] = []
    coverage_bad: list[str] = []
    keep_t: list[Target] = []
    keep_v: list[Leaf] = []
    for t in targets:
        meta = metadata.tensors.get(t.name)
        if meta is None:
            if t.name in metadata.values:
                kind_bad.append(f"{t.name!r} (state dict: tensor, checkpoint: non-tensor value)")
            else:
                missing.append(t.name)
            continue
        if tuple(meta.shape) != tuple(t.global_shape):
            shape_bad.append(f"{t.name!r} (state dict {tuple(t.global_shape)}, checkpoint {tuple(meta.shape)})")
            continue
        if meta.dtype != t.dtype:
            dtype_bad.append(f"{t.name!r} (state dict {t.dtype}, checkpoint {meta.dtype})")
            continue
        covered = sum(math.prod(s) for _, _, s in intersect(meta.chunks, t.offsets, t.sizes))
        if covered < t.numel:
            coverage_bad.append(f"{t.name!r} box offsets={t.offsets} sizes={t.sizes}: "
                                f"{covered} of {t.numel} elements saved")
            continue
        keep_t.append(t)
    for leaf in values:
        if leaf.name in metadata.values:
            keep_v.append(leaf)
        elif leaf.name in metadata.tensors:
            kind_bad.append(f"{leaf.name!r} (state dict: {type(leaf.value).__name__} value, checkpoint: tensor)")
        else:
            missing.append(leaf.name)
    if missing and strict:
        errors.append(f"{len(missing)} key(s) of the state dict are missing from the checkpoint: "
                      f"{summarise([repr(n) for n in missing])}; remove them from the state dict or pass strict=False "
                      "to load the rest")
    if shape_bad:
        errors.append(f"shape mismatch for {len(shape_bad)} tensor(s): {summarise(shape_bad)}; "
                      "build the model with the checkpoint's shapes")
    if dtype_bad:
        errors.append(f"dtype mismatch for {len(dtype_bad)} tensor(s): {summarise(dtype_bad)}; "
                      "cast the state dict's tensors to the checkpoint's dtypes before loading")
    if kind_bad:
        errors.append(f"tensor/value mismatch for {len(kind_bad)} entr(ies): {summarise(kind_bad)}")
    if coverage_bad:
        errors.append(f"the checkpoint's chunks do not cover {len(coverage_bad)} wanted box(es): "
                      f"{summarise(coverage_bad)}; the checkpoint is incomplete")
    return errors, keep_t, keep_v, (missing if not strict else [])


def check_reads(reader: Any, items: Sequence[ReadItem], values: Sequence[Leaf]
                ) -> tuple[list[str], dict[str, Any]]:
    """Open every data file this rank will read, and read its non-tensor values.

    For each saved chunk this rank reads from, the reader fetches the chunk's last element,
    which makes it open the file, check the header and check that the chunk's bytes lie
    inside the file (a truncated file fails here, before any write). Returns (errors,
    values read by name).
    """
    errors: list[str] = []
    tensors = reader.metadata.tensors
    seen: set[tuple[str, int]] = set()
    for item in items:
        if (item.name, item.chunk) in seen:
            continue
        seen.add((item.name, item.chunk))
        chunk = tensors[item.name].chunks[item.chunk]
        last = tuple(o + s - 1 for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        try:
            if chunk.storage is not None:
                # Formats that cannot narrow a read (torch DCP blobs) would fetch the whole
                # blob for a probe: check that the file holds the blob's bytes instead.
                _check_extent(reader.path, chunk)
            else:
                reader.read(item.name, chunk, last, (1,) * len(last))
        except Exception as exc:  # noqa: BLE001 - every failure is reported to all ranks, not raised here
            errors.append(f"cannot read {item.name!r} from {chunk.file!r}: {type(exc).__name__}: {exc}")
    got: dict[str, Any] = {}
    for leaf in values:
        try:
            got[leaf.name] = reader.read_value(leaf.name)
        except Exception as exc:  # noqa: BLE001 - as above
            errors.append(f"cannot read value {leaf.name!r}: {type(exc).__name__}: {exc}")
    return errors, got


def _check_extent(root: Any, chunk: Any) -> None:
    path = os.path.join(os.fspath(root), chunk.file)
    size = os.stat(path).st_size
    end = chunk.storage[0] + chunk.storage[1]
    if size < end:
        raise OSError(f"{path} is {size} bytes but chunk {chunk.key!r} ends at byte {end} "
                      "(truncated file); re-copy or re-save the checkpoint")


def exchange(platform: Any, errors: Sequence[str], phase: str, *, collective: bool,
             payload: Any = None, gather: Any = None) -> list[Any]:
    """All-gather (errors, payload); raise ``LoadError`` on every rank when any rank failed.

    Without collectives only this rank's errors count. Returns the gathered payloads.
    ``gather``: the all-gather to use (a bounded one, ``Watch.gather``); default the
    platform's.
    """
    if collective:
        gathered = (gather or platform.all_gather_object)((list(errors), payload))
    else:
        gathered = [(list(errors), payload)]
    failures: Mapping[int, list[str]] = {
        (r if collective else platform.rank()): e for r, (e, _) in enumerate(gathered) if e
    }
    if failures:
        raise LoadError(failures, phase)
    return [p for _, p in gathered]
