"""Functions that run inside ranks for test_integ_uri_spelling.py (not a test module)."""

from __future__ import annotations

from typing import Any

import torch


def save_and_load(rank: int, world: int, uri: str) -> dict[str, Any]:
    """Save with ``uri`` spelled with a trailing slash on odd ranks, then load it back the same way."""
    import dcp_load

    mine = uri + "/" if rank % 2 else uri
    state = {"w": torch.arange(64.0).reshape(8, 8), "step": 7}
    out: dict[str, Any] = {"saved": None, "loaded": None}
    try:
        out["saved"] = dcp_load.save(state, checkpoint_id=mine, timeout=60).path
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        out["saved_error"] = f"{type(exc).__name__}: {exc}"
        return out
    target = {"w": torch.full((8, 8), float("nan")), "step": 0}
    dcp_load.load(target, checkpoint_id=mine, timeout=60)
    out["loaded"] = bool(torch.equal(target["w"], state["w"])) and target["step"] == 7
    return out
