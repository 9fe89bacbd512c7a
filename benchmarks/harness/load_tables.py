"""The tables of the replicated-load scenarios (1a-1c, 4) in the report, from one run's results.

Every number is computed from the results ``bench_load_replicated.run`` returns: times and
ratios per layout, method and cache mode, bytes per rank and per node, the broadcast or
re-read comparison, the phase attribution, dcp's own phase times and the peak memory.
"""

from __future__ import annotations

from typing import Any

from harness import attrib
from harness.layouts import LAYOUT_NAMES, METHOD_NAMES, TITLES, disk_bw, med, ratio_in_run, runs_of
from harness.stats import fmt_bytes, median, table


def tables(res: dict[str, Any]) -> list[str]:
    layouts = list(dict.fromkeys(r["layout"] for r in res["runs"]))
    methods = list(dict.fromkeys(r["method"] for r in res["runs"]))
    modes = list(dict.fromkeys(r["mode"] for r in res["runs"]))
    out = [_times(res, mode, layouts, methods) for mode in modes]
    if "cold" in modes and res["disk"]:
        out.append(_per_node(res, layouts, methods))
    if "dcp" in methods and "dcp-reread" in methods:
        out.append(_reread(res, layouts, modes))
    out.append(attrib.tables(res, METHOD_NAMES, LAYOUT_NAMES)[0])
    out += [_phases(res, layouts, modes, methods), _memory(res, layouts, modes, methods)]
    return [x for x in out if x]


def _times(res: dict[str, Any], mode: str, layouts: list[str], methods: list[str]) -> str:
    """Table 1a / 1b / 1c: load time, ratio to torch DCP, storage bytes, collectives, CPU."""
    unique = res["unique_bytes"]
    reps = len({r["repeat"] for r in res["runs"]})
    rows = []
    floor = unique / disk_bw(res) if mode != "warm" and res["disk"] else None
    for lay in layouts:
        for m in methods:
            rs = runs_of(res, lay, mode, m)
            if not rs:
                continue
            walls = [r["summary"]["wall_s"] for r in rs]
            row = [LAYOUT_NAMES[lay], rs[0]["world"], METHOD_NAMES[m],
                   f"{median(walls):.3f}", f"{min(walls):.3f}-{max(walls):.3f}"]
            row.append(f"{ratio_in_run(res, lay, mode, m, 'torch'):.2f}" if "torch" in methods else "-")
            total = med(res, lay, mode, m, "read_bytes_total")
            row += [fmt_bytes(total), f"{total / unique:.2f}",
                    fmt_bytes(med(res, lay, mode, m, "read_bytes_max")),
                    f"{med(res, lay, mode, m, 'data_collectives_max'):.0f}"]
            cpu = [r["summary"]["cpu_s_total"] for r in rs if "cpu_s_total" in r["summary"]]
            row.append(f"{median(cpu):.2f}" if cpu else "-")
            if floor:
                row.append(f"{median(walls) / floor:.2f}")
            rows.append(row)
    title = TITLES[mode]
    floor_text = (f" x floor = time / physical floor, the floor being unique bytes / measured "
                  f"disk bandwidth = {fmt_bytes(unique)} / {disk_bw(res) / 1e9:.2f} GB/s = "
                  f"{floor:.3f} s." if floor else "")
    return (f"### {title}\n\nCheckpoint {fmt_bytes(unique)} (unique bytes); "
            f"median of {reps} runs; ratio = time / torch DCP's time in the same repeat "
            "(median of the per-repeat ratios); storage reads from /proc/self/io read_bytes "
            f"summed over ranks; amplification = storage reads / unique bytes; CPU = user + system "
            f"time of every rank's process during the load (all threads), summed over ranks.{floor_text}\n\n"
            + table(["layout", "ranks", "method", "load s (median)", "range", "x torch",
                     "storage read (all ranks)", "amplification", "max per rank", "collectives/rank", "CPU core-s"]
                    + (["x floor"] if floor else []), rows))


def _per_node(res: dict[str, Any], layouts: list[str], methods: list[str]) -> str:
    """Table 1b, bytes: what each rank and each simulated node fetched, cold."""
    unique = res["unique_bytes"]
    bw = disk_bw(res)
    bound = unique / bw
    rows = []
    for lay in layouts:
        for m in methods:
            rs = runs_of(res, lay, "cold", m)
            if not rs:
                continue
            per_rank = [median([r["summary"]["read_bytes_per_rank"][k] for r in rs])
                        for k in range(rs[0]["world"])]
            nodes = rs[0]["nodes"]
            per_node = [median([r["summary"]["read_bytes_per_node"][k] for r in rs]) for k in range(nodes)]
            rows.append([LAYOUT_NAMES[lay], f"{nodes} x {rs[0]['ranks_per_node']}",
                         METHOD_NAMES[m], " / ".join(f"{b / 2**20:.0f}" for b in per_rank),
                         " / ".join(f"{b / unique:.2f}" for b in per_node),
                         f"{sum(per_node) / unique:.2f}", f"{max(per_node) / (unique / nodes):.2f}",
                         f"{med(res, lay, 'cold', m, 'wall_s') / bound:.2f}"])
    p = res.get("probe")
    probe = "" if not p else (
        f"\n\nReadahead probe, same run: copying one cold {fmt_bytes(p['box_bytes'])} range out "
        f"of {p['file']} fetched " + ", ".join(f"{fmt_bytes(p[k])} through {k}" for k in (
            "mmap", "mmap MADV_RANDOM", "preadv", "preadv FADV_RANDOM"))
        + f" (block device read_ahead_kb = {p['read_ahead_kb']}). The loaders' readers, same run: "
        f"the first half of the rows of {p['loaders']['tensor']} "
        f"({fmt_bytes(p['loaders']['box_bytes'])}, cold) fetched {fmt_bytes(p['loaders']['dcp_reader'])} "
        f"through dcp_reader.read and {fmt_bytes(p['loaders']['safetensors get_slice'])} through "
        "safetensors get_slice (torch DCP's HF reader).")
    return ("### 1b. Bytes fetched from storage per rank and per node, cold (median over repeats)\n\n"
            f"Raw disk bandwidth, cold sequential 16 MiB reads of the files, median: "
            f"{bw / 1e9:.2f} GB/s, so the physical floor unique bytes / bandwidth = {bound:.3f} s. "
            "Per node: the bytes the ranks of simulated node k fetched from their copy of the "
            "files / unique bytes; node balance = the busiest node's bytes / (unique bytes / "
            f"nodes), 1.00 when the job's reads are spread evenly over the nodes.{probe}\n\n" + table(
        ["layout", "nodes x ranks", "method", "MiB read per rank (rank 0..N-1)",
        "per node / unique (node 0..N-1)", "all nodes / unique", "node balance",
        "time / floor"], rows))


