"""The standalone example in the package README (examples/push_parameters.py): the README
shows the file verbatim, and its push_parameters works on 4 real gloo ranks with the
receivers poisoned (every parameter and buffer arrives bit-exact from the source rank)."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import broadcast_rank_cases as cases  # noqa: E402

PACKAGE = Path(__file__).parent.parent
EXAMPLE = PACKAGE / "examples" / "push_parameters.py"


def test_broadcast_readme_shows_the_example_verbatim():
    readme = (PACKAGE / "README.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in readme


def test_broadcast_example_pushes_parameters():
    per_rank = run_ranks(cases.example_case, 4, str(EXAMPLE), timeout=120)
    assert all(r == per_rank[1] for r in per_rank)
    # Linear (weight, bias), BatchNorm1d (weight, bias, running mean/var, count), Linear
    assert per_rank[0][-1] == "items=9"
