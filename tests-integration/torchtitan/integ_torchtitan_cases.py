"""In-rank functions of test_integ_torchtitan: torchtitan's ``CheckpointManager`` run once
with torch.distributed.checkpoint and once with ``dcp_load.torch_compat`` put in its place
(the one assignment a user makes: the module's ``dcp`` attribute).

The model is a small module of this file, wrapped with FSDP2's ``fully_shard`` on gloo
(torchtitan's own models need triton, which a CPU machine lacks), with torchtitan's
``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` and a train state shaped as its
trainer's. Values are compared as full tensors, gathered on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import dcp_load.torch_compat
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

POISON = -7777.0  # no checkpoint holds it
VOCAB, DIM, HIDDEN = 64, 32, 48
HF_NAMES = {"embed.weight": "model.embed_tokens.weight", "up.weight": "model.layers.0.mlp.up_proj.weight",
            "up.bias": "model.layers.0.mlp.up_proj.bias", "down.weight": "lm_head.weight"}


class Tiny(torch.nn.Module):
    """An embedding and two linear layers; ``forward`` returns a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(tokens)))).pow(2).mean()


class TrainState:
    """torchtitan's trainer as a Stateful: its step and tokens seen."""

    def __init__(self, step: int, ntokens: int) -> None:
        self.step, self.ntokens_seen = step, ntokens

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def _adapter_class() -> type:
    from torchtitan.protocols.state_dict_adapter import StateDictAdapter

    class TinyAdapter(StateDictAdapter):
        """Hugging Face names for ``Tiny`` (torchtitan's adapters rename the same way)."""

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return {HF_NAMES[k]: v for k, v in state_dict.items() if k in HF_NAMES}

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            back = {v: k for k, v in HF_NAMES.items()}
            return {back[k]: v for k, v in hf_state_dict.items()}

    return TinyAdapter


@contextlib.contextmanager
def checkpoint_module(impl: str) -> Iterator[Any]:
    """torchtitan's checkpointer module with ``dcp`` swapped for dcp's when ``impl == "dcp"``."""
    from torchtitan.components.checkpointer import dcp as titan

    original = titan.dcp
    if impl == "dcp":
        titan.dcp = dcp_load.torch_compat
    try:
        yield titan
    finally:
        titan.dcp = original


def build(seed: int, trained_steps: int) -> dict[str, Any]:
    """Model (fully sharded), optimizers, LR schedulers and train state, trained
    ``trained_steps`` steps on the same tokens on every rank."""
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    torch.manual_seed(seed)
    model = Tiny()
    fully_shard(model)
    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"  # "fused" is CUDA only
    optimizers = config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(trained_steps):
        model(torch.randint(0, VOCAB, (2, 8), generator=gen)).backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
    return {"model": model, "optimizers": optimizers, "schedulers": schedulers,
            "train": TrainState(trained_steps, 1000 * trained_steps)}


def poison(parts: dict[str, Any]) -> None:
    """Fill every value a load restores with POISON (optimizer state made first, as torch
    DCP's optimizer state dict does for a fresh optimizer)."""
    with torch.no_grad():
        for p in parts["model"].parameters():
            p.fill_(POISON)
        parts["optimizers"].state_dict()  # creates the (zero) state of a fresh optimizer
        for opt in parts["optimizers"].optimizers:
            for state in opt.state.values():
                for value in state.values():
                    value.fill_(POISON)
    for sched in parts["schedulers"].schedulers:
        sched.last_epoch = -77
    parts["train"].step, parts["train"].ntokens_seen = -77, -77


def _full(value: Any) -> Any:
    """A tensor as a NumPy array of all of it (arrays cross the result queue by value;
    tensors would be shared through file descriptors of the exiting rank)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return value


def snapshot(parts: dict[str, Any]) -> dict[str, Any]:
    """Every value a resume restores, as full arrays and plain values."""
    optim = {k: _full(v) for k, v in parts["optimizers"].state_dict().items()}
    return {"model": {k: _full(v) for k, v in parts["model"].state_dict().items()},
            "optim": optim,
            "lr": [(s.last_epoch, [g["lr"] for g in s.optimizer.param_groups]) for s in parts["schedulers"].schedulers],
            "train": parts["train"].state_dict()}


def manager(titan: Any, parts: dict[str, Any], root: str, folder: str, adapter: Any = None, **config: Any) -> Any:
    """torchtitan's manager over ``parts``, saving under ``root/folder`` every step."""
    cfg = titan.CheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0, **config)
    return titan.CheckpointManager(cfg, dataloader=None, model_parts=[parts["model"]],
                                   optimizers=parts["optimizers"], lr_schedulers=parts["schedulers"],
                                   states={"train_state": parts["train"]}, sd_adapter=adapter,
                                   base_folder=root)


#: torchtitan's async modes that run on CPU: "async_with_pinned_mem" builds a DefaultStager
#: with non-blocking copies, which torch refuses without an accelerator.
MODES = ("disabled", "async")


