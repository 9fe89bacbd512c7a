"""``dcp --help`` names every command, and every checkpoint path argument says that an
object-store URI works (before, the description left out convert and plan and no path
argument mentioned s3://)."""

from __future__ import annotations

import pytest
from dcp_load.cli._main import main


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_top_level_help_names_every_command_and_uris(capsys) -> None:
    text = _help(capsys)
    for command in ("inspect", "verify", "plan", "convert", "demo"):
        assert command in text.split("{", 1)[1].split("}", 1)[0], text  # the command list
    assert "plan the load of and convert" in text and "s3://bucket/prefix" in text, text


@pytest.mark.parametrize("command", ["inspect", "verify", "plan", "convert"])
def test_each_path_argument_says_s3_works(capsys, command) -> None:
    assert "s3://bucket/prefix" in _help(capsys, command)


def test_demo_passes_modes_through(capsys) -> None:
    assert "--modes" in _help(capsys, "demo")
    from dcp_load.demo import main as demo_main

    with pytest.raises(SystemExit):
        demo_main(["--modes", "auto,sometimes"])
    assert "unknown: sometimes" in capsys.readouterr().err
