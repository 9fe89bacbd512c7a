"""A load's plan for any world size, in one process: what ``dcp plan`` prints.

A synthetic model (``MODELS``: Llama-like shapes, bf16, saved as Hugging Face safetensors
with one chunk per tensor in files of about 5 GB) or a checkpoint's metadata, held on a
``tp x pp x dp`` layout: TP innermost (rank = (dp_i * pp + pp_i) * tp + tp_i), pipeline
stages of consecutive layers (embeddings on the first, final norm and lm_head on the
last), column-parallel weights ``Shard(0)`` over tp, row-parallel ones ``Shard(1)``,
norms replicated; ``Replicate`` over dp, or ``Shard(0)`` with ``fsdp``. Tensors of a
checkpoint are classified by name the same way (``o_proj``/``down_proj``/``wo``/``w2``:
row-parallel; 1-D: replicated; ``layers.N.``: layer N).

The load's ``broadcast_replicated_tensors`` mode is planned as ``load`` plans it
(``load_mode``): ``"auto"`` (the default) broadcasts a replicated box only when its ranks
span hosts, and on object storage (``s3://``: no page cache shared by a host's ranks)
broadcasts as ``True`` does; ``True`` reads each box once and broadcasts it; ``False``:
every rank reads what it holds.

Every rank's role is its (pp, tp) coordinate: ``simulate`` times the rank-local planning
(derivation, digest lanes, ``plan_for_rank``) of one rank per role, and builds the whole
job's reads stage by stage (owners are chosen per holder set, and a stage's holder sets
never leave the stage) to report bytes read and broadcasts per rank. Bytes read per rank
count page-cache re-reads by ranks of one host; amplification is the bytes fetched from
storage (once per broadcast, once per host for a box its ranks each read) over the unique
bytes wanted.
"""

from __future__ import annotations

import gc
import math
import pickle
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._derive import Derived, mesh_boxes
from ._items import BROADCASTABLE, VIEWS

__all__ = ["MODELS", "MODES", "Layout", "load_mode", "model_metadata", "parse_mesh", "simulate"]

#: ``dcp plan --broadcast`` value -> ``load``'s ``broadcast_replicated_tensors``
MODES: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}

FILE_BYTES = 5 * 10**9
#: ``load``'s default ``broadcast_batch_bytes`` (``dcp_load.DEFAULT_BATCH_BYTES``)
BATCH_BYTES = 6 * 1024 * 1024

#: name -> (layers, hidden, kv dim, intermediate, vocab): Llama 3.1 shapes
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "llama-8b": (32, 4096, 1024, 14336, 128256),
    "llama-70b": (80, 8192, 1024, 28672, 128256),
    "llama-405b": (126, 16384, 1024, 53248, 128256),
}

_ROW_PARALLEL = re.compile(r"(o_proj|down_proj|\.wo|\.w2|out_proj|dense_4h_to_h)")
_LAYER = re.compile(r"layers\.(\d+)\.")