def save_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save step 1 with each implementation and mode; then the initial load from Hugging
    Face files with each. Returns what was saved and what each HF load gave."""
    parts = build(seed=3, trained_steps=2)
    out: dict[str, Any] = {"saved": snapshot(parts), "seconds": {}, "files": {}}
    for impl in ("torch", "dcp"):
        for mode in MODES:
            with checkpoint_module(impl) as titan:
                t0 = time.perf_counter()
                mgr = manager(titan, parts, root, f"{impl}-{mode}", async_mode=mode)
                assert mgr.save(curr_step=1)
                mgr.maybe_wait_for_staging()
                mgr.maybe_wait_for_saving()
                out["seconds"][f"{impl}-{mode}"] = time.perf_counter() - t0
                mgr.close()
            out["files"][f"{impl}-{mode}"] = sorted(os.listdir(os.path.join(root, f"{impl}-{mode}", "step-1")))
    dist.barrier()
    out["hf"] = hf_initial_loads(rank, root)
    return out


def write_hf(root: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A Hugging Face checkpoint of ``Tiny`` (two files and their index), values seeded."""
    from safetensors.torch import save_file

    hf_dir = os.path.join(root, "hf")
    gen = torch.Generator().manual_seed(11)
    model = Tiny()
    values = {HF_NAMES[k]: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    names = sorted(values)
    files = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    if dist.get_rank() == 0:
        os.makedirs(hf_dir)
        for file in sorted(set(files.values())):
            save_file({n: values[n] for n in names if files[n] == file}, os.path.join(hf_dir, file))
        with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": files}, f)
    dist.barrier()
    return hf_dir, values


def hf_initial_loads(rank: int, root: str) -> dict[str, Any]:
    """torchtitan's initial load from HF files (``initial_load_in_hf``: through its adapter's
    ``HuggingFaceStorageReader``), with each implementation, into poisoned models."""
    hf_dir, values = write_hf(root)
    adapter = _adapter_class()(model_config=None, hf_assets_path=None)
    out: dict[str, Any] = {"files": {k: _full(v) for k, v in values.items()}}
    for impl in ("torch", "dcp"):
        parts = build(seed=5, trained_steps=0)
        poison(parts)
        with checkpoint_module(impl) as titan:
            mgr = manager(titan, parts, root, f"{impl}-from-hf", initial_load_path=hf_dir, initial_load_in_hf=True,
                          initial_load_model_only=True, adapter=adapter)
            out[f"{impl}_loaded"] = mgr.load()
            mgr.close()
        out[impl] = {HF_NAMES[k]: v for k, v in snapshot(parts)["model"].items()}
    return out


def resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """A new launch at another world size: a fresh, poisoned state per saved checkpoint,
    loaded by a fresh manager with the implementation that saved it (torchtitan's
    ``load(step=1)``, its ``checkpoint.load_step``)."""
    out: dict[str, Any] = {"latest": {}}
    for impl in ("torch", "dcp"):
        for mode in MODES:
            parts = build(seed=9, trained_steps=0)
            poison(parts)
            with checkpoint_module(impl) as titan:
                mgr = manager(titan, parts, root, f"{impl}-{mode}")
                assert mgr.load(step=1)
                out["latest"][f"{impl}-{mode}"] = mgr._find_load_step()
                mgr.close()
            out[f"{impl}-{mode}"] = snapshot(parts)
    return out



class _Numbers(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        yield from range(1000)


def _loader(rank: int, world: int, batches: int) -> Any:
    """torchtitan's ``ParallelAwareDataloader`` (state under ``dp_rank_<rank>``, bytes), with
    ``batches`` batches taken; each rank's numbers differ."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class Offset(_Numbers):
        def __iter__(self) -> Iterator[int]:
            yield from (100 * rank + i for i in range(1000))

    loader = ParallelAwareDataloader(Offset(), dp_rank=rank, dp_world_size=world, batch_size=4)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader


def _loader_manager(titan: Any, parts: dict[str, Any], loader: Any, root: str, folder: str, **config: Any) -> Any:
    cfg = titan.CheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0, **config)
    return titan.CheckpointManager(cfg, dataloader=loader, model_parts=[parts["model"]], optimizers=parts["optimizers"],
                                   lr_schedulers=parts["schedulers"], states={}, sd_adapter=None, base_folder=root)


def save_with_dataloader(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each implementation and mode saves step 1 with the dataloader 3 batches in."""
    parts = build(seed=3, trained_steps=1)
    loader = _loader(rank, world, batches=3)
    for impl in ("torch", "dcp"):
        for mode in MODES:
            with checkpoint_module(impl) as titan:
                mgr = _loader_manager(titan, parts, loader, root, f"loader-{impl}-{mode}", async_mode=mode)
                assert mgr.save(curr_step=1)
                mgr.maybe_wait_for_saving()
                mgr.close()
    return {"rank": rank}


def resume_with_dataloader(rank: int, world: int, root: str) -> dict[str, Any]:
    """A new launch: a fresh dataloader (at its start) per checkpoint, loaded by torchtitan;
    the batch each gives next."""
    out: dict[str, Any] = {}
    for impl in ("torch", "dcp"):
        for mode in MODES:
            parts = build(seed=9, trained_steps=0)
            poison(parts)
            loader = _loader(rank, world, batches=0)
            with checkpoint_module(impl) as titan:
                mgr = _loader_manager(titan, parts, loader, root, f"loader-{impl}-{mode}")
                assert mgr.load(step=1)
                mgr.close()
            out[f"{impl}-{mode}"] = next(iter(loader)).numpy()
    return out
