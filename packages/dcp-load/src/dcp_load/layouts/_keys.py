"""Advice when state dict keys are missing from a checkpoint: the checkpoint's nearest key
names, and a prefix (such as ``model.``) that one side carries and the other lacks."""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Collection, Sequence

__all__ = ["missing_advice"]

#: Missing names for which nearest checkpoint names are shown (difflib is O(n) per name).
SHOWN = 3


def _prefix_counts(missing: Sequence[str], saved: Collection[str]) -> tuple[Counter[str], Counter[str]]:
    """(prefixes the state dict adds, prefixes it lacks), each counted over missing names."""
    added: Counter[str] = Counter()
    lacked: Counter[str] = Counter()
    wanted = set(missing)
    for name in missing:
        for i, ch in enumerate(name):
            if ch == "." and name[i + 1:] in saved:
                added[name[:i + 1]] += 1
    for name in saved:
        for i, ch in enumerate(name):
            if ch == "." and name[i + 1:] in wanted:
                lacked[name[:i + 1]] += 1
    return added, lacked


def _best_prefix(missing: Sequence[str], saved: Collection[str]) -> tuple[int, str, str] | None:
    """(count, prefix, "added" or "lacked") of the prefix that explains most missing names."""
    added, lacked = _prefix_counts(missing, saved)
    return max([(n, p, "added") for p, n in added.items()] + [(n, p, "lacked") for p, n in lacked.items()],
               default=None)


def _prefix_hint(missing: Sequence[str], best: tuple[int, str, str]) -> str:
    count, prefix, kind = best
    if kind == "added":
        return (f"{count} of the {len(missing)} missing key(s) carry a prefix {prefix!r} the checkpoint's keys "
                f"lack: strip it from the state dict's keys (for example load "
                f"{{k.removeprefix({prefix!r}): v for k, v in sd.items()}}, or load sd[{prefix[:-1]!r}] if it "
                "is nested)")
    return (f"the checkpoint's keys carry a prefix {prefix!r} that {count} of the {len(missing)} missing key(s) "
            f"lack: add it (for example load {{{prefix[:-1]!r}: sd}} or {{{prefix!r} + k: v ...}})")


def _nearest(name: str, pool: list[str], saved: Collection[str], best: tuple[int, str, str] | None) -> list[str]:
    out = []
    if best is not None:
        _, prefix, kind = best
        twin = name.removeprefix(prefix) if kind == "added" else prefix + name
        if twin != name and twin in saved:
            out.append(twin)
    out += [c for c in difflib.get_close_matches(name, pool, n=3, cutoff=0.5) if c not in out]
    return out[:3]


def missing_advice(missing: Sequence[str], saved: Collection[str]) -> str:
    """A sentence or two for the missing-keys error: a detected prefix, then the nearest
    saved names of the first few missing keys (empty when nothing is near)."""
    parts = []
    best = _best_prefix(missing, saved)
    if best is not None:
        parts.append(_prefix_hint(missing, best))
    pool = list(saved)
    near = []
    for name in missing[:SHOWN]:
        close = _nearest(name, pool, saved, best)
        if close:
            near.append(f"{name!r} -> {', '.join(repr(c) for c in close)}")
    if near:
        parts.append(f"nearest checkpoint keys: {'; '.join(near)}")
    elif best is None and pool:
        parts.append(f"the checkpoint holds {len(pool)} key(s), for example "
                     f"{', '.join(repr(n) for n in sorted(pool)[:SHOWN])}")
    return "; ".join(parts)
