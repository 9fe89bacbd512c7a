"""Turning a numpy view or a torch tensor into what the caller asked for. torch is imported
only on torch paths, MindSpore only when framework="mindspore"."""

from __future__ import annotations

from typing import Any

from ._dtypes import numpy_dtype

FRAMEWORKS = ("torch", "numpy", "mindspore")


def torch_to_numpy(t: Any, dtype: str) -> Any:
    """A torch CPU tensor as a numpy array of ``numpy_dtype(dtype)`` (bf16/fp8 via their bits)."""
    import torch

    np_dt = numpy_dtype(dtype)
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        bits = torch.int16 if t.dtype == torch.bfloat16 else torch.uint8
        return t.contiguous().view(bits).numpy().view(np_dt)
    return t.numpy()


def numpy_to_mindspore(arr: Any, dtype: str) -> Any:
    """A MindSpore tensor holding a copy of ``arr`` (a read-only view of a memory map)."""
    import mindspore as ms
    import numpy as np

    np_dt = numpy_dtype(dtype)  # MindSpore is imported now: bf16 is a registered numpy type
    a = np.array(arr, copy=True)  # MindSpore tensors own their memory; the map is read-only
    if a.dtype != np_dt:
        a = a.view(np_dt)  # raw bits read before MindSpore registered bfloat16: reinterpret
    return ms.Tensor(a)
