"""The issue's goals, each reported met or missed from one run's measured results."""

from __future__ import annotations

import math
from typing import Any

from _bench_stats import MiB, fmt_bytes, median, table

# A measured read amplification at most this counts as 1.00: /proc/self/io counts whole
# pages and kernel readahead, so a read-once load measures a little above 1.
AMPLIFICATION_SLACK = 1.02


def _rep(res: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [r for r in res["runs"] if all(r.get(k) == v for k, v in match.items())]


def goals(results: dict[str, Any]) -> list[str]:
    rows: list[list[str]] = []
    rep = results.get("replicated")
    small = results.get("small")
    try:
        from dcp_broadcast import DEFAULT_MAX_IN_FLIGHT
    except ImportError:  # only for the text; the load itself would have failed without it
        DEFAULT_MAX_IN_FLIGHT = 8
    batch = results["args"]["batch_bytes"]
    if rep:
        unique = rep["unique_bytes"]
        layouts = list(dict.fromkeys(r["layout"] for r in rep["runs"]))
        # 1. read amplification, cold (each node has its own files, so every fetch shows)
        for lay, m in [(lay, m) for lay in layouts for m in ("dcp", "dcp-auto")]:
            d = _rep(rep, layout=lay, mode="cold", method=m)
            t = _rep(rep, layout=lay, mode="cold", method="torch")
            if not d:
                continue
            amp = median([r["summary"]["read_bytes_total"] / unique for r in d])
            rep_amp = median([r["summary"].get("report_bytes_read_total", 0) / unique for r in d])
            tamp = median([r["summary"]["read_bytes_total"] / unique for r in t]) if t else float("nan")
            dp = d[0]["dp"]
            ok = amp <= AMPLIFICATION_SLACK
            why = "" if ok else f" (dcp's own count of box bytes read: {rep_amp:.2f})"
            rows.append([f"Read amplification 1.00 ({lay}, cold, R={dp}, {m})",
                         "met" if ok else "missed",
                         f"dcp {amp:.2f} (storage bytes / unique bytes), torch DCP {tamp:.2f}{why}"])
        # 3. cold time against unique bytes / raw disk bandwidth
        if rep["disk"]:
            bw = median([x["bytes_per_s"] for x in rep["disk"]])
            bound = unique / bw
            for lay in layouts:
                d = _rep(rep, layout=lay, mode="cold", method="dcp")
                if not d:
                    continue
                wall = median([r["summary"]["wall_s"] for r in d])
                ratio = wall / bound
                rows.append([f"Cold multi-node time <= 1.2 x unique / bandwidth ({lay})",
                             "met" if ratio <= 1.2 else "missed",
                             f"{wall:.2f} s = {ratio:.2f} x ({fmt_bytes(unique)} / {bw / 1e9:.2f} GB/s "
                             f"= {bound:.2f} s)"])
        # 4. warm single node no slower than torch DCP
        for lay in layouts:
            for m in ("dcp-auto", "dcp", "dcp-64k", "dcp-reread"):
                a = {r["repeat"]: r["summary"]["wall_s"] for r in _rep(rep, layout=lay, mode="warm", method=m)}
                b = {r["repeat"]: r["summary"]["wall_s"] for r in _rep(rep, layout=lay, mode="warm", method="torch")}
                if not a or not b:
                    continue
                ratio = median([a[k] / b[k] for k in a if k in b])
                label = {"dcp": "broadcast", "dcp-64k": "broadcast, 64 KiB batches",
                         "dcp-reread": "every rank reads", "dcp-auto": "auto, the default"}[m]
                rows.append([f"Warm single-node time <= torch DCP ({lay}, dcp {label})",
                             "met" if ratio <= 1.0 else "missed",
                             f"{median(list(a.values())):.2f} s vs {median(list(b.values())):.2f} s: "
                             f"x{ratio:.2f} (median of per-repeat ratios)"])
        # 2. collectives on the big checkpoint: broadcasts <= replicated bytes / batch + groups
        for lay in layouts:
            d = _rep(rep, layout=lay, method="dcp")
            if not d:
                continue
            dp, tp = d[0]["dp"], d[0]["tp"]
            groups = tp + (1 if tp > 1 else 0)  # one set per TP rank, plus all ranks (norms)
            replicated = unique  # with DP >= 2 every box is wanted by dp ranks
            bound = replicated / batch + groups
            got = max(r["summary"].get("report_broadcasts_max", 0) for r in d)
            rows.append([f"Broadcasts <= replicated bytes / batch + groups ({lay})",
                         "met" if got <= bound else "missed",
                         f"{got} per rank (max) vs {fmt_bytes(replicated)} / {fmt_bytes(batch)} + "
                         f"{groups} = {bound:.1f}"])
        # 5. peak extra memory, per batch threshold
        for m, mb in (("dcp", batch), ("dcp-64k", 64 * 1024)):
            limit = mb * DEFAULT_MAX_IN_FLIGHT + 64 * MiB
            d = [r for r in rep["runs"] if r["method"] == m and "extra_anon_max" in r["summary"]]
            if not d:
                continue
            worst = max(d, key=lambda r: r["summary"]["extra_anon_max"])
            worst_rss = max(r["summary"]["extra_rss_max"] for r in d)
            x = worst["summary"]["extra_anon_max"]
            rows.append([f"Peak extra memory <= batch x in-flight + 64 MiB ({m})",
                         "met" if x <= limit else "missed",
                         f"worst rank over all {m} runs: {fmt_bytes(x)} private ({worst['layout']}, "
                         f"{worst['mode']}) vs {fmt_bytes(mb)} x {DEFAULT_MAX_IN_FLIGHT} + 64 MiB = "
                         f"{fmt_bytes(limit)}; counting mapped file pages too (VmHWM): "
                         f"{fmt_bytes(worst_rss)}"])
    if small:
        runs = [r for r in small["runs"] if r["variant"].startswith("dcp batched")]
        if runs:
            sp = small["spec"]
            replicated = sp["count"] * sp["nbytes"]
            sbatch = 6 * MiB
            bound = replicated / sbatch + 1
            got = max(r["summary"].get("report_broadcasts_max", 0) for r in runs)
            rows.append([f"Broadcasts <= replicated bytes / batch + groups ({sp['count']} small tensors)",
                         "met" if got <= bound else "missed",
                         f"{got} per rank vs {fmt_bytes(replicated)} / {fmt_bytes(sbatch)} + 1 = "
                         f"{bound:.1f} (ceil {math.ceil(replicated / sbatch)} + 1)"])
    if not rows:
        return []
    return ["## Goals\n\n" + table(["goal", "result", "measured"], rows)]
