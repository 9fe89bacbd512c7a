"""Small helpers shared by the scenarios: summaries of one multi-rank run, medians, tables."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

MiB = 1024 * 1024


def summarise(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Job-level numbers of one run: wall clock from the first start to the last end."""
    t0 = min(r["t0"] for r in per_rank)
    t1 = max(r["t1"] for r in per_rank)
    out: dict[str, Any] = {
        "wall_s": t1 - t0,
        "read_bytes_total": sum(r["read_bytes"] for r in per_rank),
        "read_bytes_per_rank": [r["read_bytes"] for r in per_rank],
        "read_bytes_max": max(r["read_bytes"] for r in per_rank),
        "read_bytes_per_node": per_node(per_rank, "read_bytes"),
        "data_collectives_max": max(r["data_collectives"] for r in per_rank),
        "collectives_rank0": per_rank[0]["collectives"],
        "dest_bytes_total": sum(r["dest_bytes"] for r in per_rank),
    }
    if all("cpu_s" in r for r in per_rank):
        out["cpu_s_total"] = sum(r["cpu_s"] for r in per_rank)
    if per_rank[0].get("report_bytes_read") is not None:
        out["report_bytes_read_total"] = sum(r["report_bytes_read"] or 0 for r in per_rank)
        out["report_bytes_read_per_rank"] = [r["report_bytes_read"] for r in per_rank]
        out["report_bytes_received_total"] = sum(r["report_bytes_received"] or 0 for r in per_rank)
        out["report_broadcasts_max"] = max(r["report_broadcasts"] or 0 for r in per_rank)
    mem = [r["memory"] for r in per_rank if r.get("memory")]
    if mem:
        out["extra_anon_max"] = max(m["extra_anon"] for m in mem)
        out["extra_rss_max"] = max(m["extra_rss"] for m in mem)
        out["peak_rss_max"] = max(m["peak_rss"] for m in mem)
        out["peak_file_max"] = max(m["peak_file"] for m in mem)
    return out


def per_node(per_rank: list[dict[str, Any]], key: str) -> list[int]:
    """``key`` summed over the ranks of each simulated node (``node`` of each rank)."""
    out = [0] * (1 + max(r.get("node", 0) for r in per_rank))
    for r in per_rank:
        out[r.get("node", 0)] += r[key]
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def by_repeat(runs: list[dict[str, Any]], key: str = "wall_s") -> dict[int, float]:
    """``summary[key]`` of each run, by its repeat."""
    return {r["repeat"]: r["summary"][key] for r in runs}


def ratio_by_repeat(a: dict[int, float], b: dict[int, float]) -> float:
    """Median over repeats of ``a[k] / b[k]``, each ratio taken within one repeat (side by side)."""
    return median([a[k] / b[k] for k in a if k in b and b[k]])


def unique_failures(failures: list[dict[str, Any]], method: str) -> list[dict[str, Any]]:
    """``method``'s failures, one per (layout, mode, reason): a failure repeated in every repeat
    is one row, not one per repeat."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for f in failures:
        if f["method"] == method:
            seen.setdefault((f["layout"], f["mode"], f["reason"]), f)
    return list(seen.values())


def fmt_bytes(n: float) -> str:
    if n != n:  # NaN
        return "-"
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table (also readable as plain text)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)
