"""Repeated loads hold no more memory (integ_repeat_cases): 4 real gloo ranks load one
checkpoint again and again, from dcp's native format and from a Hugging Face file, in every
``broadcast_replicated_tensors`` mode (True, False, "auto"), each load into poisoned
destinations checked against the truth.

What is measured per rank is the growth of its resident anonymous memory (``RssAnon``; the
part of ``VmRSS`` no file backs) from after a warm-up round to after the last round, as the
process holds it and after a ``malloc_trim`` (freed pages given back: what a leak keeps).
What the reading and broadcasting threads of the loads free stays in glibc's arenas until
``malloc_trim``: with a trim at most every 30 s, 60 loads in 30-55 s grew one rank by 15.1
and 19.4 MiB (two runs; VmRSS +22.1 MiB) while malloc's in-use bytes stayed flat. A trim
is now also made whenever a load ends with ``TRIM_GROWTH_BYTES`` (8 MiB) more than after
the last one: 7.6 and 8.3 MiB at most, 13.6 MiB on a machine running three other test
workers, 16.6 MiB in one CI run on 2 cores; after a trim, 0.4-7.2 MiB (fragments a trim
cannot give back). The bounds: 32 MiB as held (the bound the growth was first judged by),
16 MiB after a trim (a leak of 0.3 MiB per load passes neither).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_repeat_cases as cases  # noqa: E402

MiB = 2**20
#: Growth of RssAnon allowed per rank over the measured rounds, as the process holds it:
#: the issue's bound. dcp's trims (``_execute.TRIM_GROWTH_BYTES``, 8 MiB, or every 30 s)
#: leave up to 8 MiB of freed pages plus what a round allocates after its last trim: 5-17
#: MiB measured (CI runs on 2 cores reached 16.6).
BOUND = 32 * MiB
#: Growth allowed of what the process still holds after a ``malloc_trim`` (freed pages given
#: back): what a leak keeps; 0.4-7.2 MiB measured (module docstring).
HELD_BOUND = 16 * MiB
ROUNDS = 10  # x 2 formats x 3 modes = 60 measured loads per rank


@pytest.mark.slow
def test_repeated_loads_keep_memory_bounded(tmp_path):
    paths = {"native": str(tmp_path / "native"), "hf": str(tmp_path / "hf")}
    cases.write(paths["native"], paths["hf"])
    per_rank = run_ranks(cases.repeated, 4, paths, [True, False, "auto"], ROUNDS, timeout=300, pg_timeout=240)
    grew = []
    for rank, r in enumerate(per_rank):
        assert r["wrong"] == [], f"rank {rank}: {r['wrong'][:5]}"
        assert len(r["anon"]) == ROUNDS + 1 and len(r["held"]) == 2
        grew.append((r["anon"][-1] - r["anon"][0], r["rss"][-1] - r["rss"][0], r["held"][1] - r["held"][0]))
    shown = ", ".join(f"rank {k}: RssAnon {a / MiB:+.1f} MiB (VmRSS {v / MiB:+.1f}, after a trim {h / MiB:+.1f})"
                      for k, (a, v, h) in enumerate(grew))
    print(shown)
    assert max(a for a, _, _ in grew) < BOUND, f"{ROUNDS * 6} repeated loads grew {shown}; bound {BOUND / MiB:.0f} MiB"
    assert max(h for _, _, h in grew) < HELD_BOUND, (
        f"{ROUNDS * 6} repeated loads kept {shown}; bound after a trim {HELD_BOUND / MiB:.0f} MiB")
