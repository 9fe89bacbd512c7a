"""Groups for the broadcasts: supplied, cached, the world, or created collectively."""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from dcp_platform import PeerFailure, Platform

logger = logging.getLogger(__name__)

# This process's count of ensures made without a watch: with every rank making the same
# ensure calls, the n-th of every rank shares one name (the groups' rendezvous keys).
_ENSURES = itertools.count()


def _as_key(ranks: Iterable[int], what: str) -> tuple[int, ...]:
    key = tuple(ranks)
    if not key or list(key) != sorted(set(key)):
        raise ValueError(f"{what}: rank set must be non-empty, sorted and unique, got {key}")
    return key


class GroupManager:
    """Finds or creates the group for each rank set, and destroys only what it created.

    Call order: every rank enters the context, then calls ``ensure`` with the same rank
    sets (a collective: one all-gather, then one ``platform.new_group`` per missing set in
    sorted order on every rank, members and non-members alike), then ``get`` freely.
    On exit (also on failure) it synchronizes the device and destroys the groups it created.
    A manager can serve many ``broadcast_items`` calls; groups it created stay cached until
    exit.

    ``supplied`` maps a sorted rank tuple to a group the caller owns: it is used as is and
    never destroyed. A rank set equal to the whole world uses ``platform.world_group()``.
    When ``platform.capabilities.subgroups`` is False, ``get`` returns the world group for
    every set and ``ensure`` creates nothing (the caller broadcasts over the world and
    non-members discard what they receive).

    ``supplied=None`` and ``ensure(own=True)`` on a platform with
    ``capabilities.member_groups``: groups are made by their members alone
    (``platform.new_member_group``), with no list exchange; give ``supplied`` on every rank
    or on none (a rank with supplied groups all-gathers, one without does not).

    ``watch``: a ``dcp_platform.Watch`` entered on every rank; the manager's all-gathers
    are then bounded by it (``dcp_platform.PeerFailure`` once a peer failed or died), and
    the members of each new group meet at a bounded store barrier (``Watch.barrier``)
    before connecting, and connect on a helper thread waited on in slices (the connect
    itself cannot be interrupted): a member that dies before or while connecting makes
    the others raise ``PeerFailure``; their helper thread ends at the group timeout.
    """

    def __init__(self, platform: Platform, supplied: Mapping[tuple[int, ...], Any] | None = None, *,
                 watch: Any = None):
        if supplied is not None and not isinstance(supplied, Mapping):
            raise TypeError(
                f"GroupManager supplied groups must be a mapping from rank tuple to group, "
                f"got {type(supplied).__name__}"
            )
        self._platform = platform
        self._supplied = {_as_key(k, "GroupManager supplied"): g for k, g in (supplied or {}).items()}
        self._created: dict[tuple[int, ...], Any] = {}
        self._closed = False
        self._watch = watch
        self._own_done = False  # an ensure(own=True) ran: later ensures need no collective
        self._had_supplied = supplied is not None  # then groups are gathered, never made by members alone
        self._member_path = False  # groups were made by their members alone: close() syncs every rank
        self._ensures = 0

    def _gather(self, obj: Any) -> list[Any]:
        if self._watch is not None:
            return self._watch.gather(obj)
        return self._platform.all_gather_object(obj)

    @property
    def subgroups(self) -> bool:
        """Whether broadcasts go over exact groups (else over the world group)."""
        return self._platform.capabilities.subgroups

    @property
    def created(self) -> tuple[tuple[int, ...], ...]:
        """Rank sets of the groups this manager created and still holds."""
        return tuple(self._created)

    def __enter__(self) -> GroupManager:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # After a failure, peers may be stuck in a collective: no barrier then, and a group
        # that cannot be destroyed is logged, so that the original error propagates.
        self.close(wait_for_peers=exc_type is None, raise_errors=exc_type is None)

    def _world(self) -> tuple[int, ...]:
        return tuple(range(self._platform.world_size()))

    def _have(self, key: tuple[int, ...]) -> bool:
        return key == self._world() or key in self._supplied or key in self._created

    def ensure(self, rank_sets: Iterable[Iterable[int]], *, own: bool = False) -> None:
        """Collective: make a group available for every rank set, on every rank.

        Each rank reports the sets it is a member of and has no group for; the union is
        created on every rank in sorted order. If one member supplied a group and another
        did not, both use the newly created one, so members always agree.

        ``own=True``: each rank passes only the sets it is a member of, which may differ
        from rank to rank (plans each rank derives for itself): every rank calls it, even
        with no sets. After it, an ``ensure`` whose sets all have a group returns without
        any collective (ranks with different sets cannot agree on one), so
        ``broadcast_items`` can run on the ranks that have items only. When the platform
        has ``capabilities.member_groups`` and the manager was made without ``supplied``
        groups, nothing is exchanged: each rank creates its own sets with their members
        alone, all in one sorted order (every member of a set must pass it); otherwise the
        sets are all-gathered and created on every rank, as above.
        """
        if self._closed:
            raise RuntimeError("GroupManager.ensure called after the manager was closed")
        keys = sorted({_as_key(s, "GroupManager.ensure") for s in rank_sets})
        world = self._platform.world_size()
        out_of_range = [k for k in keys if k[-1] >= world]
        if out_of_range:
            raise ValueError(f"GroupManager.ensure: rank sets {out_of_range} exceed world size {world}")
        if not self.subgroups or not self._platform.is_distributed():
            return
        if self._own_done and not own and all(self._have(k) for k in keys):
            return
        self._own_done = self._own_done or own
        if not own and all(k == self._world() for k in keys):
            # Every rank sees the same rank sets, so every rank skips the all-gather alike.
            return
        start = time.perf_counter()
        rank = self._platform.rank()
        scope = self._scope()
        missing_here = [k for k in keys if rank in k and not self._have(k)]
        if own and self._members_only:
            self._member_path = True
            for key in missing_here:  # sorted: one global order, so no two members wait crosswise
                self._create(key, scope, members_only=True)
            missing = missing_here
        else:
            gathered = self._gather(missing_here)
            missing = sorted({tuple(k) for per_rank in gathered for k in per_rank})
            for key in missing:
                # new_group is a collective over the whole world: every rank, same order.
                self._create(key, scope, members_only=False)
            if missing:
                # gloo's new_group returns on a rank before its peers finish connecting; a rank
                # that destroyed a fresh group early (say, on an error) broke a peer's connect
                # ("Connection closed by peer"). One all-gather keeps every rank here until all
                # groups exist everywhere.
                self._gather(None)
        logger.debug("rank %d: groups ensured (%d needed, %d created%s) in %.4f s", rank, len(keys),
                     len(missing), " by their members alone" if own and self._members_only else "",
                     time.perf_counter() - start)

    @property
    def _members_only(self) -> bool:
        return getattr(self._platform.capabilities, "member_groups", False) and not self._had_supplied

    def _scope(self) -> str:
        """A name every rank gives this ``ensure`` alike, unique in the job's store: the
        watch's operation name and this manager's count of ensures (each rank makes the same
        calls on a manager), or without a watch a count of this process's ensures."""
        self._ensures += 1
        if self._watch is not None:
            return f"{self._watch.name}/g{self._ensures}"
        return f"dcp-broadcast/{next(_ENSURES)}"

    def _create(self, key: tuple[int, ...], scope: str, *, members_only: bool) -> None:
        """Create the group for ``key``; with a watch, its members first meet at a store
        barrier bounded by the watch, then connect (see ``_connect``); a failure to connect
        is published."""
        name = f"{scope}/{hashlib.sha1(repr(key).encode()).hexdigest()[:16]}"
        member = self._platform.rank() in key
        try:
            if member and self._watch is not None:  # keys under the watch's name: drop it here
                self._watch.barrier(name.removeprefix(f"{self._watch.name}/"), key)
            if members_only:
                group = self._connect(key, lambda: self._platform.new_member_group(list(key), name))
            else:
                group = self._connect(key, lambda: self._platform.new_group(list(key)))
        except PeerFailure:
            raise
        except Exception as exc:
            if self._watch is None:
                raise
            raise self._watch.lost(exc) from exc
        stale = self._created.pop(key, None)
        self._created[key] = group
        if stale is not None:
            self._platform.destroy_group(stale)

    def _connect(self, key: tuple[int, ...], make: Any) -> Any:
        """``make()``, which connects the group's members and cannot be interrupted. With a
        bounded watch, a member runs it on a helper thread and waits for it in slices: a
        member that dies while connecting makes the others raise ``PeerFailure`` (the
        thread is then left to end at the group timeout; the connect releases the GIL,
        measured: a ticking thread ran on while a gloo connect waited for a missing peer)."""
        if self._watch is None or not getattr(self._watch, "bounded", False) or self._platform.rank() not in key:
            return make()
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["group"] = make()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                done.set()

        thread = threading.Thread(target=run, name=f"dcp-broadcast-connect-{key}", daemon=True)
        thread.start()
        try:
            self._watch.wait_event(done)
        except PeerFailure:
            logger.warning("rank %d: a peer failed while group %s was connecting; its connect "
                           "ends at the group timeout", self._platform.rank(), key)
            raise
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["group"]

    def get(self, ranks: Iterable[int]) -> Any:
        """The group to broadcast over for ``ranks`` (after ``ensure`` on every rank)."""
        key = _as_key(ranks, "GroupManager.get")
        if not self.subgroups or key == self._world():
            return self._platform.world_group()
        if key in self._created:
            return self._created[key]
        if key in self._supplied:
            return self._supplied[key]
        raise KeyError(
            f"GroupManager.get: no group for ranks {key}; call ensure([{key}, ...]) on every "
            "rank first, or supply it"
        )

    def close(self, *, wait_for_peers: bool = True, raise_errors: bool = True) -> None:
        """Synchronize the device, then destroy the groups this manager created.

        ``raise_errors=False`` (used when leaving on an exception): a group that cannot be
        destroyed is logged as a warning instead of raising over the error being handled.

        ``wait_for_peers`` (a collective, used on normal exit; only when this manager
        created groups, which every rank knows alike): one all-gather first, so that no
        rank closes a group's connections while a peer is still finishing a broadcast on it.
        """
        if self._closed:
            return
        self._closed = True
        start = time.perf_counter()
        created, self._created = self._created, {}
        try:
            # In-flight device work may still use a group; destroy it only once finished.
            self._platform.synchronize()
            # Groups made by their members alone: a rank that created none does not know
            # whether others did, so every rank that used that path syncs (all do alike).
            if (created or self._member_path) and wait_for_peers and self._platform.is_distributed():
                self._gather(None)
        finally:
            errors = []
            for key, group in created.items():
                try:
                    self._platform.destroy_group(group)
                except Exception as exc:  # keep destroying the others; reported below
                    errors.append(f"{key}: {exc!r}")
            logger.debug("rank %d: destroyed %d group(s) in %.4f s", self._platform.rank(),
                         len(created), time.perf_counter() - start)
            if errors and not raise_errors:
                logger.warning("rank %d: GroupManager.close: could not destroy groups: %s",
                               self._platform.rank(), "; ".join(errors))
            elif errors:
                raise RuntimeError(f"GroupManager.close: could not destroy groups: {'; '.join(errors)}")
