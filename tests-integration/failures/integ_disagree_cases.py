"""Functions that run inside ranks for test_integ_disagree.py (not a test module).

Two checkpoints, A and B, hold the same names, shapes and chunks with different values
(the same model at two steps); ``hf_a``/``hf_b`` are the same as single Hugging Face
safetensors files, which carry no checksums. Targets are poisoned (NaN) before each load
and compared with the checkpoint the rank asked for.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from integ_failure_cases import dp_tp_state, outcome

NAMES = [f"layer{i}.w" for i in range(8)]
SHORT_S = 5.0  # the timeout= of the cases where one rank waits for the other to arrive
SHAPE = (16, 8)


def values(which: str, name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) + (0 if which == "a" else 1000))
    return torch.randn(SHAPE, generator=g)


def write(root: str) -> dict[str, str]:
    """A and B (native, with checksums) and hf_a and hf_b (one safetensors file each)."""
    import dcp_load
    from safetensors.torch import save_file

    out = {}
    for which in ("a", "b"):
        out[which] = os.path.join(root, f"step-{which}")
        dcp_load.save({n: values(which, n) for n in NAMES}, checkpoint_id=out[which], no_dist=True)
        hf = os.path.join(root, f"hf-{which}")
        os.makedirs(hf)
        save_file({n: values(which, n) for n in NAMES}, os.path.join(hf, "model.safetensors"))
        out[f"hf_{which}"] = hf
    return out


def poisoned() -> dict[str, torch.Tensor]:
    return {n: torch.full(SHAPE, float("nan")) for n in NAMES}


def holds(state: dict[str, Any], which: str) -> bool:
    def local(v: Any) -> torch.Tensor:
        return v.tensor if hasattr(v, "tensor") else v

    return all(torch.equal(local(state[n]), values(which, n)) for n in NAMES)


def _load(state: dict[str, Any], path: str, **kw: Any) -> Any:
    import dcp_load

    kw.setdefault("broadcast_replicated_tensors", True)
    kw.setdefault("timeout", 30.0)
    return dcp_load.load(state, checkpoint_id=path, **kw)


def _case(path: str, which: str, **kw: Any) -> dict[str, Any]:
    state = poisoned()
    out = outcome(lambda: _load(state, path, **kw), lambda: holds(state, which))
    out["untouched"] = all(bool(torch.isnan(t).all()) for t in state.values())
    return out


def pairing_cases(rank: int, world: int, ck: dict[str, str]) -> dict[str, Any]:
    """Calls that some ranks make differently, each followed by calls that agree."""
    import dcp_load

    res: dict[str, Any] = {}
    # The reproduction: rank 1's first call is refused on its arguments.
    res["bad_argument"] = _case(ck["a"], "a", timeout=0 if rank == 1 else 30.0)
    res["then_a"] = _case(ck["a"], "a")
    res["then_b"] = _case(ck["b"], "b")
    # Calls without collectives on one rank (inspecting a checkpoint) take no part: the
    # collective calls after them pair as they are.
    if rank == 0:
        res["alone"] = _case(ck["b"], "b", no_dist=True)
        res["alone_read"] = dcp_load.read_state_dict(ck["a"])["layer0.w"].equal(values("a", "layer0.w"))
    res["after_alone_a"] = _case(ck["a"], "a")
    res["after_alone_b"] = _case(ck["b"], "b")
    # A call without collectives on one rank where the other calls with them: the other
    # waits out its timeout and names what this rank called; the next calls pair again.
    res["no_collectives"] = _case(ck["b"], "b", use_collectives=rank != 1, timeout=SHORT_S)
    if rank == 1:
        time.sleep(SHORT_S + 3)  # rank 0's wait expires first
    res["after_no_collectives"] = _case(ck["a"], "a")
    # A late rank fails alone, fast, naming the call the others moved on to, which its own
    # next call joins.
    if rank == 1:
        time.sleep(SHORT_S + 3)
    res["late"] = _case(ck["b"], "b", timeout=SHORT_S)
    res["after_late"] = _case(ck["a"], "a")
    # A save on rank 0 alone (writing a copy) does not shift the loads' pairing.
    if rank == 0:
        dcp_load.save({n: values("a", n) for n in NAMES}, checkpoint_id=ck["scratch"], no_dist=True)
    res["after_solo_save"] = _case(ck["b"], "b")
    # A no_dist load on every rank pairs with nothing and leaves no key in the store.
    import torch.distributed as dist
    from dcp_load.run import _coordinate
    from torch.distributed import distributed_c10d as c10d

    slot = _coordinate.peek_slot("load")  # the number the next call takes
    res["all_no_dist"] = _case(ck["a"], "a", no_dist=True)
    dist.barrier()
    res["all_no_dist"]["keys_left"] = [k for k in (f"dcp-load/{slot}/abort", f"dcp-load/{slot}/skipped")
                                       if c10d._get_default_store().check([k])]
    res["after_all_no_dist"] = _case(ck["b"], "b")
    # A late rank that reads a foreign value (here a pickle) under the key naming the missing
    # ranks: its error stays a LoadError, naming the key.
    slot = _coordinate.peek_slot("load")
    if rank == 1:
        time.sleep(SHORT_S + 3)
    res["late_foreign"] = _case(ck["b"], "b", timeout=SHORT_S)
    if rank == 0:
        import pickle

        c10d._get_default_store().set(f"dcp-load/{slot}/missing", pickle.dumps({"missing": [1]}))
    res["after_late_foreign"] = _case(ck["a"], "a")
    return res


def mixed_checkpoint_cases(rank: int, world: int, ck: dict[str, str]) -> dict[str, Any]:
    """Rank 0 loads A, rank 1 loads B (same layout): derived, gathered and HF paths."""
    from dcp_load import Chunk

    res: dict[str, Any] = {}
    which = "a" if rank == 0 else "b"
    res["derived"] = _case(ck[which], which)
    res["derived_no_broadcast"] = _case(ck[which], which, broadcast_replicated_tensors=False)
    res["hf"] = _case(ck[f"hf_{which}"], which)
    state = {n: Chunk(torch.full(SHAPE, float("nan")), SHAPE, (0, 0)) for n in NAMES}
    out = outcome(lambda: _load(state, ck[which]), lambda: holds(state, which))
    out["untouched"] = all(bool(torch.isnan(c.tensor).all()) for c in state.values())
    res["gathered"] = out
    res["after"] = _case(ck["a"], "a")
    return res


def groups_cases(rank: int, world: int, ck: dict[str, str]) -> dict[str, Any]:
    """``broadcast_groups=`` on rank 0 only, then a load where every rank agrees."""
    import torch.distributed as dist

    res: dict[str, Any] = {}
    groups = {tuple(range(world)): dist.group.WORLD} if rank == 0 else None
    res["groups_on_one_rank"] = _case(ck["a"], "a", broadcast_groups=groups, broadcast_batch_bytes=0)
    res["after"] = _case(ck["b"], "b", broadcast_batch_bytes=0)
    return res


def default_timeout_cases(rank: int, world: int, ck: dict[str, str]) -> dict[str, Any]:
    """Rank 1 reaches load 3 s after the process group's timeout (2 s); no timeout= given."""
    import dcp_load

    state = poisoned()
    if rank == 1:
        time.sleep(5.0)
    return outcome(lambda: dcp_load.load(state, checkpoint_id=ck["a"]), lambda: holds(state, "a"))


