"""The user guide and the code agree: every ``LoadReport`` field is in the table of
docs/failures.md,
``load``'s docstring names the default planner the code uses, the ``--allow-pickle`` help
texts say what the flag does, and ``checkpoint_id`` is described as the directory it must be."""

from __future__ import annotations

import dataclasses
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import dcp_load
import pytest
from dcp_load import LoadReport
from dcp_load.cli._main import main

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "failures.md"


def test_every_load_report_field_is_in_the_guide_table():
    text = GUIDE.read_text()
    table = text[text.index("## Report fields (`LoadReport`)"):]
    table = table[:table.index("\n\n", table.index("| field |"))]
    named = set(re.findall(r"`([a-z_]+)`", table))
    fields = {f.name for f in dataclasses.fields(LoadReport)} | {"read_amplification"}
    assert fields - named == set(), f"LoadReport fields missing from the table of docs/failures.md: {fields - named}"


def test_load_docstring_names_the_default_planner_the_code_uses():
    doc = " ".join(dcp_load.load.__doc__.split())
    assert "default: GreedyPlanner" not in doc and "``GreedyPlanner``)" not in doc
    assert "the byte-level owner rule" in doc


@pytest.mark.parametrize(("command", "says"), [("inspect", "values that only unpickling can read"),
                                                ("plan", "has no effect")])
def test_allow_pickle_help_says_what_the_flag_does(command, says):
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(out.getvalue().split())
    assert says in text and "pickled metadata" not in text, text


def test_checkpoint_id_is_described_as_a_directory(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint_id= \(the checkpoint directory\)"):
        dcp_load.load({})
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(dcp_load.LoadError, match="not a directory; pass the checkpoint directory"):
        dcp_load.load({"w": 0}, checkpoint_id=tmp_path / "model.safetensors")
