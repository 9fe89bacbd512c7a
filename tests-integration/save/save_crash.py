"""Save-crash trials: ``dcp_load.save`` killed with SIGKILL at random points of saves and
overwrites, by one process or by 2 gloo ranks, after which the directory must hold one
whole loadable checkpoint, the old one or the new one, every tensor and value exact and
from one single save; or none, when there was none before.

Each trial forks the savers from a forkserver that has torch and dcp_load imported, waits
until they are about to call ``save`` (the process group is up), sleeps a random time
within about 1.3 x a measured save and kills every saver (all at once, or one and then
the others a few milliseconds later). Then it reads the directory in this process: which
save the metadata says (the value ``gen``), a load of every tensor and value of that save
into poisoned destinations compared bit for bit, and ``verify_checkpoint`` (stray files
from the killed save are allowed until a save finishes: the last one of each run must leave
none). Every generation writes a
different set of tensors (their number and sizes vary), so an earlier, larger save leaves
files that a later one must not name.

Used by test_integ_save_crash.py (a few kills) and benchmarks/save/save_crash.py (200).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CTX: Any = None


def _context() -> Any:
    global _CTX  # one forkserver per process, started on first use
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "dcp_load", "dcp_reader"])
    return _CTX


def names(gen: int) -> list[str]:
    """The tensors save ``gen`` writes: 3 to 6 of them, so generations differ in files."""
    return [f"t{i}" for i in range(3 + gen % 4)]


def full(gen: int, name: str) -> Any:
    """Tensor ``name`` of save ``gen``: every element says which save and tensor it is from."""
    import torch

    rows = 64 + 32 * (int(name[1:]) % 3)
    base = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024)
    return base + gen * 1e6 + int(name[1:]) * 1e4


def state(gen: int, rank: int, world: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` saves in save ``gen``: even tensors split by rows
    (``Chunk``), odd ones replicated (written once), and values."""
    from dcp_load import Chunk

    sd: dict[str, Any] = {}
    for n in names(gen):
        t = full(gen, n)
        if int(n[1:]) % 2 == 0 and world > 1:
            rows = t.shape[0] // world
            sd[n] = Chunk(t[rank * rows:(rank + 1) * rows].clone(), tuple(t.shape), (rank * rows, 0))
        else:
            sd[n] = t
    sd["gen"] = gen
    sd["meta"] = {"names": names(gen), "lr": 0.5 ** gen}
    return sd


def _saver(rank: int, world: int, init_file: str, path: str, gen: int, events: Any, mode: str = "sync") -> None:
    import dcp_load
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    sd = state(gen, rank, world)
    events.put(("ready", rank, time.monotonic()))
    if mode == "async":  # the kill then mostly lands in the background write or its commit
        fut = dcp_load.async_save(sd, checkpoint_id=path, no_dist=world == 1, timeout=60)
        for v in sd.values():  # the training step after the call: the checkpoint keeps the values at it
            t = getattr(v, "tensor", v)  # a Chunk's tensor
            if hasattr(t, "neg_"):
                t.neg_()
        fut.result()
    else:
        dcp_load.save(sd, checkpoint_id=path, no_dist=world == 1, timeout=60)
    events.put(("done", rank, time.monotonic()))
    if world > 1:
        dist.destroy_process_group()


def check(path: str, old: int | None, new: int) -> tuple[str, str]:
    """("old" | "new" | "none", "") when the directory holds what a crash may leave, else
    ("LOST", why)."""
    import dcp_load
    import torch
    from dcp_reader import MissingMetadataError, open_checkpoint, verify_checkpoint

    try:
        with open_checkpoint(path) as r:
            gen = r.read_value("gen")
    except MissingMetadataError as e:
        return ("none", "") if old is None else ("LOST", f"no checkpoint after a save over {old}: {e}")
    except Exception as e:  # noqa: BLE001 - any other failure to open is a lost checkpoint
        return "LOST", f"cannot open: {type(e).__name__}: {e}"
    if gen not in (old, new):
        return "LOST", f"metadata of save {gen}, expected {old} or {new}"
    dest: dict[str, Any] = {n: torch.full_like(full(gen, n), float("nan")) for n in names(gen)}
    dest.update(gen=None, meta={"names": None, "lr": None})
    try:
        dcp_load.load(dest, checkpoint_id=path, no_dist=True)
    except Exception as e:  # noqa: BLE001 - a checkpoint that does not load is lost
        return "LOST", f"save {gen} does not load: {type(e).__name__}: {e}"
    wrong = [n for n in names(gen) if not torch.equal(dest[n], full(gen, n))]
    if wrong or dest["gen"] != gen or dest["meta"] != {"names": names(gen), "lr": 0.5 ** gen}:
        return "LOST", f"save {gen} loads other data: tensors {wrong}, gen {dest['gen']}, meta {dest['meta']}"
    problems = [p for p in verify_checkpoint(path).problems if not p.startswith("stray file")]
    if problems:
        return "LOST", f"verify: {problems[:3]}"
    return ("old" if gen == old else "new"), ""


