"""Functions that run inside ranks for test_integ_sync_readme (not a test module): the
weight-sync example of the user guide (docs/transfer.md), its trainer half or its engine half,
executed as written (with a free port for 29600) with the names it assumes defined here."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests-integration"))
import docs_blocks  # noqa: E402

TRAINER_MARK, ENGINE_MARK = "# The trainer", "# An engine worker"
PREFIX = "model.layers.0.self_attn."
SHAPES = {f"{PREFIX}q_proj.weight": (8, 4), f"{PREFIX}k_proj.weight": (4, 4), f"{PREFIX}v_proj.weight": (4, 4),
          f"{PREFIX}o_proj.weight": (4, 8)}
TP = 2


def halves() -> tuple[str, str]:
    """(shared lines + trainer half, shared lines + engine half) of the guide's example."""
    readme = ROOT / "docs" / "transfer.md"
    [block] = [b for b in docs_blocks.find_blocks(readme) if 'side="engine"' in b.code]
    shared, rest = block.code.split(TRAINER_MARK, 1)
    trainer, engine = rest.split(ENGINE_MARK, 1)
    return shared + TRAINER_MARK + trainer, shared + ENGINE_MARK + engine


def truth(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*SHAPES[name], generator=g)


def expected(rank: int) -> dict[str, torch.Tensor]:
    """Engine TP rank ``rank``'s shards: its heads' [q; k; v] and its columns of o_proj."""
    parts = [truth(f"{PREFIX}{p}_proj.weight").chunk(TP, dim=0)[rank] for p in "qkv"]
    return {f"{PREFIX}qkv_proj.weight": torch.cat(parts), f"{PREFIX}o_proj.weight":
            truth(f"{PREFIX}o_proj.weight").chunk(TP, dim=1)[rank]}


def job(rank: int, world: int, side: str, port: int) -> Any:
    trainer_code, engine_code = halves()
    scope: dict[str, Any] = {"trainer_host": "127.0.0.1", "engine_tp_size": TP, "trainer_world_size": 1}
    if side == "trainer":
        state = {n: truth(n) for n in SHAPES}
        scope["model"] = SimpleNamespace(state_dict=lambda: state)
        exec(compile(trainer_code.replace("29600", str(port)), "README trainer", "exec"), scope)
        scope["group"].close()
        return None
    full = {f"{PREFIX}qkv_proj.weight": (16, 4), f"{PREFIX}o_proj.weight": (4, 8)}
    splits = {f"{PREFIX}qkv_proj.weight": 0, f"{PREFIX}o_proj.weight": 1}
    params = {n: torch.nn.Parameter(torch.full(v.shape, float("nan")), requires_grad=False)
              for n, v in expected(rank).items()}
    scope.update(model=SimpleNamespace(named_parameters=lambda: iter(params.items())), full_shapes=full,
                 split_dims=splits)
    exec(compile(engine_code.replace("29600", str(port)), "README engine", "exec"), scope)
    scope["group"].close()
    return [n for n, v in expected(rank).items() if not torch.equal(params[n].data, v)]