def _reread(res: dict[str, Any], layouts: list[str], modes: list[str]) -> str:
    """One host: dcp's broadcast against every rank reading, warm and cold."""
    rows = []
    for mode in [m for m in ("warm", "coldhost") if m in modes]:
        for lay in layouts:
            row = [LAYOUT_NAMES[lay], mode]
            for m in ("dcp", "dcp-64k", "dcp-reread", "dcp-auto", "torch"):
                v = med(res, lay, mode, m, "wall_s")
                row.append("-" if v != v else f"{v:.3f}")
            for m in ("dcp", "dcp-64k"):
                v = ratio_in_run(res, lay, mode, m, "dcp-reread")
                row.append("-" if v != v else f"{v:.2f}")
            row.append(fmt_bytes(med(res, lay, mode, "dcp-reread", "read_bytes_total")))
            rows.append(row)
    if rows:
        return ("### One host: broadcast or re-read?\n\nEvery rank on one host, one copy of "
                "the files. broadcast / re-read = dcp (read once + broadcast, 6 MiB or 64 KiB "
                "batches) time over dcp (every rank reads) time in the same repeat (median of the ratios); storage "
                "read = bytes all ranks fetched from storage when every rank reads.\n\n" + table(
                    ["layout", "cache", "dcp broadcast s", "broadcast 64 KiB s", "dcp re-read s",
                     "dcp auto s", "torch DCP s", "broadcast / re-read", "64 KiB / re-read",
                     "storage read, re-read"], rows))
    return ""


def _phases(res: dict[str, Any], layouts: list[str], modes: list[str], methods: list[str]) -> str:
    """dcp's own LoadReport.seconds of rank 0."""
    rows = []
    phases = ("prepare", "plan", "validate", "execute", "finish", "total")
    for lay in layouts:
        for mode in modes:
            for m in [m for m in methods if m.startswith("dcp")]:
                rs = runs_of(res, lay, mode, m)
                secs = [p.get("report_seconds") for r in rs for p in r["per_rank"][:1]]
                if not rs or not all(secs):
                    continue
                rows.append([LAYOUT_NAMES[lay], mode, METHOD_NAMES[m]]
                            + [f"{median([x.get(k, float('nan')) for x in secs]):.3f}" for k in phases])
    if rows:
        return ("### dcp's own phase times (LoadReport.seconds of rank 0, median over repeats)\n\n"
                + table(["layout", "cache", "method", *phases], rows))
    return ""


def _memory(res: dict[str, Any], layouts: list[str], modes: list[str], methods: list[str]) -> str:
    """Table 4: peak resident memory per rank during the load."""
    rows = []
    for lay in layouts:
        for mode in modes:
            for m in methods:
                rs = runs_of(res, lay, mode, m)
                if not rs or "extra_anon_max" not in rs[0]["summary"]:
                    continue
                dest = rs[0]["summary"]["dest_bytes_total"] / rs[0]["world"]
                rows.append([LAYOUT_NAMES[lay], mode, METHOD_NAMES[m], fmt_bytes(dest),
                             fmt_bytes(med(res, lay, mode, m, "extra_anon_max")),
                             fmt_bytes(med(res, lay, mode, m, "extra_rss_max")),
                             fmt_bytes(med(res, lay, mode, m, "peak_rss_max"))])
    if rows:
        return ("### 4. Peak resident memory per rank during the load (worst rank, median over "
                "repeats)\n\nDestination tensors are allocated and poisoned before the load, so "
                "they are in the baseline. extra private = peak RssAnon (sampled every 2 ms) "
                "minus RssAnon before the load; extra RSS = VmHWM (reset through "
                "/proc/self/clear_refs) minus VmRSS before the load, which also counts pages of "
                "memory-mapped checkpoint files (page cache the kernel can reclaim).\n\n" + table(
                    ["layout", "cache", "method", "destination per rank", "extra private (anon)",
                     "extra RSS (anon + mapped file)", "peak RSS"], rows))
    return ""
