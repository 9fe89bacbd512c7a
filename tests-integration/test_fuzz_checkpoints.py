"""Fuzzing the readers through dcp_load.load: a few hundred seeded mutants of small
checkpoints in six formats (native JSON, native with pickled values, Hugging Face single
file and index, torch DCP default writer and HF writer), each loaded into poisoned targets
in a child process. Asserts only typed errors with targets untouched, no hang, crash or
memory blow-up, and no silently changed tensor or value in the native format (block
checksums, value checksums).
The full 10,000-mutant run is benchmarks/fuzz_checkpoints.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fuzz_mutations as fm  # noqa: E402

COUNT = int(os.environ.get("DCP_FUZZ_COUNT", "300"))
SEED = int(os.environ.get("DCP_FUZZ_SEED", "20261201"))


def test_fuzz_checkpoints(tmp_path):
    seeds = fm.build_seeds(str(tmp_path))
    for fmt in fm.FORMATS:  # unmutated, every seed loads exactly
        assert fm.run_one(fmt, seeds[fmt]) == ("same", ""), fmt
    result = fm.run_all(seeds, SEED, COUNT, batch=100, batch_timeout=120, workers=1)
    print(fm.summary(result))
    assert sum(result["counts"].values()) == COUNT
    assert result["counts"]["same"] + result["counts"]["typed"] > COUNT // 2  # the mutants load or fail
    assert not result["failures"], "\n".join(
        f"mutant {i} ({fmt}, {desc}): {outcome}: {detail}" for i, fmt, desc, outcome, detail in result["failures"][:20])
