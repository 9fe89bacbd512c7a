"""Functions that run inside ranks for test_integ_disagree_property.py (not a test module).

``draws`` runs many draws in one long-lived set of ranks. In each draw every rank draws its
own arguments from a generator seeded by (seed, draw, rank); a shared generator seeded by
(seed, draw) gives the value a field takes when the ranks agree on it, so that some draws
agree on everything, most on nearly everything, and a few on little. Each rank loads with
what it drew and records what happened; then every rank loads with agreeing arguments
(which must succeed). ``no_dist`` and ``use_collectives`` are drawn alike on every rank (a
call without collectives takes no part in the others' calls: one rank's in place of their
collective call is one call fewer, not a disagreement); a rank may instead make a call of
its own without collectives before the drawn one (``alone``) or come late to it (``late``,
after the others' timeout): both are calls the others never wait for. Targets are poisoned (NaN) before each load.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from integ_disagree_cases import NAMES, SHAPE, holds

#: field -> (options, weights): what a rank may pass
FIELDS: dict[str, tuple[tuple[Any, ...], tuple[float, ...]]] = {
    "checkpoint": (("a", "b"), (1, 1)),
    "source": (("id", "reader"), (3, 1)),
    "mode": ((True, False, "auto"), (2, 1, 1)),
    "batch": ((0, 512, 6 * 1024 * 1024), (1, 1, 2)),
    "timeout": ((5.0, 10.0, 20.0), (1, 1, 1)),  # short enough to matter, long enough for 2 busy cores
    "groups": ((False, True), (4, 1)),
    "no_dist": ((False, True), (9, 1)),
    "collectives": ((True, False), (9, 1)),
    "layout": (("plain", "chunk"), (3, 1)),
    "planner": ((None, "greedy"), (6, 1)),
    "failing": ((None, "argument", "missing_key", "read"), (12, 1, 1, 1)),
    "alone": ((False, "load", "read"), (8, 1, 1)),  # a call of this rank's own, without collectives, first
    "late": ((False, True), (24, 1)),  # this rank comes after the others gave up waiting for it
}
#: fields every rank draws alike (a difference there is a call fewer, not a disagreement)
SHARED = ("no_dist", "collectives")
#: fields a rank draws alone, from a base of False (so that draws agreeing on all have none)
OWN = ("alone", "late")


def draw(seed: int, k: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s arguments in draw ``k``: each field is the shared value unless the
    rank's own generator says to differ (never in a draw where every rank agrees)."""
    shared = random.Random(f"{seed}/{k}")
    own = random.Random(f"{seed}/{k}/{rank}")
    agree_all = shared.random() < 0.3
    differ = shared.choice((0.05, 0.15, 0.5))  # how often a field differs in this draw
    out = {}
    for field, (options, weights) in FIELDS.items():
        base = shared.choices(options, weights)[0]
        mine = own.choices(options, weights)[0]
        if field in OWN:
            base = False
        out[field] = base if field in SHARED or agree_all or own.random() >= differ else mine
    if out["late"]:  # a late rank that also loaded alone the checkpoint the others gave up is read
        out["alone"] = False  # as having made that call alone (run/_calls.py): it would join their next
    return out


def _state(layout: str, extra: bool) -> dict[str, Any]:
    from dcp_load import Chunk

    def one() -> Any:
        t = torch.full(SHAPE, float("nan"))
        return t if layout == "plain" else Chunk(t, SHAPE, (0, 0))

    state = {n: one() for n in NAMES}
    if extra:
        state["extra.w"] = one()
    return state


def _failing_reader(path: str) -> Any:
    """An open reader whose first read raises (on the read-ahead thread: execute phase)."""
    from dcp_reader import open_checkpoint

    reader = open_checkpoint(path)

    def fail(*args: Any, **kw: Any) -> Any:
        raise OSError("injected read failure")

    reader.read = fail  # type: ignore[method-assign]
    reader.read_into = fail  # type: ignore[method-assign]
    return reader


def _one(rank: int, world: int, ck: dict[str, str], args: dict[str, Any]) -> dict[str, Any]:
    """Load with ``args``; what happened, kept small (the parent asserts on it)."""
    import dcp_load
    import torch.distributed as dist
    from dcp_load import LoadError
    from dcp_reader import open_checkpoint

    path = ck[args["checkpoint"]]
    reader = None
    kw: dict[str, Any] = {"broadcast_replicated_tensors": args["mode"], "broadcast_batch_bytes": args["batch"],
                          "timeout": args["timeout"], "no_dist": args["no_dist"],
                          "use_collectives": args["collectives"]}
    if args["groups"]:
        kw["broadcast_groups"] = {tuple(range(world)): dist.group.WORLD}
    if args["planner"] == "greedy":
        kw["planner"] = dcp_load.GreedyPlanner()
    if args["failing"] == "argument":
        kw["broadcast_batch_bytes"] = -1
    if args["failing"] == "read":
        reader = kw["storage_reader"] = _failing_reader(path)
    elif args["source"] == "reader":
        reader = kw["storage_reader"] = open_checkpoint(path)
    else:
        kw["checkpoint_id"] = path
    state = _state(args["layout"], args["failing"] == "missing_key")
    start = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        dcp_load.load(state, **kw)
        out["holds"] = holds(state, args["checkpoint"])
    except (LoadError, ValueError) as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)[:400]
    except BaseException as exc:  # noqa: BLE001 - an untyped error is a finding: report it
        out["error"] = f"untyped {type(exc).__name__}"
        out["message"] = repr(exc)[:400]
    finally:
        if reader is not None:
            reader.close()
    out["seconds"] = round(time.monotonic() - start, 3)
    return out


def _before(args: dict[str, Any], ck: dict[str, str]) -> None:
    """What this rank does before its drawn call: a call of its own, or wait past the others' timeout."""
    import dcp_load

    if args["alone"] == "load":
        state = _state("plain", False)
        dcp_load.load(state, checkpoint_id=ck["b"], no_dist=True)
        assert holds(state, "b")
    elif args["alone"] == "read":
        assert set(dcp_load.read_state_dict(ck["a"])) == set(NAMES)
    if args["late"]:
        time.sleep(args["timeout"] + 3.0)


def draws(rank: int, world: int, ck: dict[str, str], seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` draws, each followed by a load where every rank agrees."""
    import dcp_load

    records = []
    for k in range(count):
        args = draw(seed, k, rank)
        _before(args, ck)
        got = _one(rank, world, ck, args)
        which = "ab"[k % 2]
        state = _state("plain", False)
        start = time.monotonic()
        try:
            dcp_load.load(state, checkpoint_id=ck[which], timeout=60.0)
            after = {"ok": holds(state, which)}
        except BaseException as exc:  # noqa: BLE001 - the property fails: report it
            after = {"ok": False, "message": f"{type(exc).__name__}: {str(exc)[:400]}"}
        after["seconds"] = round(time.monotonic() - start, 3)
        records.append({"args": args, "got": got, "after": after})
    return records
