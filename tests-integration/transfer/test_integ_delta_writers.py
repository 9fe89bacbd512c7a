"""``transfer(..., delta=True)`` where the destinations do not hold the delta plan's previous
step although they are the same tensors (another kept plan or a ``delta=False`` refresh wrote
them since), and sources whose strides are not row-major (integ_delta_writers_cases): exact
values on real gloo ranks, the whole piece sent where the destination was overwritten."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_delta_writers_cases as cases  # noqa: E402


def test_another_plan_into_the_same_destination_makes_the_next_delta_send_everything():
    steps = run_ranks(cases.two_plans_one_destination, 2, timeout=180, pg_timeout=120)[1]
    assert [s["wrong"] for s in steps] == [0, 0, 0], steps
    assert steps[2]["reused"] and steps[2]["received"] == steps[2]["kept"], steps  # plan A kept, sent whole


def test_a_full_refresh_between_deltas_makes_the_next_delta_send_everything():
    steps = run_ranks(cases.refresh_between_deltas, 2, timeout=180, pg_timeout=120)[1]
    assert [s["wrong"] for s in steps] == [0, 0, 0], steps
    assert steps[2]["reused"] and steps[2]["received"] == steps[2]["kept"], steps


@pytest.mark.parametrize("kind", ["transposed", "channels_last"])
@pytest.mark.parametrize("changes", [1, 40])
def test_delta_from_sources_that_are_not_row_major(kind, changes):
    steps = run_ranks(cases.strided_sources, 2, kind, changes, timeout=180, pg_timeout=120)[1]
    assert [s["wrong"] for s in steps] == [0, 0, 0], steps
    assert steps[1]["reused"] and 0 < steps[1]["received"] < steps[1]["kept"], steps  # only what changed


def test_a_write_through_a_view_inside_the_destination_makes_the_next_delta_send_it():
    steps = run_ranks(cases.view_overlaps_destination, 2, timeout=180, pg_timeout=120)[1]
    assert [s["wrong"] for s in steps] == [0, 0, 0], steps
    assert steps[2]["reused"] and steps[2]["received"] == steps[2]["kept"], steps  # plan A kept, sent whole
