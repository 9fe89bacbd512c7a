"""The error every rank raises when a load or save fails anywhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["LoadError"]


class LoadError(Exception):
    """A load (or save) failed on one or more ranks; raised on every rank alike.

    ``failures`` maps each failing rank to its causes; ``phase`` is the step that failed
    (``"validate"`` failures happen before any destination tensor is written).
    """

    def __init__(self, failures: Mapping[int, Sequence[str]], phase: str):
        self.failures = {int(r): tuple(c) for r, c in sorted(failures.items())}
        self.phase = phase
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [f"{phase} failed on rank(s) {ranks}:"]
        for rank, causes in self.failures.items():
            for cause in causes:
                lines.append(f"  rank {rank}: {cause}")
        if phase == "validate":
            lines.append("No destination tensor was changed.")
        super().__init__("\n".join(lines))

    def __reduce__(self):  # picklable, so that a test harness can carry it between processes
        return (type(self), (self.failures, self.phase))
