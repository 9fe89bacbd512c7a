"""Per-phase times of one torch.distributed.checkpoint load, taken by timing its public steps.

torch DCP's load calls, on every rank and in this order: ``reader.read_metadata``,
``planner.set_up_planner``, ``reader.set_up_storage_reader``, ``planner.create_local_plan``,
``reader.prepare_local_plan``, then (coordinator) ``planner.create_global_plan`` and
``reader.prepare_global_plan`` between a gather and a scatter of the plans,
``planner.finish_plan``, ``reader.read_data`` (which reads each item and copies it into the
destination through ``planner.resolve_tensor`` / ``commit_tensor``) and a final all-gather.
``timed_torch_load`` wraps those methods on the planner and reader instances it passes to
``torch.distributed.checkpoint.load`` (``functools.wraps`` keeps the signatures torch
inspects), so nothing inside torch is changed. Collective time is taken by
``harness.common.CollectiveCounter`` around the same call.

Phases (seconds, this rank): ``metadata`` (read_metadata + set_up_*), ``local plan``
(create_local_plan + prepare_local_plan), ``global plan`` (create_global_plan +
prepare_global_plan + finish_plan), ``read + copy`` (read_data, resolve/commit included),
``copy`` (the resolve/commit part alone).
"""

from __future__ import annotations

import functools
import time
from typing import Any

PHASES = {
    "metadata": (("reader", "read_metadata"), ("planner", "set_up_planner"),
                 ("reader", "set_up_storage_reader")),
    "local plan": (("planner", "create_local_plan"), ("reader", "prepare_local_plan")),
    "global plan": (("planner", "create_global_plan"), ("reader", "prepare_global_plan"),
                    ("planner", "finish_plan")),
    "read + copy": (("reader", "read_data"),),
    "copy": (("planner", "resolve_tensor"), ("planner", "commit_tensor")),
}


def _wrap(obj: Any, name: str, phase: str, seconds: dict[str, float]) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t

    setattr(obj, name, timed)


def timed_torch_load(state_dict: dict[str, Any], reader: Any, no_dist: bool) -> dict[str, float]:
    """``torch.distributed.checkpoint.load`` with ``reader``; returns seconds per phase."""
    import torch.distributed.checkpoint as tdcp

    planner = tdcp.DefaultLoadPlanner()
    seconds: dict[str, float] = {}
    objs = {"reader": reader, "planner": planner}
    for phase, steps in PHASES.items():
        for owner, name in steps:
            _wrap(objs[owner], name, phase, seconds)
    t = time.perf_counter()
    tdcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    seconds["total"] = time.perf_counter() - t
    return seconds
