"""``dcp plan``: the dry run's JSON and text output for built-in models and a checkpoint
directory, each broadcast mode planned as load plans it (tests-integration/load/test_integ_plan.py
compares the plan with real loads), its numbers checked against the global plan built from
every rank's gathered wants and the broadcasts against dcp_broadcast's packing, the PNG, clear errors for bad arguments and unreadable checkpoints, the histogram's
bins (property-tested, as is the mesh parsing), the terminal status line, and role timing
(which roles each pass times, the simulation frozen out of garbage collection)."""

from __future__ import annotations

import gc
import io
import json
from contextlib import redirect_stdout

import pytest
from dcp_load.cli._main import main
from dcp_load.cli._plan import StatusLine, histogram
from dcp_load.plan import _simulate
from dcp_load.plan._plan import build_global_plan
from dcp_load.plan._simulate import Layout, gathered_wants, model_metadata, simulate
from hypothesis import given, settings
from hypothesis import strategies as st

KEYS = {"world_size", "planning_seconds_max", "exchanged_bytes_per_rank_max", "read_bytes_per_rank_max",
        "read_bytes_per_rank_mean", "broadcasts_per_rank_max", "amplification"}


def _run(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["plan", *argv])
    return code, buf.getvalue()


def test_json_for_a_built_in_model() -> None:
    code, text = _run("--model", "llama-8b", "--mesh", "tp=2,pp=2,dp=4", "--json", "--repeats", "2")
    assert code == 0
    out = json.loads(text)
    assert out["timing_repeats"] == 2 and out["roles_timed"] == 4
    assert KEYS <= set(out)
    assert out["world_size"] == 16 and out["tensors"] == 32 * 9 + 3
    assert 0 < out["planning_seconds_max"] < 5
    assert out["exchanged_bytes_per_rank_max"] <= 4096
    assert out["read_bytes_per_rank_max"] >= out["read_bytes_per_rank_mean"] > 0
    assert out["read_bytes_per_rank_mean"] * 16 == out["read_bytes_total"]
    assert 1.0 <= out["amplification"] < 1.01  # the same host re-reads only replicated norms
    assert out["broadcasts_per_rank_max"] > 0


def test_simulated_reads_equal_the_gathered_global_plan() -> None:
    tensors = model_metadata("llama-8b")
    layout = Layout(2, 2, 2, ranks_per_host=2)
    wants, hosts = gathered_wants(tensors, layout)
    full = build_global_plan(tensors, wants, hosts=hosts)
    sim = simulate(tensors, layout, time_roles=False)
    assert sim["read_bytes_per_rank"] == list(full.loads)
    assert sim["unique_bytes"] == full.unique_bytes
    per_rank = [sum(1 for i in full.broadcasts if r in i.ranks) for r in range(layout.world)]
    assert sim["broadcast_items_per_rank_max"] == max(per_rank)
    # The collectives load runs for them: the items packed by dcp_broadcast's own planning.
    from dcp_broadcast import BroadcastItem
    from dcp_broadcast._plan import build_plan

    transfers = build_plan([BroadcastItem(i.reader, i.ranks, i.nbytes) for i in full.broadcasts], 6 * 1024 * 1024)
    assert sim["broadcasts_per_rank"] == [sum(1 for t in transfers if r in t.ranks) for r in range(layout.world)]
    assert 0 < max(sim["broadcasts_per_rank"]) < max(per_rank)


def test_each_broadcast_mode_is_planned_as_load_plans_it() -> None:
    """Before, the plan always assumed "auto" on files, whatever load would do."""
    common = ("--model", "llama-8b", "--mesh", "tp=2,dp=2", "--ranks-per-host", "4", "--json", "--repeats", "1")
    out = {mode: json.loads(_run(*common, "--broadcast", mode)[1]) for mode in ("auto", "true", "false")}
    assert [out[m]["broadcast_replicated_tensors"] for m in out] == ["auto", True, False]
    half = out["true"]["read_bytes_total"]
    assert out["true"]["unique_bytes"] == half and out["true"]["broadcasts_per_rank_max"] > 0
    for mode in ("auto", "false"):  # one host: every rank reads all it holds (norms on 4 ranks), no broadcast
        assert out[mode]["read_bytes_total"] > 2 * half and out[mode]["broadcasts_per_rank_max"] == 0, mode
    assert out["auto"]["read_bytes_total"] == out["false"]["read_bytes_total"]
    spread = json.loads(_run(*common[:4], "--ranks-per-host", "1", "--json", "--repeats", "1")[1])
    assert spread["read_bytes_total"] == half  # "auto" across hosts: read once, broadcast
    unpacked = json.loads(_run(*common, "--broadcast", "true", "--batch-bytes", "0")[1])
    assert unpacked["broadcasts_per_rank_max"] == unpacked["broadcast_items_per_rank_max"]
    assert out["true"]["broadcasts_per_rank_max"] < unpacked["broadcasts_per_rank_max"]


