"""``dcp plan``: the dry run's JSON and text output for built-in models and a checkpoint
directory, its numbers checked against the global plan built from every rank's gathered
wants, the PNG, and clear errors for bad arguments."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
from dcp_load._cli import main
from dcp_load._plan import build_global_plan
from dcp_load._simulate import Layout, gathered_wants, model_metadata, simulate

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
    assert sim["broadcasts_per_rank_max"] == max(per_rank)


def test_text_output_has_every_number_and_a_histogram() -> None:
    code, text = _run("--model", "llama-8b", "--mesh", "tp=2,dp=4", "--fsdp")
    assert code == 0
    for needle in ("planning per rank", "exchanged per rank", "read per rank: max", "broadcasts per rank",
                   "storage amplification", "bytes read per rank:"):
        assert needle in text
    bars = [line for line in text.splitlines() if " | " in line]
    assert len(bars) == 8 and sum(int(b.rsplit(" ", 1)[1]) for b in bars) == 8


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
])
def test_bad_arguments_exit_2_naming_them(argv, needle, capsys) -> None:
    assert main(["plan", *argv]) == 2
    assert needle in capsys.readouterr().err
