"""Agreeing on a derived plan with a fixed-size digest instead of gathering wants.

Each rank sends one SUM all-reduce of a few int64 lanes, whatever the number of tensors or
ranks (``LANES_BYTES``):

* *equality*: for each hash every rank must share (checkpoint metadata, settings, how
  hosts are known, and the host id), each of its three 21-bit chunks ``c`` as ``c`` and
  ``c * c``: all ranks had the same chunk exactly when ``world * sum(c * c) == sum(c) ** 2``
  (Cauchy-Schwarz; the sums fit int64 below 2**21 ranks). Equal host ids need no gather.
* *flags*: the derivable flags (all or nothing: the sum is the world), whether any rank
  already failed, whether any rank leads a name for the tied-weights count below, a
  random nonce whose sum every rank receives alike, and whether any rank's checks of the
  reads it guessed failed (``derived_plan``'s ``check``: the plan is derived and its reads
  checked before this exchange, so that a load whose checks pass needs no exchange of its
  own for them).
* two hashes (mod the prime 2**61 - 1, each sent as two 31-bit halves so that the int64
  sum cannot overflow below 2**32 ranks):
  - *holders*: each rank adds ``H(e) * g(rank)`` for every entry ``e`` it holds, and the
    lowest holder of ``e`` subtracts ``H(e) * sum(g(m) for m in e's holders)``. The sum is
    zero exactly when every rank that holds an entry holds it with the same spec (name,
    shape, dtype, flags, mesh, placements) and every rank the spec names holds it (up to a
    hash collision, about 2**-61).
  - *hosts*: with ``$LOCAL_WORLD_SIZE`` (torchrun), rank ``r`` is taken to run on node
    ``r // LOCAL_WORLD_SIZE``; each rank adds ``h(host_id) * g(node)`` and the node's first
    rank subtracts the node's share: zero when every node's ranks report one host.

A name held on two meshes that do not know each other (a tied embedding on the first and
last pipeline stages) passes both checks, since each mesh is consistent in itself: so one
holder of each (name, layout), chosen by the name's hash, counts it in the job's store
(``TCPStore.add`` under a key made of the nonce), an all-reduce makes sure every count is
in, and another (MAX of "a name was counted twice") sends such a job to the gathered path;
after it each leader deletes its keys. Layouts held by every rank are not counted, and when
no rank counts a name (every layout spans the world) neither all-reduce is made. The store
traffic per rank is the names it leads, each added and deleted: about tensors / holders per
mesh, for names not held by the whole world.

With a ``watch`` (``dcp_platform.Watch``), every all-reduce and gather here waits in
slices bounded by it: a rank that died makes the others raise ``PeerFailure``.

Only on a mismatch do ranks gather details (to name the ranks that differ, in a
``LoadError`` raised on every rank), and only when hosts cannot be derived do they gather
host ids (one short string each).

Control traffic never touches device memory: it runs on the platform's control group
(``Platform.all_reduce``, ``all_gather_object``): when the process group is not gloo (NCCL,
HCCL), a gloo group over its ranks is created once per group and kept for later loads;
creating it is a collective every rank makes in the same load call, decided by the backend
name all ranks share.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import secrets
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .._errors import LoadError, format_ranks
from ._derive import Derived

__all__ = ["LANES_BYTES", "Agreement", "agree", "all_equal", "all_reduce", "checkpoint_causes", "digest",
           "equal_lanes", "gather_hosts", "Reduction", "start_all_reduce"]

logger = logging.getLogger(__name__)

PRIME = (1 << 61) - 1
_HALF = 31
_CHUNK = 21  # a 61-bit hash as three chunks whose squares, summed over < 2**21 ranks, fit int64
_EQUAL = 4  # metadata, settings, host mode, host id
#: bytes each rank sends for the digest: 6 lanes per value every rank must share, the
#: derivable and failed flags, the nonce, the counted flag, 2 holders and 2 hosts lanes
LANES_BYTES = 8 * (6 * _EQUAL + 4 + 4 + 1)


def digest(*parts: Any) -> int:
    """A 61-bit hash of ``parts``' repr (stable across processes, unlike ``hash``)."""
    raw = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") % PRIME


def _mix(values: Any) -> Any:
    """splitmix64 of each value, cut to 40 bits (numpy: vectorised over a mesh)."""
    import numpy as np

    x = np.asarray(values, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) & np.uint64((1 << 40) - 1)


