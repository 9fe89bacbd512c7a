"""Store keys as foreign input (integ_fuzz_cases, 2 real gloo ranks): while ``load``, ``save``,
``async_save`` and ``transfer`` run, one rank's reads of one kind of key (abort, missing,
reduction lanes and results, async_save's write errors and outcome) return a value dcp did not
write: a pickle that would run code, older dcp formats, JSON of the wrong shape, oversized and
random bytes. Only typed errors come out, within the call's bound, no code runs, and the next
clean call of the same operation succeeds on both ranks, or, after a failure in a load's or
transfer's execute phase (where broadcasts may be pending), refuses at once saying to
re-create the process group, as after any failure there; so the reduction keys come last."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_fuzz_cases as cases  # noqa: E402

TYPED = ("LoadError", "ControlMessageError", "PeerFailure", "TransferGroupError")
PATTERNS = {
    "load": [r"/abort$", r"/missing$", r"/r/\d+/\d+$", r"/r/\d+/out$"],
    "save": [r"/abort$", r"/r/\d+/out$"],
    "async": [r"/abort$", r"/fin/w/\d+$", r"/fin/outcome$"],
    "transfer": [r"/abort$", r"/r/\d+/out$"],
}


def test_foreign_store_values_give_typed_errors_only(tmp_path):
    if os.path.exists(cases.MARKER):
        os.remove(cases.MARKER)
    plan = [(op, pattern, index) for op, patterns in PATTERNS.items() for pattern in patterns
            for index in (0, 4, 11, 47)]  # a pickle, JSON of another kind, random bytes
    plan.sort(key=lambda case: "/r/" in case[1])  # reductions last (module docstring)
    per_rank = run_ranks(cases.run_fuzz, 2, str(tmp_path), plan, 1234, timeout=600, pg_timeout=120)
    assert not os.path.exists(cases.MARKER), "a pickle from the store was unpickled"
    counts = {"ok": 0, "typed": 0, "read": 0, "unusable": 0}
    for rank, results in enumerate(per_rank):
        for (op, pattern, index), (outcome, seconds, hits, clean) in zip(plan, results, strict=True):
            where = (rank, op, pattern, index, outcome, clean)
            assert outcome == "ok" or outcome.startswith(TYPED), where
            assert seconds < 60, where
            assert clean == "ok" or (clean.startswith("LoadError") and "re-create" in clean.replace("\n", " ")
                                     or "unfinished collective" in clean), where
            counts["unusable"] += clean != "ok"
            counts["ok" if outcome == "ok" else "typed"] += 1
            counts["read"] += hits > 0
    print(f"control fuzz: {len(plan)} cases x 2 ranks: {counts}")
    assert counts["typed"] > 0 and counts["read"] > 0, counts
