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

from .._errors import LoadError
from ..layouts._boxes import intersect
from ..layouts._keys import missing_advice
from ..layouts._state import Leaf
from ..layouts._targets import Target
from ..plan._items import ReadItem

__all__ = ["ReadChecks", "check_dtypes", "check_launch", "check_reads", "check_targets", "exchange", "summarise"]

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
    meta_dev = [repr(t.name) for t in targets if t.adapter.device_type(t.local) == "meta"]
    if meta_dev:
        errors.append(f"{len(meta_dev)} destination tensor(s) are on the 'meta' device, which holds no "
                      f"memory to load into: {summarise(meta_dev)}; materialise them first (for example "
                      "model.to_empty(device='cpu') or device='cuda') and load into the result")
    missing: list[str] = []
    shape_bad: list[str] = []
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
        short = _uncovered(meta.chunks, t)
        if short:
            coverage_bad.append(f"{t.name!r} {short}")
            continue
        keep_t.append(t)
    for leaf in values:
        if leaf.name in metadata.values:
            keep_v.append(leaf)
        elif leaf.name in metadata.tensors:
            kind_bad.append(f"{leaf.name!r} (state dict: {type(leaf.value).__name__} value, checkpoint: tensor)")
        else:
            missing.append(leaf.name)
    errors.extend(_missing_errors(missing, [*metadata.tensors, *metadata.values], strict,
                                  loaded=len(keep_t) + len(keep_v)))
    if shape_bad:
        errors.append(f"shape mismatch for {len(shape_bad)} tensor(s): {summarise(shape_bad)}; "
                      "build the model with the checkpoint's shapes")
    if kind_bad:
        errors.append(f"tensor/value mismatch for {len(kind_bad)} entr(ies): {summarise(kind_bad)}")
    if coverage_bad:
        errors.append(f"the checkpoint's chunks do not cover {len(coverage_bad)} wanted box(es): "
                      f"{summarise(coverage_bad)}; the checkpoint is incomplete")
    return errors, keep_t, keep_v, (missing if not strict else [])


def _missing_errors(missing: Sequence[str], saved: Sequence[str], strict: bool, loaded: int) -> list[str]:
    """The error for keys the checkpoint lacks (strict), or for a non-strict load that would
    load nothing at all; a non-strict load that leaves some keys unloaded warns instead."""
    if not missing:
        return []
    names = summarise([repr(n) for n in missing])
    advice = missing_advice(missing, saved)
    advice = f"; {advice}" if advice else ""
    if strict:
        return [f"{len(missing)} key(s) of the state dict are missing from the checkpoint: {names}{advice}; "
                "rename them to match, remove them from the state dict, or pass strict=False to load the rest"]
    if not loaded:
        return [f"strict=False, but none of the state dict's {len(missing)} key(s) is in the checkpoint, so "
                f"nothing would be loaded: {names}{advice}"]
    logger.warning("strict=False: %d key(s) of the state dict are not in the checkpoint and keep their "
                   "current values: %s", len(missing), summarise([repr(n) for n in missing], limit=5))
    return []


def _uncovered(chunks: Any, target: Target) -> str:
    """A description of the first box of ``target`` the saved chunks do not cover, or ''."""
    for box in target.boxes:
        covered = sum(math.prod(s) for _, _, s in intersect(chunks, box.offsets, box.sizes))
        if covered < box.numel:
            return f"box offsets={box.offsets} sizes={box.sizes}: {covered} of {box.numel} elements saved"
    return ""


def check_launch(platform: Any, no_dist: bool, caller: str) -> None:
    """Refuse to run as a world of one when the launcher started several processes.

    torchrun (and other launchers) set ``WORLD_SIZE``; without a process group each process
    would load or save alone, unaware of the others. Raised locally: there is no group to
    tell the other ranks through, and every one of them finds the same thing.
    """
    world = os.environ.get("WORLD_SIZE", "")
    if no_dist or not world.isdigit() or int(world) <= 1 or platform.is_distributed():
        return
    if getattr(platform, "group_key", "world") != "world":
        return  # a process group of one rank, given on purpose
    # no_dist=True makes every process save as rank 0 of 1: safe only into a directory of its own
    alone = ("pass no_dist=True to load this rank's tensors on their own" if caller == "load" else
             "pass no_dist=True and a checkpoint_id of this rank's own (for example "
             "f\"{path}/rank-{os.environ['RANK']}\") to save this rank's tensors on their own: ranks "
             "saving with no_dist=True into one directory would replace each other's files")
    raise RuntimeError(
        f"{caller}: WORLD_SIZE={world} is set (a launcher such as torchrun started {world} processes) but "
        "no process group is initialised, so this process would run as a world of one: call "
        "torch.distributed.init_process_group(backend=...) (for example backend='gloo' on CPU, 'nccl' on "
        f"CUDA) before {caller}, or {alone}"
    )


