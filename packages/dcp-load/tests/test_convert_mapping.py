"""``convert`` maps names with ``load``'s own code: two outputs of one saved tensor (an
embedding untied) are both written; rename-only ``sources=`` are checked as ``load`` checks
them (a placeholder the key lacks, two entries matching one name), a repeated placeholder
works, an entry that composes nothing is named with the nearest saved names, and every
mistake comes before anything exists; ``dcp convert`` answers mapping and read errors with
one line and exit 2; every tensor starts at a multiple of its element size; ``prefix=``
selects and renames a training checkpoint's model, and ``config=`` writes ``config.json``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load import Concat, Stack
from dcp_load.cli._main import main as cli_main
from safetensors.torch import save_file


def _hf(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


def _read(path: Path, to: str) -> dict[str, torch.Tensor]:
    if to == "native":
        from dcp_reader import verify_checkpoint

        check = verify_checkpoint(path)
        assert check.ok, check.problems
    return dcp_load.read_state_dict(path)


def _nothing_beside(tmp_path: Path, *keep: str) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src", *keep])


@pytest.mark.parametrize("to", ["hf", "native"])
def test_two_outputs_of_one_saved_tensor_are_both_written(tmp_path, to):
    emb = torch.randn(50, 8)
    src = _hf(tmp_path, {"model.embed_tokens.weight": emb, "norm": torch.ones(8)})
    dcp_load.convert(src, tmp_path / "out", to=to, sources={
        "tok_embeddings.weight": "model.embed_tokens.weight", "output.weight": "model.embed_tokens.weight"})
    got = _read(tmp_path / "out", to)
    assert sorted(got) == ["norm", "output.weight", "tok_embeddings.weight"]
    assert torch.equal(got["tok_embeddings.weight"], emb) and torch.equal(got["output.weight"], emb)


@pytest.mark.parametrize("sources, match", [
    ({"w": "layers.{i}.w"}, r"sources\['w'\] = 'layers.\{i\}.w' uses placeholder\(s\) \{i\} that the key lacks"),
    ({"x.{i}": "layers.{i}.w", "x.{j}": "b.{j}"},
     r"destination 'x.0' matches 2 sources entries \('x.\{i\}', 'x.\{j\}'\)"),
])
def test_rename_only_sources_are_checked_as_load_checks_them(tmp_path, sources, match):
    tensors = {f"layers.{i}.w": torch.full((3,), float(i)) for i in range(4)}
    tensors.update({f"b.{i}": torch.zeros(3) for i in range(4)})
    src = _hf(tmp_path, tensors)
    with pytest.raises((ValueError, TypeError), match=match):
        dcp_load.convert(src, tmp_path / "out", sources=sources)
    _nothing_beside(tmp_path)
    state = {"w": torch.zeros(3), "x.0": torch.zeros(3)}
    with pytest.raises(dcp_load.LoadError, match=match.replace("convert", "load")):  # load refuses it alike
        dcp_load.load(state, checkpoint_id=src, sources=sources, no_dist=True)


def test_a_repeated_placeholder_is_matched_as_load_matches_it(tmp_path):
    src = _hf(tmp_path, {"a.0.b.0": torch.zeros(2), "a.1.b.1": torch.ones(2), "a.1.b.2": torch.full((2,), 5.0)})
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--to", "hf", "--quiet", "--sources",
                     _json(tmp_path, {"x.{i}": "a.{i}.b.{i}"})]) == 0
    got = dcp_load.read_state_dict(tmp_path / "out")
    assert sorted(got) == ["a.1.b.2", "x.0", "x.1"]  # a.1.b.2 is no x: it stays under its own name
    assert torch.equal(got["x.1"], torch.ones(2)) and torch.equal(got["x.0"], torch.zeros(2))


def _json(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_an_entry_that_composes_nothing_names_the_nearest_saved_names(tmp_path):
    src = _hf(tmp_path, {f"model.layers.{i}.attn.wq": torch.zeros(2) for i in range(2)})
    with pytest.raises(ValueError, match=r"sources\['layers.\{i\}.wq'\] = 'model.layer.\{i\}.attn.wq' composes "
                                         r"nothing .* nearest checkpoint keys: .*'model.layers.0.attn.wq'"):
        dcp_load.convert(src, tmp_path / "out", sources={"layers.{i}.wq": "model.layer.{i}.attn.wq"})
    _nothing_beside(tmp_path)


def test_a_load_sources_key_matching_no_destination_names_the_nearest(tmp_path):
    src = _hf(tmp_path, {f"model.layers.{i}.wq": torch.full((2,), float(i)) for i in range(2)})
    state = {f"layers.{i}.wq": torch.full((2,), -1.0) for i in range(2)}
    with pytest.raises(dcp_load.LoadError, match=r"sources\['layer.\{i\}.wq'\] matches no destination key of the "
                                                 r"state dict; nearest destination keys: .*'layers.0.wq'"):
        dcp_load.load(state, checkpoint_id=src, sources={"layer.{i}.wq": "model.layers.{i}.wq"}, no_dist=True)
    assert all(bool((t == -1).all()) for t in state.values())
    # with every destination found, an extra entry in one process is refused too
    with pytest.raises(dcp_load.LoadError, match=r"sources\['extra'\] matches no destination key"):
        dcp_load.load({"model.layers.0.wq": torch.zeros(2)}, checkpoint_id=src, no_dist=True,
                      sources={"extra": "model.layers.1.wq"})
    dcp_load.load(state, checkpoint_id=src, sources={"layers.{i}.wq": "model.layers.{i}.wq"}, no_dist=True)
    assert torch.equal(state["layers.1.wq"], torch.ones(2))


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["convert", *args])
    return code, capsys.readouterr().err


def test_mapping_and_read_errors_are_one_line_and_exit_2(tmp_path, capsys):
    src = _hf(tmp_path, {"a": torch.zeros(4, 3), "b": torch.zeros(4, 5)})
    spec = _json(tmp_path, {"ab": {"concat": ["a", "b"], "dim": 0}})
    code, err = _cli(capsys, str(src), str(tmp_path / "o1"), "--to", "hf", "--sources", spec)
    assert code == 2 and "Traceback" not in err and "the parts' shapes must agree outside dim 0" in err
    assert err.startswith("dcp convert: ")
    # a corrupt block of a native source: its checksum fails while the output is filled
    native = tmp_path / "native"
    dcp_load.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(native), no_dist=True)
    data = next(native.glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, err = _cli(capsys, str(native), str(tmp_path / "o2"), "--to", "hf", "--quiet")
    assert code == 2 and "Traceback" not in err and "checksum" in err.lower(), err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


ODD = {"a_flag": torch.tensor([True, False, True]), "b_f32": torch.arange(5, dtype=torch.float32),
       "c_i8": torch.arange(3, dtype=torch.int8), "d_f64": torch.arange(7, dtype=torch.float64),
       "e_f16": torch.arange(3, dtype=torch.float16), "f_i64": torch.arange(2, dtype=torch.int64),
       "g_bf16": torch.ones(1, dtype=torch.bfloat16), "h_i32": torch.arange(3, dtype=torch.int32)}


@pytest.mark.parametrize("to", ["hf", "native"])
def test_every_tensor_starts_at_a_multiple_of_its_element_size(tmp_path, to):
    src = _hf(tmp_path, ODD)
    report = dcp_load.convert(src, tmp_path / "out", to=to, max_shard_bytes="200B")
    seen = {}
    for name in report.files:
        path = tmp_path / "out" / name
        raw = bytearray(path.read_bytes())  # offsets in it are the file's, as in a mapping of it
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__")
        whole = torch.frombuffer(raw, dtype=torch.uint8)
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            t = ODD[key.split("@")[0]]
            start = 8 + n + begin
            assert start % t.element_size() == 0, (name, key, t.dtype, start)
            view = whole[start:8 + n + end].view(t.dtype)  # zero-copy, refused when misaligned
            assert torch.equal(view, t), key
            seen[key] = True
    assert len(seen) == len(ODD)
    assert {k: torch.equal(v, ODD[k]) for k, v in _read(tmp_path / "out", to).items()} == dict.fromkeys(ODD, True)


def _training_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    model = {"embed.weight": torch.randn(10, 4), "layers.0.wq": torch.randn(4, 4), "layers.0.wk": torch.randn(2, 4)}
    state = {"model": dict(model), "optim": {"state": {"embed.weight": {"exp_avg": torch.zeros(10, 4)}},
                                             "param_groups": [{"lr": 0.1}]}, "step": 3}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        tdcp.save(state, checkpoint_id=str(path), no_dist=True)
    return model


def test_prefix_selects_the_model_of_a_training_checkpoint_and_config_is_written(tmp_path, capsys):
    model = _training_checkpoint(tmp_path / "src")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    code, _ = _cli(capsys, str(tmp_path / "src"), str(tmp_path / "out"), "--to", "hf", "--prefix", "model.",
                   "--config", str(config))
    assert code == 0
    got = dcp_load.read_state_dict(tmp_path / "out")
    assert sorted(got) == sorted(model) and all(torch.equal(got[k], v) for k, v in model.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 4}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    # renamed, composed from the renamed names, selected by keys; native keeps values under the prefix
    report = dcp_load.convert(tmp_path / "src", tmp_path / "fused", to="native", prefix={"model.": "m."},
                              sources={"m.layers.{i}.wqk": Concat(["m.layers.{i}.wq", "m.layers.{i}.wk"])},
                              keys=["m.layers.*"])
    got = dcp_load.read_state_dict(tmp_path / "fused")
    assert sorted(got) == ["m.layers.0.wqk"] and report.tensors == 1
    assert torch.equal(got["m.layers.0.wqk"], torch.cat([model["layers.0.wq"], model["layers.0.wk"]]))


@pytest.mark.parametrize("kwargs, match", [
    ({"prefix": "modle."}, r"prefix 'modle.' starts no tensor or value name of the checkpoint"),
    ({"prefix": {"model.": "", "optim.state.": ""}}, r"prefix= gives 'embed.weight.exp_avg'|prefix= gives"),
    ({"prefix": {"model.": "x."}, "sources": {"y": Stack(["model.embed.weight"])}},
     r"sources\['y'\] = Stack\(\['model.embed.weight'\], dim=0\) composes nothing .* 'x.embed.weight'"),
    ({"config": {"model_type": "llama"}, "to": "native"}, r"config= \(--config\) is written for a Hugging Face"),
])
def test_prefix_and_config_mistakes_are_refused_before_anything(tmp_path, kwargs, match):
    _training_checkpoint(tmp_path / "src")
    if "optim.state." in kwargs.get("prefix", {}):  # two saved names renamed to one
        dcp_load.save({"model.a": torch.zeros(1), "optim.state.a": torch.zeros(1)},
                      checkpoint_id=str(tmp_path / "src2"), no_dist=True)
        src = tmp_path / "src2"
        match = r"prefix= gives 'a' to both 'model.a' and 'optim.state.a'"
    else:
        src = tmp_path / "src"
    with pytest.raises((ValueError, TypeError), match=match):
        dcp_load.convert(src, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_worker_process_reads_through_the_mapping(tmp_path, monkeypatch):
    from dcp_load.conversion import _fill, _workers

    def one_then_stop(counter, n):  # this process fills one file, the worker process the others
        real, took = _fill.claimer(counter, n), []
        return lambda: None if took else took.append(real()) or took[0]

    monkeypatch.setattr(_workers, "claimer", one_then_stop)
    parts = {f"l.{i}.{x}": torch.randn(40, 8) for i in range(2) for x in "ab"}
    src = _hf(tmp_path, parts)
    report = dcp_load.convert(src, tmp_path / "out", max_shard_bytes="2KB", workers=2,
                              sources={"w.{i}": Concat(["l.{i}.a", "l.{i}.b"], groups=2), "e.{i}": "l.{i}.a"})
    assert report.workers == 2 and len(report.files) == 4
    got = dcp_load.read_state_dict(tmp_path / "out")
    for i in range(2):
        a, b = parts[f"l.{i}.a"], parts[f"l.{i}.b"]
        assert torch.equal(got[f"w.{i}"], torch.cat([a[:20], b[:20], a[20:], b[20:]]))
        assert torch.equal(got[f"e.{i}"], a)
