"""PNG plots of one run's results: load time and bytes read against the number of ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harness.layouts import LAYOUT_NAMES, LAYOUTS, METHOD_NAMES  # noqa: E402
from harness.stats import median  # noqa: E402

COLORS = {"dcp": "#1f77b4", "dcp-64k": "#6baed6", "dcp-reread": "#c6dbef", "dcp-auto": "#2ca02c",
          "torch": "#d62728", "fastsafetensors": "#9467bd"}


def _layouts(rep: dict[str, Any]) -> list[str]:
    lays = list(dict.fromkeys(r["layout"] for r in rep["runs"]))
    order = list(LAYOUTS)
    return sorted(lays, key=lambda lay: (next(r["world"] for r in rep["runs"] if r["layout"] == lay),
                                         order.index(lay)))


def _label(rep: dict[str, Any], lay: str) -> str:
    world = next(r["world"] for r in rep["runs"] if r["layout"] == lay)
    return f"{world} ranks\n{LAYOUT_NAMES[lay]}"


def _bars(ax: Any, rep: dict[str, Any], mode: str, key: str, scale: float) -> None:
    lays = _layouts(rep)
    methods = [m for m in COLORS if any(r["method"] == m and r["mode"] == mode for r in rep["runs"])]
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for i, lay in enumerate(lays):
            vals = [r["summary"][key] / scale for r in rep["runs"]
                    if r["layout"] == lay and r["mode"] == mode and r["method"] == m]
            if not vals:
                continue
            med = median(vals)
            xs.append(i + (j - (len(methods) - 1) / 2) * width)
            ys.append(med)
            lo.append(med - min(vals))
            hi.append(max(vals) - med)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, color=COLORS[m], label=METHOD_NAMES[m])
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(lays)), [_label(rep, lay) for lay in lays])
    ax.grid(axis="y", alpha=0.3)


def _legend(fig: Any, axes: Any) -> None:
    """One legend for the figure, below the panels (the panels hold different methods)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(len(seen), 3), fontsize=8,
               frameon=False)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    rep = results.get("replicated")
    if rep:
        modes = list(dict.fromkeys(r["mode"] for r in rep["runs"]))
        titles = {"warm": "warm page cache, one host", "coldhost": "cold, one host (one copy)",
                  "cold": "cold, simulated nodes (a copy each)"}
        gib = rep["unique_bytes"] / 2**30
        fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 5.0), squeeze=False)
        for ax, mode in zip(axes[0], modes, strict=True):
            _bars(ax, rep, mode, "wall_s", 1.0)
            ax.set_title(f"{titles[mode]}")
            ax.set_ylabel("load time, s (median; bars: min-max)")
        if "cold" in modes and rep["disk"]:
            bw = median([d["bytes_per_s"] for d in rep["disk"]])
            ax = axes[0][modes.index("cold")]
            ax.axhline(rep["unique_bytes"] / bw * 1.2, color="k", ls="--", lw=1,
                       label="goal: 1.2 x unique bytes / disk bandwidth")
        _legend(fig, axes[0])
        fig.suptitle(f"Loading a {gib:.2f} GiB HF checkpoint on gloo ranks: time "
                     f"(median of {len({r['repeat'] for r in rep['runs']})} runs)", fontsize=11)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        p = out / "load_time_vs_ranks.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

        # Warm runs fetch nothing from storage: only the cold modes are worth a panel.
        bmodes = [m for m in modes if m != "warm"] or modes
        fig, axes = plt.subplots(1, len(bmodes), figsize=(5.5 * len(bmodes), 4.8), squeeze=False)
        for ax, mode in zip(axes[0], bmodes, strict=True):
            _bars(ax, rep, mode, "read_bytes_total", 2**30)
            ax.axhline(gib, color="k", ls="--", lw=1, label="unique bytes (checkpoint)")
            ax.set_title(titles[mode])
            ax.set_ylabel("GiB fetched from storage, all ranks\n(/proc/self/io read_bytes)")
        _legend(fig, axes[0])
        fig.suptitle("Bytes read from storage against the number of ranks", fontsize=11)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        p = out / "bytes_read_vs_ranks.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
