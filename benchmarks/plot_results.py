"""The user guide's plots, drawn from the committed benchmark results (benchmarks/results/*.md).

    python benchmarks/plot_results.py [--out docs/assets/plots]

Each plot reads one table of a results file by its heading, so a plot always shows the
figures the results state; a table that moved or lost a column is an error naming the file,
the heading and the column. Every figure names its source, command and machine in its
footer. Needs matplotlib (the ``docs`` nox session installs it).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MACHINE = "2 shared AMD EPYC cores, 23.5 GiB, no accelerator, real gloo ranks"
COLORS = {"dcp": "#1f77b4", "torch DCP": "#d62728", "fastsafetensors": "#9467bd", "memcpy": "#7f7f7f"}
# Without the Software tag (matplotlib's version) the same table gives the same PNG bytes.
PNG_META = {"Software": None}


class ResultsError(ValueError):
    """A results table that is missing, or lacks a column or a value a plot needs."""


@dataclass(frozen=True)
class Table:
    """One Markdown table: where it was found, its header and its rows (cells stripped)."""

    where: str
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> int:
        for i, h in enumerate(self.header):
            if h.startswith(name):
                return i
        raise ResultsError(f"{self.where}: no column starting {name!r}; columns: {self.header}")

    def records(self) -> list[dict[str, str]]:
        return [dict(zip(self.header, r, strict=False)) for r in self.rows]

    def get(self, row: list[str], name: str) -> str:
        return row[self.column(name)]


def read_table(path: Path, heading: str) -> Table:
    """The first table after the line that starts with ``heading`` in ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    where = f"{path.relative_to(ROOT)}, {heading!r}"
    starts = [i for i, line in enumerate(lines) if line.startswith(heading)]
    if not starts:
        raise ResultsError(f"{where}: heading not found")
    i = starts[0] + 1
    while i < len(lines) and not lines[i].startswith("|"):
        if lines[i].startswith("#"):
            raise ResultsError(f"{where}: no table before the next heading {lines[i]!r}")
        i += 1
    block = []
    while i < len(lines) and lines[i].startswith("|"):
        block.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
        i += 1
    if len(block) < 3:
        raise ResultsError(f"{where}: a table needs a header, a rule and a row")
    return Table(where, block[0], block[2:])


def seconds(text: str, where: str) -> float | None:
    """``"0.035 s"`` -> 0.035; ``"< 1 ms"`` (below what the run resolves) -> None."""
    if text.startswith("<"):
        return None
    m = re.fullmatch(r"([0-9.]+)\s*(s|ms)?", text)
    if m is None:
        raise ResultsError(f"{where}: {text!r} is not a time in s or ms")
    return float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)


