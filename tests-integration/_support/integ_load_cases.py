"""Checkpoint builders and the functions that run inside ranks for the dcp-load
integration tests (not a test module).

It lives in ``tests-integration/_support/`` (helpers shared by several areas): the tests
put that folder on ``sys.path`` so that ``run_ranks`` children can import these
functions by name (pytest's importlib mode gives test modules names children cannot
import). Each ``*_cases`` function runs many scenarios in one launch (a launch costs
seconds) and returns, per scenario, this rank's reports and every problem it found.
Targets are poisoned before every load (NaN for floats, -123 for ints), and every value is
compared byte for byte with the global tensor the checkpoint was written from.
"""

from __future__ import annotations

import math
import os
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

HOST_ID_ENV = "DCP_HOST_ID"  # dcp_load's host override for the "auto" broadcast mode

POISON_INT = -123

# name -> (shape, dtype): a mix of sizes and dtypes, uneven shapes and a 0-dim scalar.
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embed.weight": (32, 16), "layers.0.attn.wq": (16, 16), "layers.0.mlp.w1": (24, 16),
    "layers.0.norm": (16,), "layers.1.attn.wq": (16, 16), "layers.1.mlp.w1": (24, 16),
    "odd.w": (7, 5), "ints": (6, 4), "half": (8, 8), "f8": (8, 4), "scalar": (),
}
# Only in its own checkpoint (32 MiB): big enough for the planner to split it into slabs.
BIG = {"big.lm_head": ((8192, 1024), torch.float32)}
DTYPES = {"half": torch.bfloat16, "ints": torch.int64, "f8": torch.float8_e4m3fn,
          "layers.0.attn.wq": torch.float16}
SPECS = {k: (v, DTYPES.get(k, torch.float32)) for k, v in SPECS.items()}  # type: ignore[misc]
NAMES = list(SPECS)
SPECS.update(BIG)  # type: ignore[arg-type]


def full(name: str) -> torch.Tensor:
    """The global tensor ``name`` every checkpoint here is written from (deterministic)."""
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g, dtype=dtype)


def poison_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.full(t.shape, float("nan"), dtype=t.dtype)
    return torch.full(t.shape, POISON_INT, dtype=t.dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN poison never equals data)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# -- checkpoint builders (run in the test process) --------------------------------------------
def _splits(n: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of torch.tensor_split's ``parts`` pieces of ``n`` (uneven allowed)."""
    base, extra = divmod(n, parts)
    out, o = [], 0
    for i in range(parts):
        s = base + (1 if i < extra else 0)
        out.append((o, s))
        o += s
    return [p for p in out if p[1] > 0] or [(0, 0)]


def write_native(path: str, names: Sequence[str], grid: Callable[[str], Sequence[int]], files: int = 3) -> None:
    """A native checkpoint of ``names`` where tensor ``n`` is saved as a grid of chunks
    (``grid(n)[d]`` pieces along dim ``d``), spread over ``files`` data files."""
    import itertools

    from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, chunk_key

    writer = NativeWriter(path)
    per_file: dict[str, dict[str, torch.Tensor]] = {}
    metas = {}
    count = 0
    for name in names:
        t = full(name)
        dims = [_splits(n, p) for n, p in zip(t.shape, grid(name), strict=True)]
        chunks = []
        for box in itertools.product(*dims):
            offsets = tuple(o for o, _ in box)
            sizes = tuple(s for _, s in box)
            piece = t[tuple(slice(o, o + s) for o, s in box)]
            file = f"data-{count % files}.safetensors"
            count += 1
            key = chunk_key(name, offsets)
            per_file.setdefault(file, {})[key] = piece.contiguous()
            chunks.append(ChunkMeta(offsets, sizes, file, key))
        metas[name] = TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(chunks))
    for file, tensors in per_file.items():
        writer.write_file(file, tensors)
    writer.commit(CheckpointMetadata(tensors=metas, values={}, format="native"))


