"""``transfer_group`` on its own (one process): the bound on reaching a group that never
opens; and the wording of its messages (which ranks are which job's, the names a
destination could come from)."""

from __future__ import annotations

import socket
import time

import pytest
from dcp_load import TransferGroupError, transfer_group
from dcp_load.transferring._sync_group import TransferGroup

TIMEOUT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("side", ["trainer", "engine"])
def test_a_group_that_never_forms_fails_within_its_timeout(side):
    start = time.monotonic()
    with pytest.raises(TransferGroupError) as caught:
        transfer_group("127.0.0.1", free_port(), side=side, rank=0, world_sizes=(1, 1), timeout=TIMEOUT_S)
    seconds = time.monotonic() - start
    # the bound is the timeout (the engine's attempts to reach the store included), plus
    # the scheduling slack of a busy 2-core machine
    assert TIMEOUT_S - 0.1 <= seconds < TIMEOUT_S + 1.0, (seconds, str(caught.value))
    other = "engine rank 0 did not join" if side == "trainer" else "trainer rank 0 did not open the group"
    assert f"({side} rank 0)" in str(caught.value) and other in str(caught.value), caught.value


def test_sides_text_speaks_of_one_rank_and_of_several():
    def text(sizes):
        group = TransferGroup(None, 0, sum(sizes), side="trainer", side_rank=0, world_sizes=sizes, key="k",
                              hosted=None)
        return group.sides_text()

    assert text((1, 2)) == "In transfer group 'k': rank 0 is the trainer's rank 0, ranks 1-2 the engine's ranks 0-1."
    assert text((2, 1)) == "In transfer group 'k': ranks 0-1 are the trainer's ranks 0-1, rank 2 the engine's rank 0."


def test_a_dst_no_src_holds_is_named_with_the_src_names_not_a_checkpoint():
    import torch
    from dcp_load import transfer
    from dcp_load._errors import LoadError

    dst = {"ref.w": torch.full((2, 2), float("nan"))}
    with pytest.raises(LoadError) as caught:
        transfer({"policy.w": torch.ones(2, 2)}, dst)
    message = str(caught.value)
    assert "dst 'ref.w': no rank's src holds 'ref.w'" in message, message
    assert "the ranks' src hold 1 key(s), for example 'policy.w'" in message and "checkpoint" not in message, message
    assert torch.isnan(dst["ref.w"]).all()
