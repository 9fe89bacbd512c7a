"""Find and run the ```python blocks of the READMEs and of the user guide (docs/), so that the docs stay true.

The line just before a block's fence (blank lines aside) says how it runs:

- ``<!-- docs-test: fragment -->``: not executed (an excerpt, or it needs hardware or a
  framework the test environment lacks). Text after the word may give the reason:
  ``<!-- docs-test: fragment (needs MindSpore workers) -->``. A fragment must still parse.
- ``<!-- docs-test: ranks=N -->``: run as written, as ``__main__``, inside ``N`` real gloo
  ranks (``dcp_platform.testing.run_ranks``): ``torch.distributed`` is already initialised
  in each rank, and ``$DCP_DOCS_TMP`` names a fresh temporary directory the ranks share.
- anything else: run as written in one fresh Python process, in a fresh temporary
  directory that ``$DCP_DOCS_TMP`` also names.

Used by ``tests-integration/test_docs_blocks.py`` and by the ``packages-alone`` nox
session, which runs a package's README in an environment holding only that package:
``python tests-integration/docs_blocks.py packages/dcp-broadcast/README.md``.
This module needs only the standard library (and dcp-platform for ``ranks=N`` blocks).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "DocsBlockError", "find_blocks", "run_block", "main"]

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_DIRECTIVE = re.compile(r"^(fragment|ranks=([1-9][0-9]*))(?:\s.*)?$")

#: Seconds one block may take (a fresh process imports torch: ~5 s on a loaded 2-core machine).
TIMEOUT_S = 300.0


class DocsBlockError(ValueError):
    """A README block that is marked wrongly, does not parse or fails when run."""


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code and how it runs (``ranks`` 0: one process)."""

    path: str
    line: int  # 1-based line of the opening fence
    code: str
    fragment: bool
    ranks: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _directive(lines: list[str], fence_index: int, path: str) -> tuple[bool, int]:
    i = fence_index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i < 0:
        return False, 0
    m = _MARKER.match(lines[i].strip())
    if m is None:
        return False, 0
    d = _DIRECTIVE.match(m.group(1))
    if d is None:
        raise DocsBlockError(
            f"{path}:{i + 1}: unknown docs-test marker {lines[i].strip()!r}; write "
            "'<!-- docs-test: fragment -->' or '<!-- docs-test: ranks=N -->' (N >= 1)")
    return d.group(2) is None, int(d.group(2) or 0)


def find_blocks(path: str | os.PathLike[str]) -> list[Block]:
    """Every ```python block of the Markdown file ``path``, with how it is to run."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i, m.group(2).lower()
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        if i == len(lines):
            raise DocsBlockError(f"{path}:{start + 1}: code fence never closed")
        if lang in ("python", "py"):
            body = [ln[len(m.group(1)):] for ln in lines[start + 1:i]]
            fragment, ranks = _directive(lines, start, os.fspath(path))
            blocks.append(Block(os.fspath(path), start + 1, "\n".join(body) + "\n", fragment, ranks))
        i += 1
    return blocks


def check_parses(block: Block) -> None:
    """Raise ``DocsBlockError`` when a block fenced as python is not valid Python."""
    try:
        ast.parse(block.code, filename=block.where)
    except SyntaxError as exc:
        raise DocsBlockError(
            f"{block.where}: a ```python block must be valid Python (line {exc.lineno} of the "
            f"block: {exc.msg}); fence signatures and pseudo-code as ```text instead") from exc


def _rank_main(rank: int, world_size: int, code: str, where: str) -> None:
    """Runs inside each rank of ``run_ranks``: the block as ``__main__``."""
    exec(compile(code, where, "exec"), {"__name__": "__main__", "__file__": where})


def run_block(block: Block, *, timeout: float = TIMEOUT_S) -> None:
    """Run ``block`` (see the module docstring); raise ``DocsBlockError`` if it fails."""
    check_parses(block)
    if block.fragment:
        return
    with tempfile.TemporaryDirectory(prefix="dcp-docs-") as tmp:
        env = {"DCP_DOCS_TMP": tmp}
        if block.ranks:
            from dcp_platform.testing import RanksFailed, run_ranks

            try:
                run_ranks(_rank_main, block.ranks, block.code, block.where, timeout=timeout, env=env)
            except RanksFailed as exc:
                raise DocsBlockError(f"{block.where}: the block failed on {block.ranks} rank(s):\n{exc}") from exc
            return
        proc = subprocess.run([sys.executable, "-c", block.code], cwd=tmp, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise DocsBlockError(f"{block.where}: the block exited with {proc.returncode}:\n"
                                 f"{proc.stdout[-4000:]}{proc.stderr[-8000:]}")


def main(argv: list[str] | None = None) -> int:
    """Run every block of the given Markdown files; print one line per block."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python docs_blocks.py README.md [...]", file=sys.stderr)
        return 2
    failed = 0
    for path in paths:
        for block in find_blocks(path):
            kind = "fragment" if block.fragment else (f"ranks={block.ranks}" if block.ranks else "process")
            try:
                run_block(block)
            except DocsBlockError as exc:
                failed += 1
                print(f"FAIL {block.where} ({kind})\n{exc}", flush=True)
            else:
                print(f"ok   {block.where} ({kind})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