def test_load_mode_is_loads_rule_and_the_batch_default_is_loads() -> None:
    import dcp_load
    from dcp_load.plan._simulate import BATCH_BYTES, load_mode

    assert BATCH_BYTES == dcp_load.DEFAULT_BATCH_BYTES
    assert load_mode("auto", object_store=False) == (True, True)
    assert load_mode("auto", object_store=True) == (True, False)  # no page cache shared on object storage
    assert load_mode(True, object_store=False) == load_mode(True, object_store=True) == (True, False)
    assert load_mode(False, object_store=True) == (False, False)
    with pytest.raises(ValueError, match="got 'yes'"):
        load_mode("yes", object_store=False)


def test_text_output_has_every_number_and_a_histogram() -> None:
    code, text = _run("--model", "llama-8b", "--mesh", "tp=2,dp=4", "--fsdp")
    assert code == 0
    for needle in ("broadcast_replicated_tensors='auto': each rank of a box's host reads it (8 ranks per host)",
                   "planning per rank", "exchanged per rank", "read per rank: max", "broadcasts per rank",
                   "storage amplification", "bytes read per rank:"):
        assert needle in text
    bars = [line for line in text.splitlines() if " | " in line]
    assert bars == [f"     2.0 GB (every rank) | {'#' * 40} 8"]  # FSDP over dp: every rank reads alike


def test_a_checkpoint_directory_and_png(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    h = 64
    state = {"model.embed_tokens.weight": torch.zeros(256, h), "model.norm.weight": torch.zeros(h),
             "lm_head.weight": torch.zeros(256, h)}
    for n in range(4):
        state[f"model.layers.{n}.self_attn.q_proj.weight"] = torch.zeros(h, h)
        state[f"model.layers.{n}.self_attn.o_proj.weight"] = torch.zeros(h, h)
        state[f"model.layers.{n}.input_layernorm.weight"] = torch.zeros(h)
    save_file(state, str(tmp_path / "model.safetensors"))
    png = tmp_path / "reads.png"
    code, text = _run("--checkpoint", str(tmp_path), "--mesh", "tp=2,pp=2,dp=2", "--json", "--png", str(png))
    assert code == 0
    out = json.loads(text)
    assert out["world_size"] == 8 and out["tensors"] == len(state)
    assert out["amplification"] >= 1.0 and out["unique_bytes"] == sum(t.numel() * 4 for t in state.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "llama-1t", "--mesh", "tp=8"], "llama-1t"),
    (["--model", "llama-8b", "--mesh", "tp=8,xp=2"], "xp=2"),
    (["--model", "llama-8b", "--mesh", "tp=0"], "tp=0"),
    (["--model", "llama-8b", "--mesh", "tp=2", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--model", "llama-8b", "--mesh", "tp=2", "--batch-bytes", "-1"], "--batch-bytes must be >= 0"),
    (["--model", "llama-8b", "--mesh", "tp=2,pp=2,tp=4"], "each dimension may be given once, got tp=2 and tp=4"),
])
def test_bad_arguments_exit_2_naming_them(argv, needle, capsys) -> None:
    assert main(["plan", *argv]) == 2
    assert needle in capsys.readouterr().err


def _tiny_hf(path, names=("w",)) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({n: torch.zeros(8, 4) for n in names}, str(path / "model.safetensors"))


