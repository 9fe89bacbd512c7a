"""What ranks are told when they planned from different checkpoint metadata
(``_digest.checkpoint_causes``, used by the derived and the gathered paths alike; the
real ranks: tests-integration/failures/test_integ_disagree.py): ranks that opened different
checkpoints are shown which rank opened which, a shared path whose metadata differs
names the ranks that differ, and equal metadata is no problem."""

from __future__ import annotations

from dcp_load.plan._digest import checkpoint_causes


def test_different_paths_show_each_ranks_checkpoint_on_every_rank() -> None:
    out = checkpoint_causes([(1, "/ck/step-a"), (2, "/ck/step-b"), (1, "/ck/step-a"), (3, None)])
    assert sorted(out) == [0, 1, 2, 3] and len({tuple(c) for c in out.values()}) == 1
    (text,) = out[0]
    assert ("opened different checkpoints, whose metadata differs (ranks 0, 2 opened '/ck/step-a'; rank 1 opened "
            "'/ck/step-b'; rank 3 opened a storage_reader without a path): pass every rank the same checkpoint_id"
            ) in text, text
    assert "layout" not in text


def test_one_path_names_the_ranks_whose_metadata_differs() -> None:
    out = checkpoint_causes([(1, "/ck"), (2, "/ck"), (1, "/ck"), (2, "/ck"), (1, "/ck")])
    assert sorted(out) == [1, 3]
    assert out[1] == ["the checkpoint metadata differs from rank 0's (on ranks 1, 3), though every rank opened "
                      "'/ck': a copy that differs between nodes, a checkpoint re-saved during the load, or "
                      "different sources="]


def test_equal_metadata_is_no_problem_wherever_it_is_mounted() -> None:
    assert checkpoint_causes([(7, "/mnt/a/ck"), (7, "/data/ck")]) == {}


def test_many_checkpoints_are_cut_short() -> None:
    (text,) = checkpoint_causes([(r, f"/ck/{r}") for r in range(9)])[0]
    assert "rank 5 opened '/ck/5'; and 3 more checkpoint(s)" in text and "'/ck/6'" not in text
