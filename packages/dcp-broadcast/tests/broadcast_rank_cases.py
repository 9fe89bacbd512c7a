"""Functions that run inside gloo ranks for the dcp-broadcast tests (not a test module).

The tests put this folder on ``sys.path`` so that ``run_ranks`` children can import these
functions by name (pytest's importlib mode gives test modules names that children cannot
import). Each ``*_cases`` function runs several scenarios in one launch and returns, per
scenario, this rank's stats and every problem it found, so the tests can assert on them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from dcp_broadcast import BroadcastItem, GroupManager, ScheduleMismatchError, broadcast_items
from dcp_platform import Capabilities, Platform, get_platform

POISON = 0x7F
WORLD4 = (0, 1, 2, 3)


# -- a platform wrapper that watches what the scheduler does ---------------------------------
class _WatchedHandle:
    def __init__(self, owner: WatchingPlatform, inner: Any, wire: Any):
        self.owner, self.inner, self.wire = owner, inner, wire

    def wait(self) -> None:
        self.owner.on_wait_entry()
        if self.inner is not None:
            self.inner.wait()
        self.owner.outstanding -= 1
        self.owner.outstanding_noncontig -= not self.wire.is_contiguous()
        self.owner.outstanding_staging -= self.owner.staging_bytes(self.wire)
        self.owner.waits_returned += 1


class WatchingPlatform(Platform):
    """Delegates to a real platform; counts groups, in-flight broadcasts and staging bytes.

    ``complete_at_issue``: finish each real broadcast inside ``broadcast`` and hand back a
    handle whose ``wait`` only records the wait, so the data has arrived in the wire buffer
    long before the scheduler waits: a scheduler that wrote receivers early would be seen.
    ``subgroups=False`` hides subgroup support, as MindSpore on CPU does.
    """

    name = "watched"

    def __init__(self, inner: Platform, *, complete_at_issue: bool = False, subgroups: bool = True):
        self.inner, self.complete_at_issue = inner, complete_at_issue
        self._caps = dataclasses.replace(inner.capabilities, subgroups=subgroups and inner.capabilities.subgroups)
        self.new_groups: list[tuple[int, ...]] = []
        self.destroyed = 0
        self.groups_used: list[Any] = []
        self.outstanding = self.max_outstanding = 0
        self.outstanding_noncontig = self.max_outstanding_noncontig = 0
        self.outstanding_staging = self.max_outstanding_staging = 0
        self.waits_returned = 0
        self.staging: set[int] = set()  # data pointers of the buffers ``empty`` made
        self.allocations = self.allocated_bytes = 0  # every ``empty`` call, and its bytes
        self.on_event: Any = None  # callable(kind) run at each issue and each wait entry
        self.fail_at: int | None = None  # raise instead of issuing this rank's n-th broadcast

    def staging_bytes(self, wire: Any) -> int:
        """Bytes of ``wire`` when it lies in a buffer ``empty`` made (the buffer itself, or a
        leading slice of a reused one)."""
        return wire.numel() * wire.element_size() if wire.untyped_storage().data_ptr() in self.staging else 0

    def on_wait_entry(self) -> None:
        if self.on_event is not None:
            self.on_event("wait")

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def rank(self) -> int:
        return self.inner.rank()

    def world_size(self) -> int:
        return self.inner.world_size()

    def is_distributed(self) -> bool:
        return self.inner.is_distributed()

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.inner.all_gather_object(obj)

    def world_group(self) -> Any:
        return self.inner.world_group()

    def new_group(self, ranks: Sequence[int]) -> Any:
        if not self._caps.subgroups:
            raise self._unsupported("subgroups")
        self.new_groups.append(tuple(ranks))
        return self.inner.new_group(ranks)

    def destroy_group(self, group: Any) -> None:
        self.destroyed += 1
        self.inner.destroy_group(group)

    def broadcast(self, tensor: Any, src: int, group: Any = None) -> Any:
        if self.on_event is not None:
            self.on_event("issue")
        if self.fail_at is not None and len(self.groups_used) + 1 == self.fail_at:
            raise RuntimeError(f"injected failure at broadcast {self.fail_at}")
        self.groups_used.append(group)
        handle = self.inner.broadcast(tensor, src, group)
        if self.complete_at_issue and handle is not None:
            handle.wait()
            handle = None
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        self.outstanding_noncontig += not tensor.is_contiguous()
        self.max_outstanding_noncontig = max(self.max_outstanding_noncontig, self.outstanding_noncontig)
        self.outstanding_staging += self.staging_bytes(tensor)
        self.max_outstanding_staging = max(self.max_outstanding_staging, self.outstanding_staging)
        return _WatchedHandle(self, handle, tensor)

    def fused_copy(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        self.inner.fused_copy(dsts, srcs)

    def empty(self, shape: Sequence[int], dtype: Any, device: Any = None) -> Any:
        t = self.inner.empty(shape, dtype, device)
        self.staging.add(t.untyped_storage().data_ptr())
        self.allocations += 1
        self.allocated_bytes += t.numel() * t.element_size()
        return t

    def nbytes(self, tensor: Any) -> int:
        return self.inner.nbytes(tensor)

    def as_bytes(self, tensor: Any) -> Any:
        return self.inner.as_bytes(tensor)

    def from_bytes(self, raw: Any, dtype: Any, shape: Sequence[int]) -> Any:
        return self.inner.from_bytes(raw, dtype, shape)

    def dtype_name(self, dtype: Any) -> str:
        return self.inner.dtype_name(dtype)

    def dtype_from_name(self, name: str) -> Any:
        return self.inner.dtype_from_name(name)

    def synchronize(self) -> None:
        self.inner.synchronize()


# -- items with known contents -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    src: int
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    noncontig: bool = False


def reference(index: int, spec: Spec) -> torch.Tensor:
    """The values item ``index`` carries: the same on every rank, never all poison bytes."""
    g = torch.Generator().manual_seed(1000 + index)
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, spec.shape, generator=g).bool()
    if not spec.dtype.is_floating_point and not spec.dtype.is_complex:
        return torch.randint(-100, 100, spec.shape, generator=g).to(spec.dtype)
    return torch.randn(spec.shape, generator=g).to(spec.dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _poisoned(spec: Spec, ref: torch.Tensor) -> torch.Tensor:
    if spec.dtype == torch.bool:
        return ~ref  # every element differs from what will arrive
    raw = torch.full((ref.numel() * ref.element_size(),), POISON, dtype=torch.uint8)
    return raw.view(spec.dtype).view(spec.shape)


def _place(spec: Spec, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values`` in a contiguous tensor, or in a strided view of a poisoned base (view, base)."""
    if not spec.noncontig or len(spec.shape) == 0:
        return values.clone(), None
    base_shape = (*spec.shape[:-1], spec.shape[-1] * 2)
    base = _poisoned(dataclasses.replace(spec, shape=base_shape), torch.zeros(base_shape, dtype=spec.dtype))
    if spec.dtype == torch.bool:
        base = torch.zeros(base_shape, dtype=torch.bool)
    view = base[..., ::2]
    view.copy_(values)
    return view, base


