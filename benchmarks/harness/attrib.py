"""Where the warm one-host time goes: dcp's and torch DCP's phases side by side, per rank.

dcp's phases are its own ``LoadReport.seconds``; torch DCP's are taken by timing its public
planner and reader steps (``harness.phases``); blocking collective time comes from the
wrapped ``torch.distributed`` functions (``harness.common.CollectiveCounter``), the same for
both. The phases are mapped onto common columns:

- metadata: dcp ``prepare`` (metadata and this rank's wants) / torch ``read_metadata`` +
  ``set_up_planner`` + ``set_up_storage_reader``;
- planning: dcp ``plan`` (plan exchange included) / torch ``create_local_plan`` +
  ``prepare_local_plan`` + ``create_global_plan`` + ``prepare_global_plan`` +
  ``finish_plan`` + the plan's gather and scatter;
- validate: dcp ``validate`` (torch DCP has no such step);
- read + copy: dcp ``execute`` (reads, broadcasts, copies) / torch ``read_data``;
- rest: the rank's total minus the above (dcp ``finish``; torch's closing all-gather).
"""

from __future__ import annotations

from typing import Any

from harness.stats import median, table

COLUMNS = ("metadata", "planning", "validate", "read + copy", "rest")
_PLAN_COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list")


def rank_phases(p: dict[str, Any]) -> dict[str, float] | None:
    """One rank's seconds per common column (plus ``total`` and ``collectives``), or None."""
    coll = sum((p.get("collective_seconds") or {}).values())
    if p.get("report_seconds"):
        s = p["report_seconds"]
        out = {"metadata": s.get("prepare", 0.0), "planning": s.get("plan", 0.0),
               "validate": s.get("validate", 0.0), "read + copy": s.get("execute", 0.0)}
        total = s.get("total", p["seconds"])
    elif p.get("torch_seconds"):
        s = p["torch_seconds"]
        plan_coll = sum(v for k, v in (p.get("collective_seconds") or {}).items() if k in _PLAN_COLLECTIVES)
        out = {"metadata": s.get("metadata", 0.0),
               "planning": s.get("local plan", 0.0) + s.get("global plan", 0.0) + plan_coll,
               "validate": 0.0, "read + copy": s.get("read + copy", 0.0)}
        total = s.get("total", p["seconds"])
    else:
        return None
    out["rest"] = total - sum(out.values())
    out["total"] = total
    out["collectives"] = coll
    return out


def _summary(runs: list[dict[str, Any]]) -> dict[str, tuple[float, float]] | None:
    """Per column: (median over repeats of the median over ranks, of the max over ranks)."""
    per_run = []
    for r in runs:
        ph = [rank_phases(p) for p in r["per_rank"]]
        if not ph or any(x is None for x in ph):
            return None
        per_run.append(ph)
    keys = (*COLUMNS, "total", "collectives")
    return {k: (median([median([x[k] for x in ph]) for ph in per_run]),
                median([max(x[k] for x in ph) for ph in per_run])) for k in keys}


def tables(rep: dict[str, Any], names: dict[str, str], layout_names: dict[str, str]) -> tuple[str, list[tuple[str, str, float, str]]]:
    """The attribution table (warm mode) and, per layout and dcp method, the largest gap."""
    rows = []
    gaps: list[tuple[str, str, float, str]] = []
    warm = [r for r in rep["runs"] if r["mode"] == "warm"]
    for lay in dict.fromkeys(r["layout"] for r in warm):
        t = _summary([r for r in warm if r["layout"] == lay and r["method"] == "torch"])
        for m in dict.fromkeys(r["method"] for r in warm if r["layout"] == lay):
            s = _summary([r for r in warm if r["layout"] == lay and r["method"] == m])
            if s is None:
                continue
            wall = median([r["summary"]["wall_s"] for r in warm if r["layout"] == lay and r["method"] == m])
            rows.append([layout_names[lay], names[m], f"{wall:.3f}"]
                        + [f"{s[k][0]:.3f} ({s[k][1]:.3f})" for k in ("total", *COLUMNS, "collectives")])
            if t is not None and m != "torch" and m.startswith("dcp"):
                diffs = {k: s[k][0] - t[k][0] for k in COLUMNS}
                rows.append([layout_names[lay], f"gap: {names[m]} - torch DCP", f"{wall - _wall(warm, lay):+.3f}",
                             f"{s['total'][0] - t['total'][0]:+.3f}"]
                            + [f"{diffs[k]:+.3f}" for k in COLUMNS]
                            + [f"{s['collectives'][0] - t['collectives'][0]:+.3f}"])
                worst = max(diffs, key=lambda k: diffs[k])
                gaps.append((lay, m, diffs[worst], worst))
    if not rows:
        return "", gaps
    per_rank = _per_rank_rows(warm, names, layout_names)
    text = ("### Attribution of the warm one-host time, per rank\n\n"
            "Warm page cache, one host, the same files for both loaders. Each cell: median over "
            "ranks (max over ranks in parentheses), seconds, median over repeats. Columns: "
            + "; ".join(_COLUMN_TEXT) + ". The *gap* rows subtract torch DCP's medians from dcp's: "
            "a positive number is time dcp spends that torch DCP does not.\n\n"
            + table(["layout", "loader", "job load s", "rank total", *COLUMNS, "blocking collectives"], rows)
            + "\n\nEach rank on its own (first repeat; seconds, ranks 0..N-1):\n\n"
            + table(["layout", "loader", "rank total", "metadata", "planning", "read + copy"], per_rank))
    return text, gaps


def _per_rank_rows(warm: list[dict[str, Any]], names: dict[str, str],
                   layout_names: dict[str, str]) -> list[list[str]]:
    rows = []
    for r in warm:
        if r["repeat"] != 0 or r["method"] not in ("dcp-auto", "torch"):
            continue
        ph = [rank_phases(p) for p in r["per_rank"]]
        if any(x is None for x in ph):
            continue
        rows.append([layout_names[r["layout"]], names[r["method"]]]
                    + [" / ".join(f"{x[k]:.3f}" for x in ph) for k in ("total", "metadata", "planning",
                                                                         "read + copy")])
    return rows


def _wall(warm: list[dict[str, Any]], lay: str) -> float:
    return median([r["summary"]["wall_s"] for r in warm if r["layout"] == lay and r["method"] == "torch"])


_COLUMN_TEXT = (
    "metadata = dcp `prepare` / torch `read_metadata` + `set_up_planner` + `set_up_storage_reader`",
    "planning = dcp `plan` (its plan exchange included) / torch `create_local_plan` + "
    "`prepare_local_plan` + `create_global_plan` + `prepare_global_plan` + `finish_plan` + the plan's "
    "gather and scatter",
    "validate = dcp `validate` (torch DCP has none)",
    "read + copy = dcp `execute` (reads, broadcasts, copies into the destinations) / torch `read_data` "
    "(reads and copies)",
    "rest = the rank's total minus those (dcp `finish`; torch DCP's closing all-gather)",
    "blocking collectives = time inside `torch.distributed` calls, both loaders (asynchronous "
    "broadcasts count only their issue)",
)
