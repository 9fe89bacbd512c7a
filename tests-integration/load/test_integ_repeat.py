"""Repeated loads hold no more memory (integ_repeat_cases): 4 real gloo ranks load one
checkpoint again and again, from dcp's native format and from a Hugging Face file, in every
``broadcast_replicated_tensors`` mode (True, False, "auto"), each load into poisoned
destinations checked against the truth.

What is measured per rank is the growth of its resident anonymous memory (``RssAnon``; the
part of ``VmRSS`` no file backs) from after a warm-up round to after the last round. What
the reading and broadcasting threads of the loads free stays in glibc's arenas until
``malloc_trim``: with a trim at most every 30 s, 60 loads in 30-55 s grew one rank by 15.1
and 19.4 MiB (two runs; VmRSS +22.1 MiB) while malloc's in-use bytes stayed flat. A trim
is now also made whenever a load ends with ``TRIM_GROWTH_BYTES`` (8 MiB) more than after
the last one: 7.6 and 8.3 MiB at most, 13.6 MiB on a machine running three other test
workers. The bound adds 8 MiB for the pages a round allocates after its last trim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_repeat_cases as cases  # noqa: E402

MiB = 2**20
#: Growth of RssAnon allowed per rank over the measured rounds: dcp_load.run._execute's
#: TRIM_GROWTH_BYTES (8 MiB) and 8 MiB (module docstring).
BOUND = 16 * MiB
ROUNDS = 10  # x 2 formats x 3 modes = 60 measured loads per rank


@pytest.mark.slow
def test_repeated_loads_keep_memory_bounded(tmp_path):
    paths = {"native": str(tmp_path / "native"), "hf": str(tmp_path / "hf")}
    cases.write(paths["native"], paths["hf"])
    per_rank = run_ranks(cases.repeated, 4, paths, [True, False, "auto"], ROUNDS, timeout=300, pg_timeout=240)
    grew = []
    for rank, r in enumerate(per_rank):
        assert r["wrong"] == [], f"rank {rank}: {r['wrong'][:5]}"
        assert len(r["anon"]) == ROUNDS + 1
        grew.append((r["anon"][-1] - r["anon"][0], r["rss"][-1] - r["rss"][0]))
    shown = ", ".join(f"rank {k}: RssAnon {a / MiB:+.1f} MiB (VmRSS {v / MiB:+.1f})" for k, (a, v) in enumerate(grew))
    print(shown)
    assert max(a for a, _ in grew) < BOUND, f"{ROUNDS * 6} repeated loads grew {shown}; bound {BOUND / MiB:.0f} MiB"
