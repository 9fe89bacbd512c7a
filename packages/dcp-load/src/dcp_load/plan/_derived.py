"""The derived branch of ``load``: plan from the mesh, agree by digest, no gathered wants.

``derived_plan`` is called by every rank of a collective load. It derives every entry's
holders (``_derive``); when every rank of the job can, and the digest exchange
(``_digest.agree``) finds that they planned from the same metadata, settings and state
dict layout, it returns this rank's own plan (``_local_plan``). It returns None when any
rank cannot derive (chunk annotations, MindSpore, other placements, a custom planner) or
already failed: ``load`` then gathers the wants as before, and reports errors there.
A layout mismatch raises ``LoadError`` on every rank, naming the ranks that differ.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._derive import Derived, derive_entry
from ._digest import agree, digest, gather_hosts, local_world_size
from ._hosts import host_id
from ._items import GlobalPlan, HostBlocks, Want
from ._local import plan_for_rank

__all__ = ["Derivation", "checkpoint_digest", "derived_plan", "ensure_groups", "metadata_digest", "settings_text"]

logger = logging.getLogger(__name__)


def metadata_digest(tensors: Mapping[str, Any], *, values: Mapping[str, Any] | None = None,
                    name: str | None = None) -> int:
    """A hash of the checkpoint as ranks must share it: what planning reads from the
    metadata (names, shapes, dtypes, chunks and their files; for a chunk composed by
    ``sources=``, the saved chunk it reads), the chunks' and values' checksums (two saves of one layout differ there), and ``name``, the checkpoint
    directory's last path component (two checkpoints without checksums, such as Hugging
    Face files of one model at two steps, differ there; the rest of the path may differ
    between nodes that mount one checkpoint at different places)."""
    return digest(name, *[(n, tuple(t.shape), t.dtype,
                           tuple((tuple(c.offsets), tuple(c.sizes), str(c.file), c.checksum,
                                  *getattr(c, "origin", ())) for c in t.chunks))
                          for n, t in sorted(tensors.items())],
                  *[(n, getattr(v, "checksum", None)) for n, v in sorted((values or {}).items())])


def settings_text(settings: tuple[Any, ...]) -> str:
    """The broadcast settings ``_load`` compares, as a person reads them (in mismatch errors)."""
    return (f"broadcast_replicated_tensors={settings[0]}, broadcast_batch_bytes={settings[1]}, "
            f"broadcast_groups={'given' if settings[2] else 'None'}, planner={settings[3] or 'default'}, "
            f"storage={'an object store' if settings[4] else 'local'}")


def checkpoint_digest(reader: Any) -> int:
    """``metadata_digest`` of an open ``dcp_reader.CheckpointReader``."""
    import os

    path = getattr(reader, "path", None)
    name = os.path.basename(os.path.normpath(os.path.realpath(path))) if path else None
    return metadata_digest(reader.metadata.tensors, values=reader.metadata.values, name=name)


def _entries(wants: Sequence[Want], values: Mapping[str, Any], rank: int, world: int,
             shapes: Mapping[str, tuple[int, ...]], to_group: Mapping[int, int] | None = None) -> list[Derived] | None:
    out = []
    meshes: dict[int, Any] = {}
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for name, offsets, sizes, _, _ in wants:  # a _StridedShard's rows may make several boxes
        boxes.setdefault(name, []).append((offsets, sizes))
    for name, _, _, flags, dtype in wants:
        own = boxes.pop(name, None)
        if own is None:
            continue
        entry = derive_entry(values[name], name, shapes[name], dtype, flags, world, own, rank, meshes, to_group)
        if entry is None:
            return None
        out.append(entry)
    return out


def _to_group(platform: Any) -> dict[int, int] | None:
    """Global rank -> the platform's rank, when the platform works within a process group
    (``TorchPlatform.global_ranks``); None for the world."""
    ranks = platform.global_ranks() if hasattr(platform, "global_ranks") else None
    return None if ranks is None else {g: r for r, g in enumerate(ranks) if g is not None}


@dataclass
class Derivation:
    """``derived_plan``'s answer: this rank's plan, and when ``check`` ran on it before the
    digest exchange, what it found (``errors``, this rank's) and whether any rank's checks
    failed (``checks_failed``, the same on every rank); ``checked`` False otherwise."""

    plan: GlobalPlan
    checked: bool = False
    errors: list[str] = field(default_factory=list)
    checks_failed: bool = False


def derived_plan(platform: Any, tensors: Mapping[str, Any], wants: Sequence[Want], values: Mapping[str, Any], *,
                 failed: bool, settings: tuple[Any, ...], broadcast: bool, same_host_reads: bool,
                 custom_planner: bool, watch: Any = None, meta_hash: int | None = None,
                 checkpoint: Any = None, check: Callable[[GlobalPlan], list[str]] | None = None,
                 relay: bool = False) -> Derivation | None:
    """This rank's plan, or None for the gathered path (module docstring).

    ``wants``: this rank's ``(name, offsets, sizes, flags, dtype)``; ``values``: the state
    dict value of each name; ``settings``: what shapes the collectives (compared by hash);
    ``watch``: the load's ``dcp_platform.Watch``, which bounds every wait of the exchange.
    ``meta_hash``: the checkpoint's ``checkpoint_digest`` (default: ``metadata_digest`` of
    ``tensors``). ``checkpoint``: the path of the checkpoint opened, shown when ranks' metadata differs.
    ``check(plan) -> errors``: run on the plan this rank derives with the hosts it expects
    (``_checked_guess``) before the exchange, which then also says whether any rank's
    checks failed; used when the exchange confirms those hosts. ``relay``: as for
    ``build_global_plan`` (the checkpoint is in an object store).
    """
    start = time.perf_counter()
    rank, world = platform.rank(), platform.world_size()
    entries, given, meta_hash = None, meta_hash, 0
    if not failed and not custom_planner:
        try:
            shapes = {name: tuple(int(s) for s in tensors[name].shape) for name, *_ in wants}
            entries = _entries(wants, values, rank, world, shapes, _to_group(platform))
            meta_hash = metadata_digest(tensors) if given is None else given
        except Exception:  # noqa: BLE001 - this rank must still join the exchange: it gathers instead
            logger.warning("rank %d: cannot derive the wants; gathering them", rank, exc_info=True)
            entries = None
    # Nodes follow from $LOCAL_WORLD_SIZE in the world's numbering only, not a group's.
    local_world = local_world_size() if broadcast and _to_group(platform) is None else 0
    host = host_id() if broadcast else ""
    guess = None
    if entries is not None and check is not None:
        guess = _checked_guess(tensors, entries, rank, world, broadcast, local_world, host, same_host_reads, check,
                               relay)
    equal = [(meta_hash, checkpoint),  # shown by _digest.checkpoint_causes
             (digest(settings, custom_planner), f"{settings_text(settings)}: every rank must pass "
              "the same broadcast settings"),
             (local_world, f"LOCAL_WORLD_SIZE={local_world or 'unset'} (0 with DCP_HOST_ID set): every rank "
              "must see the same")]
    decided = agree(platform, equal=equal, derivable=entries is not None, failed=failed,
                    entries=entries or [], host=host, local_world=local_world, watch=watch,
                    checks_failed=guess is not None and bool(guess.errors), checked=guess is not None)
    if not decided.derived:
        logger.debug("rank %d: some rank cannot derive its wants; gathering them", rank)
        return None
    assert entries is not None
    if guess is not None and (not broadcast or (decided.hosts_derived if local_world else decided.one_host)):
        guess.checks_failed = decided.checks_failed  # the hosts it was planned with hold
        return guess
    hosts: Sequence[Any] | None = None
    if broadcast:
        hosts = (HostBlocks(world, local_world) if decided.hosts_derived
                 else [host] * world if decided.one_host else gather_hosts(platform, host, watch))
    plan = plan_for_rank(tensors, entries, rank, world, broadcast=broadcast, hosts=hosts,
                         same_host_reads=same_host_reads, relay=relay)
    logger.debug("rank %d: derived plan of %d tensor(s) in %.4f s (%d broadcast(s), hosts %s)", rank,
                 len(entries), time.perf_counter() - start, len(plan.broadcasts),
                 "derived" if decided.hosts_derived else "gathered" if broadcast else "unused")
    return Derivation(plan)


def _checked_guess(tensors: Mapping[str, Any], entries: list[Derived], rank: int, world: int, broadcast: bool,
                   local_world: int, host: str, same_host_reads: bool,
                   check: Callable[[GlobalPlan], list[str]], relay: bool) -> Derivation:
    """This rank's plan with the hosts it expects the exchange to confirm (derived from
    ``$LOCAL_WORLD_SIZE``, else every rank on this host), and ``check``'s errors on it (an
    exception is an error too: the exchange carries it to every rank)."""
    hosts = (HostBlocks(world, local_world) if local_world else [host] * world) if broadcast else None
    try:
        plan = plan_for_rank(tensors, entries, rank, world, broadcast=broadcast, hosts=hosts,
                             same_host_reads=same_host_reads, relay=relay)
    except Exception as exc:  # noqa: BLE001 - the checks fail on this rank; the exchange tells the others
        nothing = GlobalPlan(world, (), (), (0,) * world, 0, rank=rank)  # never run: the checks failed
        return Derivation(nothing, checked=True, errors=[f"{type(exc).__name__}: {exc}"])
    try:
        errors = list(check(plan))
    except Exception as exc:  # noqa: BLE001 - as above
        errors = [f"{type(exc).__name__}: {exc}"]
    return Derivation(plan, checked=True, errors=errors)


def ensure_groups(platform: Any, plan: GlobalPlan, groups: Any, watch: Any = None) -> tuple[Any, bool]:
    """A group manager holding every group this rank's broadcasts need (``own=True``: each
    rank knows only its own broadcasts; the members of each group make it alone where the
    platform can, else the sets are gathered). Returns (manager, whether the caller must
    close it)."""
    from dcp_broadcast import GroupManager

    manager = groups if isinstance(groups, GroupManager) else GroupManager(platform, groups, watch=watch)
    try:
        manager.ensure({i.ranks for i in plan.broadcasts if len(i.ranks) > 1}, own=True)
    except BaseException:
        if manager is not groups:  # groups made before the failure would leak
            manager.close(wait_for_peers=False, raise_errors=False)
        raise
    return manager, manager is not groups
