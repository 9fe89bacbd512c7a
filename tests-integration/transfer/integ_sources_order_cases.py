"""In-rank function of test_integ_sources_order.py (not a test module: the ranks import it
by name): ``transfer`` with a ``sources=`` mapping that each rank builds itself."""

from __future__ import annotations

from typing import Any

SHAPE = (6, 10)


def truth(name: str) -> Any:
    import torch

    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) + 1000 * (ord(name) - ord("a") + 1)


def transfer_with(rank: int, world: int, orders: list[list[tuple[str, str]]]) -> dict[str, Any]:
    """Every rank holds ``a`` and ``b`` whole and fills ``x`` and ``y`` (poisoned first)
    through ``sources`` built from ``orders[rank]`` in that insertion order. Returns which
    destination equals which source, or the error's text."""
    import dcp_load
    import torch

    src = {"a": truth("a"), "b": truth("b")}
    dst = {"x": torch.full(SHAPE, float("nan")), "y": torch.full(SHAPE, float("nan"))}
    sources = dict(orders[rank])
    try:
        dcp_load.transfer(src, dst, sources=sources, timeout=60)
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"filled": {d: next((s for s in "ab" if torch.equal(t, truth(s))), None) for d, t in dst.items()}}
