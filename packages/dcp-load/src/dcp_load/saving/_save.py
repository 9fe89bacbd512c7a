"""``save``: write a state dict in the native format, each replicated box once.

Call order (every rank): rank 0 takes the directory's single-writer lock and serialises
the non-tensor values (a second writer, a directory holding another format's checkpoint,
or a value that cannot be stored, is refused here); all ranks all-gather what they hold
(names, boxes, dtypes, global shapes: small tuples), rank 0's new save id and the
directory each rank resolved (they must agree); every rank derives the same layout (one writer per
distinct box, balanced by bytes with the load planner's greedy rule) and checks it tiles
every tensor. Nothing is written before all of this passed on every rank.

Each writer then writes one data file named with the save id, beside whatever the directory
holds; after an exchange that shows every rank finished, rank 0 replaces the metadata in
one rename (the commit), removes the files the new metadata does not name (an earlier
save's, a killed save's temporary files), and releases the lock; a final exchange returns
its outcome to everyone. A save that fails or is killed before the commit leaves the
previous checkpoint whole and loadable (its metadata names only its own files); after it,
the new one. Every wait is bounded by a ``Coordinator`` (``dcp-save/<n>``): arrival within
``timeout``, and each exchange aborted once a rank published a failure or stopped beating.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import LoadError
from .._load import resolve_platform
from ..layouts._flat_target import check_overlaps
from ..layouts._state import flatten_state_dict, is_tensor
from ..layouts._stateful import resolve as resolve_statefuls
from ..layouts._target_for import target_for
from ..layouts._targets import in_mesh
from ..plan._items import GreedyPlanner, ReadItem
from ..run._coordinate import (
    Coordinator,
    next_slot,
    note_one_process_call,
    refused_together,
    scope_of,
    timeout_seconds,
)
from ..run._shared_open import local_storage
from ..run._torch_args import NATIVE, WriterOptions, save_arguments, writer_options
from ..run._validate import check_launch, exchange, summarise
from . import _agreed as agreed
from ._queue import wait_for_previous

__all__ = ["PlannedSave", "SaveReport", "commit", "plan_save", "resolve_save", "save", "save_slot", "tidy",
           "write_files"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveReport:
    """One rank's account of a ``save`` or ``async_save``: what it wrote and how long it took.

    ``seconds``: from the call to the commit. ``write_seconds``: writing this rank's files.
    ``async_save`` only (0 for ``save``): ``staged_bytes``, the bytes copied into the
    staging pool (those of the boxes this rank writes); ``staging_seconds``, the copy;
    ``blocked_seconds``, how long the call kept the caller (the checks, the exchange, the
    copy, and any wait for this process's previous save).
    """

    rank: int
    world_size: int
    path: str
    tensors: int
    chunks_written: int
    bytes_written: int
    job_bytes: int
    seconds: float
    write_seconds: float = 0.0
    staged_bytes: int = 0
    staging_seconds: float = 0.0
    blocked_seconds: float = 0.0

    def __post_init__(self) -> None:
        if min(self.bytes_written, self.chunks_written, self.staged_bytes) < 0:
            raise ValueError("SaveReport counts must be >= 0")


def _layout(gathered: list[Any], save_id: str, data_file_name: Callable[[int, str], str]
            ) -> tuple[dict[str, Any], dict[int, list[ReadItem]], dict[int, list[str]]]:
    """(tensor metadata by name, items each rank writes, errors by offending rank) from
    every rank's holdings (the same on every rank); ``data_file_name(rank, save_id)``: the
    format's name of a rank's data file."""
    from dcp_reader import ChunkMeta, TensorMeta, chunk_key

    errors: dict[int, list[str]] = {}
    info: dict[str, tuple[tuple[int, ...], str]] = {}
    boxes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for rank, (holdings, *_) in enumerate(gathered):
        for name, offsets, sizes, dtype, shape in holdings:
            seen = info.setdefault(name, (shape, dtype))
            if seen != (shape, dtype):
                errors.setdefault(rank, []).append(
                    f"{name!r}: this rank holds global shape {shape} {dtype}, a lower rank {seen[0]} {seen[1]}; "
                    "every rank must agree on a tensor's global shape and dtype")
                continue
            if offsets is not None:
                boxes.setdefault((name, offsets, sizes), []).append(rank)
    itemsize = {n: TensorMeta(n, shape, dtype, ()).itemsize for n, (shape, dtype) in info.items()}
    items = [ReadItem(n, 0, o, s, _numel(s) * itemsize[n], tuple(r)) for (n, o, s), r in boxes.items()]
    items.sort(key=lambda i: (-i.nbytes, i.name, i.offsets))
    writers = GreedyPlanner().assign(items, [0] * len(gathered))
    per_rank: dict[int, list[ReadItem]] = {}
    chunks: dict[str, list[Any]] = {}
    for item, w in zip(items, writers, strict=True):
        per_rank.setdefault(w, []).append(item)
        chunks.setdefault(item.name, []).append(
            ChunkMeta(item.offsets, item.sizes, data_file_name(w, save_id), chunk_key(item.name, item.offsets)))
    tensors = {}
    for name, (shape, dtype) in info.items():  # a name no rank holds a box of has no chunk: a gap
        tensors[name] = TensorMeta(name, shape, dtype, tuple(sorted(chunks.get(name, ()), key=lambda c: c.offsets)))
    return tensors, per_rank, errors


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def save(
    state_dict: Mapping[Any, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    no_dist: bool = False,
    allow_pickle: bool = False,
    platform: Any = None,
    timeout: Any = None,
    process_group: Any = None,
    storage_writer: Any = None,
    planner: Any = None,
    use_collectives: bool = True,
    format: str = "native",  # noqa: A002 - the name torch users and dcp's CLI know
) -> SaveReport:
    """Write ``state_dict`` to the directory ``checkpoint_id`` in the native format, or in
    torch.distributed.checkpoint's own format with ``format="torch_dcp"``.

    Call on every rank. Holds the same entries ``load`` takes (DTensors, plain tensors,
    ``Chunk``, nested dicts and lists, non-tensor values). Boxes held identically by
    several ranks are written once, by the holder with the fewest bytes so far. Non-tensor
    values are taken from rank 0; values that are not JSON need ``allow_pickle=True``.
    A failure on any rank raises ``LoadError`` (phase ``"save"``) on every rank.

    ``timeout`` (a ``timedelta`` or seconds; default: the default process group's timeout,
    else 10 minutes): how long ranks that entered ``save`` wait for the others. Every exchange of the save is bounded as in
    ``load``: a rank that fails, dies or never arrives makes the others raise ``LoadError``
    naming it (within about 15 s for a dead rank) instead of waiting in the next exchange.

    An ``async_save`` of this process still writing is waited for first: saves of one
    process run in call order. ``process_group``: the torch.distributed group to save
    within (default: the default group); its rank 0 writes the metadata, ranks outside it
    do not call. A rank whose arguments are refused here tells the others at once.
    ``storage_writer``, ``planner``, ``use_collectives``: torch DCP's, as docs/from-torch-dcp.md
    says (the directory of torch's ``FileSystemWriter``...).

    ``format``: ``"native"`` (dcp's: safetensors data files, JSON metadata) or
    ``"torch_dcp"`` (torch's ``.metadata`` and ``.distcp`` files, which torch DCP's ``load``,
    ``FileSystemReader`` and ``format_utils`` read; each replicated box still written once,
    the metadata still last, block checksums in ``dcp-checksums.json``).
    """
    start = time.perf_counter()
    slot = save_slot(no_dist, process_group)
    path, leaves, platform, wait_s, collective, options = refused_together("save", slot, process_group, lambda: (
        *resolve_save(state_dict, save_arguments(checkpoint_id, storage_writer, planner, use_collectives, no_dist,
                                                 "save"), no_dist, platform, timeout, process_group=process_group),
        writer_options(storage_writer, format, "save")))
    wait_for_previous("save", path)
    with Coordinator(platform, collective=collective, timeout=wait_s, operation="save", slot=slot,
                     target=path) as coord:
        coord.arrive()
        planned = plan_save(coord, platform, collective, leaves, path, allow_pickle, no_dist, options=options)
        try:
            return _save(coord, planned, start)
        finally:
            planned.release_lock()


def save_slot(no_dist: bool, process_group: Any) -> int | None:
    """The number of this collective save of the process on its group (None with ``no_dist``:
    a save on some ranks only, say rank 0 alone, must not shift the count)."""
    return None if no_dist else next_slot("save", scope_of(process_group))


def resolve_save(state_dict: Mapping[Any, Any], checkpoint_id: Any, no_dist: bool, platform: Any,
                 timeout: Any, what: str = "save", process_group: Any = None) -> tuple[str, list[Any], Any, float, bool]:
    """(directory, leaves, platform, timeout in seconds, collective) of a ``save`` call;
    its argument errors raise here, before any rank waits for another."""
    if checkpoint_id is None:
        raise ValueError(f"{what}: checkpoint_id= (the directory to write) is required")
    if timeout is not None:
        timeout_seconds(timeout, what)  # refuse a bad value before anything else
    from dcp_reader.storage import real_root

    path = os.fspath(checkpoint_id)
    # else s3://bucket/prefix, spelled one way on every rank (no trailing slash), as a local
    # path is made absolute: ranks that write "s3://b/ck/" and "s3://b/ck" name one prefix
    path = os.path.abspath(path) if local_storage(path) else real_root(path)
    refused: list[str] = []
    resolved = resolve_statefuls(state_dict, refused)  # Stateful objects: their state_dict()
    if refused:
        raise ValueError(f"{what}: " + "; ".join(refused))
    leaves = flatten_state_dict(resolved.state)
    platform = resolve_platform(platform, leaves, process_group)
    wait_s = timeout_seconds(timeout, what, platform)
    check_launch(platform, no_dist, what)
    if no_dist:  # takes no call number: recorded for a rank that waits for this one to name it
        note_one_process_call(process_group, f"save of {path} without collectives (no_dist=True)")
    return path, leaves, platform, wait_s, not no_dist and platform.is_distributed()


def _hold(leaves: list[Any], errors: list[str]) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """(this rank's holdings, targets by name, non-tensor values); errors are recorded."""
    holdings: list[tuple[Any, ...]] = []
    targets: dict[str, Any] = {}
    values: dict[str, Any] = {}
    try:
        for leaf in leaves:
            if is_tensor(leaf.value):
                if not in_mesh(leaf.value):
                    continue  # this rank holds no part of it; the mesh's ranks write it
                t = target_for(leaf)
                targets[t.name] = t
                holdings.extend((t.name, b.offsets, b.sizes, t.dtype, t.global_shape) for b in t.boxes)
                if not t.boxes:  # an empty Flat interval still names its tensor (``_layout``)
                    holdings.append((t.name, None, None, t.dtype, t.global_shape))
            else:
                values[leaf.name] = leaf.value
        errors.extend(check_overlaps(list(targets.values())))  # a Flat sharing bytes with another entry
    except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
        errors.append(f"{type(exc).__name__}: {exc}")
    return holdings, targets, values


@dataclass
class PlannedSave:
    """A save every rank agreed on, before anything is written: the layout, what this rank
    writes (``mine``, read from ``targets``) and, on rank 0, the lock and the values."""

    platform: Any
    collective: bool
    path: str
    rank: int
    world: int
    me: int
    writer: Any
    lock: Any
    encoded: Any
    save_id: str
    tensors: dict[str, Any]
    mine: list[ReadItem]
    targets: dict[str, Any]
    counts: tuple[int, int] = (0, 0)  # the save's (tensors, bytes): ``tensors`` may be {} off rank 0
    early: Any = None  # what ``while_agreeing`` returned (``plan_save``), or None
    #: (save id, this save's id) when ``tensors`` are a remembered layout's, whose chunk files
    #: name the earlier save: ``metadata`` renames them, on the commit's path, not the caller's
    #: (137 chunks took 1-13 ms of rank 0's blocked time on 4 busy gloo ranks)
    rename: tuple[str, str] | None = None

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def metadata(self, value_meta: dict[str, Any]) -> Any:
        from dcp_reader import CheckpointMetadata

        tensors = self.tensors if self.rename is None else agreed.renamed(self.tensors, *self.rename)
        return CheckpointMetadata(tensors=tensors, values=value_meta, format=self.writer.format)

    def report(self, written: int, nbytes: int, seconds: float, **timings: Any) -> SaveReport:
        return SaveReport(rank=self.rank, world_size=self.world, path=self.path, tensors=self.counts[0],
                          chunks_written=written, bytes_written=nbytes, job_bytes=self.counts[1], seconds=seconds,
                          **timings)


def plan_save(coord: Coordinator, platform: Any, collective: bool, leaves: list[Any], path: str,
              allow_pickle: bool, no_dist: bool, while_agreeing: Callable[..., Any] | None = None,
              options: WriterOptions = NATIVE) -> PlannedSave:
    """Every check of a save, once every rank arrived; ``LoadError`` on every rank when any
    rank failed one (rank 0's lock is then released). Nothing is written here.

    ``while_agreeing(data, stop)``: called, when this rank remembers what it wrote with the
    same holdings (``_agreed``), with those boxes ({chunk key: values}) while the ranks
    agree; ``stop()`` turns True once the agreement completed with other boxes (stop then:
    a rank that gathers waits). What it returns is the plan's ``early`` (``async_save``
    copies the boxes there). ``options``: the format and torch writer options
    (``run._torch_args.writer_options``)."""
    rank = platform.rank()
    me = rank if collective else 0
    errors: list[str] = []
    writer = lock = encoded = save_id = None
    try:
        writer = options.writer(path, allow_pickle)
    except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
        errors.append(f"{type(exc).__name__}: {exc}")
    holdings, targets, values = _hold(leaves, errors)
    early = None
    try:
        if me == 0 and writer is not None:
            writer.planner_data = {leaf.name: leaf.keys for leaf in leaves}
            lock, encoded, save_id = _prepare(writer, values, no_dist, errors, options)
        world = platform.world_size() if collective else 1
        remembered, scope = None, f"{getattr(platform, 'group_key', 'world')}/{options.label}"
        if collective:  # the same holdings as a save before: one all-reduce instead of a gathering
            pending = agreed.start(platform, coord.waiter, world=world, rank=rank, holdings=holdings,
                                   values=sorted(values), path=f"{options.label}:{path}", save_id=save_id,
                                   failed=bool(errors), scope=scope)
            early = _while(pending, while_agreeing, targets)
            remembered = pending.result()
        planned = _planned(coord, collective, remembered, (holdings, sorted(values), save_id, path, options.label),
                           errors, world, me, scope, options.data_file_name)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    tensors, mine, save_id, counts, rename = planned
    return PlannedSave(platform, collective, path, rank, world, me, writer, lock, encoded, save_id, tensors, mine,
                       targets, counts, early, rename)


def _while(pending: Any, while_agreeing: Any, targets: dict[str, Any]) -> Any:
    """``while_agreeing`` of the boxes this rank guesses it writes, or None; a failure in it
    waits for the agreement first (its collective is in flight on every rank)."""
    if while_agreeing is None or pending.guess is None:
        return None
    try:
        return while_agreeing(_box_data(pending.guess, targets), pending.missed)
    except BaseException:
        with contextlib.suppress(Exception):
            pending.result()
        raise


def _planned(coord: Coordinator, collective: bool, remembered: tuple[Any, str] | None, payload: tuple[Any, ...],
             errors: list[str], world: int, me: int, scope: str, data_file_name: Callable[[int, str], str]
             ) -> tuple[dict[str, Any], list[ReadItem], str, tuple[int, int], tuple[str, str] | None]:
    """(tensors, this rank's items, save id, (tensors, job bytes), rename) of the remembered
    layout every rank agreed (its checks passed when it was made), or of a full exchange (a
    first save, a change, a failure), which every rank then remembers. With a remembered
    layout only rank 0 has the tensor metadata (it commits it; the others get ``{}``), whose
    chunk files ``rename`` (old id, new id) names for this save (``PlannedSave.metadata``)."""
    if remembered is not None:
        entry, save_id = remembered
        tensors = {} if entry.tensors is None else entry.tensors
        rename = None if entry.tensors is None else (entry.save_id, save_id)
        return tensors, list(entry.mine), save_id, (entry.n_tensors, entry.job_bytes), rename
    gathered = coord.exchange(exchange, errors, "save", collective=collective, payload=payload)
    save_id = gathered[0][2]  # rank 0's: every rank names the files alike
    tensors, per_rank, failures = _layout(gathered, save_id, data_file_name)
    _agree(gathered, tensors, failures)
    if failures:
        raise LoadError(failures, "save")
    mine = per_rank.get(me, [])
    if collective:
        agreed.remember(world, me, gathered, tensors, mine, save_id, scope)
    return tensors, mine, save_id, (len(tensors), sum(t.nbytes for t in tensors.values())), None


def _agree(gathered: list[Any], tensors: dict[str, Any], failures: dict[int, list[str]]) -> None:
    """Record in ``failures`` what the ranks disagree on: the directory, the values rank 0
    lacks, boxes that do not tile their tensors (the same verdict on every rank)."""
    from dcp_reader import CheckpointMetadata

    for r, g in enumerate(gathered):
        if g[3] != gathered[0][3]:  # a relative checkpoint_id from another working directory, say
            failures.setdefault(r, []).append(
                f"checkpoint_id is {g[3]} here but {gathered[0][3]} on rank 0: every rank must pass the same "
                "directory (an absolute path; a relative one depends on each process's working directory)")
        if g[4] != gathered[0][4]:
            failures.setdefault(r, []).append(f"format={g[4]!r} here but {gathered[0][4]!r} on rank 0: every rank "
                                              "must save in the same format")
    missing_values = sorted(set().union(*(set(v) for _, v, *_ in gathered)) - set(gathered[0][1]))
    if missing_values:
        failures.setdefault(0, []).append(
            f"non-tensor values held by other ranks but not by rank 0: {summarise(missing_values)}; "
            "rank 0 writes the values, so it must hold all of them")
    try:
        CheckpointMetadata(tensors=tensors, values={}, format="native")
    except Exception as exc:  # noqa: BLE001 - same data on every rank, so every rank raises alike
        failures.setdefault(0, []).append(f"the boxes all ranks hold do not tile the tensors: "
                                          f"{type(exc).__name__}: {exc}")


def box_data(planned: PlannedSave) -> dict[str, Any]:
    """{chunk key: the values of the box} of every box this rank writes (views, not copies)."""
    return _box_data(planned.mine, planned.targets)


def _box_data(items: list[ReadItem], targets: dict[str, Any]) -> dict[str, Any]:
    from dcp_reader import chunk_key

    return {chunk_key(i.name, i.offsets): targets[i.name].values(i.offsets, i.sizes) for i in items}


def _save(coord: Coordinator, planned: PlannedSave, start: float) -> SaveReport:
    """Write, check that every rank wrote, commit (rank 0), check the commit."""
    errors: list[str] = []
    t0 = time.perf_counter()
    files, value_meta = write_files(planned, box_data(planned), errors)
    write_s = time.perf_counter() - t0
    try:
        coord.check(errors, "save", collective=planned.collective)
    except BaseException:
        planned.writer.discard(files)
        raise
    metadata = planned.metadata(value_meta) if planned.me == 0 else None
    if metadata is not None:
        commit(planned.writer, planned.lock, metadata, errors, then_tidy=False)
    coord.check(errors, "save", collective=planned.collective)
    if metadata is not None:  # committed on rank 0; the others need not wait for the tidy-up
        tidy(planned.writer, planned.lock, metadata)
    seconds = time.perf_counter() - start
    nbytes = sum(i.nbytes for i in planned.mine)
    logger.debug("rank %d: saved %d chunk(s), %d bytes to %s in %.4f s", planned.rank, len(planned.mine), nbytes,
                 planned.path, seconds)
    return planned.report(len(planned.mine), nbytes, seconds, write_seconds=write_s)


def _prepare(writer: Any, values: dict[str, Any], no_dist: bool, errors: list[str], options: WriterOptions
             ) -> tuple[Any, Any, str]:
    """Rank 0, before anything is written: (the directory's write lock, the serialised
    values, a new save id); every refusal is recorded in ``errors``."""
    from dcp_reader import WriterLockError

    lock = encoded = None
    try:
        encoded = writer.encode_values(values)
    except (TypeError, ValueError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    note = _launch_note(no_dist)
    foreign = _other_format(writer.path, writer.format, options.overwrite)
    if foreign:
        errors.append(foreign)
        return None, encoded, _new_save_id(writer.path)
    try:
        lock = writer.lock(note)
    except (WriterLockError, OSError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    else:
        errors.extend(_same_launch(lock.previous, note, writer.path))
    return lock, encoded, _new_save_id(writer.path)


def _other_format(path: str, mine: str = "native", overwrite: bool = True) -> str | None:
    """The refusal when ``path`` holds a checkpoint of another format than ``mine`` (one
    beside it would hide it from ``load``, or be hidden, and a killed save's data files can
    make it undetectable), or any checkpoint when ``overwrite`` is False (torch's
    ``FileSystemWriter(overwrite=False)``)."""
    from dcp_reader import CheckpointError, detect_format

    try:
        fmt = detect_format(path)
    except CheckpointError:
        return None  # no checkpoint, or an unfinished save: nothing to hide
    if not overwrite:
        return (f"{path} already holds a {fmt} checkpoint and the storage_writer has overwrite=False: nothing "
                "was written and that checkpoint is kept. Save into another directory, or pass overwrite=True")
    if fmt == mine:
        return None
    return (f"{path} holds a {fmt} checkpoint: a {mine} checkpoint saved into the same directory would hide it "
            "from load or be hidden by it. Save into another directory (for example a subdirectory), or move "
            "that checkpoint away first")


def _new_save_id(path: str) -> str:
    """12 random hex digits that no file in ``path`` carries (a collision is ~2**-48 a save)."""
    try:
        names = os.listdir(path)
    except OSError:
        names = []
    while True:
        save_id = secrets.token_hex(6)
        if not any(save_id in n for n in names):
            return save_id


def _launch_note(no_dist: bool) -> dict[str, Any]:
    """What the write lock records about this writer: under a launcher with ``no_dist``,
    which launch and which of its ranks (to refuse a sibling rank's save afterwards)."""
    world = os.environ.get("WORLD_SIZE", "")
    if not (no_dist and world.isdigit() and int(world) > 1):
        return {}
    launch = [os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")]
    return {"launch": launch, "launch_rank": os.environ.get("RANK")}


def _same_launch(previous: Any, note: dict[str, Any], path: str) -> list[str]:
    """The refusal when another rank of this launch saved into ``path`` with ``no_dist``:
    each process saves as rank 0 of 1, so this save would replace that rank's tensors."""
    if not note or not isinstance(previous, dict) or previous.get("launch") != note["launch"]:
        return []
    if previous.get("launch_rank") == note["launch_rank"]:
        return []  # the same rank saving again: an ordinary overwrite
    return [f"{path} was saved by rank {previous.get('launch_rank')} of this launch (pid {previous.get('pid')} on "
            f"{previous.get('host')!r}) with no_dist=True, and this is rank {note['launch_rank']}: with no_dist=True "
            "every process saves as rank 0 of 1, so this save would replace the other rank's tensors. Give each "
            f"rank a checkpoint_id of its own (for example f\"{{path}}/rank-{{os.environ['RANK']}}\"), or call "
            "torch.distributed.init_process_group before save so that the ranks save one checkpoint together"]


def write_files(planned: PlannedSave, data: dict[str, Any], errors: list[str]) -> tuple[list[str], dict[str, Any]]:
    """This rank's data file of ``data`` ({chunk key: values}) and rank 0's values file.
    Returns (the files written, for removal after a failure anywhere; value metadata); a
    failure is recorded in ``errors`` and what this rank wrote is removed."""
    from dcp_reader import data_file_name, values_file_name

    files: list[str] = []
    value_meta: dict[str, Any] = {}
    writer = planned.writer
    try:
        if data:
            files.append(getattr(writer, "data_file_name", data_file_name)(planned.me, planned.save_id))
            writer.write_file(files[-1], data)
        if planned.me == 0:
            files.append(getattr(writer, "values_file_name", values_file_name)(planned.save_id))
            value_meta = planned.writer.write_values(planned.encoded, file_name=files[-1])
    except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
        errors.append(f"{type(exc).__name__}: {exc}")
        planned.writer.discard(files)
    return files, value_meta


def commit(writer: Any, lock: Any, metadata: Any, errors: list[str], *, then_tidy: bool = True) -> None:
    """Rank 0: switch the directory to the new files (the metadata, in one rename), then
    (``then_tidy``) remove what the new metadata does not name. When the commit fails, the files
    the new metadata names are removed: all carry this save's id, so none is the committed one's."""
    try:
        writer.commit(metadata)
    except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
        errors.append(f"commit: {type(exc).__name__}: {exc}")
        new = {c.file for t in metadata.tensors.values() for c in t.chunks}
        writer.discard(sorted(new | {v.file for v in metadata.values.values() if v.file is not None}))
        return
    if then_tidy:
        tidy(writer, lock, metadata)


def tidy(writer: Any, lock: Any, metadata: Any) -> None:
    """Rank 0, after a commit, holding the lock: record it, remove the leftovers of earlier
    saves. Never raises: the new checkpoint loads whatever happens here."""
    try:
        lock.committed()
        writer.remove_stray(metadata)
    except Exception as exc:  # noqa: BLE001 - the new checkpoint loads; a leftover only costs space
        logger.warning("%s is committed, but removing the leftovers of earlier saves failed: %s: %s",
                       writer.path, type(exc).__name__, exc)
