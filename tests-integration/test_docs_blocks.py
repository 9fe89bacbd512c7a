"""Every ```python block of README.md, packages/*/README.md and the user guide (docs/**/*.md) runs (one fresh process, or N
real gloo ranks when marked ``<!-- docs-test: ranks=N -->``) or is a fragment on purpose
(``<!-- docs-test: fragment -->``), and every block fenced as python parses. The marker
parser itself is checked on small Markdown texts. Runner and convention: docs_blocks.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import docs_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md")), *sorted(ROOT.glob("docs/**/*.md"))]
BLOCKS = [b for path in READMES for b in docs_blocks.find_blocks(path)]


def _id(block: docs_blocks.Block) -> str:
    return f"{Path(block.path).relative_to(ROOT)}:{block.line}"


@pytest.mark.parametrize("block", BLOCKS, ids=[_id(b) for b in BLOCKS])
def test_readme_block_runs(block: docs_blocks.Block):
    docs_blocks.run_block(block)


def _blocks(tmp_path: Path, text: str) -> list[docs_blocks.Block]:
    md = tmp_path / "doc.md"
    md.write_text(text)
    return docs_blocks.find_blocks(md)


def test_markers_are_read_from_the_line_before_the_fence(tmp_path):
    blocks = _blocks(tmp_path, (
        "<!-- docs-test: fragment (needs MindSpore) -->\n```python\nimport mindspore\n```\n"
        "text\n<!-- docs-test: ranks=3 -->\n\n```python\nx = 1\n```\n"
        "```python\ny = 2\n```\n```bash\nls\n```\n  ```py\n  z = 3\n  ```\n"))
    assert [(b.line, b.fragment, b.ranks, b.code) for b in blocks] == [
        (2, True, 0, "import mindspore\n"), (8, False, 3, "x = 1\n"),
        (11, False, 0, "y = 2\n"), (17, False, 0, "z = 3\n")]


def test_unknown_marker_and_unclosed_fence_are_errors(tmp_path):
    with pytest.raises(docs_blocks.DocsBlockError, match=r"doc.md:1: unknown docs-test marker.*ranks=N"):
        _blocks(tmp_path, "<!-- docs-test: ranks=0 -->\n```python\nx = 1\n```\n")
    with pytest.raises(docs_blocks.DocsBlockError, match=r"doc.md:2: code fence never closed"):
        _blocks(tmp_path, "text\n```python\nx = 1\n")


def test_a_signature_fenced_as_python_fails_even_as_a_fragment(tmp_path):
    [block] = _blocks(tmp_path, "<!-- docs-test: fragment -->\n```python\nload(sd, *, x=1) -> Report\n```\n")
    with pytest.raises(docs_blocks.DocsBlockError, match=r"doc.md:2: .*fence signatures .* as ```text"):
        docs_blocks.run_block(block)


def test_a_failing_block_reports_its_place_and_output(tmp_path):
    [block] = _blocks(tmp_path, "intro\n\n```python\nimport os\nprint(os.environ['DCP_DOCS_TMP'])\n"
                                "raise SystemExit('boom')\n```\n")
    with pytest.raises(docs_blocks.DocsBlockError, match=r"(?s)doc.md:3: the block exited with 1:.*dcp-docs-.*boom"):
        docs_blocks.run_block(block)
