"""The transfer plans kept for reuse, per process group, with their broadcast groups.

Every rank of a group keeps the same list of plans in the same order: a transfer reuses,
adds or drops the same plan on every rank, decided from the one all-reduce that every call
makes (``agree``). So a rank never decides alone to drop a plan whose groups its peers
keep: the plan replaced, evicted or forgotten is the same on every rank, at the same point
of the same call, and its groups are released there. A rank's own layout is not the key:
two plans may share it (one rank's layout alternates while another's stays), and both are
kept. The all-reduce also carries a digest of the list, so that lists that came apart
(a failure seen by some ranks only) are dropped on every rank alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..plan._digest import all_reduce, digest

__all__ = ["MAX_PLANS", "agree", "forget", "forget_group", "group_object", "keep"]

#: Plans kept per process group (one per pair of layouts: a job that moves a policy's and a
#: reference model's weights keeps both, as does a rank whose layout alternates); the oldest
#: is dropped, with its groups.
MAX_PLANS = 4

#: group key (``Platform.group_key``) -> its kept plans, oldest first (the same on every rank)
_PLANS: dict[str, list[Any]] = {}


def group_object(platform: Any) -> Any:
    """The group object ``platform``'s collectives run within (the default group for the
    world), or None without one."""
    try:
        return platform.world_group() if platform.is_distributed() else None
    except (RuntimeError, NotImplementedError):
        return None


def _alive(group: Any) -> bool:
    """Whether ``group`` may still carry broadcasts: registered with torch.distributed (a
    destroyed group is not), or a group dcp-platform joined (alive while referenced)."""
    if group is None:
        return False
    if getattr(group, "dcp_group_key", None) is not None:
        return True
    from dcp_platform._scope import registered

    return registered(group)


def _drop(entry: Any) -> None:
    # Called at the same point of the same call on every rank, after every broadcast on
    # these groups completed (the previous call's final check, or this call's): no rank
    # waits for another here, and a platform whose destroy is collective sees every member
    # destroy the same groups in one order.
    if _alive(entry.world):
        entry.groups.close(wait_for_peers=False, raise_errors=False)


def _scope(platform: Any) -> str:
    return getattr(platform, "group_key", "world")


def _kept(platform: Any) -> list[Any]:
    """This group's kept plans; those made over a process group destroyed since are dropped
    (every rank sees the same group object, or the digest below tells them apart)."""
    kept = _PLANS.setdefault(_scope(platform), [])
    world = group_object(platform)
    for entry in [e for e in kept if e.world is not world]:
        _remove(kept, entry)
        _drop(entry)
    return kept


def _remove(kept: list[Any], entry: Any) -> None:
    """Remove ``entry`` itself from ``kept`` (plans hold tensors: never compared by value)."""
    kept[:] = [e for e in kept if e is not entry]


def _split(value: int) -> list[int]:
    return [value >> 31, value & ((1 << 31) - 1)]


def agree(platform: Any, collective: bool, key: int, *, failed: bool, keep_plan: bool,
          watch: Any, extra: Sequence[int] = ()) -> tuple[Any, bool, list[int]]:
    """(the kept plan to reuse or None, whether the plan of this call is kept afterwards,
    ``extra`` reduced): one MAX all-reduce of whether any rank failed already, of
    ``-keep_plan`` (kept only when every rank keeps it), of the kept list's digest and its
    negation (equal on every rank exactly when both come back as sent), per kept plan of
    ``-(its layout is this rank's now)`` (the newest plan whose layout is every rank's is
    reused), and of the caller's ``extra`` lanes (``_transfer``: the version and its negation)."""
    kept = _kept(platform)
    parts = _split(digest(tuple(e.job for e in kept)))
    mine = [int(e.key == key) for e in kept] + [0] * (MAX_PLANS - len(kept))
    lanes = [int(failed), -int(keep_plan), *parts, *(-p for p in parts), *(-m for m in mine), *extra]
    if collective:
        lanes = all_reduce(platform, lanes, "max", watch)
    keep, reduced = lanes[1] == -1, lanes[6 + MAX_PLANS:]
    if lanes[2:4] != parts or lanes[4:6] != [-p for p in parts]:
        _clear(kept)  # the lists differ: no rank can tell which plans its peers hold
        return None, keep, reduced
    if lanes[0]:
        return None, keep, reduced
    everyone = [i for i in range(len(kept)) if lanes[6 + i] == -1]
    return (kept[everyone[-1]] if everyone else None), keep, reduced


def _clear(kept: list[Any]) -> None:
    while kept:
        _drop(kept.pop(0))


def keep(platform: Any, entry: Any, kept_after: bool) -> None:
    """After a transfer that every rank completed: keep ``entry`` as the newest plan
    (dropping the oldest beyond ``MAX_PLANS``), or forget it when ``kept_after`` is False
    (``agree``: the same on every rank)."""
    kept = _kept(platform)
    _remove(kept, entry)
    if not kept_after:
        entry.groups.close(wait_for_peers=True, raise_errors=True)
        return
    for same in [e for e in kept if e.job == entry.job]:  # a plan made again: the older one goes
        _remove(kept, same)
        _drop(same)
    kept.append(entry)
    while len(kept) > MAX_PLANS:
        _drop(kept.pop(0))


def forget(platform: Any, entry: Any) -> None:
    """After a failed transfer: drop ``entry`` without waiting for peers (some may have
    failed; the digest in ``agree`` brings lists that came apart together again)."""
    _remove(_PLANS.get(_scope(platform), []), entry)
    entry.groups.close(wait_for_peers=False, raise_errors=False)


def forget_group(key: str) -> None:
    """Drop every plan kept for the group ``key`` and its broadcast groups, when that group
    is closed (``TransferGroup.close``, on every member after its last transfer: no peer
    waits on them)."""
    for entry in _PLANS.pop(key, []):
        entry.groups.close(wait_for_peers=False, raise_errors=False)