@functools.lru_cache(maxsize=1024)
def _mass(ranks: tuple[int, ...]) -> int:
    return int(_mix(ranks).astype("int64").sum()) % PRIME


def _g(rank: int) -> int:
    return int(_mix([rank])[0])


@functools.lru_cache(maxsize=256)
def _layout_hash(layout: tuple[Any, ...]) -> int:
    return digest(layout)  # a mesh's rank list is long: hashed once per layout


def _entry_hash(name: str, shape: tuple[int, ...], dtype: str, flags: int, layout: tuple[Any, ...]) -> int:
    return digest(name, shape, dtype, flags, _layout_hash(layout))


def holder_lane(entries: Sequence[Derived], rank: int) -> int:
    """This rank's share of the holders check (see module docstring)."""
    total, mine = 0, _g(rank)
    for e in entries:
        h = _entry_hash(e.name, e.shape, e.dtype, e.flags, e.layout)
        total += h * mine
        if e.holders and e.holders[0] == rank:
            total -= h * _mass(e.holders)
    return total % PRIME


def host_lane(host: str, rank: int, world: int, local_world: int) -> int:
    """This rank's share of the hosts check for node = rank // local_world."""
    node = rank // local_world
    h = digest(host) * _g(node)
    if rank % local_world == 0:
        h -= min(local_world, world - node * local_world) * digest(host) * _g(node)
    return h % PRIME


def _split(v: int) -> list[int]:
    return [v >> _HALF, v & ((1 << _HALF) - 1)]


def _join(hi: int, lo: int) -> int:
    return ((hi << _HALF) + lo) % PRIME


# -- the control channel ---------------------------------------------------------------
def _torch(platform: Any) -> bool:
    return getattr(platform, "name", "") in ("torch", "ascend")


def all_reduce(platform: Any, lanes: Sequence[int], op: str, watch: Any = None, phases: int = 1) -> list[int]:
    """Element-wise MAX or SUM of int64 ``lanes`` over all ranks, on the CPU; with ``watch``
    (a ``dcp_platform.Watch``) the wait is bounded by it (``PeerFailure`` once a peer died),
    ``phases`` times its bound when the others make that many steps before joining."""
    return start_all_reduce(platform, lanes, op, watch, phases).result()


class Reduction:
    """An ``all_reduce`` in flight (``start_all_reduce``): ``ready()`` says, without waiting,
    whether it completed; ``result()`` waits for it (bounded by the watch) and returns it."""

    def __init__(self, work: Any, tensor: Any, watch: Any, done: list[int] | None = None, phases: int = 1,
                 stored: Any = None):
        self._work, self._t, self._watch, self._done, self._phases = work, tensor, watch, done, phases
        self._stored = stored  # a dcp_platform store reduction, when the watch made one

    def ready(self) -> bool:
        if self._stored is not None:
            return self._done is not None or self._stored.ready()
        return self._done is not None or bool(self._work.is_completed())

    def result(self) -> list[int]:
        if self._done is None and self._stored is not None:
            self._done = self._watch.reduced(self._stored, phases=self._phases)
        elif self._done is None:
            if self._watch is not None:
                self._watch.wait(self._work, phases=self._phases)
            else:
                self._work.wait()
            self._done = [int(v) for v in self._t.tolist()]
        return self._done


def start_all_reduce(platform: Any, lanes: Sequence[int], op: str, watch: Any = None, phases: int = 1) -> Reduction:
    """``all_reduce`` begun: the caller works meanwhile, then calls ``result()`` (on failure
    too: the reduction is in flight on every rank). With a watch over this platform's ranks
    and a store, small worlds reduce through the store (``Watch.start_reduce``: a few store
    requests per rank, where a gloo ring on busy cores took milliseconds); else on torch the
    reduction runs on the process group's own thread, and other platforms gather here,
    before returning. ``phases``: the steps of local work the others may still make before
    joining (``Watch.wait``)."""
    start = getattr(watch, "start_reduce", None)
    if start is not None and watch.world == platform.world_size() and watch.rank == platform.rank():
        stored = start(list(lanes), op)
        if stored is not None:
            return Reduction(None, None, watch, phases=phases, stored=stored)
    if _torch(platform):
        import torch

        t = torch.tensor(list(lanes), dtype=torch.int64)
        return Reduction(platform.all_reduce(t, op), t, watch, phases=phases)
    # Other platforms gather (each rank still sends only its lanes) and reduce here.
    gathered = gather(platform, list(lanes), watch)
    reduce = max if op == "max" else sum
    return Reduction(None, None, None, [reduce(col) for col in zip(*gathered, strict=True)])


