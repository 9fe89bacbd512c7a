"""The error every rank raises when a load or save fails anywhere."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["LoadError", "format_ranks"]

#: Distinct causes shown in a message, and rank ranges shown per cause: beyond these the
#: message counts the rest, so that its size does not grow with the world size.
MAX_CAUSES = 20
MAX_RANGES = 8


def format_ranks(ranks: Iterable[int], limit: int = MAX_RANGES) -> str:
    """``"ranks 0-3, 5"`` (``"rank 2"`` for one): runs of consecutive ranks as ranges, at
    most ``limit`` of them, then a count of the rest."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in ordered:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    text = ", ".join(parts)
    if len(runs) > limit:
        shown = sum(b - a + 1 for a, b in runs[:limit])
        text += f", ... and {len(ordered) - shown} more"
    return f"{'rank' if len(ordered) == 1 else 'ranks'} {text}"


class LoadError(Exception):
    """A load (or save) failed on one or more ranks; raised on every rank alike.

    ``failures`` maps each failing rank to its causes; ``phase`` is the step that failed
    (``"validate"`` failures happen before any destination tensor is written). The message
    lists each distinct cause once with the ranks that hit it (``ranks 0-3, 5: cause``),
    so that its size stays flat as the world grows. ``advice``: its closing line, what the
    destinations hold (by default the phase's: unchanged, or possibly partly written);
    ``advise`` replaces it. ``torn``: after a ``transfer`` that failed while writing in
    place, this rank's destinations it wrote (the others hold what they held); empty
    otherwise.
    """

    torn: tuple[str, ...] = ()

    def __init__(self, failures: Mapping[int, Sequence[str]], phase: str, advice: str | None = None):
        self.failures = {int(r): tuple(c) for r, c in sorted(failures.items())}
        self.phase = phase
        by_cause: dict[str, list[int]] = {}
        for rank, causes in self.failures.items():
            for cause in causes:
                by_cause.setdefault(cause, []).append(rank)
        lines = [f"{phase} failed on {len(self.failures)} rank(s) ({format_ranks(self.failures)}):"]
        for cause, ranks in list(by_cause.items())[:MAX_CAUSES]:
            lines.append(f"  {format_ranks(ranks)}: {cause}")
        if len(by_cause) > MAX_CAUSES:
            rest = {r for _, ranks in list(by_cause.items())[MAX_CAUSES:] for r in ranks}
            lines.append(f"  ... and {len(by_cause) - MAX_CAUSES} more distinct cause(s) on {format_ranks(rest)} "
                         "(LoadError.failures holds every one)")
        if advice is None and phase == "validate":
            advice = "No destination tensor was changed."
        elif advice is None and phase in ("execute", "finish"):
            advice = ("Found only while reading: destination tensors of this load may have been "
                      "partly written (any tensor entry of the state dict; non-tensor values were "
                      "not replaced). Load again before using them.")
        self.advice = advice
        super().__init__("\n".join([*lines, advice] if advice else lines))

    def advise(self, advice: str) -> None:
        """Close the message with ``advice`` instead (a caller that knows better what the
        destinations hold: ``transfer``); lines added after the old one stay after it."""
        text = str(self.args[0]) if self.args else ""
        old, self.advice = self.advice, advice
        self.args = (text.replace(old, advice) if old and old in text else f"{text}\n{advice}", *self.args[1:])

    def __reduce__(self):  # picklable, so that a test harness can carry it between processes
        return (type(self), (self.failures, self.phase, self.advice))
