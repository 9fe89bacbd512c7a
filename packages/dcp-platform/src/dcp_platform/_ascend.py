"""Ascend backend: torch with torch_npu, tensors on ``npu:<current>``, collectives over HCCL.

Everything but the device is torch's (``TorchPlatform``); ``torch_npu`` is imported only
here, so the other backends never need it.
"""

from __future__ import annotations

import logging

import torch

from ._torch import TorchPlatform

try:
    import torch_npu  # registers the "npu" device and the "hccl" backend with torch
except ImportError as exc:
    raise ImportError(
        "the 'ascend' platform needs torch_npu, which is not importable here "
        f"({exc}). Install the torch_npu release that matches torch {torch.__version__} and "
        "your CANN toolkit (pip install torch-npu==<version>), and source CANN's set_env.sh; "
        "on a machine without Ascend NPUs choose the 'torch' platform instead"
    ) from exc

logger = logging.getLogger(__name__)


class AscendPlatform(TorchPlatform):
    """torch.distributed over HCCL with staging buffers on the current NPU.

    ``device``: default ``npu:<torch.npu.current_device()>``. ``synchronize`` waits for
    all work queued on that NPU (HCCL collectives and copies run asynchronously there).
    """

    name = "ascend"
    _default_backend = "hccl"

    def _default_device(self) -> torch.device:
        return torch.device("npu", torch_npu.npu.current_device())

    def synchronize(self) -> None:
        if self._device.type == "npu":
            torch_npu.npu.synchronize(self._device)
        # A CPU staging device (device="cpu" given explicitly) has no stream to drain.