def gather(platform: Any, obj: Any, watch: Any = None) -> list[Any]:
    """All-gather a small object over a CPU group: with ``watch``, the platform's bounded
    all-gather (over its own host-memory control group), else this module's control group."""
    if watch is not None:
        return watch.gather(obj)
    return platform.all_gather_object(obj)


def gather_hosts(platform: Any, host: str, watch: Any = None) -> list[str]:
    """Every rank's host id (the fallback when hosts cannot be derived)."""
    return [str(h) for h in gather(platform, host, watch)]


def local_world_size() -> int:
    """``$LOCAL_WORLD_SIZE`` when hosts can be derived from it (no ``$DCP_HOST_ID``), else 0."""
    from ._hosts import HOST_ID_ENV

    if os.environ.get(HOST_ID_ENV):
        return 0
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return 0
    return max(n, 0)


# -- the agreement ---------------------------------------------------------------------
class Agreement:
    """What the digest exchange decided: plan derived (every rank can) or gathered, whether
    the hosts derived from ``$LOCAL_WORLD_SIZE`` hold (else gather host ids), and whether
    every rank reported one host id (then there is nothing to gather either), and whether
    any rank's checks of its guessed reads failed (``checks_failed``)."""

    def __init__(self, derived: bool, hosts_derived: bool, one_host: bool = False, checks_failed: bool = False):
        self.derived, self.hosts_derived, self.one_host = derived, hosts_derived, one_host
        self.checks_failed = checks_failed


def _countable(entries: Sequence[Derived], world: int) -> bool:
    """Whether ``_count_names`` would count any of ``entries`` (a layout not held by every rank)."""
    return any(e.holders and len(e.holders) < world for e in entries)


def equal_lanes(values: Sequence[int]) -> list[int]:
    """Per value, for each of its three 21-bit chunks ``c``: ``c`` and ``c * c``."""
    out = []
    for v in values:
        for k in range(3):
            c = (int(v) >> (_CHUNK * k)) & ((1 << _CHUNK) - 1)
            out += [c, c * c]
    return out


def all_equal(sums: Sequence[int], world: int) -> list[bool]:
    """From ``equal_lanes``' sums over ``world`` ranks, per value whether every rank had
    it: ``world * sum(c * c) == sum(c) ** 2`` exactly when every ``c`` is one value."""
    chunks = [world * sums[i + 1] == sums[i] ** 2 for i in range(0, len(sums), 2)]
    return [all(chunks[j:j + 3]) for j in range(0, len(chunks), 3)]


def agree(platform: Any, *, equal: Sequence[tuple[int, str]], derivable: bool, failed: bool,
          entries: Sequence[Derived], host: str, local_world: int, watch: Any = None,
          checks_failed: bool = False, checked: bool = False) -> Agreement:
    """The digest exchange (module docstring); raises ``LoadError`` on every rank when
    derivable ranks disagree. ``equal``: (hash, what it stands for, shown on a mismatch)
    for metadata, settings and host mode, which every rank must share; the metadata's is
    the path of the checkpoint opened (``checkpoint_causes``). ``watch``: bounds
    every wait (a dead rank raises ``PeerFailure`` on the others)."""
    rank, world = platform.rank(), platform.world_size()
    shown = [text for _, text in equal]
    equal = [int(v) % PRIME for v, _ in equal]
    holders = holder_lane(entries, rank) if derivable else 0
    hosts = host_lane(host, rank, world, local_world) if local_world else 0
    lanes = [*equal_lanes([*equal, digest(host)]), int(derivable), int(failed), secrets.randbelow(1 << _HALF),
             int(_countable(entries, world)), *_split(holders), *_split(hosts), int(checks_failed)]
    # With checks, the others prepare and check their reads before joining: two steps.
    sums = all_reduce(platform, lanes, "sum", watch, phases=2 if checked else 1)
    n, at = len(equal), 6 * (len(equal) + 1)
    flags = all_equal(sums[:at], world)
    derivable_all, failed_any, nonce, counted = sums[at] == world, sums[at + 1] > 0, sums[at + 2], sums[at + 3] > 0
    if failed_any or not derivable_all:  # a rank failed or cannot derive: the gathered path
        return Agreement(False, False)
    if not all(flags[:n]) or _join(sums[at + 4], sums[at + 5]) != 0:
        differ = _differences(platform, list(zip(equal, shown, strict=True)), entries, watch)
        if not differ:  # plain tensors only some ranks hold (per-rank keys): the gathered wants plan them
            return Agreement(False, False)
        raise LoadError(differ, "validate")
    if counted and _counted_twice(platform, entries, rank, world, nonce % PRIME, watch):
        logger.debug("rank %d: a tensor is held on two meshes (tied weights); gathering wants", rank)
        return Agreement(False, False)
    return Agreement(True, local_world > 0 and _join(sums[at + 6], sums[at + 7]) == 0, flags[n], sums[at + 8] > 0)


