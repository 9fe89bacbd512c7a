"""Runs a README code block inside gloo ranks for test_integ_readme_resume (not a test
module): the block is executed as written, with torch.distributed already initialised."""

from __future__ import annotations

import contextlib
import io
import traceback
from typing import Any


def run_block(rank: int, world: int, code: str) -> dict[str, Any]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {"__name__": "__docs__"})  # noqa: S102 - the block under test
    except Exception:  # noqa: BLE001 - returned for the test to show
        return {"error": traceback.format_exc(), "stdout": out.getvalue()}
    return {"error": None, "stdout": out.getvalue()}
