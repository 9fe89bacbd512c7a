"""The public API of each package: every name of its ``__all__`` imports from the installed
package, and the names of the 0.5 / 0.4 releases are all still there (the API grows only by
addition; moving modules into sub-packages changed no public name). Also the house rules
of ``.ci/check_house.py`` (no import circles, dcp-load's layers one way, URI tests only in
dcp-reader's storage, no function over 60 lines) hold for the checked-out tree."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Each package's ``__all__`` as released (dcp-platform 0.3.1, dcp-reader 0.4.0,
#: dcp-broadcast 0.3, dcp-load 0.5.0).
RELEASED = {
    "dcp_platform": ["Capabilities", "ENV_VAR", "HEARTBEAT_S", "Handle", "PLATFORM_NAMES", "PeerFailure",
                     "Platform", "STALE_S", "Watch", "__version__", "get_platform", "platform_name"],
    "dcp_reader": ["CheckpointError", "CheckpointMetadata", "CheckpointReader", "ChecksumError", "ChunkMeta",
                   "CoverageError", "EncodedValues", "METADATA_FILE", "MetadataError", "MissingFileError",
                   "MissingKeyError", "MissingMetadataError", "NativeWriter", "SCHEMA_VERSION",
                   "StorageAuthError", "StorageError", "TensorMeta", "TruncatedFileError", "UnknownDtypeError",
                   "UnsafePathError", "UnsafePickleError", "ValueMeta", "VerifyReport", "WriterLock",
                   "WriterLockError", "__version__", "chunk_key", "data_file_name", "detect_format",
                   "is_rank_local", "open_checkpoint", "stray_files", "values_file_name", "verify_checkpoint"],
    "dcp_broadcast": ["BroadcastItem", "BroadcastStats", "DEFAULT_BATCH_BYTES", "DEFAULT_MAX_IN_FLIGHT",
                      "GroupManager", "ScheduleMismatchError", "__version__", "broadcast_items"],
    "dcp_load": ["Chunk", "Concat", "ConvertReport", "DEFAULT_BATCH_BYTES", "Flat", "GlobalPlan", "GreedyPlanner",
                 "LoadError", "LoadReport", "Planner", "ReadItem", "SaveReport", "Slice", "Stack", "__version__",
                 "build_global_plan", "convert", "flat_views", "load", "read_state_dict", "save"],
}


@pytest.mark.parametrize("package", sorted(RELEASED))
def test_every_public_name_imports(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from {package} import *", namespace)  # noqa: S102 - the star import users write
    assert set(module.__all__) <= set(namespace)


@pytest.mark.parametrize("package", sorted(RELEASED))
def test_released_names_are_kept(package):
    module = importlib.import_module(package)
    gone = sorted(set(RELEASED[package]) - set(module.__all__))
    assert not gone, f"{package} dropped released public names: {gone}"


def test_public_functions_stay_functions():
    """``dcp_load.save`` and ``dcp_load.convert`` are functions, whichever of the package's
    sub-modules were imported first (sub-packages are named ``saving`` and ``conversion`` so
    that importing one never rebinds the public name)."""
    import dcp_load
    import dcp_load.conversion._fill  # noqa: F401
    import dcp_load.saving._save  # noqa: F401

    assert callable(dcp_load.save) and callable(dcp_load.convert) and callable(dcp_load.load)
    assert dcp_load.save.__module__ == "dcp_load.saving._save"


def test_house_rules_hold():
    proc = subprocess.run([sys.executable, str(ROOT / ".ci" / "check_house.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