def mib(text: str, where: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*(MiB|GiB)", text)
    if m is None:
        raise ResultsError(f"{where}: {text!r} is not a size in MiB or GiB")
    return float(m.group(1)) * (1024.0 if m.group(2) == "GiB" else 1.0)


def _method(name: str) -> str | None:
    """The results' method names -> the plots' three series (other dcp modes are left out)."""
    if name.startswith("dcp (auto"):
        return "dcp"
    if name.startswith("torch DCP"):
        return "torch DCP"
    if name.startswith("fastsafetensors"):
        return "fastsafetensors"
    return None


def _footer(fig, source: str, command: str) -> None:
    fig.text(0.01, 0.01, f"{source}; {command}\n{MACHINE}", fontsize=7, color="#555555", va="bottom")


def _grouped_bars(ax, labels: list[str], series: dict[str, list[float | None]], fmt: str) -> None:
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(labels))]
        pts = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        ax.bar([x for x, _ in pts], [v for _, v in pts], width, color=COLORS[name], label=name)
        for x, v in pts:
            ax.annotate(fmt.format(v), (x, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(range(len(labels)), labels)
    ax.grid(axis="y", alpha=0.3)


def _by_layout(table: Table, value_column: str, label_column: str, convert) -> tuple[list[str], dict]:
    """Layouts in order of rank count (then as listed) and one value list per series."""
    layouts: dict[str, str] = {}
    values: dict[tuple[str, str], float | None] = {}
    for row in table.rows:
        method = _method(table.get(row, "method"))
        if method is None:
            continue
        layout = table.get(row, "layout")
        layouts.setdefault(layout, table.get(row, label_column))
        values[(layout, method)] = convert(table.get(row, value_column), table.where)
    order = sorted(layouts, key=lambda lay: (_ranks(layouts[lay]), list(layouts).index(lay)))
    methods = [m for m in COLORS if any(k[1] == m for k in values)]
    series = {m: [values.get((lay, m)) for lay in order] for m in methods}
    return [f"{lay}\n{layouts[lay]}" for lay in order], series


def _ranks(cell: str) -> int:
    """``"8"`` -> 8, ``"4 x 2"`` (nodes x ranks per node) -> 8."""
    product = 1
    for part in cell.split("x"):
        product *= int(part)
    return product


def plot_load_time(out: Path) -> Path:
    load = RESULTS / "load.md"
    warm = read_table(load, "### 1a. Warm page cache")
    cold = read_table(load, "### 1b. Simulated multi-node cold storage")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, table, title in ((axes[0], warm, "warm page cache, one host"),
                             (axes[1], cold, "cold, simulated nodes (a copy of the files each)")):
        labels, series = _by_layout(table, "load s", "ranks", lambda t, w: seconds(t, w))
        labels = [lab + " ranks" for lab in labels]
        _grouped_bars(ax, labels, series, "{:.2f}")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("load time, s (median of 5)")
        ax.legend(fontsize=8, frameon=False)
    fig.suptitle("Load time against ranks: 1.08 GiB Hugging Face checkpoint", fontsize=11)
    _footer(fig, "benchmarks/results/load.md, tables 1a and 1b",
            "benchmarks/run_all.py --keep --repeats 5 (git 9f046a1)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, out / "load_time_vs_ranks.png")


def plot_bytes_read(out: Path) -> Path:
    table = read_table(RESULTS / "load.md", "### 1b. Bytes fetched from storage")
    labels, series = _by_layout(table, "all nodes / unique", "nodes x ranks", lambda t, w: float(t))
    labels = [lab + "\n(nodes x ranks)" for lab in labels]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    _grouped_bars(ax, labels, series, "{:.2f}")
    ax.axhline(1.0, color="#333333", lw=0.8, ls="--")
    ax.set_ylabel("bytes fetched from storage / unique bytes")
    ax.set_title("Bytes read against ranks: cold, one copy of the files per simulated node", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    _footer(fig, "benchmarks/results/load.md, table 1b (bytes per node)",
            "benchmarks/run_all.py --keep --repeats 5 (git 9f046a1)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, out / "bytes_read_vs_ranks.png")


def plot_save_blocking(out: Path) -> Path:
    table = read_table(RESULTS / "save.md", "## Time, 8 MiB to 1 GiB")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    columns = (("dcp", "dcp async blocked"), ("torch DCP", "torch async blocked"), ("memcpy", "memcpy"))
    for ax, layout in zip(axes, ("DP2xTP2", "FSDP4"), strict=True):
        rows = [r for r in table.rows if table.get(r, "layout") == layout
                and re.fullmatch(r"[0-9.]+ (MiB|GiB)", table.get(r, "size"))]
        if not rows:
            raise ResultsError(f"{table.where}: no rows for layout {layout}")
        sizes = [mib(table.get(r, "size"), table.where) for r in rows]
        for name, column in columns:
            pts = [(s, seconds(table.get(r, column), table.where)) for s, r in zip(sizes, rows, strict=True)]
            pts = [(s, v) for s, v in pts if v is not None]
            ax.plot([s for s, _ in pts], [v * 1000 for _, v in pts], marker="o", color=COLORS[name],
                    label=f"{name} async_save blocked" if name != "memcpy" else "memcpy of the written bytes")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{s:g} MiB" if s < 1024 else f"{s / 1024:g} GiB" for s in sizes])
        ax.set_title(f"{layout}, 4 ranks", fontsize=10)
        ax.set_xlabel("state saved by the job")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("caller blocked, ms (slowest rank, median)")
    axes[0].legend(fontsize=8, frameon=False)
    fig.suptitle("Save blocking against size: async_save, dcp and torch DCP", fontsize=11)
    _footer(fig, "benchmarks/results/save.md, 'Time, 8 MiB to 1 GiB'",
            "benchmarks/save/bench_save.py --size 8|64|1024 (memcpy below 1 ms not drawn)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, out / "save_blocking_vs_size.png")


def plot_planning(out: Path) -> Path:
    table = read_table(RESULTS / "planning.md", "## Derived planning at scale")
    ranks = [int(table.get(r, "ranks").replace(",", "")) for r in table.rows]
    worst = [float(table.get(r, "planning CPU").split("/")[0]) for r in table.rows]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    ax.plot(ranks, worst, marker="o", color=COLORS["dcp"], label="derived plan, slowest rank role")
    for x, y in zip(ranks, worst, strict=True):
        ax.annotate(f"{y:g} ms", (x, y), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [f"{r:,}" for r in ranks])
    ax.set_xlabel("ranks (TP8 x PP8 x DP)")
    ax.set_ylabel("planning CPU per rank, ms")
    ax.set_title("Planning a 70B-like model against ranks (no gathered wants)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, frameon=False)
    _footer(fig, "benchmarks/results/planning.md, 'Derived planning at scale'",
            "benchmarks/load/bench_derive_plan.py (git c931374)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return _save(fig, out / "planning_vs_ranks.png")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, metadata=PNG_META)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "assets" / "plots"), help="folder for the PNGs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        paths = [plot_load_time(out), plot_bytes_read(out), plot_save_blocking(out), plot_planning(out)]
    except ResultsError as exc:
        print(f"plot_results: {exc}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
