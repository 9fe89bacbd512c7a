"""Scenario 5: planning at scale without processes, with dcp_load's own planner.

A 70B-like model (80 layers, hidden 8192, 64 query / 8 KV heads of 128, intermediate
28672, vocab 128256, bf16, saved as HF safetensors: one chunk per tensor, ~5 GB files) is
held by TP8 x PP8 x DP16 (1024 ranks) and TP8 x PP8 x DP64 (4096 ranks): TP innermost, 10
layers per pipeline stage, embeddings on the first stage, final norm and lm_head on the
last; column-parallel weights shard dim 0, row-parallel ones dim 1, norms are replicated.

Every rank sends the others its compact plan (the ``wants`` list that ``dcp_load.load``
all-gathers: one (name, offsets, sizes, flags) tuple per tensor) and then computes the
same global plan from all of them. Reported: the pickled size of one rank's message (as
``all_gather_object`` pickles it), the bytes each rank receives (all messages), and the
time one process takes to build the global plan and extract its own reads
(``build_global_plan`` + ``reads_for``), plus turning the broadcast list into
``dcp_broadcast.BroadcastItem``s as ``load`` does.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.stats import fmt_bytes, median, table  # noqa: E402


@dataclasses.dataclass(frozen=True)
class BigModel:
    layers: int = 80
    hidden: int = 8192
    kv_dim: int = 1024
    intermediate: int = 28672
    vocab: int = 128256
    itemsize: int = 2
    file_bytes: int = 5 * 10**9

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None, int | None]]:
        """(name, shape, tp_dim, layer or None) in checkpoint order."""
        h, kv, i, v = self.hidden, self.kv_dim, self.intermediate, self.vocab
        out: list[tuple[str, tuple[int, ...], int | None, int | None]] = [
            ("model.embed_tokens.weight", (v, h), 0, None)]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,), None, n),
                    (p + "self_attn.q_proj.weight", (h, h), 0, n),
                    (p + "self_attn.k_proj.weight", (kv, h), 0, n),
                    (p + "self_attn.v_proj.weight", (kv, h), 0, n),
                    (p + "self_attn.o_proj.weight", (h, h), 1, n),
                    (p + "post_attention_layernorm.weight", (h,), None, n),
                    (p + "mlp.gate_proj.weight", (i, h), 0, n),
                    (p + "mlp.up_proj.weight", (i, h), 0, n),
                    (p + "mlp.down_proj.weight", (h, i), 1, n)]
        out += [("model.norm.weight", (h,), None, None), ("lm_head.weight", (v, h), 0, None)]
        return out


def metadata(model: BigModel) -> dict[str, Any]:
    """Checkpoint metadata as dcp_reader builds it for an HF checkpoint."""
    from dcp_reader import ChunkMeta, TensorMeta

    out: dict[str, Any] = {}
    file_no, size = 1, 0
    for name, shape, _, _ in model.tensors():
        nb = math.prod(shape) * model.itemsize
        if size and size + nb > model.file_bytes:
            file_no, size = file_no + 1, 0
        size += nb
        chunk = ChunkMeta(offsets=(0,) * len(shape), sizes=shape, file=f"model-{file_no:05d}.safetensors",
                          key=name)
        out[name] = TensorMeta(name=name, shape=shape, dtype="bfloat16", chunks=(chunk,))
    return out


def wants_for(model: BigModel, tp: int, pp: int, dp: int) -> list[list[Any]]:
    """Every rank's wants (rank = (dp_i * pp + pp_i) * tp + tp_i)."""
    from dcp_load.plan._plan import BROADCASTABLE, VIEWS

    flags = BROADCASTABLE | VIEWS
    per_stage = model.layers // pp
    tensors = model.tensors()
    stage_tensors: list[list[tuple[str, tuple[int, ...], int | None]]] = [[] for _ in range(pp)]
    for name, shape, tp_dim, layer in tensors:
        if layer is not None:
            stage = layer // per_stage
        else:
            stage = 0 if "embed" in name else pp - 1
        stage_tensors[stage].append((name, shape, tp_dim))
    by_stage_tp: dict[tuple[int, int], list[Any]] = {}
    for s in range(pp):
        for t in range(tp):
            ws = []
            for name, shape, tp_dim in stage_tensors[s]:
                offsets = [0] * len(shape)
                sizes = list(shape)
                if tp_dim is not None:
                    sizes[tp_dim] = shape[tp_dim] // tp
                    offsets[tp_dim] = t * sizes[tp_dim]
                ws.append((name, tuple(offsets), tuple(sizes), flags))
            by_stage_tp[(s, t)] = ws
    out = []
    for _d in range(dp):
        for s in range(pp):
            for t in range(tp):
                out.append(list(by_stage_tp[(s, t)]))  # each rank's own list, as after a gather
    return out