def _counted_twice(platform: Any, entries: Sequence[Derived], rank: int, world: int, nonce: int,
                   watch: Any) -> bool:
    """Whether a name was counted by two layouts (module docstring): two all-reduces, the
    first so that every count is in before any rank reads, the second after every read."""
    store = platform.store()
    keys = _count_names(store, entries, rank, world, nonce)
    try:
        all_reduce(platform, [0], "sum", watch)
        return bool(all_reduce(platform, [_twice(store, keys)], "max", watch)[0])
    finally:
        _forget(store, keys)


def _count_names(store: Any, entries: Sequence[Derived], rank: int, world: int, nonce: int) -> list[str]:
    """Count, in the store, every (name, layout) this rank leads; returns the keys.

    A layout held by every rank (plain tensors, world-replicated DTensors) is not counted:
    a second layout of its name would need ranks outside the world (a rank holds one entry
    per name, and the holders check already fails when ranks disagree on its layout)."""
    keys = []
    for e in entries:
        if len(e.holders) < world and e.holders and e.holders[digest(e.name) % len(e.holders)] == rank:
            key = f"dcp_load/{nonce:x}/{digest(e.name):x}"
            store.add(key, 1)
            keys.append(key)
    return keys


def _twice(store: Any, keys: Sequence[str]) -> int:
    """1 when a name this rank counted was counted by another layout too."""
    return int(any(store.add(key, 0) > 1 for key in keys))


def _forget(store: Any, keys: Sequence[str]) -> None:
    """Remove this rank's counts from the store (two leaders of one name both try: fine)."""
    for key in keys:
        try:
            store.delete_key(key)
        except Exception as exc:  # noqa: BLE001 - a leftover key is harmless (unique per load): log it
            logger.debug("could not remove %s from the store: %r", key, exc)


#: At most this many (checkpoint, ranks) groups are listed when ranks opened different checkpoints.
_SHOWN_CHECKPOINTS = 6

LAYOUT_HINT = "every rank must pass the same state dict layout (see README, derived planning)"


def checkpoint_causes(opened: Sequence[tuple[Any, Any]]) -> dict[int, list[str]]:
    """What to tell each rank when ranks planned from different checkpoint metadata;
    ``opened[r]``: rank r's (metadata hash, the checkpoint path it opened, None for a reader
    without one). {} when every hash is equal. Where the paths differ, every rank is shown
    which ranks opened which checkpoint; where they are one path, the ranks whose
    metadata differs from the most common one are named (a copy that differs between nodes,
    a checkpoint re-saved during the load, or different ``sources=``)."""
    by_hash: dict[Any, list[int]] = {}
    for r, (h, _) in enumerate(opened):
        by_hash.setdefault(h, []).append(r)
    if len(by_hash) < 2:
        return {}
    if len({str(p) for _, p in opened}) > 1:
        groups: dict[tuple[Any, str], list[int]] = {}
        for r, (h, p) in enumerate(opened):
            groups.setdefault((h, "a storage_reader without a path" if p is None else repr(str(p))), []).append(r)
        listed = sorted(groups.items(), key=lambda kv: kv[1][0])
        shown = "; ".join(f"{format_ranks(ranks)} opened {where}" for (_, where), ranks in listed[:_SHOWN_CHECKPOINTS])
        if len(listed) > _SHOWN_CHECKPOINTS:
            shown += f"; and {len(listed) - _SHOWN_CHECKPOINTS} more checkpoint(s)"
        text = (f"the ranks opened different checkpoints, whose metadata differs ({shown}): pass every rank the "
                "same checkpoint_id (one directory, or identical copies of it) with the same sources= (copies that "
                "are identical still differ when the ranks compose them differently)")
        return {r: [text] for r in range(len(opened))}
    ordered = sorted(by_hash.values(), key=lambda g: (-len(g), g))
    where = opened[0][1]
    return {r: [f"the checkpoint metadata differs from rank {ordered[0][0]}'s (on {format_ranks(g)}), though "
                f"every rank opened {str(where)!r}: a copy that differs between nodes, a checkpoint re-saved "
                "during the load, or different sources="] for g in ordered[1:] for r in g}