def _kind(dtype: str) -> str:
    return "complex" if dtype.startswith("complex") else "real"


def check_dtypes(targets: Sequence[Target], metadata: Any, allow_cast: bool) -> tuple[list[str], list[str]]:
    """Destinations whose dtype differs from the checkpoint's are cast while loading, as
    torch.distributed.checkpoint does (each piece is copied into its destination with a
    cast: no tensor-sized temporary). Returns (errors, names of the cast tensors); with
    ``allow_cast=False`` every mismatch is an error. Complex and real never mix."""
    cast: list[str] = []
    bad: list[str] = []
    for t in targets:
        saved = metadata.tensors[t.name].dtype
        if saved == t.dtype:
            continue
        if allow_cast and _kind(saved) == _kind(t.dtype):
            cast.append(t.name)
        else:
            bad.append(f"{t.name!r} (state dict {t.dtype}, checkpoint {saved})")
    if not bad:
        return [], cast
    fix = ("allow_dtype_cast=False refuses casts: cast the state dict's tensors to the checkpoint's "
           "dtypes first" if not allow_cast else "complex and real dtypes cannot be cast into each other")
    return [f"dtype mismatch for {len(bad)} tensor(s): {summarise(bad)}; {fix}"], cast


class ReadChecks:
    """What ``check_reads`` found, by saved chunk and for the values: a second call with the
    same ``ReadChecks`` checks only the chunks the first did not, and reads no value again
    (``load`` checks a guessed plan's reads before the digest exchange, and the plan it
    then runs may differ)."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[str, int], str | None] = {}
        self.values: tuple[list[str], dict[str, Any]] | None = None


def check_reads(reader: Any, items: Sequence[ReadItem], values: Sequence[Leaf],
                checks: ReadChecks | None = None) -> tuple[list[str], dict[str, Any]]:
    """Open every data file this rank will read, and read its non-tensor values.

    For each saved chunk this rank reads from, the reader checks the chunk without reading
    its data (``CheckpointReader.check_chunk``): the file opens, its header or blob index
    parses, agrees with the metadata and places the chunk inside the file, so a truncated
    file or a corrupt blob fails here, before any write. Returns (errors, values read by
    name). ``checks``: what earlier calls found (module ``ReadChecks``), added to here.
    """
    checks = ReadChecks() if checks is None else checks
    tensors = reader.metadata.tensors
    keys = list(dict.fromkeys((i.name, i.chunk) for i in items))
    new = [k for k in keys if k not in checks.chunks]
    if new and hasattr(reader, "prefetch"):  # an object store opens its files in parallel
        reader.prefetch([tensors[name].chunks[c].file for name, c in new])
    for name, c in new:
        chunk = tensors[name].chunks[c]
        try:
            reader.check_chunk(name, chunk)
            checks.chunks[(name, c)] = None
        except Exception as exc:  # noqa: BLE001 - every failure is reported to all ranks, not raised here
            checks.chunks[(name, c)] = f"cannot read {name!r} from {chunk.file!r}: {type(exc).__name__}: {exc}"
    errors = [e for e in (checks.chunks[k] for k in keys) if e is not None]
    if checks.values is None:
        value_errors: list[str] = []
        got: dict[str, Any] = {}
        for leaf in values:
            try:
                got[leaf.name] = reader.read_value(leaf.name)
            except Exception as exc:  # noqa: BLE001 - as above
                value_errors.append(f"cannot read value {leaf.name!r}: {type(exc).__name__}: {exc}")
        checks.values = (value_errors, got)
    return errors + checks.values[0], checks.values[1]


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
