"""Parsing JSON from a checkpoint: every way it can fail becomes a typed error."""

from __future__ import annotations

import json
from typing import Any

from ._errors import MetadataError


def load_json(raw: str | bytes, path: str | None, fix: str) -> Any:
    """``json.loads(raw)``; MetadataError naming ``path`` and saying ``fix`` when the text is
    not JSON, not UTF-8, nested too deeply (RecursionError) or holds an integer longer than
    Python converts (ValueError beyond 4300 digits)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise MetadataError(f"JSON nested too deeply to parse; {fix}", path=path) from None
    except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, too long an int, not text
        raise MetadataError(f"invalid JSON ({type(e).__name__}: {str(e)[:200]}); {fix}", path=path) from None
