"""broadcast_items on a real MindSpore cluster (a scheduler plus 3 CPU workers), where the
backend has no subgroups: every item goes over the world group, non-members receive into
scratch and drop it, receivers (poisoned first) get bit-exact int64/bf16/float16/uint8.
Both with batch_bytes=0 and with batching asked for (MindSpore's CPU from_bytes refuses
slices of a buffer, so items then go alone). One launch (20-60 s). Marked ``mindspore``:
run where MindSpore is installed (``nox -s tests-mindspore`` or ``.venv-ms``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mindspore

sys.path.insert(0, str(Path(__file__).parent))


def test_broadcast_mindspore_world_group_fallback():
    pytest.importorskip("mindspore", reason="MindSpore is not installed in this environment")
    import broadcast_ms_cases as cases
    from dcp_platform.testing import run_mindspore_workers

    world = 3
    per_rank = run_mindspore_workers(cases.fallback_cases, world, timeout=300)
    for rank, result in enumerate(per_rank):
        assert result["subgroups"] is False
        for mode in ("batch_bytes=0", "batch_bytes=4096"):
            run = result[mode]
            assert not run["errors"], run["errors"]
            stats = run["stats"]
            members = [s for s in cases.SPECS if rank in s[1]]
            # Every rank joins every broadcast (world group); it counts only its own items.
            assert stats["broadcasts"] == len(cases.SPECS)
            assert stats["items"] == len(members)
            assert stats["items_batched"] == 0
            assert stats["bytes_sent"] + stats["bytes_received"] > 0