def _run_save(path: str, gen: int, world: int, kill_after: float | None, rng: random.Random,
              tmp: str, mode: str = "sync") -> tuple[str, float]:
    """Run save ``gen``; kill it ``kill_after`` s after the last rank was ready (None: let
    it finish). Returns ("killed" when some rank had not returned from ``save`` when the
    kill began | "finished", seconds from ready to done or to the kill). Times come from
    the savers' own clocks (``time.monotonic`` is system-wide), not from the queue."""
    ctx = _context()
    events = ctx.Queue()
    init_file = os.path.join(tmp, f"store-{gen}")
    procs = [ctx.Process(target=_saver, args=(r, world, init_file, path, gen, events, mode), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, float] = {}
    try:
        ready: dict[int, float] = {}
        deadline = time.monotonic() + 60
        while len(ready) < world:
            kind, rank, t = events.get(timeout=max(0.1, deadline - time.monotonic()))
            (ready if kind == "ready" else done)[rank] = t
        t0 = max(ready.values())
        if kill_after is None:
            while len(done) < world:
                kind, rank, t = events.get(timeout=max(0.1, deadline - time.monotonic()))
                done[rank] = t
            return "finished", max(done.values()) - t0
        time.sleep(max(0.0, t0 + kill_after - time.monotonic()))
        kill_t = time.monotonic()
        order = list(procs)
        rng.shuffle(order)
        for i, p in enumerate(order):
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
            if i == 0 and rng.random() < 0.5:
                time.sleep(rng.uniform(0, 0.02))  # the others a moment later
        for p in procs:
            p.join(timeout=30)
        while True:
            try:
                kind, rank, t = events.get(timeout=0.05)
            except queue.Empty:
                break
            if kind == "done":
                done[rank] = t
        finished = len(done) == world and max(done.values()) < kill_t
        return ("finished" if finished else "killed"), kill_t - t0
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        events.close()


def _calibrate(path: str, world: int, rng: random.Random, tmp: str, mode: str) -> float:
    """The median time of 3 saves, after one to warm up (gens 0-3)."""
    times = sorted(_run_save(path, gen, world, None, rng, tmp, mode)[1] for gen in range(4))[:3]
    return times[1]


def run_trials(kills: int, *, worlds: tuple[int, ...] = (1, 2), seed: int = 20261201, fresh_every: int = 5,
               log: Callable[[str], None] | None = None, mode: str = "sync") -> dict[str, Any]:
    """Trials until ``kills`` saves were killed before they returned (split over
    ``worlds``; at most 3 x as many trials). The kill comes uniformly within 1.1 x the
    median save time, so some saves finish first. Every ``fresh_every``-th trial starts
    from an empty directory (a first save must leave no checkpoint or a whole one); the
    others overwrite a whole checkpoint. ``mode="async"``: the savers call ``async_save``,
    negate every tensor as soon as it returns, then wait for its result. Returns counts by
    outcome and the failures."""
    from dcp_reader import verify_checkpoint

    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dcp-save-crash-") as tmp:
        for world in worlds:
            path = os.path.join(tmp, f"ckpt-w{world}")
            took = _calibrate(path, world, rng, tmp, mode)
            gen = 3
            share = kills // len(worlds) + (world == worlds[0]) * (kills % len(worlds))
            current: int | None = gen  # what the directory holds
            killed = trial = 0
            while killed < share and trial < 3 * share:
                if trial % fresh_every == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    current = None
                elif current is None:  # the last kill left nothing: overwrite a whole checkpoint again
                    gen += 1
                    _run_save(path, gen, world, None, rng, tmp, mode)
                    current = gen
                gen += 1
                trial += 1
                after = rng.uniform(0, 1.1 * took)
                how, _ = _run_save(path, gen, world, after, rng, tmp, mode)
                killed += how == "killed"
                outcome, why = check(path, current, gen)
                counts[f"w{world}:{'first' if current is None else 'over'}:{how}:{outcome}"] += 1
                counts[how] += 1
                if outcome == "LOST":
                    failures.append(f"world {world}, save {gen} over {current}, killed {after * 1000:.0f} ms "
                                    f"in: {why}")
                    shutil.rmtree(path, ignore_errors=True)
                current = {"new": gen, "old": current}.get(outcome)
                if log:
                    log(f"world {world} trial {trial}: {how} {after * 1000:.0f} ms after start (a save takes "
                        f"~{took * 1000:.0f} ms): {outcome} {why}")
            # a save that finishes removes whatever the killed ones left (temporary files of
            # killed writes, data files of saves never committed, earlier larger saves' files)
            gen += 1
            _run_save(path, gen, world, None, rng, tmp, mode)
            outcome, why = check(path, current, gen)
            left = verify_checkpoint(path).problems
            counts[f"w{world}:final:{outcome}"] += 1
            if outcome != "new" or left:
                failures.append(f"world {world}, the last save {gen}: {outcome} {why}; left: {left[:3]}")
    return {"counts": dict(counts), "failures": failures}
