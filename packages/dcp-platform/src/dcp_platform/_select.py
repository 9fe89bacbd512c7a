"""Choosing a backend: a name argument, then ``DCP_PLATFORM``, then the type of a tensor."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ._base import Platform

ENV_VAR = "DCP_PLATFORM"

# name -> (module, class); modules are imported only when chosen, so a backend's framework
# is imported only by that backend.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("dcp_platform._torch", "TorchPlatform"),
    "ascend": ("dcp_platform._ascend", "AscendPlatform"),
    "mindspore": ("dcp_platform._mindspore", "MindSporePlatform"),
}

PLATFORM_NAMES: tuple[str, ...] = tuple(_BACKENDS)


def _name_from_tensor(tensor: Any) -> str | None:
    """The backend of ``tensor`` by type, subclasses included (torch ``nn.Parameter``;
    MindSpore ``Parameter``, whose class reports module ``abc``). Only frameworks already
    imported are looked up: a tensor of a framework implies it was imported."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        device = getattr(tensor, "device", None)
        return "ascend" if getattr(device, "type", None) == "npu" else "torch"
    ms = sys.modules.get("mindspore")
    if ms is not None and isinstance(tensor, ms.Tensor):
        return "mindspore"
    return None


def platform_name(name: str | None = None, tensor: Any = None) -> str:
    """The backend name chosen by ``name``, else ``$DCP_PLATFORM``, else ``tensor``'s type."""
    if name is not None:
        source = "the name argument"
    elif os.environ.get(ENV_VAR):
        name, source = os.environ[ENV_VAR], f"${ENV_VAR}"
    elif tensor is not None:
        name, source = _name_from_tensor(tensor), f"a tensor of type {type(tensor).__qualname__}"
        if name is None:
            raise ValueError(
                f"cannot choose a platform from a tensor of type {type(tensor).__module__}."
                f"{type(tensor).__qualname__}; pass name= one of {list(PLATFORM_NAMES)} "
                f"or set ${ENV_VAR}"
            )
    else:
        raise ValueError(
            f"no platform chosen: pass name= one of {list(PLATFORM_NAMES)}, set ${ENV_VAR}, "
            "or pass a tensor to choose by its type"
        )
    name = name.strip().lower()
    if name not in _BACKENDS:
        raise ValueError(f"unknown platform {name!r} (from {source}); choose one of {list(PLATFORM_NAMES)}")
    return name


def get_platform(name: str | None = None, *, tensor: Any = None, **options: Any) -> Platform:
    """Create the platform object for a backend; ``options`` go to its constructor.

    The object is new on each call: callers keep it and pass it down.
    """
    chosen = platform_name(name, tensor)
    module_name, class_name = _BACKENDS[chosen]
    module = importlib.import_module(module_name)
    return getattr(module, class_name)(**options)
