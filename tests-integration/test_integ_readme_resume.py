"""The root README's resume example (model, optimizer and scheduler through torch's
get_state_dict / set_state_dict around dcp_load.save and dcp_load.load) runs as written on
2 real gloo ranks, with its own asserts that the resumed job continues exactly."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_docs_cases as cases  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"<!-- docs-test: ranks=(\d+) -->\n```python\n(.*?)```", re.S)


def test_readme_resume_block_runs_on_two_ranks(tmp_path):
    blocks = [(int(n), code) for n, code in MARKER.findall(README.read_text())]
    resume = [(n, code) for n, code in blocks if "set_state_dict" in code]
    assert len(resume) == 1, f"expected one resume block marked docs-test, found {len(resume)}"
    ranks, code = resume[0]
    assert ranks == 2
    results = run_ranks(cases.run_block, ranks, code, timeout=240, pg_timeout=120,
                        env={"DCP_DOCS_TMP": str(tmp_path)})
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}:\n{r['error']}"
        assert f"rank {rank}: read " in r["stdout"]
    assert (tmp_path / "dcp-resume" / "step-2").is_dir()
