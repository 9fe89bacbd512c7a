"""In-rank functions of test_integ_sharded_tensor: torch ShardedTensors (what FSDP1's
``SHARDED_STATE_DICT`` holds, ChunkShardingSpec over dim 0 or dim 1, uneven, one or two
local shards per rank) saved by torch DCP and by dcp (native and torch DCP formats), loaded
by dcp and by torch DCP into NaN-poisoned ShardedTensors, DTensors and plain tensors.

Each function returns {case: "ok" or what differed}, so that the test names every case."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import dcp_load
import dcp_load.torch_compat as compat
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

SHAPE = (11, 7)  # uneven over 2 and 4 chunks along either dim (6 + 5 and 3+3+3+2 rows, 4 + 3 and 2+2+2+1 columns)
#: (sharded dim, local shards per rank): the layouts every case is saved and loaded in
LAYOUTS = {"dim0": (0, 1), "dim1": (1, 1), "dim0x2": (0, 2), "dim1x2": (1, 2)}
#: 7 columns in 6 chunks of 2: the last two are empty, placed past the end (torch's own save refuses that)
EMPTY = {"dim1x3": (1, 3)}

warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)


def _full() -> torch.Tensor:
    return torch.arange(float(SHAPE[0] * SHAPE[1])).reshape(SHAPE) * 1.5 + 1


def _spec(layout: str, world: int) -> ChunkShardingSpec:
    dim, per_rank = {**LAYOUTS, **EMPTY}[layout]
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{i % world}/cpu" for i in range(world * per_rank)])


def _box(shard: Any) -> tuple[slice, ...]:
    m = shard.metadata
    return tuple(slice(o, o + n) for o, n in zip(m.shard_offsets, m.shard_sizes, strict=True))


def sharded(layout: str, world: int, poisoned: bool = False) -> Any:
    """A ShardedTensor of ``_full()`` in ``layout`` (NaN everywhere when ``poisoned``)."""
    st = sharded_tensor.empty(_spec(layout, world), *SHAPE)
    for shard in st.local_shards():
        shard.tensor.copy_(torch.full_like(shard.tensor, float("nan")) if poisoned else _full()[_box(shard)])
    return st


def _dtensor(dim: int, world: int, poisoned: bool = False) -> DTensor:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.full(SHAPE, float("nan")) if poisoned else _full()
    return distribute_tensor(full, mesh, [Shard(dim)])


def check(value: Any) -> str:
    """"ok" when ``value`` (ShardedTensor, DTensor or plain) holds ``_full()`` where it holds anything."""
    if isinstance(value, DTensor):
        got, want = value.full_tensor(), _full()
    elif isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
        got, want = value, _full()
    else:
        shards = value.local_shards()
        got = torch.cat([s.tensor.reshape(-1) for s in shards]) if shards else torch.zeros(0)
        want = torch.cat([_full()[_box(s)].reshape(-1) for s in shards]) if shards else torch.zeros(0)
    return "ok" if torch.equal(got, want) else f"got {got.tolist()}, want {want.tolist()}"


def _load_into(out: dict[str, str], name: str, load: Callable[..., Any], path: str, make: Callable[[], Any],
               **kwargs: Any) -> None:
    state = {"st": make(), "step": -1}
    try:
        load(state, checkpoint_id=path, **kwargs)
        out[name] = check(state["st"]) if state["step"] == 3 else f"step {state['step']}"
    except Exception as exc:  # noqa: BLE001 - reported by case name
        out[name] = f"{type(exc).__name__}: {exc}"


def _targets(world: int) -> dict[str, Callable[[], Any]]:
    """Every poisoned destination a checkpoint is loaded into, by name."""
    out: dict[str, Callable[[], Any]] = {
        f"st-{layout}": (lambda layout=layout: sharded(layout, world, poisoned=True)) for layout in LAYOUTS}
    out["dtensor-0"] = lambda: _dtensor(0, world, poisoned=True)
    out["dtensor-1"] = lambda: _dtensor(1, world, poisoned=True)
    out["plain"] = lambda: torch.full(SHAPE, float("nan"))
    return out


def torch_saved(rank: int, world: int, root: str) -> dict[str, str]:
    """torch DCP saves a ShardedTensor of each layout; dcp (dcp_load.load and torch_compat)
    loads each into every destination."""
    out: dict[str, str] = {}
    for layout in LAYOUTS:
        path = os.path.join(root, f"torch-{layout}")
        tdcp.save({"st": sharded(layout, world), "step": 3}, checkpoint_id=path)
        for name, make in _targets(world).items():
            _load_into(out, f"torch-{layout} -> dcp {name}", dcp_load.load, path, make)
        _load_into(out, f"torch-{layout} -> compat st-dim1", compat.load, path,
                   lambda: sharded("dim1", world, poisoned=True))
    return out


def dcp_saved(rank: int, world: int, root: str) -> dict[str, str]:
    """dcp saves a ShardedTensor (native format, torch DCP's format, torch_compat); torch DCP
    loads the torch-format ones into ShardedTensors of every layout, dcp loads all of them."""
    out: dict[str, str] = {}
    saves = {"native": lambda s, p: dcp_load.save(s, checkpoint_id=p),
             "torch_dcp": lambda s, p: dcp_load.save(s, checkpoint_id=p, format="torch_dcp"),
             "compat": lambda s, p: compat.save(s, checkpoint_id=p)}
    for layout in ("dim0", "dim1x2"):
        for fmt, save in saves.items():
            path = os.path.join(root, f"{fmt}-{layout}")
            save({"st": sharded(layout, world), "step": 3}, path)
            for name, make in _targets(world).items():
                _load_into(out, f"{fmt}-{layout} -> dcp {name}", dcp_load.load, path, make)
                if fmt != "native" and name.startswith("st-"):
                    _load_into(out, f"{fmt}-{layout} -> torch {name}", tdcp.load, path, make)
    return out


def others_saved(rank: int, world: int, root: str) -> dict[str, str]:
    """A DTensor and a plain tensor saved by torch DCP and by dcp, loaded by dcp into
    ShardedTensors of every layout."""
    out: dict[str, str] = {}
    sources = {"dtensor-1": lambda: _dtensor(1, world), "plain": _full}
    for kind, make_source in sources.items():
        for saver, save in (("torch", tdcp.save), ("dcp", dcp_load.save)):
            path = os.path.join(root, f"{saver}-{kind}")
            save({"st": make_source(), "step": 3}, checkpoint_id=path)
            for layout in LAYOUTS:
                _load_into(out, f"{saver} {kind} -> dcp st-{layout}", dcp_load.load, path,
                           lambda layout=layout: sharded(layout, world, poisoned=True))
    return out


def saved_for_one(rank: int, world: int, root: str) -> None:
    """The 2-rank saves that ``load_alone`` reads on a world of one."""
    tdcp.save({"st": sharded("dim0", world), "step": 3}, checkpoint_id=os.path.join(root, "torch"))
    dcp_load.save({"st": sharded("dim1x2", world), "step": 3}, checkpoint_id=os.path.join(root, "native"))
    compat.save({"st": sharded("dim0x2", world), "step": 3}, checkpoint_id=os.path.join(root, "compat"))


def load_alone(rank: int, world: int, root: str) -> dict[str, str]:
    """On a world of one, with ``no_dist=True``: each 2-rank save loaded into ShardedTensors
    (one and two shards on this rank) and a plain tensor."""
    out: dict[str, str] = {}
    for saved in ("torch", "native", "compat"):
        path = os.path.join(root, saved)
        for name, make in _targets(world).items():
            if not name.startswith("dtensor"):
                _load_into(out, f"{saved} -> dcp {name}", dcp_load.load, path, make, no_dist=True)
        _load_into(out, f"{saved} -> compat st-dim1", compat.load, path,
                   lambda: sharded("dim1", world, poisoned=True), no_dist=True)
    return out


def empty_shards(rank: int, world: int, root: str) -> dict[str, str]:
    """dcp saves a ShardedTensor whose ranks each hold an empty shard past the tensor's end
    (native and torch DCP formats); dcp loads it into every destination, and a save of
    another layout into it."""
    out: dict[str, str] = {}
    for fmt in ("native", "torch_dcp"):
        path = os.path.join(root, f"empty-{fmt}")
        dcp_load.save({"st": sharded("dim1x3", world), "step": 3}, checkpoint_id=path, format=fmt)
        for name, make in _targets(world).items():
            _load_into(out, f"{fmt} dim1x3 -> dcp {name}", dcp_load.load, path, make)
    path = os.path.join(root, "torch-dim0")
    tdcp.save({"st": sharded("dim0", world), "step": 3}, checkpoint_id=path)
    _load_into(out, "torch-dim0 -> dcp st-dim1x3", dcp_load.load, path,
               lambda: sharded("dim1x3", world, poisoned=True))
    return out