def test_unreadable_checkpoints_are_one_line_and_exit_2(tmp_path, capsys) -> None:
    import torch
    from safetensors.torch import save_file

    _tiny_hf(tmp_path)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(2)}, str(sharded / "model-00001-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    for path, needle in ((tmp_path / "absent", "does not exist"), (tmp_path / "model.safetensors", "not a directory"),
                         (sharded, "model-00002-of-00002.safetensors")):
        assert main(["plan", "--checkpoint", str(path), "--mesh", "tp=2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dcp plan: {path}") and err.count("\n") == 1 and needle in err, err


def test_one_tensor_is_singular(tmp_path) -> None:
    _tiny_hf(tmp_path)
    code, text = _run("--checkpoint", str(tmp_path), "--mesh", "dp=2", "--repeats", "1")
    assert code == 0 and ": 2 ranks, 1 tensor, 128 B" in text, text


def test_histogram_of_equal_reads_is_one_line() -> None:
    assert histogram([4096] * 4) == [f"     4.1 KB (every rank) | {'#' * 40} 4"]


def test_histogram_bins_are_distinct_when_sizes_round_alike() -> None:
    lines = histogram([3912, 3912, 3912, 2928])
    assert [int(line.rsplit(" ", 1)[1]) for line in lines] == [1, 0, 0, 0, 0, 0, 0, 3]
    lines = histogram([3912, 3912, 3912, 3904])  # every edge rounds to 3.9 KB: printed in bytes
    edges = [" ".join(line.split("|")[0].split()) for line in lines]
    assert len(set(edges)) == len(edges) == 8, lines
    assert edges[0] == "3,904 B - 3,905 B" and edges[-1] == "3,911 B - 3,912 B", edges
    assert len(histogram([10, 12])) == 2  # never more bins than byte counts between the extremes
    assert [line.split("|")[0].split() for line in histogram([0, 1])] == [["0", "B", "-", "1", "B"], ["1", "B", "-", "2", "B"]]


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_only_on_a_terminal_and_erased_at_the_end() -> None:
    now = [0.0]
    tty = _TTY()
    line = StatusLine(tty, clock=lambda: now[0])
    line("building the job's plan: 8 ranks")
    line("timing rank roles: pass 1 of 1, role 1 of 2")  # within 0.1 s: skipped
    now[0] = 1.0
    line("timing rank roles: pass 1 of 1, role 2 of 2")
    line.close()
    assert tty.getvalue() == ("\rdcp plan: building the job's plan: 8 ranks"
                              "\rdcp plan: timing rank roles: pass 1 of 1, role 2 of 2"
                              "\r" + " " * 53 + "\r")
    pipe = io.StringIO()
    quiet = StatusLine(pipe)
    quiet("building the job's plan: 8 ranks")
    quiet.close()
    assert pipe.getvalue() == ""


def test_roles_are_timed_with_the_simulation_frozen(monkeypatch) -> None:
    """Each role's garbage collection must not walk the simulation's own objects: with
    them frozen, TP8 x PP8 x DP256 took 8 s instead of 26 s on one core."""
    frozen = []
    timed = _simulate._timed

    def spy(fn):
        frozen.append(gc.get_freeze_count())
        return timed(fn)

    monkeypatch.setattr(_simulate, "_timed", spy)
    before = len(gc.get_objects())
    out = simulate(model_metadata("llama-8b"), Layout(2, 2, 4), repeats=2)
    assert out["roles_timed"] == 4 and len(frozen) >= 2 + 4 + 1 + 2  # pass 2: half the roles, their stages
    assert min(frozen) > 0.9 * before and gc.get_freeze_count() == 0  # and unfrozen after


def test_every_role_is_timed_once_and_the_slower_half_in_every_pass(monkeypatch) -> None:
    planned: list[int] = []
    monkeypatch.setattr(_simulate, "_plan_role", lambda tensors, layout, rank, entries, hosts: planned.append(rank))

    def fake_timed(fn):  # rank r's own part takes (r + 1) ms; a stage's shared part 0
        n = len(planned)
        out = fn()
        wall = (planned[-1] + 1) / 1000 if len(planned) > n else 0.0
        return wall, wall / 2, out

    monkeypatch.setattr(_simulate, "_timed", fake_timed)
    said: list[str] = []
    out = simulate(model_metadata("llama-8b"), Layout(2, 2, 1), repeats=3, progress=said.append)
    assert planned == [0, 0, 1, 2, 3, 1, 2, 3, 1, 2, 3]  # warm-up, pass 1, then ranks at or above the median
    assert out["roles_timed"] == 4 and out["timing_repeats"] == 3
    assert out["planning_seconds_max"] == 0.004 and out["planning_seconds_median"] == 0.0025
    assert out["planning_cpu_seconds_max"] == 0.002
    assert said[0] == "building the job's plan: 4 ranks" and said[-1] == "timing rank roles: pass 3 of 3, role 3 of 3"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**12), min_size=1, max_size=300))
def test_histogram_counts_every_rank_once_under_distinct_labels(values) -> None:
    lines = histogram(values)
    counts = [int(line.rsplit(" ", 1)[1]) for line in lines]
    assert sum(counts) == len(values)
    assert (len(lines) == 1) == (len(set(values)) == 1) and len(lines) <= 8
    if len(lines) > 1:
        edges = [" ".join(line.split("|")[0].split()) for line in lines]
        assert len(set(edges)) == len(edges), lines
        assert counts[0] >= 1 and counts[-1] >= 1  # the extremes fall in the end bins


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["tp", "pp", "dp"]), min_size=1, max_size=5), st.data())
def test_parse_mesh_takes_each_dimension_once(dims, data) -> None:
    sizes = [data.draw(st.integers(1, 4096)) for _ in dims]
    text = ",".join(f"{d}={n}" for d, n in zip(dims, sizes, strict=True))
    if len(set(dims)) < len(dims):
        with pytest.raises(ValueError, match="each dimension may be given once"):
            _simulate.parse_mesh(text)
    else:
        assert _simulate.parse_mesh(text) == {"tp": 1, "pp": 1, "dp": 1, **dict(zip(dims, sizes, strict=True))}


def test_simulated_object_store_plan_relays_column_shards() -> None:
    # On object storage (relay) every byte is still read once; a TP layout's row-parallel
    # slabs are read whole by the host's relaying rank (4 ranks on one 8-rank host: rank 0),
    # which sends the other columns.
    from dcp_load.plan._simulate import Layout, model_metadata, simulate

    tensors = model_metadata("llama-8b")
    out = {relay: simulate(tensors, Layout(2, 1, 2, same_host_reads=False, relay=relay), repeats=1)
           for relay in (False, True)}
    for result in out.values():
        assert result["amplification"] == 1.0 and result["read_bytes_total"] == result["unique_bytes"]
    loads = out[True]["read_bytes_per_rank"]
    assert loads[0] == max(loads) > out[False]["read_bytes_per_rank_max"]
    assert out[True]["broadcasts_per_rank_max"] > out[False]["broadcasts_per_rank_max"]
