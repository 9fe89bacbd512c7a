"""Fuzzing the readers through dcp_load.load: a few hundred seeded mutants of small
checkpoints in six formats (native JSON, native with pickled values, Hugging Face single
file and index, torch DCP default writer and HF writer), 4 in 10 of them changing a pickle
by its structure (negative and huge lengths, deep nesting, shared containers passed to
allowed callables, BUILD on stand-ins: tests-integration/formats/pickle_mutations.py), each loaded
into poisoned targets in a child process under a time limit, its peak memory measured.
Asserts only typed errors with targets untouched, no hang, crash or memory beyond the bound,
and no silently changed tensor or value in the native format (block checksums, value
checksums). The full 20,000-mutant run is benchmarks/storage/fuzz_checkpoints.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fuzz_mutations as fm  # noqa: E402

COUNT = int(os.environ.get("DCP_FUZZ_COUNT", "400"))
SEED = int(os.environ.get("DCP_FUZZ_SEED", "20261201"))


def test_fuzz_checkpoints(tmp_path):
    seeds = fm.build_seeds(str(tmp_path))
    for fmt in fm.FORMATS:  # unmutated, every seed loads exactly
        assert fm.run_one(fmt, seeds[fmt]) == ("same", ""), fmt
    result = fm.run_all(seeds, SEED, COUNT, batch=100, batch_timeout=300, workers=1, mutant_timeout=60)
    print(fm.summary(result))
    assert sum(result["counts"].values()) == COUNT
    assert result["counts"]["same"] + result["counts"]["typed"] > COUNT // 2  # the mutants load or fail
    assert sum(result["by_format"]["torch-dcp-pickle"].values()) == COUNT * 3 // 10  # the pickle mutants ran
    assert not result["failures"], "\n".join(
        f"mutant {i} ({fmt}, {desc}): {outcome}: {detail}" for i, fmt, desc, outcome, detail in result["failures"][:20])
