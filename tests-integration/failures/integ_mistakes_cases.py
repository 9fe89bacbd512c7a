"""Functions that run inside 2 gloo ranks for test_integ_load_mistakes (not a test module):
tied weights (one tensor under two keys) loaded from checkpoints that agree, disagree, or
hold only one of the keys. Destinations are poisoned before every load."""

from __future__ import annotations

import traceback
from typing import Any

import torch


def _tied_state() -> tuple[dict[str, Any], torch.Tensor]:
    w = torch.full((4, 3), float("nan"))
    return {"embed.weight": w, "other": torch.full((2,), float("nan")), "head.weight": w}, w


def _run(fn: Any) -> dict[str, Any]:
    try:
        return {"ok": fn()}
    except Exception as exc:  # noqa: BLE001 - the test asserts on the outcome
        return {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}


def tied_cases(rank: int, world: int, ckpts: dict[str, str]) -> dict[str, Any]:
    import dcp_load

    out: dict[str, Any] = {}

    def load(path: str, **kw: Any) -> Any:
        sd, w = _tied_state()
        report = dcp_load.load(sd, checkpoint_id=path, **kw)
        return {"w": w.tolist(), "other": sd["other"].tolist(), "tied": [list(p) for p in report.tied],
                "tensors": report.tensors, "same_object": sd["head.weight"] is w}

    out["differ"] = _run(lambda: load(ckpts["differ"]))
    out["differ_head_wins"] = _run(lambda: load(ckpts["differ"], tied_weights={"embed.weight": "head.weight"}))
    out["differ_embed_wins"] = _run(lambda: load(ckpts["differ"], tied_weights={"head.weight": "embed.weight"}))
    out["agree"] = _run(lambda: load(ckpts["agree"]))
    out["only_embed"] = _run(lambda: load(ckpts["only_embed"]))
    out["bad_argument"] = _run(lambda: load(ckpts["agree"], tied_weights={"head.weight": "other"}))
    return out