class Case:
    """This rank's items for ``specs``, with receivers poisoned, and the checks afterwards."""

    def __init__(self, rank: int, specs: Sequence[Spec], *, source_poisoned: bool = False):
        self.rank, self.specs = rank, list(specs)
        self.refs = [reference(i, s) for i, s in enumerate(self.specs)]
        self.items: list[BroadcastItem] = []
        self.bases: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        for spec, ref in zip(self.specs, self.refs, strict=True):
            nbytes = ref.numel() * ref.element_size()
            if rank not in spec.ranks:
                self.items.append(BroadcastItem(spec.src, spec.ranks, nbytes))
                self.bases.append((None, None))
                continue
            fill = ref if rank == spec.src and not source_poisoned else _poisoned(spec, ref)
            tensor, base = _place(spec, fill)
            self.bases.append((base, base.clone() if base is not None else None))
            self.items.append(BroadcastItem(spec.src, spec.ranks, nbytes, tensor))

    def fill_source(self, index: int) -> None:
        self.items[index].tensor.copy_(self.refs[index])

    def finished(self, index: int) -> bool:
        return torch.equal(_raw(self.items[index].tensor), _raw(self.refs[index]))

    def untouched(self, index: int) -> bool:
        spec = self.specs[index]
        return torch.equal(_raw(self.items[index].tensor), _raw(_poisoned(spec, self.refs[index])))

    def problems(self) -> list[str]:
        out = []
        for i, (item, spec) in enumerate(zip(self.items, self.specs, strict=True)):
            if item.tensor is None:
                continue
            if not self.finished(i):
                out.append(f"rank {self.rank} item {i} {spec}: wrong values")
            base, before = self.bases[i]
            if base is not None:
                gaps = base[..., 1::2]
                if not torch.equal(_raw(gaps), _raw(before[..., 1::2])):
                    out.append(f"rank {self.rank} item {i}: bytes outside the view were written")
        return out


