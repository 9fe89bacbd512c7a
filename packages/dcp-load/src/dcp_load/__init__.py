"""dcp-load: load distributed checkpoints with resharding, read-once and batched broadcasts."""

from ._errors import LoadError
from ._load import DEFAULT_BATCH_BYTES, load
from ._version import __version__
from .conversion._convert import ConvertReport, convert
from .conversion._read_state_dict import read_state_dict
from .layouts._flat import Flat, flat_views
from .layouts._sources import Concat, Slice, Stack
from .layouts._state import Chunk
from .plan._plan import GlobalPlan, GreedyPlanner, Planner, ReadItem, build_global_plan
from .run._report import LoadReport
from .saving._async import async_save
from .saving._save import SaveReport, save
from .saving._staging import release_staging
from .transferring._engine import engine_shards, tp_offsets
from .transferring._sync_group import TransferGroup, TransferGroupError, transfer_group
from .transferring._transfer import TransferReport, transfer

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
    "read_state_dict",
    "release_staging",
    "save",
    "tp_offsets",
    "transfer",
    "transfer_group",
]
