"""dcp-load: load distributed checkpoints with resharding, read-once and batched broadcasts.

The public names are imported on first use (PEP 562 ``__getattr__``): ``import dcp_load``
and the ``dcp`` command import neither torch nor NumPy until a name that needs them is
used (``import dcp_load.cli._main`` pulled torch in through ``transferring``: 2-7 s of a
``dcp --version`` that now takes ~0.1 s; ``benchmarks/bench_cli_start.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time ``__getattr__`` imports these
    from ._errors import LoadError
    from ._load import DEFAULT_BATCH_BYTES, load
    from .conversion._convert import ConvertReport, convert
    from .conversion._read_state_dict import read_state_dict
    from .layouts._flat import Flat, flat_views
    from .layouts._sources import Concat, Slice, Stack
    from .layouts._state import Chunk
    from .plan._plan import GlobalPlan, GreedyPlanner, Planner, ReadItem, build_global_plan
    from .run._report import LoadReport
    from .saving._async import async_save
    from .saving._save import SaveReport, save
    from .saving._staging import prepare_staging, release_staging
    from .transferring._engine import engine_shards, tp_offsets
    from .transferring._sync_group import TransferGroup, TransferGroupError, transfer_group
    from .transferring._transfer import TransferReport, transfer
    from .transferring._versions import synced_version

#: Public name -> the module (relative to this package) that defines it.
_WHERE = {
    "LoadError": "._errors",
    "DEFAULT_BATCH_BYTES": "._load", "load": "._load",
    "ConvertReport": ".conversion._convert", "convert": ".conversion._convert",
    "read_state_dict": ".conversion._read_state_dict",
    "Flat": ".layouts._flat", "flat_views": ".layouts._flat",
    "Concat": ".layouts._sources", "Slice": ".layouts._sources", "Stack": ".layouts._sources",
    "Chunk": ".layouts._state",
    "GlobalPlan": ".plan._plan", "GreedyPlanner": ".plan._plan", "Planner": ".plan._plan",
    "ReadItem": ".plan._plan", "build_global_plan": ".plan._plan",
    "LoadReport": ".run._report",
    "async_save": ".saving._async",
    "SaveReport": ".saving._save", "save": ".saving._save",
    "prepare_staging": ".saving._staging", "release_staging": ".saving._staging",
    "engine_shards": ".transferring._engine", "tp_offsets": ".transferring._engine",
    "TransferGroup": ".transferring._sync_group", "TransferGroupError": ".transferring._sync_group",
    "transfer_group": ".transferring._sync_group",
    "TransferReport": ".transferring._transfer", "transfer": ".transferring._transfer",
    "synced_version": ".transferring._versions",
}

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "Chunk",
    "Concat",
    "ConvertReport",
    "Flat",
    "GlobalPlan",
    "GreedyPlanner",
    "LoadError",
    "LoadReport",
    "Planner",
    "ReadItem",
    "SaveReport",
    "Slice",
    "Stack",
    "TransferGroup",
    "TransferGroupError",
    "TransferReport",
    "__version__",
    "async_save",
    "build_global_plan",
    "convert",
    "engine_shards",
    "flat_views",
    "load",
    "prepare_staging",
    "read_state_dict",
    "release_staging",
    "save",
    "synced_version",
    "tp_offsets",
    "transfer",
    "transfer_group",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept here after."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