def model_metadata(model: str) -> dict[str, Any]:
    """Checkpoint metadata of a synthetic model, as dcp_reader builds it for HF files."""
    from dcp_reader import ChunkMeta, TensorMeta

    if model not in MODELS:
        raise ValueError(f"--model {model!r} is not a built-in model; choose one of {', '.join(MODELS)} "
                         "or give --checkpoint DIR")
    layers, h, kv, inter, vocab = MODELS[model]
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                   (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                   (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    out: dict[str, Any] = {}
    file_no, size = 1, 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * 2
        if size and size + nbytes > FILE_BYTES:
            file_no, size = file_no + 1, 0
        size += nbytes
        chunk = ChunkMeta((0,) * len(shape), shape, f"model-{file_no:05d}.safetensors", name)
        out[name] = TensorMeta(name, shape, "bfloat16", (chunk,))
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=8,pp=8,dp=256"`` -> {"tp": 8, "pp": 8, "dp": 256} (missing dims are 1); a dim
    given twice is refused, naming it and both values."""
    out = {"tp": 1, "pp": 1, "dp": 1}
    given: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in out or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: each part must be tp=N, pp=N or dp=N with N >= 1, got {part!r}")
        given.setdefault(key, []).append(part)
        out[key] = int(value)
    twice = [" and ".join(parts) for parts in given.values() if len(parts) > 1]
    if twice:
        raise ValueError(f"--mesh {text!r}: each dimension may be given once, got {'; '.join(twice)}; "
                         "keep the one you mean")
    return out


def load_mode(setting: bool | str, *, object_store: bool) -> tuple[bool, bool]:
    """(broadcast, same_host_reads) of a collective ``load`` with
    ``broadcast_replicated_tensors=setting`` (``_load._load`` decides alike): ``"auto"``
    re-reads a host's replicas from its page cache, except on object storage, which has no
    page cache a host's ranks share and so broadcasts as ``True`` does."""
    if not (isinstance(setting, bool) or setting == "auto"):
        raise ValueError(f"broadcast_replicated_tensors must be True, False or 'auto', got {setting!r}")
    if setting == "auto" and object_store:
        setting = True
    return bool(setting), setting == "auto"


@dataclass(frozen=True)
class Layout:
    """The ``tp x pp x dp`` layout (see module docstring) and how ranks share hosts."""

    tp: int
    pp: int
    dp: int
    fsdp: bool = False
    ranks_per_host: int = 8
    #: how ``load`` would plan the reads (``load_mode``): the default is "auto" on files
    broadcast: bool = True
    same_host_reads: bool = True
    #: the checkpoint is in an object store: row slabs of column shards relayed (``_owners``)
    relay: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, dp_i: int, pp_i: int, tp_i: int) -> int:
        return (dp_i * self.pp + pp_i) * self.tp + tp_i

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The stage's mesh (dp, tp), row-major."""
        return tuple(self.rank(d, stage, t) for d in range(self.dp) for t in range(self.tp))

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host


def _stage_of(name: str, tensors: Mapping[str, Any], pp: int, layers: int) -> int:
    m = _LAYER.search(name)
    if m:
        return min(pp - 1, int(m.group(1)) * pp // max(1, layers))
    return 0 if "embed" in name else pp - 1


def _placements(name: str, ndim: int, layout: Layout) -> tuple[tuple[Any, ...], ...]:
    dp = ("S", 0) if layout.fsdp and ndim else ("R",)
    if ndim < 2:
        return dp, ("R",)
    return dp, ("S", 1 if _ROW_PARALLEL.search(name) else 0)


def stage_entries(tensors: Mapping[str, Any], layout: Layout) -> list[list[Derived]]:
    """Per pipeline stage: the derived entries every rank of the stage holds."""
    layers = 1 + max((int(m.group(1)) for n in tensors if (m := _LAYER.search(n))), default=0)
    flags = (BROADCASTABLE if layout.broadcast else 0) | VIEWS
    out: list[list[Derived]] = [[] for _ in range(layout.pp)]
    mesh_shape = (layout.dp, layout.tp)
    for stage in range(layout.pp):
        ranks = layout.stage_ranks(stage)
        holders = tuple(sorted(ranks))
        for name, meta in tensors.items():
            if _stage_of(name, tensors, layout.pp, layers) != stage:
                continue
            shape = tuple(meta.shape)
            key = _placements(name, len(shape), layout)
            boxes = mesh_boxes(shape, mesh_shape, ranks, key)
            out[stage].append(Derived(name, shape, meta.dtype, flags, ("mesh", mesh_shape, ranks, key), holders,
                                      boxes))
    return out


def gathered_wants(tensors: Mapping[str, Any], layout: Layout) -> tuple[list[list[tuple[Any, ...]]], list[Any]]:
    """Every rank's wants and host, as the gathered path would collect them (for comparing
    the derived plan with ``build_global_plan``)."""
    wants: list[list[tuple[Any, ...]]] = [[] for _ in range(layout.world)]
    for entries in stage_entries(tensors, layout):
        for e in entries:
            for o, s, holders in e.boxes:
                for r in holders:
                    wants[r].append((e.name, o, s, e.flags, e.dtype))
    return wants, [layout.host(r) for r in range(layout.world)]


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall, CPU seconds, result) of ``fn()``. Garbage is collected first, so that the
    simulation's own garbage is not charged (``_time_roles`` freezes the simulation's live
    objects, so this collection is cheap). CPU time is what a rank with a core to itself waits."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - cpu, out


def _derive_stage(tensors: Mapping[str, Any], entries: Sequence[Derived]) -> list[Derived]:
    """The part of a rank's planning every rank of a stage does alike: derive the stage's
    entries (cold cache) and hash the checkpoint metadata."""
    from ._derived import metadata_digest

    mesh_boxes.cache_clear()
    again = [Derived(e.name, e.shape, e.dtype, e.flags, e.layout, e.holders,
                     mesh_boxes(e.shape, e.layout[1], e.layout[2], e.layout[3])) for e in entries]
    metadata_digest(tensors)
    return again