def _run(platform: Platform, rank: int, specs: Sequence[Spec], **kwargs: Any) -> dict[str, Any]:
    case = Case(rank, specs)
    stats = broadcast_items(platform, case.items, check_schedule=True, **kwargs)
    return {"stats": dataclasses.asdict(stats), "errors": case.problems()}


ALL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
              torch.bool, torch.complex64)
GROUPS = ((0, 1, 2, 3), (0, 3), (1, 2), (0, 1), (2, 3), (1, 2, 3), (0, 2))


def threshold_specs() -> list[Spec]:
    """With batch_bytes=1024: 1023 B and 1020 B are batched (two batches: together they
    would overflow), 1024, 1025, 1024 and 1028 B go alone: 6 broadcasts, 2 items batched."""
    return [Spec(1, WORLD4, (1023,), torch.uint8), Spec(1, WORLD4, (1024,), torch.uint8),
            Spec(1, WORLD4, (1025,), torch.uint8), Spec(1, WORLD4, (255,), torch.float32),
            Spec(1, WORLD4, (256,), torch.float32), Spec(1, WORLD4, (257,), torch.float32)]


def dtype_specs() -> list[Spec]:
    specs = []
    for i, dtype in enumerate(ALL_DTYPES):
        ranks = GROUPS[i % len(GROUPS)]
        src = ranks[i % len(ranks)]
        specs += [Spec(src, ranks, (3, 5), dtype), Spec(src, ranks, (), dtype),
                  Spec(src, ranks, (7, 9), dtype, noncontig=True), Spec(src, ranks, (300, 40), dtype)]
    return specs


