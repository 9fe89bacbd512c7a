"""Scenario 6: cold loads from storage with a cluster's bandwidth (kernel block-I/O throttle).

Simulated nodes as in scenario 1b (node k = ranks [k*tp, (k+1)*tp), its own byte-identical
copy of the files, page cache dropped before each load, a DCP_HOST_ID per node), with the
read bandwidth capped at B by ``harness.throttle``:

- ``node`` (per-node link): one cgroup per node, each capped at B;
- ``shared`` (shared file system): every rank in one cgroup capped at B.

Every method loads with the same caps, one after the other, on the same files. The physical
floor is what storage alone forces: per-node link, the job's unique bytes spread evenly
over the nodes' links, ``unique / nodes / B``; shared file system, ``unique / B``. Beside
it, each loader's own floor: the bytes its busiest node (or, shared, all nodes) really
fetched, over B.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from bench_load_replicated import prepare_checkpoints  # noqa: E402
from harness import throttle as throttle  # noqa: E402
from harness.common import Run  # noqa: E402
from harness.layouts import (  # noqa: E402
    LAYOUT_NAMES,
    LAYOUTS,
    METHOD_NAMES,
    METHOD_RUN,
    SOURCES,
    peer_status,
    ranks_per_node,
    run_one,
)
from harness.stats import fmt_bytes, median, table

SCENARIOS = ("node", "shared")
SCENARIO_NAMES = {"node": "per-node link", "shared": "shared file system"}


def run(args: Any, log: Any) -> dict[str, Any]:
    reason = throttle.unavailable(args.workdir)
    if reason is not None:
        log(f"throttled: skipped: {reason}")
        return {"skipped": reason}
    for d in throttle.remove_stale():
        log(f"throttled: removed a cgroup an earlier run left: {d}")
    layouts = args.throttle_layouts
    spec, nbytes, sources = prepare_checkpoints(args, log, layouts, True)
    device = throttle.block_device(sources["hf"]["dirs"][0])
    peers = peer_status()
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for rep in range(args.throttle_repeats):
        for bps in args.throttle_bps:
            for scen in SCENARIOS:
                for lay in layouts:
                    _layout(args, log, rep, bps, scen, lay, spec, sources, device, peers, runs, failures)
    return {"unique_bytes": nbytes, "device": device, "bps": args.throttle_bps, "runs": runs,
            "peers": peers, "peer_failures": failures}


def _layout(args: Any, log: Any, rep: int, bps: int, scen: str, lay: str, spec: Any,
            sources: dict[str, Any], device: str, peers: dict[str, str | None],
            runs: list[dict[str, Any]], failures: list[dict[str, Any]]) -> None:
    dp, tp = LAYOUTS[lay]
    world = dp * tp
    rpn = ranks_per_node(args, lay)
    src = sources[SOURCES.get(lay, "hf")]
    dirs = tuple(src["dirs"][: world // rpn])
    names = [f"node{k}" for k in range(len(dirs))] if scen == "node" else ["shared"]
    order = list(args.throttle_methods)
    k = rep % len(order)
    for method in order[k:] + order[:k]:
        run_method, batch = METHOD_RUN[method]
        entry = {"layout": lay, "world": world, "dp": dp, "tp": tp, "mode": scen, "bps": bps,
                 "method": method, "repeat": rep, "nodes": len(dirs), "ranks_per_node": rpn}
        with throttle.Throttle(device, bps, names) as th:
            r = Run(method=run_method, spec=spec, dp=dp, tp=tp, ckpt_dirs=dirs, ranks_per_node=rpn,
                    cold=True, batch_bytes=args.batch_bytes if batch is None else batch,
                    verify=rep == 0 or args.verify_all, warmup_dir=src["warm"], simulate_hosts=True,
                    fmt=src["fmt"], verify_dir=src["verify"],
                    cgroups=tuple(th.path(n) for n in names))
            done = run_one(args, r, world, entry, failures, peers, log)
            served = th.bytes_served()
        if done is None:
            continue
        done["cgroup_read_bytes"] = served
        runs.append(done)
        s = done["summary"]
        log(f"  rep {rep} {bps / 2**20:.0f} MiB/s {scen:6s} {lay:7s} {method:10s} {s['wall_s']:7.3f} s  "
            f"read {fmt_bytes(s['read_bytes_total'])} (per node "
            f"{' / '.join(f'{b / 2**20:.0f}' for b in s['read_bytes_per_node'])} MiB)")


def floor_s(res: dict[str, Any], r: dict[str, Any]) -> float:
    """The physical floor of run ``r``: what storage alone forces, in seconds."""
    unique = res["unique_bytes"]
    return unique / r["bps"] / (r["nodes"] if r["mode"] == "node" else 1)


def own_floor_s(r: dict[str, Any]) -> float:
    """The loader's own storage time: its busiest link's fetched bytes over B."""
    per_node = r["summary"]["read_bytes_per_node"]
    return (max(per_node) if r["mode"] == "node" else sum(per_node)) / r["bps"]


def _rs(res: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [r for r in res["runs"] if all(r.get(k) == v for k, v in match.items())]


def ratio(res: dict[str, Any], a: str, b: str, **match: Any) -> float:
    """Median over repeats of time(a) / time(b), each ratio within one repeat."""
    ta = {r["repeat"]: r["summary"]["wall_s"] for r in _rs(res, method=a, **match)}
    tb = {r["repeat"]: r["summary"]["wall_s"] for r in _rs(res, method=b, **match)}
    return median([ta[k] / tb[k] for k in ta if k in tb])


def tables(res: dict[str, Any]) -> list[str]:
    if res.get("skipped"):
        return ["### 6. Throttled storage (kernel block-I/O throttle)\n\nNot run here: "
                f"{res['skipped']}."]
    rows = []
    for bps in res["bps"]:
        for scen in SCENARIOS:
            for lay in dict.fromkeys(r["layout"] for r in res["runs"]):
                for m in dict.fromkeys(r["method"] for r in res["runs"]):
                    rs = _rs(res, bps=bps, mode=scen, layout=lay, method=m)
                    if not rs:
                        continue
                    wall = median([r["summary"]["wall_s"] for r in rs])
                    floor = floor_s(res, rs[0])
                    per_node = [median([r["summary"]["read_bytes_per_node"][k] for r in rs])
                                for k in range(rs[0]["nodes"])]
                    rows.append([f"{bps / 2**20:.0f} MiB/s", SCENARIO_NAMES[scen], LAYOUT_NAMES[lay],
                                 f"{rs[0]['nodes']} x {rs[0]['ranks_per_node']}", METHOD_NAMES[m],
                                 f"{wall:.2f}", f"{floor:.2f}", f"{wall / floor:.2f}",
                                 f"{median([own_floor_s(r) for r in rs]):.2f}",
                                 f"{ratio(res, m, 'torch', bps=bps, mode=scen, layout=lay):.2f}",
                                 " / ".join(f"{b / 2**20:.0f}" for b in per_node)])
    reps = len({r["repeat"] for r in res["runs"]})
    return ["### 6. Throttled storage: a cluster's read bandwidth (kernel block-I/O throttle)\n\n"
            f"Cold, simulated nodes (a copy of the files per node, page cache dropped), read "
            f"bandwidth of device {res['device']} capped with cgroup v1 "
            "`blkio.throttle.read_bps_device`. *per-node link*: one cgroup per node, each capped "
            "at B; *shared file system*: every rank in one cgroup capped at B. Physical floor = "
            f"unique bytes ({fmt_bytes(res['unique_bytes'])}) / nodes / B (per-node link) or "
            "unique bytes / B (shared): what storage alone forces on any loader. Own floor = the "
            "bytes this loader's busiest link really fetched (per-node link: the busiest node; "
            "shared: all nodes) / B. x torch = time / torch DCP's time, same repeat. "
            f"{reps} repeat(s); times are medians.\n\n" + table(
                ["B", "storage", "layout", "nodes x ranks", "method", "load s", "physical floor s",
                 "x floor", "own floor s", "x torch", "MiB fetched per node"], rows)]
