"""Functions that run inside ranks for the derived-planning integration tests (not a test
module; see integ_load_cases for why). Every control collective a rank makes during a load
is counted (bytes it sends: the tensor of an all-reduce, the pickled object of an
all-gather), targets are poisoned before every load and compared bit-exactly.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
from integ_load_cases import HOST_ID_ENV, check, dtensor, full, local_of, poison_like, report, run_case, same

# Many small tensors: the count must not change the control bytes of a derived load.
MANY = 96


class Counter:
    """Counts the bytes this rank sends through torch.distributed's object, gather and
    reduce collectives while installed (``with Counter() as c``), and the int64 lanes it
    sends through a store reduction (``dcp_platform.Watch.start_reduce``, ``"store_reduce"``,
    counted as 8 bytes each, as the all-reduce it replaces). A
    bounded object gather (``dcp_platform.Watch.gather``) runs as two tensor all-gathers:
    their bytes count."""

    def __enter__(self) -> Counter:
        import torch.distributed as dist

        self.sent, self.calls = 0, []
        self._saved = dist.all_gather_object, dist.all_reduce, dist.all_gather
        gather, reduce, tensor_gather = self._saved

        def all_gather_object(out: Any, obj: Any, group: Any = None) -> Any:
            self.sent += len(pickle.dumps(obj))
            self.calls.append("all_gather_object")
            return gather(out, obj, group=group)

        def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
            self.sent += tensor.numel() * tensor.element_size()
            self.calls.append("all_reduce")
            return reduce(tensor, op=op, group=group, async_op=async_op)

        def all_gather(outs: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
            self.sent += tensor.numel() * tensor.element_size()
            self.calls.append("all_gather")
            return tensor_gather(outs, tensor, group=group, async_op=async_op)

        dist.all_gather_object, dist.all_reduce, dist.all_gather = all_gather_object, all_reduce, all_gather
        from dcp_platform._torch import TorchPlatform

        self._store = TorchPlatform.store
        counter = self

        class CountingStore:  # the tied-weights check: one add and one delete per (name, layout) a rank leads
            def __init__(self, inner: Any):
                self.inner = inner

            def __getattr__(self, name: str) -> Any:  # the watch's traffic passes uncounted
                return getattr(self.inner, name)

            def set(self, key: str, value: Any) -> None:
                if re.search(r"/r/\d+/\d+$", key):  # a rank's lanes in a store reduction
                    counter.sent += 8 * len(bytes(value).split(b","))
                    counter.calls.append("store_reduce")
                return self.inner.set(key, value)

            def add(self, key: str, value: int) -> int:
                if key.startswith("dcp_load/"):
                    counter.store_sent += len(key) + 8
                return self.inner.add(key, value)

            def delete_key(self, key: str) -> bool:
                if key.startswith("dcp_load/"):
                    counter.store_sent += len(key)
                return self.inner.delete_key(key)

        self.store_sent = 0
        inner_store = self._store
        TorchPlatform.store = lambda platform: CountingStore(inner_store(platform))  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_gather_object, dist.all_reduce, dist.all_gather = self._saved
        from dcp_platform._torch import TorchPlatform

        TorchPlatform.store = self._store  # type: ignore[method-assign]


def _many(n: int) -> dict[str, Any]:
    return {f"many.{i}": poison_like(full_many(i)) for i in range(n)}


def full_many(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(4, 3, generator=g)


def derive_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    import dcp_load
    from dcp_load import Chunk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    R, S = Replicate(), Shard
    results: dict[str, Any] = {}
    os.environ.pop(HOST_ID_ENV, None)  # hosts derived from LOCAL_WORLD_SIZE=2: two "nodes"

    def layers(placements: list[Any]) -> dict[str, Any]:
        return {name: dtensor(name, mesh, placements) for name in ("layers.0.attn.wq", "layers.0.mlp.w1",
                                                                    "layers.1.mlp.w1", "embed.weight")}

    def counted(state: dict[str, Any], errors: list[str], where: str, **kw: Any) -> dict[str, Any]:
        with Counter() as c:
            r = dcp_load.load(state, **kw)
        for name, value in state.items():
            want = full_many(int(name.split(".")[1])) if name.startswith("many.") else None
            if want is not None and not same(local_of(value), want):
                errors.append(f"{where}: {name!r} holds wrong values")
        check({k: v for k, v in state.items() if not k.startswith("many.")}, errors, where)
        return {"sent": c.sent, "store_sent": c.store_sent, "calls": c.calls, "report": report(r)}

    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [_StridedShard(0, split_factor=2), S(0)]  # FSDP2 over TP rows, as torchtitan lays them out
    for label, placements in (("RS0", [R, S(0)]), ("RS1", [R, S(1)]), ("RR", [R, R]), ("SS0", strided)):
        for src in ("tp4", "uneven"):
            key = f"values_{label}_{src}"
            run_case(results, key, lambda e, p=placements, s=src, k=key: counted(
                {**layers(p), "layers.0.norm": poison_like(full("layers.0.norm"))}, e, k, checkpoint_id=ckpts[s]))
    for n in (8, MANY):
        run_case(results, f"count_{n}", lambda e, n=n: counted(
            {**layers([R, S(0)]), **_many(n)}, e, f"count {n}", checkpoint_id=ckpts["many"]))

    def gathered(errors: list[str]) -> Any:  # one Chunk annotation anywhere: every rank gathers
        state: dict[str, Any] = {**layers([R, S(0)]), **_many(MANY)}
        if rank == 1:
            t = full("odd.w")
            state["odd.w"] = Chunk(poison_like(t), tuple(t.shape), (0, 0))
        else:
            state["odd.w"] = poison_like(full("odd.w"))
        return counted(state, errors, "gathered", checkpoint_id=ckpts["many"])

    run_case(results, "gathered", gathered)
    run_case(results, "hosts_gathered", lambda e: _with_env(HOST_ID_ENV, f"node{rank}", lambda: counted(
        layers([R, S(1)]), e, "hosts gathered", checkpoint_id=ckpts["tp4"])))
    run_case(results, "spec_differs", lambda e: _raises(
        {**layers([R, S(0)] if rank != 3 else [R, R]), "layers.0.norm": poison_like(full("layers.0.norm"))},
        e, checkpoint_id=ckpts["tp4"]))
    extra = {"odd.w": poison_like(full("odd.w"))} if rank == 2 else {}
    run_case(results, "extra_plain", lambda e: counted({**layers([R, S(1)]), **extra}, e, "extra plain",
                                                       checkpoint_id=ckpts["tp4"]))
    return results


def _with_env(name: str, value: str, fn: Callable[[], Any]) -> Any:
    os.environ[name] = value
    try:
        return fn()
    finally:
        os.environ.pop(name, None)


def _raises(state: dict[str, Any], errors: list[str], **kw: Any) -> Any:
    import dcp_load

    try:
        dcp_load.load(state, **kw)
    except dcp_load.LoadError as exc:
        poisoned = all(torch.isnan(local_of(v)).all() for v in state.values())
        return {"message": str(exc), "failures": sorted(exc.failures), "phase": exc.phase, "poisoned": poisoned}
    errors.append("no LoadError")
    return None
