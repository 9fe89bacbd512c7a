"""The measured load call of each method, inside one rank.

``do_load`` runs one loader on the rank's (poisoned) state dict and returns what the loader
itself reports (dcp's LoadReport fields, torch DCP's per-phase times).

Methods: ``dcp`` (read once + broadcast), ``dcp-reread`` (every rank reads), ``dcp-auto``
(load()'s default), ``torch`` (torch.distributed.checkpoint.load: its
HuggingFaceStorageReader on HF files, its FileSystemReader on its own format), ``safetensors``
(one process: ``load_file`` per file + copy) and the peer ``fastsafetensors``
(``ParallelLoader`` over the gloo world group, ``nogds=True``: each file is read by one
rank and every tensor is broadcast whole to every rank, which copies out its box).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.phases import timed_torch_load
from harness.spec import box

METHODS = ("dcp", "dcp-reread", "dcp-auto", "torch", "safetensors", "fastsafetensors")
DCP_MODES: dict[str, bool | str] = {"dcp": True, "dcp-reread": False, "dcp-auto": "auto"}


def import_for(method: str) -> None:
    """Import what ``method`` uses before the measured call, so imports are not timed."""
    if method.startswith("dcp"):
        import dcp_load  # noqa: F401
    elif method == "fastsafetensors":
        import fastsafetensors  # noqa: F401
    else:
        import safetensors.torch  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.hf_storage  # noqa: F401


def do_load(run: Any, sd: dict[str, Any], local: dict[str, Any], ckpt: str, distributed: bool,
            tp_rank: int) -> dict[str, Any]:
    """The measured call of ``run.method`` on checkpoint ``ckpt``."""
    if run.method in DCP_MODES:
        return _dcp(run, sd, ckpt, distributed)
    if run.method == "torch":
        import torch.distributed.checkpoint as tdcp

        reader = (tdcp.HuggingFaceStorageReader(ckpt) if run.fmt == "hf"
                  else tdcp.FileSystemReader(ckpt))
        return {"torch_seconds": timed_torch_load(sd, reader, no_dist=not distributed)}
    if run.fmt != "hf":
        raise ValueError(f"method {run.method!r} reads safetensors files only, not {run.fmt!r}")
    if run.method == "safetensors":
        return _safetensors(sd, ckpt)
    if run.method == "fastsafetensors":
        return _fastsafetensors(run, local, ckpt, distributed, tp_rank)
    raise ValueError(run.method)


def _dcp(run: Any, sd: dict[str, Any], ckpt: str, distributed: bool) -> dict[str, Any]:
    from dcp_load import load

    rep = load(sd, checkpoint_id=ckpt, no_dist=not distributed,
               broadcast_replicated_tensors=DCP_MODES[run.method],
               broadcast_batch_bytes=run.batch_bytes)
    out: dict[str, Any] = {"report_bytes_read": getattr(rep, "bytes_read", None),
                           "report_bytes_received": getattr(rep, "bytes_received", None),
                           "report_broadcasts": getattr(rep, "broadcasts", None)}
    secs = getattr(rep, "seconds", None)
    if secs is not None:
        out["report_seconds"] = dict(secs)
    return out


def _safetensors(sd: dict[str, Any], ckpt: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    # One file at a time, as a careful user would: each file is materialised whole.
    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    for fname in sorted(set(index.values())):
        part = load_file(str(Path(ckpt) / fname))
        for k, v in part.items():
            sd[k].copy_(v)
        del part
    return {}


def _fastsafetensors(run: Any, local: dict[str, Any], ckpt: str, distributed: bool,
                     tp_rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from fastsafetensors import ParallelLoader

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    files = [str(Path(ckpt) / f) for f in sorted(set(index.values()))]
    tp_dims = {name: (shape, tp_dim) for name, shape, tp_dim in run.spec.tensors()}
    loader = ParallelLoader(dist.group.WORLD if distributed else None, files, nogds=True,
                            use_tqdm_on_load=False, device="cpu", set_numa=False,
                            accumulate_resident=False)
    seen = 0
    try:
        for key, tensor in loader.iterate_weights():
            shape, tp_dim = tp_dims[key]
            offsets, sizes = box(shape, tp_dim, run.tp, tp_rank)
            part = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            local[key].copy_(tensor[part])
            seen += 1
    finally:
        loader.close()
    if seen != len(tp_dims):
        raise RuntimeError(f"fastsafetensors yielded {seen} tensors, the checkpoint has {len(tp_dims)}")
    return {}
