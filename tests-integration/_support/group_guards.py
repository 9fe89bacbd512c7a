"""Guards shared by the tests that run dcp on a group other than the default one
(groups/, sync/): destinations poisoned, and every collective on the default group
refused inside a block."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with 0x7F bytes: a value no checkpoint or sender holds."""
    t.view(torch.uint8).fill_(0x7F)


@contextlib.contextmanager
def default_group_forbidden():
    """Every collective that would run on the default group raises inside the block."""
    names = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "barrier", "new_group")
    saved = {n: getattr(dist, n) for n in names}

    def guard(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if name == "new_group" or group is None or group is dist.group.WORLD:
                raise AssertionError(f"torch.distributed.{name} on the default group inside a guarded block")
            return saved[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, guard(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
