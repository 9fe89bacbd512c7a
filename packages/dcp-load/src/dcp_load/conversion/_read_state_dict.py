"""``read_state_dict``: a checkpoint's tensors (or some of them) as whole tensors, allocated
from the metadata and read once, in one process; what torch's
``_load_state_dict_from_keys`` does, without unpickling unless asked."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["read_state_dict"]


def read_state_dict(checkpoint_id: str | os.PathLike[str], keys: Any = None, *, dtype: Any = None,
                    allow_pickle: bool = False) -> dict[str, Any]:
    """``{name: whole tensor}`` (and ``{name: value}`` for non-tensor values) of the
    checkpoint ``checkpoint_id`` (any format dcp reads), flat names as saved.

    ``keys``: names or glob patterns (``"model.layers.0.*"``) to read; default everything;
    a pattern that matches nothing is a ValueError naming it. ``dtype``: floating tensors
    are cast to it while reading, piece by piece (integer and bool tensors keep theirs).
    ``allow_pickle``: allow values stored pickled (only for checkpoints you trust). No
    process group is used: each tensor is allocated once, at its global shape, and every
    saved byte it needs is read once, narrowed, straight into it.
    """
    import torch
    from dcp_reader import open_checkpoint

    from .._load import load
    from ._convert import select_names
    from ._layout import FLOATING, cast_dtype

    to = cast_dtype(dtype)
    with open_checkpoint(checkpoint_id, allow_pickle=allow_pickle) as reader:
        meta = reader.metadata
        names = select_names(sorted([*meta.tensors, *meta.values]), keys)
        out: dict[str, Any] = {}
        for name in names:
            t = meta.tensors.get(name)
            if t is None:
                out[name] = None  # a value: load puts it here
                continue
            want = to if to is not None and t.dtype in FLOATING else t.dtype
            out[name] = torch.empty(t.shape, dtype=getattr(torch, want))
        load(out, storage_reader=reader, no_dist=True, allow_pickle=allow_pickle)
    return out