def interleaved_specs(seed: int, count: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        ranks = rng.choice(GROUPS)
        dtype = rng.choice(ALL_DTYPES)
        n = rng.choice([rng.randint(1, 300), rng.randint(300, 3000)])
        shape = (n,) if rng.random() < 0.5 else (n, 2)
        specs.append(Spec(rng.choice(ranks), ranks, shape, dtype, noncontig=rng.random() < 0.3))
    return specs


def main_cases(rank: int, world: int) -> dict[str, Any]:
    platform = get_platform("torch")
    out: dict[str, Any] = {}
    out["threshold"] = _run(platform, rank, threshold_specs(), batch_bytes=1024)
    out["dtypes"] = _run(platform, rank, dtype_specs())
    out["dtypes_unbatched"] = _run(platform, rank, dtype_specs(), batch_bytes=0)
    out["interleaved"] = _run(platform, rank, interleaved_specs(7, 150), batch_bytes=4096, max_in_flight=4)
    out["noncontig_direct"] = _run(
        platform, rank, [Spec(s, WORLD4, (64, 33), torch.bfloat16, noncontig=True) for s in range(4)]
        + [Spec(3, (0, 3), (200, 3), torch.float8_e4m3fn, noncontig=True)], batch_bytes=16)

    # In-flight cap and staging bound, counted by the wrapper as well as by the stats.
    watched = WatchingPlatform(platform)
    specs = [Spec(i % 4, WORLD4, (2048,), torch.float32) for i in range(12)]
    specs += [Spec(i % 2, (0, 1), (100,), torch.float16) for i in range(200)]
    specs += [Spec(3, (2, 3), (4096,), torch.uint8) for i in range(12)]
    res = _run(watched, rank, specs, batch_bytes=4096, max_in_flight=3)
    res.update(max_outstanding=watched.max_outstanding, outstanding_at_end=watched.outstanding,
               max_staging=watched.max_outstanding_staging, allocations=watched.allocations,
               allocated=watched.allocated_bytes)
    out["cap"] = res

    # Non-contiguous items sent alone each need a full-size contiguous temporary: at most
    # one of them is in flight at a time, whatever max_in_flight allows.
    watched = WatchingPlatform(platform)
    specs = [Spec(i % 4, WORLD4, (64, 40), torch.float32, noncontig=i >= 6) for i in range(12)]
    res = _run(watched, rank, specs, batch_bytes=1024, max_in_flight=4)
    res.update(max_noncontig=watched.max_outstanding_noncontig, max_outstanding=watched.max_outstanding)
    out["noncontig_cap"] = res

    out["untouched"] = _untouched(platform, rank)
    out["prepare"] = _prepare(platform, rank)
    out["groups"] = _groups(platform, rank)

    # World-group fallback (a backend without subgroups): non-members receive and discard.
    watched = WatchingPlatform(platform, subgroups=False)
    res = _run(watched, rank, interleaved_specs(11, 60), batch_bytes=2048, max_in_flight=2)
    res.update(new_groups=len(watched.new_groups), all_world=all(g is dist.group.WORLD for g in watched.groups_used),
               broadcasts_seen=len(watched.groups_used))
    out["fallback"] = res
    return out


def _untouched(platform: Platform, rank: int) -> dict[str, Any]:
    """Receivers stay poisoned until the wait of their own broadcast returns.

    Every item is 1024 bytes and batch_bytes is 4096, so batch b holds items 4b..4b+3.
    The wrapper completes each broadcast as it is issued, so only the scheduler's ordering
    keeps receivers untouched: at each issue and each wait, exactly the items of the batches
    whose wait returned may hold data, and no item may be partly written.
    """
    watched = WatchingPlatform(platform, complete_at_issue=True)
    specs = [Spec(0, WORLD4, (256,), torch.float32, noncontig=(i % 3 == 0)) for i in range(40)]
    case = Case(rank, specs)
    errors: list[str] = []
    events = 0

    def check(kind: str) -> None:
        nonlocal events
        events += 1
        if rank == 0:
            return
        done = [i for i in range(len(specs)) if case.finished(i)]
        partial = [i for i in range(len(specs)) if not case.finished(i) and not case.untouched(i)]
        allowed = 4 * watched.waits_returned
        if partial or done != list(range(min(allowed, len(specs)))):
            errors.append(f"at {kind} {events}: {watched.waits_returned} waits returned, finished "
                          f"{done}, partly written {partial}")

    watched.on_event = check
    stats = broadcast_items(watched, case.items, batch_bytes=4096, max_in_flight=4, check_schedule=True)
    return {"stats": dataclasses.asdict(stats), "errors": errors + case.problems(), "events": events}


def _prepare(platform: Platform, rank: int) -> dict[str, Any]:
    """Sources start poisoned; prepare(index) fills the item, so data arrives only if the
    scheduler calls it before reading; it must run once per item, on the source only."""
    specs = interleaved_specs(3, 80) + [Spec(2, WORLD4, (5000,), torch.float32)]
    case = Case(rank, specs, source_poisoned=True)
    calls: list[int] = []

    def prepare(index: int) -> None:
        calls.append(index)
        case.fill_source(index)

    stats = broadcast_items(platform, case.items, batch_bytes=4096, max_in_flight=3,
                            check_schedule=True, prepare=prepare)
    mine = sorted(i for i, s in enumerate(specs) if s.src == rank and len(s.ranks) > 1)
    errors = case.problems()
    if sorted(calls) != mine:
        errors.append(f"rank {rank}: prepare called for {sorted(calls)}, expected {mine}")
    return {"stats": dataclasses.asdict(stats), "errors": errors}


def _groups(platform: Platform, rank: int) -> dict[str, Any]:
    specs = interleaved_specs(5, 40)
    needed = sorted({s.ranks for s in specs if s.ranks != WORLD4})
    out: dict[str, Any] = {}

    # Built: every missing set created once, on every rank, in sorted order; all destroyed.
    watched = WatchingPlatform(platform)
    res = _run(watched, rank, specs, batch_bytes=2048)
    res.update(created=watched.new_groups, destroyed=watched.destroyed, needed=needed)
    out["built"] = res

    # Supplied: the caller's groups are used as they are, nothing created or destroyed.
    supplied = {key: platform.new_group(list(key)) for key in needed}
    watched = WatchingPlatform(platform)
    res = _run(watched, rank, specs, batch_bytes=2048, groups=supplied)
    allowed = {id(g) for g in supplied.values()} | {id(dist.group.WORLD)}
    res.update(created=watched.new_groups, destroyed=watched.destroyed,
               only_supplied=all(id(g) in allowed for g in watched.groups_used))
    out["supplied"] = res

    # Supplied on some members only: created for all, and the members agree on it.
    partial = {(0, 3): supplied[(0, 3)]} if rank == 0 else {}
    watched = WatchingPlatform(platform)
    res = _run(watched, rank, [Spec(3, (0, 3), (50,), torch.int32), Spec(0, (0, 3), (9000,), torch.int8)],
               groups=partial)
    res.update(created=watched.new_groups, destroyed=watched.destroyed)
    out["partly_supplied"] = res
    for group in supplied.values():
        platform.destroy_group(group)

    # A manager the caller owns: reused across calls, destroyed on exit, also on failure.
    watched = WatchingPlatform(platform)
    with GroupManager(watched) as manager:
        first = _run(watched, rank, specs, groups=manager)
        created_first = list(watched.new_groups)
        second = _run(watched, rank, interleaved_specs(6, 40), groups=manager)
        destroyed_inside = watched.destroyed
    out["manager"] = {"errors": first["errors"] + second["errors"], "created_first": created_first,
                      "created_total": watched.new_groups, "destroyed_inside": destroyed_inside,
                      "destroyed": watched.destroyed, "needed": needed,
                      "needed_both": sorted({s.ranks for s in specs + interleaved_specs(6, 40)} - {WORLD4})}
    watched = WatchingPlatform(platform)
    try:
        with GroupManager(watched) as manager:
            manager.ensure([(0, 3), (1, 2), WORLD4])
            raise KeyError("boom")
    except KeyError:
        pass
    out["manager_failure"] = {"errors": [], "created": watched.new_groups, "destroyed": watched.destroyed}

    # A backend error in the middle of broadcast_items: the groups it built are destroyed.
    # Every rank fails at its own 3rd broadcast, which both members of its group reach.
    watched = WatchingPlatform(platform)
    watched.fail_at = 3
    pairs = [Spec(0, (0, 3), (10,), torch.float32), Spec(1, (1, 2), (10,), torch.float32)] * 4
    try:
        _run(watched, rank, pairs, batch_bytes=0)
        failed = ""
    except RuntimeError as exc:
        failed = str(exc)
    out["run_failure"] = {"errors": [], "failed": failed, "created": watched.new_groups,
                          "destroyed": watched.destroyed}
    return out


# -- lifecycle: leaks and schedule mismatches ----------------------------------------------------
def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def lifecycle_cases(rank: int, world: int, repetitions: int) -> dict[str, Any]:
    platform = get_platform("torch")
    pg_map = dist.distributed_c10d._world.pg_map
    specs = interleaved_specs(9, 16)  # small: the point is 20 rounds of create and destroy
    first = _run(platform, rank, specs, batch_bytes=2048)  # warm-up: lazily started threads
    before = (threading.active_count(), _os_threads(), len(pg_map))
    errors = list(first["errors"])
    for _ in range(repetitions):
        errors += _run(platform, rank, specs, batch_bytes=2048)["errors"]
    after = (threading.active_count(), _os_threads(), len(pg_map))
    out: dict[str, Any] = {"leaks": {"errors": errors, "before": before, "after": after,
                                     "platform_groups": len(platform._created)}}
    out["mismatch"] = _mismatches(platform, rank)
    return out


def _mismatches(platform: Platform, rank: int) -> dict[str, Any]:
    base = [Spec(i % 4, GROUPS[i % len(GROUPS)][:], (10 + i,), torch.float32) for i in range(12)]
    base = [dataclasses.replace(s, src=s.ranks[0]) for s in base]
    results: dict[str, Any] = {}

    def attempt(name: str, specs: list[Spec], **kwargs: Any) -> None:
        case = Case(rank, specs)
        try:
            broadcast_items(platform, case.items, check_schedule=True, **kwargs)
            results[name] = None
        except ScheduleMismatchError as exc:
            results[name] = {"index": exc.index, "message": str(exc), "errors": exc.errors}

    changed = list(base)
    if rank == 2:
        changed[5] = dataclasses.replace(changed[5], shape=(99,))
    attempt("nbytes", changed)
    attempt("extra_item", base + ([Spec(0, WORLD4, (4,), torch.float32)] if rank == 3 else []))
    attempt("batch_bytes", base, batch_bytes=1024 if rank == 1 else 2048)
    # A local error (tensor size differs from nbytes) fails every rank, not only rank 0.
    bad = Case(rank, base)
    if rank == 0:
        bad.items[0] = dataclasses.replace(bad.items[0], tensor=torch.zeros(1000))
    try:
        broadcast_items(platform, bad.items, check_schedule=True)
        results["invalid"] = None
    except ScheduleMismatchError as exc:
        results["invalid"] = {"index": exc.index, "message": str(exc), "errors": exc.errors}
    # The ranks are still in step afterwards.
    results["after"] = _run(platform, rank, base)
    return results


# -- the README's standalone example ---------------------------------------------------------
def example_case(rank: int, world: int, path: str) -> list[str]:
    """Run the example's push_parameters; return every parameter's bytes as hex digests."""
    import hashlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("push_parameters_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 3))
    if rank != 1:  # receivers poisoned
        for t in model.state_dict().values():
            t.reshape(-1).view(torch.uint8).fill_(POISON)
    stats = module.push_parameters(model, src=1)
    digests = [hashlib.sha256(_raw(t).numpy().tobytes()).hexdigest() for t in model.state_dict().values()]
    return [*digests, f"items={stats.items}"]
