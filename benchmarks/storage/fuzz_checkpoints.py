"""Checkpoint fuzzer, full count (not a test; the CI subset is
tests-integration/formats/test_fuzz_checkpoints.py): builds small checkpoints in six formats, loads
``--count`` seeded mutants with dcp_load.load(..., no_dist=True) into poisoned targets in
child processes, and prints the outcome counts per format, every failure and the time.
4 of every 10 mutants change a pickle by its structure (torch DCP's .metadata, a blob's
data.pkl, a native values.pkl: tests-integration/formats/pickle_mutations.py).

    .venv/bin/python benchmarks/storage/fuzz_checkpoints.py [--count 20000] [--seed 20261201] [--workers 1]

Exit status 1 when any mutant failed (untyped error, targets touched, silent change in the
native format, hang past --mutant-timeout, crash, peak memory beyond the bound).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests-integration", "formats"))

import fuzz_mutations as fm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--batch-timeout", type=float, default=900.0)
    ap.add_argument("--mutant-timeout", type=float, default=60.0, help="seconds one mutant may take")
    ap.add_argument("--only", type=int, nargs="*", help="run only these mutant indices (reproduce failures)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcp-fuzz-seeds-") as root:
        seeds = fm.build_seeds(root)
        result = fm.run_all(seeds, args.seed, args.count, batch=args.batch, batch_timeout=args.batch_timeout,
                            workers=args.workers, log=lambda line: print(line, flush=True), only=args.only,
                            mutant_timeout=args.mutant_timeout)
    print(f"seed {args.seed}, workers {args.workers}, mutant timeout {args.mutant_timeout} s")
    print(fm.summary(result))
    for i, fmt, desc, outcome, detail in result["failures"]:
        print(f"FAILED mutant {i} ({fmt}, {desc}): {outcome}: {detail[:500]}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