def after_execute_failure(rank: int, world: int, ck: dict[str, str], store_file: str) -> dict[str, Any]:
    """Rank 1's third broadcast raises; then every rank loads again with timeout=30; then the
    process group is re-created and the load is repeated."""
    from datetime import timedelta

    import dcp_load
    import torch.distributed as dist
    from dcp_platform._torch import TorchPlatform
    from torch.distributed import distributed_c10d as c10d

    class Failing(TorchPlatform):
        calls = 0

        def broadcast(self, tensor: Any, src: int, group: Any = None) -> Any:
            Failing.calls += 1
            if rank == 1 and Failing.calls == 3:
                raise RuntimeError("injected broadcast failure on rank 1")
            return super().broadcast(tensor, src, group)

    res: dict[str, Any] = {}
    state, check = dp_tp_state(lambda n: values("a", n), NAMES, SHAPE)
    groups_before = len(c10d._world.pg_map)
    res["failure"] = outcome(lambda: dcp_load.load(state, checkpoint_id=ck["a"], platform=Failing(),
                                                   broadcast_replicated_tensors=True, broadcast_batch_bytes=0,
                                                   timeout=30.0))
    res["groups_leaked"] = len(c10d._world.pg_map) - groups_before
    state, check = dp_tp_state(lambda n: values("a", n), NAMES, SHAPE)
    res["next"] = outcome(lambda: dcp_load.load(state, checkpoint_id=ck["a"], broadcast_replicated_tensors=True,
                                                timeout=30.0), check)
    res["save"] = outcome(lambda: dcp_load.save({n: values("a", n) for n in NAMES},
                                                checkpoint_id=ck["scratch"] + f"-{rank}", timeout=30.0))
    # Re-created, the process group loads again.
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    state, check = dp_tp_state(lambda n: values("a", n), NAMES, SHAPE)
    res["rebuilt"] = outcome(lambda: dcp_load.load(state, checkpoint_id=ck["a"], broadcast_replicated_tensors=True,
                                                   timeout=30.0), check)
    return res