def _plan_role(tensors: Mapping[str, Any], layout: Layout, rank: int, entries: Sequence[Derived],
               hosts: Any) -> None:
    """The part that depends on the rank: its digest lane and its own plan."""
    from ._digest import holder_lane
    from ._local import plan_for_rank

    holder_lane(entries, rank)
    plan_for_rank(tensors, entries, rank, layout.world, broadcast=layout.broadcast, hosts=hosts,
                  same_host_reads=layout.same_host_reads, relay=layout.relay)


def _time_roles(tensors: Mapping[str, Any], layout: Layout, per_stage: Sequence[Sequence[Derived]], repeats: int,
                progress: Callable[[str], None]) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds each (pp, tp) role spends planning (stage-major): the stage's
    shared part (``_derive_stage``: the same inputs for every role of the stage, so timed
    once per stage and pass) plus the role's own part (``_plan_role``), each the fastest of
    its passes. Every role is timed in the first pass; the roles at or above that pass's
    median, which decide the reported max and median, in ``repeats - 1`` more (the others
    keep their first time, so both numbers can only come out higher than with every role
    re-timed, never lower). Timing the shared part once per role took 30 % longer and
    re-timing every role 50 % longer (TP8 x PP8 x DP256)."""
    from ._items import HostBlocks

    hosts = HostBlocks(layout.world, layout.ranks_per_host)
    warm = _derive_stage(tensors, per_stage[0])  # warm-up: imports and first-call costs
    _plan_role(tensors, layout, 0, warm, hosts)
    n = len(per_stage) * layout.tp
    own = [[float("inf")] * 2 for _ in range(n)]
    shared = [[float("inf")] * 2 for _ in per_stage]
    roles = list(range(n))
    # The simulation's own objects (every stage's boxes for every rank) stay alive while
    # the roles are timed: frozen, they are left out of each collection before a timed part
    # and of the automatic ones inside it, as a real rank has no such heap. Collecting them
    # before every role took 90 ms each (TP8 x PP8 x DP256: 17 of 26 s).
    gc.collect()
    gc.freeze()
    try:
        for p in range(repeats):  # whole passes: a burst of other work spoils one pass
            derived: dict[int, list[Derived]] = {}
            for done, k in enumerate(roles):
                stage, tp_i = divmod(k, layout.tp)
                if stage not in derived:
                    wall, used, derived[stage] = _timed(lambda st=stage: _derive_stage(tensors, per_stage[st]))
                    shared[stage] = [min(shared[stage][0], wall), min(shared[stage][1], used)]
                progress(f"timing rank roles: pass {p + 1} of {repeats}, role {done + 1} of {len(roles)}")
                rank = layout.rank(0, stage, tp_i)
                wall, used, _ = _timed(lambda r=rank, d=derived[stage]: _plan_role(tensors, layout, r, d, hosts))
                own[k] = [min(own[k][0], wall), min(own[k][1], used)]
            if p == 0:
                first = [own[k][0] + shared[k // layout.tp][0] for k in range(n)]
                middle = sorted(first)[(n - 1) // 2]
                roles = [k for k in range(n) if first[k] >= middle]
    finally:
        gc.unfreeze()
    return ([own[k][0] + shared[k // layout.tp][0] for k in range(n)],
            [own[k][1] + shared[k // layout.tp][1] for k in range(n)])


class _Piece:
    """What ``dcp_broadcast``'s packing reads of a broadcast item (without the checks a
    ``BroadcastItem`` makes, which cost ~10 us per stage-wide rank set)."""

    __slots__ = ("src", "ranks", "nbytes")

    def __init__(self, src: int, ranks: tuple[int, ...], nbytes: int):
        self.src, self.ranks, self.nbytes = src, ranks, nbytes


def _per_rank(world: int, sets: Counter[int], objects: Mapping[int, tuple[int, ...]]) -> Any:
    """How many of the counted sets (by id, see ``_job``) each rank is in."""
    import numpy as np

    out = np.zeros(world, dtype=np.int64)
    for key, count in sets.items():
        out[np.asarray(objects[key])] += count
    return out


def _job(tensors: Mapping[str, Any], layout: Layout, per_stage: Sequence[Sequence[Derived]],
         batch_bytes: int) -> dict[str, Any]:
    """The whole job's reads, stage by stage (a stage's holder sets never leave it), and its
    broadcasts: plan items, and the collectives ``load`` runs for them (items below
    ``batch_bytes`` packed per rank set and source, by ``dcp_broadcast``'s own packing)."""
    import numpy as np
    from dcp_broadcast._plan import build_plan

    from ._items import SPLIT_BYTES, HostBlocks
    from ._local import held_by
    from ._owners import PlanBuilder

    world = layout.world
    hosts = HostBlocks(world, layout.ranks_per_host)
    loads = np.zeros(world, dtype=np.int64)
    items = np.zeros(world, dtype=np.int64)
    bcasts = np.zeros(world, dtype=np.int64)
    group_bytes = np.zeros(world, dtype=np.int64)
    unique = fetched = 0
    for entries in per_stage:
        # Hosts are passed in every mode: without broadcasts they only count a box once per
        # host that fetches it (its ranks share a page cache), as amplification does.
        builder = PlanBuilder(world, broadcast=layout.broadcast, hosts=hosts, same_host_reads=layout.same_host_reads,
                              split_bytes=SPLIT_BYTES, custom=False, relay=layout.relay)
        for e in entries:
            builder.add_tensor(e.name, tensors[e.name], held_by(e))
        plan = builder.finish(tensors)
        objects = {id(i.ranks): i.ranks for i in plan.broadcasts}
        loads += np.asarray(plan.loads, dtype=np.int64)
        unique += plan.unique_bytes
        fetched += plan.fetched_bytes  # a box once per host that reads it (a shared page cache)
        # Counted by object: the builder shares one tuple per rank set, and hashing a
        # stage-wide set of 2,048 ranks once per broadcast cost 0.1 s (TP8 x PP8 x DP256).
        items += _per_rank(world, Counter(id(i.ranks) for i in plan.broadcasts), objects)
        transfers = build_plan([_Piece(i.reader, i.ranks, i.nbytes) for i in plan.broadcasts], batch_bytes)
        bcasts += _per_rank(world, Counter(id(t.ranks) for t in transfers), objects)
        for ranks in objects.values():
            group_bytes[np.asarray(ranks)] += len(pickle.dumps(ranks))  # the group sets a rank reports once
    return {
        "group_set_bytes_per_rank_max": int(group_bytes.max()) if world else 0,
        "read_bytes_per_rank_max": int(loads.max()), "read_bytes_per_rank_mean": float(loads.mean()),
        "read_bytes_total": int(loads.sum()), "unique_bytes": unique,
        "broadcasts_per_rank_max": int(bcasts.max()), "broadcast_items_per_rank_max": int(items.max()),
        "broadcast_batch_bytes": batch_bytes,
        "storage_bytes": fetched,
        "amplification": fetched / unique if unique else 0.0,
        "read_bytes_per_rank": loads.tolist(), "broadcasts_per_rank": bcasts.tolist(),
    }


def simulate(tensors: Mapping[str, Any], layout: Layout, *, time_roles: bool = True,
             repeats: int = 1, progress: Callable[[str], None] | None = None,
             batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """The plan's numbers for every rank of ``layout`` (see module docstring). ``repeats``:
    time the roles in this many passes (every role in the first, the slower half in the
    others: ``_time_roles``) and keep each role's fastest (wall and CPU each), which on a
    shared machine estimates a rank with a core to itself. ``progress``: called
    with a short line saying what runs now (``dcp plan`` shows it on a terminal).
    ``batch_bytes``: ``load``'s ``broadcast_batch_bytes``, which decides how many
    collectives the broadcast items take (``broadcasts_per_rank``; the items themselves:
    ``broadcast_items_per_rank_max``)."""
    import numpy as np

    from ._digest import LANES_BYTES

    say = progress or (lambda text: None)
    per_stage = stage_entries(tensors, layout)
    say(f"building the job's plan: {layout.world} ranks")
    job = _job(tensors, layout, per_stage, batch_bytes)
    seconds: list[float] = []
    cpu: list[float] = []
    if time_roles:
        seconds, cpu = _time_roles(tensors, layout, per_stage, max(1, repeats), say)
    return {
        "world_size": layout.world, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "fsdp": layout.fsdp,
        "ranks_per_host": layout.ranks_per_host, "broadcast": layout.broadcast,
        "same_host_reads": layout.same_host_reads, "tensors": len(tensors), "roles_timed": len(seconds),
        "timing_repeats": max(1, repeats) if time_roles else 0,
        "planning_seconds_max": max(seconds, default=0.0),
        "planning_seconds_median": float(np.median(seconds)) if seconds else 0.0,
        "planning_cpu_seconds_max": max(cpu, default=0.0),
        "planning_cpu_seconds_median": float(np.median(cpu)) if cpu else 0.0,
        "exchanged_bytes_per_rank_max": LANES_BYTES,
        **job,
    }