def write_hf(path: str, names: Sequence[str]) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({n: full(n) for n in names}, os.path.join(path, "model.safetensors"))


# -- helpers inside ranks ------------------------------------------------------------------
def dtensor(name: str, mesh: Any, placements: Sequence[Any]) -> Any:
    """A poisoned DTensor of ``name`` on ``mesh`` (local shards cut without communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(poison_like(full(name)), mesh, list(placements), src_data_rank=None)


def local_expected(name: str, value: Any, full: Callable[[str], torch.Tensor] = full) -> torch.Tensor:
    """The part of the global tensor ``full(name)`` that ``value`` holds on this rank."""
    from dcp_load import Chunk
    from torch.distributed.tensor import DTensor, distribute_tensor

    t = full(name)
    if isinstance(value, Chunk):
        return t[tuple(slice(o, o + s) for o, s in zip(value.offsets, value.sizes, strict=True))]
    if isinstance(value, DTensor):  # torch's own cut (rows of a _StridedShard need not be contiguous)
        return distribute_tensor(t, value.device_mesh, list(value.placements), src_data_rank=None).to_local()
    return t


def local_of(value: Any) -> torch.Tensor:
    from dcp_load import Chunk
    from torch.distributed.tensor import DTensor

    if isinstance(value, Chunk):
        return value.tensor
    if isinstance(value, DTensor):
        return value.to_local()
    return value


def chunk(name: str, dim: int, parts: int, index: int) -> Any:
    """A poisoned hand-sharded piece ``index`` of ``parts`` along ``dim`` (a ``Chunk``)."""
    from dcp_load import Chunk

    t = full(name)
    o, s = _splits(t.shape[dim], parts)[index]
    offsets = [0] * t.dim()
    offsets[dim] = o
    return Chunk(poison_like(t.narrow(dim, o, s)), tuple(t.shape), tuple(offsets))


def check(state: dict[str, Any], errors: list[str], where: str) -> None:
    for name, value in state.items():
        if not same(local_of(value), local_expected(name, value)):
            errors.append(f"{where}: {name!r} holds wrong values")


def run_case(results: dict[str, Any], case: str, fn: Callable[[list[str]], Any]) -> None:
    """Run one scenario; record its result and every problem, never raise (keeps ranks in step)."""
    errors: list[str] = []
    try:
        out = fn(errors)
    except Exception:  # noqa: BLE001 - recorded for the test to report with the case name
        errors.append(traceback.format_exc())
        out = None
    results[case] = {"errors": errors, "out": out}


class FailingReader:
    """A CheckpointReader whose first read of more than one element fails (validation's
    checks pass), as a disk error after validation would."""

    def __init__(self, inner: Any, fail: bool):
        self.inner, self.fail, self.reads = inner, fail, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _maybe_fail(self, name: str, sizes: Any) -> None:
        if self.fail and math.prod(sizes) > 1:
            self.reads += 1
            if self.reads == 1:
                raise OSError(f"injected read failure on {name!r}")

    def read(self, name: str, chunk: Any, offsets: Any, sizes: Any, **kw: Any) -> Any:
        self._maybe_fail(name, sizes)
        return self.inner.read(name, chunk, offsets, sizes, **kw)

    def read_into(self, name: str, chunk: Any, offsets: Any, sizes: Any, out: Any, **kw: Any) -> None:
        self._maybe_fail(name, sizes)
        self.inner.read_into(name, chunk, offsets, sizes, out, **kw)


def report(r: Any) -> dict[str, Any]:
    d = asdict(r)
    d["seconds"] = dict(r.seconds)
    return d


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_groups() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


# -- the 4-rank launch ---------------------------------------------------------------------
MESH_NAMES = ["embed.weight", "layers.0.attn.wq", "layers.0.mlp.w1", "layers.0.norm", "odd.w", "ints",
              "half", "f8", "scalar"]


def _mesh_state(mesh: Any, placements: Sequence[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate

    out: dict[str, Any] = {}
    for name in MESH_NAMES:
        nd = len(SPECS[name][0])
        pl = [p if getattr(p, "dim", 0) < nd else Replicate() for p in placements]
        out[name] = dtensor(name, mesh, pl) if nd else poison_like(full(name))
    return out


def mesh4_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    import dcp_load
    import torch.distributed as dist
    from dcp_broadcast import GroupManager
    from dcp_platform import get_platform
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    R, S = Replicate(), Shard
    results: dict[str, Any] = {}
    # Each rank a node of its own, as on a multi-node job: the default "auto" mode then
    # broadcasts every replicated box (the auto cases at the end change this).
    os.environ[HOST_ID_ENV] = f"node{rank}"

    def load_and_check(state: dict[str, Any], errors: list[str], where: str, **kw: Any) -> dict[str, Any]:
        r = dcp_load.load(state, **kw)
        check(state, errors, where)
        return report(r)

    for label, placements in (("RR", [R, R]), ("RS1", [R, S(1)]), ("S0S1", [S(0), S(1)])):
        for src in ("hf", "native_grid"):
            results_key = f"mesh_{label}_{src}"
            run_case(results, results_key, lambda e, p=placements, s=src, k=results_key: load_and_check(
                _mesh_state(mesh, p), e, k, checkpoint_id=ckpts[s]))
    for batch in (0, 4096, 6 * 1024 * 1024):
        run_case(results, f"batch_{batch}", lambda e, b=batch: load_and_check(
            _mesh_state(mesh, [R, S(0)]), e, f"batch {b}", checkpoint_id=ckpts["hf"], broadcast_batch_bytes=b))
    def big_split(errors: list[str]) -> Any:
        state = {"big.lm_head": dtensor("big.lm_head", mesh, [R, R])}
        r = dcp_load.load(state, checkpoint_id=ckpts["big"])
        check(state, errors, "big")
        return report(r)

    run_case(results, "big_split", big_split)
    run_case(results, "every_rank_reads", lambda e: load_and_check(
        _mesh_state(mesh, [R, S(1)]), e, "no broadcast", checkpoint_id=ckpts["hf"],
        broadcast_replicated_tensors=False))
    run_case(results, "no_collectives", lambda e: load_and_check(
        _mesh_state(mesh, [R, S(1)]), e, "use_collectives=False", checkpoint_id=ckpts["hf"],
        use_collectives=False))

    # resharding
    def tp4_to_tp2(errors: list[str]) -> Any:
        # ranks 0 and 1 form a TP2 group of hand-sharded tensors; ranks 2 and 3 hold other keys
        if rank < 2:
            state = {n: chunk(n, 1, 2, rank) for n in ("layers.0.attn.wq", "embed.weight")}
        else:
            state = {"odd.w": chunk("odd.w", 0, 2, rank - 2)}
        return load_and_check(state, errors, "tp4->tp2", checkpoint_id=ckpts["tp4"])

    run_case(results, "tp4_to_tp2", tp4_to_tp2)
    run_case(results, "tp4_to_dp2tp2", lambda e: load_and_check(
        _mesh_state(mesh, [R, S(1)]), e, "tp4->dp2xtp2", checkpoint_id=ckpts["tp4"]))
    run_case(results, "tp4_to_dp2tp2_rows", lambda e: load_and_check(
        _mesh_state(mesh, [R, S(0)]), e, "tp4->dp2xtp2 rows", checkpoint_id=ckpts["tp4"]))
    run_case(results, "uneven_to_S0S1", lambda e: load_and_check(
        _mesh_state(mesh, [S(0), S(1)]), e, "uneven", checkpoint_id=ckpts["uneven"]))

    # saving with dcp_load.save from DP2 x TP2 and FSDP + TP, then loading as TP2
    def save_then_tp2(errors: list[str], placements: list[Any], key: str) -> Any:
        src = {n: dtensor(n, mesh, placements) for n in ("layers.0.mlp.w1", "odd.w", "embed.weight")}
        for n, v in src.items():  # fill the shards with the true values, then save them
            local_of(v).copy_(local_expected(n, v))
        path = os.path.join(ckpts["scratch"], key)
        saved = dcp_load.save(src, checkpoint_id=path)
        state = {n: chunk(n, 1, 2, rank % 2) for n in src}
        out = load_and_check(state, errors, key, checkpoint_id=path)
        out["saved"] = asdict(saved)
        return out

    run_case(results, "dp2tp2_to_tp2", lambda e: save_then_tp2(e, [R, S(1)], "dp2tp2"))
    run_case(results, "fsdp_tp_to_tp2", lambda e: save_then_tp2(e, [S(0), S(1)], "fsdptp"))

    # groups: supplied as a manager (reused across loads) and as a mapping
    def supplied_groups(errors: list[str]) -> Any:
        platform = get_platform("torch")
        before = live_groups()
        with GroupManager(platform) as manager:
            outs = [load_and_check(_mesh_state(mesh, [R, S(1)]), errors, f"manager {i}",
                                   checkpoint_id=ckpts["hf"], broadcast_groups=manager, platform=platform)
                    for i in range(2)]
            during = live_groups()
        # each rank passes the dp group it is in; other rank sets are built as needed
        mine = tuple(sorted(dist.get_process_group_ranks(mesh.get_group("dp"))))
        groups = {mine: mesh.get_group("dp")}
        outs.append(load_and_check(_mesh_state(mesh, [R, S(1)]), errors, "mapping",
                                   checkpoint_id=ckpts["hf"], broadcast_groups=groups))
        return {"reports": outs, "groups_before": before, "groups_during": during, "groups_after": live_groups()}

    run_case(results, "supplied_groups", supplied_groups)

    # non-tensor state, scalars and an optimizer state dict
    def values_and_optimizer(errors: list[str]) -> Any:
        state = {"model": {"w": dtensor("half", mesh, [R, S(0)]), "scalar": poison_like(full("scalar"))},
                 "optim": {"state": {0: {"step": torch.tensor(-1.0), "exp_avg": torch.full((4, 3), float("nan"))}},
                           "param_groups": [{"lr": None, "params": None, "name": None}]},
                 "epoch": None, "extra": [None, {"x": None}]}
        r = dcp_load.load(state, checkpoint_id=ckpts["values"])
        if not same(state["model"]["w"].to_local(), local_expected("half", state["model"]["w"])):
            errors.append("model.w wrong")
        if not same(state["model"]["scalar"], full("scalar")):
            errors.append("model.scalar wrong")
        if state["optim"]["state"][0]["step"].item() != 5.0:
            errors.append(f"step is {state['optim']['state'][0]['step']}")
        if not torch.equal(state["optim"]["state"][0]["exp_avg"], torch.arange(12.0).reshape(4, 3)):
            errors.append("exp_avg wrong")
        expected = {"lr": 0.01, "params": [0, 1], "name": "decay"}
        if state["optim"]["param_groups"][0] != expected:
            errors.append(f"param_groups: {state['optim']['param_groups']}")
        if state["epoch"] != 3 or state["extra"] != [[1, 2], {"x": "y"}]:
            errors.append(f"values: epoch={state['epoch']} extra={state['extra']}")
        return report(r)

    run_case(results, "values_and_optimizer", values_and_optimizer)

    # repeated loads leak no threads, groups or file handles
    def repeated(errors: list[str]) -> Any:
        dcp_load.load(_mesh_state(mesh, [R, S(1)]), checkpoint_id=ckpts["native_grid"])  # warm caches
        before = (threading.active_count(), live_groups(), open_fds())
        for i in range(4):
            load_and_check(_mesh_state(mesh, [S(0), S(1)] if i % 2 else [R, S(1)]), errors, f"repeat {i}",
                           checkpoint_id=ckpts["native_grid"])
        after = (threading.active_count(), live_groups(), open_fds())
        return {"before": before, "after": after}

    run_case(results, "repeated", repeated)

    # bad checkpoints: every rank raises LoadError and no target changes
    def bad(errors: list[str], key: str, state_fn: Callable[[], dict[str, Any]]) -> Any:
        state = state_fn()
        snapshot = {n: local_of(v).clone() for n, v in state.items()}
        try:
            dcp_load.load(state, checkpoint_id=ckpts[key])
        except dcp_load.LoadError as exc:
            for n, v in state.items():
                if not same(local_of(v), snapshot[n]):
                    errors.append(f"{key}: {n!r} was changed by a failed load")
            return {"message": str(exc), "failures": {int(k): list(v) for k, v in exc.failures.items()},
                    "phase": exc.phase}
        errors.append(f"{key}: no LoadError")
        return None

    for key in ("missing_key", "wrong_shape", "missing_file", "truncated"):
        run_case(results, f"bad_{key}", lambda e, k=key: bad(e, k, lambda: _mesh_state(mesh, [R, S(1)])))

    def missing_key_partial(errors: list[str]) -> Any:
        state = _mesh_state(mesh, [R, S(1)])
        state["not.saved"] = torch.zeros(2)
        r = dcp_load.load(state, checkpoint_id=ckpts["hf"], strict=False)
        del state["not.saved"]
        check(state, errors, "strict=False")
        return report(r)

    run_case(results, "strict_false", missing_key_partial)

    # a failure on one rank only: every rank raises, naming that rank
    def one_rank_bad(errors: list[str]) -> Any:
        state = _mesh_state(mesh, [R, S(1)])
        if rank == 2:
            state["only.on.rank2"] = torch.zeros(3)
        try:
            dcp_load.load(state, checkpoint_id=ckpts["hf"])
        except dcp_load.LoadError as exc:
            return {"message": str(exc), "failures": sorted(exc.failures)}
        errors.append("no LoadError")
        return None

    run_case(results, "one_rank_bad", one_rank_bad)

    def settings_differ(errors: list[str]) -> Any:
        try:
            dcp_load.load(_mesh_state(mesh, [R, S(1)]), checkpoint_id=ckpts["hf"],
                          broadcast_batch_bytes=4096 if rank == 3 else 8192)
        except dcp_load.LoadError as exc:
            return {"message": str(exc), "failures": sorted(exc.failures)}
        errors.append("no LoadError")
        return None

    run_case(results, "settings_differ", settings_differ)

    # a read that fails mid-run, after validation, on rank 1: no hang, every rank raises
    def midrun_failure(errors: list[str]) -> Any:
        from dcp_reader import open_checkpoint

        threads = threading.active_count()
        with open_checkpoint(ckpts["hf"]) as inner:
            reader = FailingReader(inner, fail=rank == 1)
            try:
                dcp_load.load(_mesh_state(mesh, [R, R]), storage_reader=reader)
            except dcp_load.LoadError as exc:
                return {"message": str(exc), "failures": sorted(exc.failures), "phase": exc.phase,
                        "threads_leaked": threading.active_count() - threads}
        errors.append("no LoadError")
        return None

    run_case(results, "midrun_failure", midrun_failure)

    # torch.distributed.checkpoint wrote it (default writer, HF writer): same as dcp.load
    def torch_compat(errors: list[str], kind: str) -> Any:
        import torch.distributed.checkpoint as dcp

        names = ["embed.weight", "layers.0.mlp.w1", "odd.w", "ints", "half", "scalar"]
        src = {n: (dtensor(n, mesh, [S(0), S(1)]) if SPECS[n][0] else full(n)) for n in names}
        for n, v in src.items():
            local_of(v).copy_(local_expected(n, v))
        path = os.path.join(ckpts["scratch"], f"torch-{kind}")
        writer = (dcp.HuggingFaceStorageWriter(path, save_distributed=True) if kind == "hf"
                  else dcp.FileSystemWriter(path))
        values = kind == "default"  # the HF writer stores tensors only
        if values:
            src["meta"] = {"step": 5, "tags": ["a", "b"], "lr": 0.25}
        dcp.save(src, storage_writer=writer)
        outs = {}
        for label, placements in (("RS1", [R, S(1)]), ("S1S0", [S(1), S(0)])):
            theirs = _state_for(names, mesh, placements)
            ours = _state_for(names, mesh, placements)
            if values:
                theirs["meta"] = {"step": None, "tags": None, "lr": None}
                ours["meta"] = {"step": None, "tags": None, "lr": None}
            reader = dcp.HuggingFaceStorageReader(path) if kind == "hf" else dcp.FileSystemReader(path)
            dcp.load(theirs, storage_reader=reader)
            r = dcp_load.load(ours, checkpoint_id=path)
            for n in names:
                if not same(local_of(ours[n]), local_of(theirs[n])):
                    errors.append(f"torch {kind} {label}: {n!r} differs from torch.distributed.checkpoint.load")
            if values and not (ours["meta"] == theirs["meta"] == src["meta"]):
                errors.append(f"torch {kind} {label}: values {ours['meta']} vs torch {theirs['meta']}")
            check({n: ours[n] for n in names}, errors, f"torch {kind} {label}")
            outs[label] = report(r)
        return outs

    run_case(results, "torch_dcp_default", lambda e: torch_compat(e, "default"))
    run_case(results, "torch_dcp_hf", lambda e: torch_compat(e, "hf"))

    # "auto": replicas on one host re-read from the shared page cache, across hosts they
    # receive a broadcast; an explicit True broadcasts whatever the hosts.
    for label, host in (("one_host", "host"), ("two_nodes", f"node{rank // 2}")):
        os.environ[HOST_ID_ENV] = host
        for mode in ("auto", True):
            run_case(results, f"auto_{label}_{mode}", lambda e, m=mode, k=label: load_and_check(
                _mesh_state(mesh, [R, R]), e, f"{k} {m}", checkpoint_id=ckpts["hf"],
                broadcast_replicated_tensors=m))
    return results


def _state_for(names: Sequence[str], mesh: Any, placements: Sequence[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate

    out = {}
    for n in names:
        nd = len(SPECS[n][0])
        pl = [p if getattr(p, "dim", 0) < nd else Replicate() for p in placements]
        out[n] = dtensor(n, mesh, pl) if nd else poison_like(full(n))
    return out


# -- the 8-rank launch: pp2 x dp2 x tp2 ----------------------------------------------------
STAGES = {0: ["embed.weight", "layers.0.attn.wq", "layers.0.mlp.w1", "layers.0.norm"],
          1: ["layers.1.attn.wq", "layers.1.mlp.w1", "embed.weight"]}  # embed is tied: on both stages


def pp8_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    os.environ[HOST_ID_ENV] = f"node{rank}"  # one node per rank: "auto" broadcasts
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh.get_local_rank("pp")
    sub = mesh["dp", "tp"]
    results: dict[str, Any] = {}

    def stage_state(placements: Sequence[Any]) -> dict[str, Any]:
        out = {}
        for n in STAGES[stage]:
            nd = len(SPECS[n][0])
            pl = [p if getattr(p, "dim", 0) < nd else Replicate() for p in placements]
            out[n] = dtensor(n, sub, pl)
        return out

    for label, placements in (("RS0", [Replicate(), Shard(0)]), ("S0S1", [Shard(0), Shard(1)]),
                              ("RR", [Replicate(), Replicate()])):
        for src in ("hf", "tp4"):
            def case(errors: list[str], p: Sequence[Any] = placements, s: str = src, k: str = label) -> Any:
                state = stage_state(p)
                r = dcp_load.load(state, checkpoint_id=ckpts[s])
                check(state, errors, f"pp8 {k} {s}")
                return report(r)

            run_case(results, f"pp_{label}_{src}", case)
    return results

