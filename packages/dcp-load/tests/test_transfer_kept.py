"""The kept transfer plans (``dcp_load.transferring._kept``), on one process: the newest plan
whose layout is this rank's is reused (two plans may share a rank's layout), a plan made
again replaces the older one, the oldest beyond ``MAX_PLANS`` is released, ``keep_plan=False``
releases the plan used, a failure forgets it, and every release closes the plan's groups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dcp_load.transferring import _kept


class _Groups:
    def __init__(self) -> None:
        self.closed: list[tuple[bool, bool]] = []

    def close(self, *, wait_for_peers: bool, raise_errors: bool) -> None:
        self.closed.append((wait_for_peers, raise_errors))


class _Platform:
    """A group whose object stays alive (dcp-platform's joined groups carry ``dcp_group_key``)."""

    group_key = "test-kept"

    def __init__(self) -> None:
        self.world = SimpleNamespace(dcp_group_key=self.group_key)

    def is_distributed(self) -> bool:
        return True

    def world_group(self) -> object:
        return self.world


@pytest.fixture
def platform():
    p = _Platform()
    yield p
    _kept._PLANS.pop(p.group_key, None)


def _entry(platform: _Platform, job: int, key: int) -> SimpleNamespace:
    return SimpleNamespace(job=job, key=key, world=platform.world, groups=_Groups())


def _agree(platform: _Platform, key: int, keep_plan: bool = True, failed: bool = False):
    entry, keep, extra = _kept.agree(platform, False, key, failed=failed, keep_plan=keep_plan, watch=None,
                                     extra=(5, -5))
    assert extra == [5, -5]  # the caller's lanes come back reduced (one rank: as sent)
    return entry, keep


def test_two_plans_sharing_this_ranks_layout_are_both_kept_and_the_newest_fitting_is_reused(platform):
    first, second = _entry(platform, 1, key=7), _entry(platform, 2, key=7)
    _kept.keep(platform, first, True)
    _kept.keep(platform, second, True)
    assert _agree(platform, 7) == (second, True)
    assert first.groups.closed == [] and second.groups.closed == []
    assert _agree(platform, 8) == (None, True)  # no kept plan has this layout
    assert _agree(platform, 7, failed=True)[0] is None  # a rank failed already: plan again


def test_the_oldest_beyond_max_plans_is_released_and_a_plan_made_again_replaces_its_twin(platform):
    entries = [_entry(platform, job, key=job) for job in range(_kept.MAX_PLANS + 1)]
    for e in entries:
        _kept.keep(platform, e, True)
    assert entries[0].groups.closed == [(False, False)]
    assert [e.groups.closed for e in entries[1:]] == [[]] * _kept.MAX_PLANS
    twin = _entry(platform, 3, key=3)
    _kept.keep(platform, twin, True)
    assert entries[3].groups.closed == [(False, False)]
    assert _agree(platform, 3)[0] is twin


def test_keep_plan_false_releases_the_plan_used_and_a_failure_forgets_it(platform):
    used, failed = _entry(platform, 1, key=1), _entry(platform, 2, key=2)
    _kept.keep(platform, used, True)
    _kept.keep(platform, failed, True)
    entry, keep = _agree(platform, 1, keep_plan=False)
    assert entry is used and keep is False
    _kept.keep(platform, entry, keep)
    assert used.groups.closed == [(True, True)] and _agree(platform, 1)[0] is None
    _kept.forget(platform, failed)
    assert failed.groups.closed == [(False, False)] and _agree(platform, 2)[0] is None
