"""Numbers as people read them: byte counts and plurals (the CLI, the demo, log lines)."""

from __future__ import annotations

__all__ = ["human_bytes", "plural"]


def human_bytes(n: float) -> str:
    """``1536000`` -> ``"1.5 MB"`` (powers of 1000, as the CLI and the demo print)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def plural(n: int, noun: str) -> str:
    """``plural(1, "tensor")`` -> ``"1 tensor"``, ``plural(3, "tensor")`` -> ``"3 tensors"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
