"""Checkpoint builders and in-rank functions for the object-storage tests (not a test
module): every format written locally, uploaded to the loopback S3 server, then loaded
from ``s3://`` into poisoned targets and compared byte for byte."""

from __future__ import annotations

import os
from typing import Any

from integ_load_cases import (
    BIG,
    MESH_NAMES,
    SPECS,
    _mesh_state,
    check,
    full,
    local_expected,
    local_of,
    poison_like,
    report,
    run_case,
    same,
    write_hf,
    write_native,
)

FORMATS = ("native", "hf", "torch-dcp", "hyper-parallel")
# every name of the 4-rank mesh cases, and one 32 MiB tensor: ranged reads cut into parts
HF_NAMES = [*MESH_NAMES, *BIG]


def build_local(root: str) -> dict[str, str]:
    """One checkpoint per format under ``root``: {format: directory}."""
    import torch.distributed.checkpoint as dcp

    out = {f: os.path.join(root, f) for f in FORMATS}
    write_native(out["native"], MESH_NAMES, lambda n: [2] * len(SPECS[n][0]), files=3)
    write_hf(out["hf"], HF_NAMES)
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({n: full(n) for n in MESH_NAMES}, checkpoint_id=out["torch-dcp"], no_dist=True)
    import hyper_writer as hw

    ranks = {0: {n: [((0,) * len(SPECS[n][0]), full(n))] for n in MESH_NAMES}}
    hw.write_checkpoint(out["hyper-parallel"], ranks, {n: SPECS[n][0] for n in MESH_NAMES})
    return out


def upload(local: str, uri: str) -> None:
    """Every file under ``local`` to the prefix ``uri`` (through the object backend)."""
    from dcp_reader.storage import ObjectStorage

    store = ObjectStorage(uri)
    for d, _, files in os.walk(local):
        for f in files:
            full_path = os.path.join(d, f)
            with open(full_path, "rb") as fh:
                store.put(os.path.relpath(full_path, local).replace(os.sep, "/"), [fh.read()])


def plain_state(names: list[str]) -> dict[str, Any]:
    return {n: poison_like(full(n)) for n in names}


def s3_mesh_cases(rank: int, world: int, uris: dict[str, str], save_uri: str, bad_key: str) -> dict[str, Any]:
    """DP2 x TP2: every format loaded from s3:// ([R, S(0)] and [S(0), S(1)]); a 4-rank save
    to s3:// loaded back; refused credentials on one rank fail every rank."""
    import dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results: dict[str, Any] = {}

    def load_check(state: dict[str, Any], errors: list[str], where: str, uri: str) -> Any:
        r = dcp_load.load(state, checkpoint_id=uri, timeout=120)
        check(state, errors, where)
        return report(r)

    for fmt, uri in uris.items():
        for label, pl in (("RS0", [Replicate(), Shard(0)]), ("S0S1", [Shard(0), Shard(1)])):
            case = f"{fmt}_{label}"
            run_case(results, case, lambda e, p=pl, u=uri, c=case: load_check(_mesh_state(mesh, p), e, c, u))

    def save_then_load(errors: list[str]) -> Any:
        src = _mesh_state(mesh, [Shard(0), Shard(1)])
        for name, v in src.items():  # what to save: this rank's part of each global tensor
            local_of(v).copy_(local_expected(name, v))
        dcp_load.save(src, checkpoint_id=save_uri, timeout=120)
        return load_check(_mesh_state(mesh, [Replicate(), Shard(0)]), errors, "save_then_load", save_uri)

    run_case(results, "save_then_load", save_then_load)

    def one_rank_refused(errors: list[str]) -> Any:
        """Rank 1's credentials are refused: every rank raises LoadError naming rank 1 and
        StorageAuthError, and no rank's destination changes."""
        state = _mesh_state(mesh, [Replicate(), Shard(0)])
        old = os.environ["AWS_ACCESS_KEY_ID"]
        if rank == 1:
            os.environ["AWS_ACCESS_KEY_ID"] = bad_key
        try:
            dcp_load.load(state, checkpoint_id=uris["hf"], timeout=120)
            errors.append("the load succeeded with refused credentials on rank 1")
        except dcp_load.LoadError as e:
            if "rank 1" not in str(e) or "StorageAuthError" not in str(e):
                errors.append(f"the error does not name rank 1's StorageAuthError: {e}")
        finally:
            os.environ["AWS_ACCESS_KEY_ID"] = old
        for name, v in state.items():
            t = local_of(v)
            if not same(t, poison_like(t)):  # bit-exact: NaN poison equals itself here
                errors.append(f"{name!r} changed on a failed load")

    run_case(results, "one_rank_refused", one_rank_refused)
    return results


def s3_save_outcome(rank: int, world: int, uri: str, seed: float) -> str:
    """Save two tensors (each rank writes one) into ``uri``; "ok" or the error's type and text."""
    import dcp_load
    import torch

    state = {"a": torch.arange(4096, dtype=torch.float32) + seed, "b": torch.full((4096,), seed)}
    try:
        report = dcp_load.save(state, checkpoint_id=uri, timeout=120)
    except Exception as e:  # noqa: BLE001 - the outcome is what the test compares across ranks
        return f"{type(e).__name__}: {e}"
    return "ok" if report.chunks_written == 1 else f"ok, but this rank wrote {report.chunks_written} chunk(s)"
