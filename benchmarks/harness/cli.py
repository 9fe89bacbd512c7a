"""The command line and output pieces the benchmark scripts share.

``parser`` builds a script's argument parser from its docstring with the options most
scripts take (``--quick``, ``--repeats``, ``--workdir``, ``--rank-timeout``, ``--json``),
each added only where the script asks for it, with the script's own default and help.
``ints`` / ``names`` read the comma-separated lists, ``write_json`` writes the ``--json``
file, ``stamped`` prints a line with the seconds since the run started.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Seconds a multi-rank run may take before the launcher gives up (``--rank-timeout``).
RANK_TIMEOUT_S = 900.0


def parser(doc: str | None, *, quick: str | None = None, repeats: int | None = None,
           repeats_help: str | None = None, workdir: str | None = None, rank_timeout: bool = False,
           json_help: str | None = None, first: str = "line") -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first line (``first="paragraph"``: its first
    paragraph), with the shared options asked for: ``quick`` is the help of ``--quick``,
    ``repeats`` the default of ``--repeats``, ``workdir`` the default of ``--workdir``,
    ``json_help`` the help of ``--json FILE``; ``rank_timeout`` adds ``--rank-timeout``."""
    text = doc or ""
    ap = argparse.ArgumentParser(description=text.split("\n\n")[0] if first == "paragraph" else text.splitlines()[0])
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    if workdir is not None:
        ap.add_argument("--workdir", default=workdir)
    if rank_timeout:
        ap.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT_S)
    if json_help is not None:
        ap.add_argument("--json", default=None, help=json_help)
    return ap


def ints(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (empty items skipped)."""
    return [int(s) for s in text.split(",") if s]


def names(text: str) -> list[str]:
    """``"dcp,torch"`` -> ``["dcp", "torch"]`` (empty items skipped)."""
    return [s for s in text.split(",") if s]


def write_json(path: str | Path | None, data: Any) -> None:
    """Write ``data`` to ``path`` (the ``--json`` file) when one was given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))


def stamped(width: int = 7) -> Callable[[str], None]:
    """A ``log(msg)`` printing ``[  12.3s] msg``: seconds since this call, ``width`` wide."""
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:{width}.1f}s] {msg}", flush=True)

    return log
