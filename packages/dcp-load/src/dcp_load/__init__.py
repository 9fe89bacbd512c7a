"""dcp-load: load distributed checkpoints with resharding, read-once and batched broadcasts."""

from ._convert import ConvertReport, convert
from ._errors import LoadError
from ._flat import Flat, flat_views
from ._load import DEFAULT_BATCH_BYTES, load
from ._plan import GlobalPlan, GreedyPlanner, Planner, ReadItem, build_global_plan
from ._read_state_dict import read_state_dict
from ._report import LoadReport
from ._save import SaveReport, save
from ._sources import Concat, Slice, Stack
from ._state import Chunk
from ._version import __version__

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
    "__version__",
    "build_global_plan",
    "convert",
    "flat_views",
    "load",
    "read_state_dict",
    "save",
]