def _summary(e: Derived) -> tuple[Any, ...]:
    return (e.shape, e.dtype, e.flags, _layout_hash(e.layout))


def _differences(platform: Any, equal: Sequence[tuple[int, str]], entries: Sequence[Derived],
                 watch: Any = None) -> dict[int, list[str]]:
    """Gather every rank's digest and entries (only after a mismatch) and name who differs.
    ``equal[0]`` is the checkpoint's (metadata hash, path opened): see ``checkpoint_causes``.
    Only ranks whose entries differ are told to pass the same state dict layout."""
    details = gather(platform, (list(equal), {e.name: (_summary(e), e.holders) for e in entries}), watch)
    out: dict[int, list[str]] = {}
    for r, causes in checkpoint_causes([d[0][0] for d in details]).items():
        out.setdefault(r, []).extend(causes)
    for i in range(1, len(equal)):
        if len({d[0][i][0] for d in details}) > 1:  # every rank shows its value: who differs is a majority call
            for r, d in enumerate(details):
                out.setdefault(r, []).append(d[0][i][1])
    layout = _layout_differences(details)
    for r, causes in layout.items():
        out.setdefault(r, []).extend([*causes, LAYOUT_HINT])
    if not out and _plain_held_by_some(details):
        return {}
    if not out:  # a hash collision cannot explain a mismatch the details do not show
        out = {r: ["the plan digests differ", LAYOUT_HINT] for r in range(len(details))}
    return out


def _plain(spec: tuple[Any, ...]) -> bool:
    """Whether an entry's ``_summary`` is a plain tensor's (derived as held by every rank)."""
    return spec[3] == _layout_hash(("plain",))


def _plain_held_by_some(details: Sequence[Any]) -> bool:
    """Whether a plain tensor is held by some ranks only, alike where held: a key of each
    rank's own (per-rank RNG or dataloader state), which each holder loads whole."""
    claims = [held for _, held in details]
    return any(_plain(spec) and not all(name in h for h in claims)
               for held in claims for name, (spec, _) in held.items())


def _layout_differences(details: Sequence[Any]) -> dict[int, list[str]]:
    """Per rank, the entries it holds differently from the other ranks (or lacks). A plain
    tensor that some ranks lack is no difference (``_plain_held_by_some``)."""
    out: dict[int, list[str]] = {}
    names = sorted({name for _, held in details for name in held})
    for name in names:
        claims = {r: held[name] for r, (_, held) in enumerate(details) if name in held}
        (spec, holders), _ = Counter(claims.values()).most_common(1)[0]
        if _plain(spec) and len(set(claims.values())) == 1:
            continue
        for r, claim in claims.items():
            if claim != (spec, holders):
                out.setdefault(r, []).append(f"entry {name!r} differs from other ranks' (shape, dtype, "
                                             "device, mesh or placements)")
            elif r not in holders:
                out.setdefault(r, []).append(f"holds {name!r}, which its mesh does not place on this rank")
        lacking = [r for r in holders if r not in claims]
        if lacking and len(lacking) > len(claims):  # a few ranks hold what most of its holders lack
            for r in claims:
                out.setdefault(r, []).append(f"holds {name!r}, which {len(lacking)} of the {len(holders)} "
                                             "ranks its layout places it on lack")
        for r in lacking if len(lacking) <= len(claims) else ():
            out.setdefault(r, []).append(f"lacks {name!r}, which other ranks' mesh places on it")
    return out
