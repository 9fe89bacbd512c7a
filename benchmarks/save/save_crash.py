"""Save-crash trials, full count (not a test; the CI subset is
tests-integration/save/test_integ_save_crash.py): saves and overwrites by one process and by 2
gloo ranks, SIGKILLed at random points until ``--kills`` of them were killed before they
returned, after which the directory
must hold the old checkpoint or the new one, whole and exact, or none when there was none.
Prints the outcome counts, every lost checkpoint and the time.

    .venv/bin/python benchmarks/save/save_crash.py [--kills 200] [--seed 20261201]

Exit status 1 when any checkpoint was lost.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests-integration", "save"))

import save_crash as sc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--verbose", action="store_true", help="print every trial")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = sc.run_trials(args.kills, worlds=tuple(args.worlds), seed=args.seed,
                           log=(lambda line: print(line, flush=True)) if args.verbose else None)
    counts = result["counts"]
    trials = counts.get("killed", 0) + counts.get("finished", 0)
    print(f"seed {args.seed}, worlds {args.worlds}: {trials} trials for {args.kills} kills in "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"killed before save returned: {counts.get('killed', 0)}, finished before the kill: "
          f"{counts.get('finished', 0)}")
    for key in sorted(k for k in counts if k.startswith("w")):
        print(f"  {key}: {counts[key]}")
    for line in result["failures"]:
        print(f"LOST {line[:500]}")
    print(f"lost checkpoints: {len(result['failures'])}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
