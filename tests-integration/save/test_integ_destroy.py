"""``async_save`` in a script that destroys the process group at once and exits without
``result()`` (integ_destroy_cases.py run as a program per rank, real gloo ranks): the save
commits (a fresh launch loads the new values into poisoned targets), also when rank 0 hosts
the store and finishes long before the others look for the outcome; a save that fails
there says so on every rank's stderr, by default, and the old checkpoint stays whole."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import integ_destroy_cases as cases  # noqa: E402


def _init_method(kind: str, tmp: Path, gen: int) -> str:
    if kind == "file":
        return f"file://{tmp / f'init-{gen}'}"
    with socket.socket() as s:  # rank 0 hosts the TCPStore on this port
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _launch(world: int, kind: str, tmp: Path, path: str, gen: int, mode: str) -> list[tuple[int, str]]:
    """Run the script on ``world`` ranks; each rank's (exit code, stdout + stderr)."""
    init = _init_method(kind, tmp, gen)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "integ_destroy_cases.py"), str(r), str(world), init, path,
                               str(gen), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    deadline, out = time.monotonic() + 240, []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n(killed after 240 s)"
        out.append((p.returncode, text))
    return out


def _loaded_gen(world: int, path: str) -> list[int | None]:
    return [r["gen"] for r in run_ranks(cases.holds, world, path, timeout=240, pg_timeout=120)]


@pytest.mark.parametrize(("world", "kind", "mode"), [(2, "tcp", "late-readers"), (4, "tcp", "late-readers"),
                                                     (4, "file", "plain")])
def test_the_save_commits_when_the_group_is_destroyed_at_once(tmp_path: Path, world: int, kind: str,
                                                               mode: str) -> None:
    path = str(tmp_path / "ckpt")
    for gen, how in ((1, "plain"), (2, mode)):
        ranks = _launch(world, kind, tmp_path, path, gen, how)
        for rank, (rc, text) in enumerate(ranks):
            assert rc == 0 and f"rank {rank}: returned" in text, (gen, rank, rc, text[-3000:])
            assert "failed" not in text, (gen, rank, text[-3000:])
    assert _loaded_gen(world, path) == [2] * world


def test_a_failed_save_nobody_observed_warns_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert all(rc == 0 for rc, _ in _launch(2, "file", tmp_path, path, 1, "plain"))
    for rank, (rc, text) in enumerate(_launch(2, "file", tmp_path, path, 2, "fail")):
        assert rc == 0, (rank, text[-3000:])
        # logging's default (no handler configured) prints warnings and errors to stderr
        assert f"into {path}: failed (the checkpoint before it stays committed)" in text, (rank, text[-3000:])
        assert "rank 1: OSError: [Errno 28] No space left on device" in text, (rank, text[-3000:])
        assert "its result() was never called" in text, (rank, text[-3000:])
    assert _loaded_gen(2, path) == [1, 1]


def test_a_commit_that_lost_its_store_names_the_destroyed_group(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert all(rc == 0 for rc, _ in _launch(2, "tcp", tmp_path, path, 1, "plain"))
    rc, text = _launch(2, "tcp", tmp_path, path, 2, "rank0-exits")[1]
    assert rc == 0, text[-3000:]
    assert f"into {path}: failed (this rank did not learn whether rank 0 committed it)" in text, text[-3000:]
    assert "the process group was destroyed before this save committed" in text, text[-3000:]
    assert _loaded_gen(2, path) == [1, 1]  # rank 0 never wrote: the old checkpoint stands