def _one(model: BigModel, tp: int, pp: int, dp: int, repeats: int) -> dict[str, Any]:
    from dcp_broadcast import BroadcastItem
    from dcp_load.plan._plan import build_global_plan

    world = tp * pp * dp
    meta = metadata(model)
    # What each rank actually receives: its own copy of every other rank's unpickled list.
    wants = [pickle.loads(pickle.dumps(w)) for w in wants_for(model, tp, pp, dp)]
    msg = [len(pickle.dumps(([], w), protocol=pickle.HIGHEST_PROTOCOL)) for w in wants]
    times, walk, reads = [], [], 0
    plan = None
    for _ in range(repeats):
        plan = None
        gc.collect()
        t0 = time.perf_counter()
        plan = build_global_plan(meta, wants, broadcast=True)
        mine = plan.reads_for(world - 1)  # the last rank: last stage, holds lm_head
        t1 = time.perf_counter()
        me = world - 1
        items = [BroadcastItem(src=i.reader, ranks=i.ranks, nbytes=i.nbytes, tensor=None)
                 for i in plan.broadcasts]
        t2 = time.perf_counter()
        times.append(t1 - t0)
        walk.append(t2 - t1)
        reads = len(mine)
    assert plan is not None
    loads = plan.loads
    return {
        "world": world, "tp": tp, "pp": pp, "dp": dp, "tensors": len(meta),
        "wants_per_rank": len(wants[0]), "msg_bytes_min": min(msg), "msg_bytes_max": max(msg),
        "msg_bytes_median": median(msg), "gathered_bytes": sum(msg),
        "plan_s": times, "plan_s_median": median(times), "walk_s_median": median(walk),
        "broadcast_items": len(plan.broadcasts), "local_items": len(plan.local),
        "reads_last_rank": reads, "max_group": max((len(i.ranks) for i in plan.broadcasts), default=0),
        "unique_bytes": plan.unique_bytes, "load_min": min(loads), "load_max": max(loads),
        "readers": sum(1 for x in loads if x), "items_walked": len(items), "rank": me,
    }


def run(args: Any, log: Any) -> dict[str, Any]:
    model = BigModel()
    out = []
    repeats = 1 if args.quick else args.repeats
    for world in args.plan_ranks:
        tp, pp = 8, 8
        if world % (tp * pp):
            raise ValueError(f"--plan-ranks: {world} is not a multiple of TP8 x PP8 = 64")
        r = _one(model, tp, pp, world // (tp * pp), repeats)
        out.append(r)
        log(f"  plan {world} ranks (TP8 x PP8 x DP{r['dp']}): {r['plan_s_median']:.3f} s, message "
            f"{fmt_bytes(r['msg_bytes_median'])}/rank, gathered {fmt_bytes(r['gathered_bytes'])}/rank")
    return {"model": dataclasses.asdict(model), "runs": out}


def tables(res: dict[str, Any]) -> list[str]:
    rows = []
    for r in res["runs"]:
        rows.append([r["world"], f"TP{r['tp']} x PP{r['pp']} x DP{r['dp']}", r["wants_per_rank"],
                     fmt_bytes(r["msg_bytes_median"]), fmt_bytes(r["gathered_bytes"]),
                     f"{r['plan_s_median']:.3f}", f"{r['walk_s_median']:.3f}", r["broadcast_items"],
                     r["max_group"], f"{r['readers']} / {r['world']}",
                     f"{fmt_bytes(r['load_min'])} - {fmt_bytes(r['load_max'])}"])
    m = res["model"]
    return [f"### 5. Planning at scale, no processes\n\n70B-like model: {m['layers']} layers, hidden "
            f"{m['hidden']}, KV dim {m['kv_dim']} (GQA), intermediate {m['intermediate']}, vocab "
            f"{m['vocab']}, bf16 ({fmt_bytes(res['runs'][0]['unique_bytes'])}). message = one rank's "
            "pickled wants as all_gather_object sends them; gathered = what every rank receives; "
            "plan s = build_global_plan + reads_for in one process (median); walk s = building "
            "the BroadcastItem list every rank passes to dcp_broadcast.\n\n" + table(
                ["ranks", "layout", "wants/rank", "message/rank", "gathered/rank", "plan s", "walk s",
                 "broadcast items", "largest group", "ranks that read", "bytes read per reader"], rows)]
