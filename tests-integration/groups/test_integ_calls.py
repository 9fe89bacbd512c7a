"""Calls pair up across ranks whatever came before (integ_calls_cases, real gloo ranks): a
rank that refuses ``transfer``, ``save`` or ``async_save`` on its arguments tells the others
at once (they raise within seconds, naming it, instead of after the timeout), a rank that
comes to ``transfer`` after the others gave up waiting fails alone at once, calls without
collectives on one rank (``save(no_dist=True)``, ``read_state_dict``, ``load(no_dist=True)``)
take part in nothing, and after any such sequence the next good call of every operation succeeds on every rank, with process groups
and file descriptors bounded (hypothesis: random sequences of good and bad calls)."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import integ_calls_cases as cases  # noqa: E402


def _good_after(per_rank):
    for rank, r in enumerate(per_rank):
        assert [o for o, _ in r["after"]] == ["ok"] * 4, (rank, r["after"])
        groups, fds = r["before"]
        assert r["end"][0] <= groups + 1 and r["end"][1] <= fds + 8, (rank, r["before"], r["end"])


def test_a_refusal_on_one_rank_is_known_at_once_and_counts(tmp_path):
    calls = [("transfer", 1), ("save", 1), ("async", 2), ("transfer", 3)]
    per_rank = run_ranks(cases.run_sequence, 4, str(tmp_path), calls, timeout=300, pg_timeout=120)
    for k, (_, who) in enumerate(calls):
        for rank, r in enumerate(per_rank):
            outcome, seconds = r["outcomes"][k]
            if rank == who:
                assert outcome.startswith("ValueError"), (k, rank, outcome)
            else:
                assert outcome.startswith("LoadError") and f"rank {who}: raised before taking part" in outcome, \
                    (k, rank, outcome)
                assert seconds < cases.WAIT_S * 5, (k, rank, seconds)  # not the 30 s timeout
    _good_after(per_rank)


def test_a_late_rank_fails_alone_and_the_next_calls_pair(tmp_path):
    calls = [("late", 0), ("transfer", -1), ("late", 1), ("late", 1), ("save", -1)]
    per_rank = run_ranks(cases.run_sequence, 2, str(tmp_path), calls, timeout=300, pg_timeout=120)
    for k, (op, who) in enumerate(calls):
        for rank, r in enumerate(per_rank):
            outcome, seconds = r["outcomes"][k]
            if op == "late" and rank == who:  # at once, naming the call the other moved on to
                assert outcome.startswith("LoadError") and "came after the other ranks gave up on it" in outcome, \
                    (k, outcome)
                assert seconds < cases.WAIT_S, (k, seconds)
            elif op == "late":  # waited out its timeout for the late rank, naming it
                assert outcome.startswith("LoadError") and "did not reach dcp-transfer" in outcome, (k, outcome)
            else:
                assert outcome == "ok", (k, rank, outcome)
    _good_after(per_rank)


def test_two_ranks_alone_then_collective_calls_on_long_paths(tmp_path):
    """3 ranks; ranks 1 and 2 each save (sync and async), read and load without collectives,
    then every rank saves, async-saves and transfers together, in a folder whose path is
    longer than a call record keeps (300 characters)."""
    root = tmp_path / ("d" * 120) / ("e" * 120) / ("f" * 100)
    root.mkdir(parents=True)
    calls = [("alone", 1), ("alone", 2), ("save", -1), ("async", -1), ("alone", 2), ("transfer", -1)]
    per_rank = run_ranks(cases.run_sequence, 3, str(root), calls, timeout=300, pg_timeout=120)
    for rank, r in enumerate(per_rank):
        for k, (op, who) in enumerate(calls):
            want = ("ok" if rank == who else "not called") if op == "alone" else "ok"
            assert r["outcomes"][k][0] == want, (rank, k, r["outcomes"][k])
    _good_after(per_rank)


# No shrinking (each example is a multi-rank launch: a failure reports the sequence as
# drawn), and the same draws on every run, so the suite's time is bounded.
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@example(calls=[("late", 0), ("transfer", 1)])  # the late rank's next call is refused: the other learns it at once
@example(calls=[("late", 0), ("transfer", 0)])  # the late rank refuses its next call
@example(calls=[("late", 0), ("save", 1)])  # the late rank reaches the next save first
@example(calls=[("alone", 1), ("save", -1), ("alone", 0), ("transfer", -1)])  # one-process calls shift nothing
# Random sequences of good, refused and late calls and calls without collectives on random ranks.
@given(st.lists(st.tuples(st.sampled_from(["transfer", "save", "async", "late", "alone"]), st.integers(-1, 1)),
                min_size=1, max_size=5))
def test_after_any_sequence_the_next_good_calls_succeed(tmp_path_factory, calls):
    calls = [(op, 0 if op in ("late", "alone") and who < 0 else who) for op, who in calls]
    per_rank = run_ranks(cases.run_sequence, 2, str(tmp_path_factory.mktemp("seq")), calls, timeout=300,
                         pg_timeout=120)
    _good_after(per_rank)
