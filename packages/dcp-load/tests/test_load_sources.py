"""``load(sources=...)`` in one process: random compositions (Concat with groups, Stack,
Slice, nested) over random saved chunkings, loaded into random destination tilings, equal
to torch.cat / stack / narrow of the whole tensors with every stored element read as often
as it is needed (once); placeholders and their argument errors; bad mappings, each with
its error and the destinations untouched; mixed part dtypes; the report's ``composed``."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import dcp_load
import pytest
import torch
from dcp_load import Chunk, Concat, LoadError, Slice, Stack
from dcp_load.layouts._sources import SourceMap
from dcp_reader import open_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import sources_cases as cases  # noqa: E402

# -- random compositions ------------------------------------------------------------------


@st.composite
def _expr(draw, shape: tuple[int, ...], depth: int, leaves: dict[str, tuple[int, ...]]):
    """A source whose result has ``shape``; the saved tensors it names go into ``leaves``."""
    kinds = ["leaf"]
    if depth > 0:
        kinds += ["slice", "concat", "concat"]
        if len(shape) >= 2 and any(n <= 3 for n in shape):
            kinds.append("stack")
    kind = draw(st.sampled_from(kinds))
    if kind == "leaf":
        name = f"t{len(leaves)}"
        leaves[name] = shape
        return name
    if kind == "slice":
        d = draw(st.integers(0, len(shape) - 1))
        before, after = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        inner = draw(_expr((*shape[:d], shape[d] + before + after, *shape[d + 1:]), depth - 1, leaves))
        return Slice(inner, d, before, before + shape[d])
    if kind == "stack":
        d = draw(st.sampled_from([i for i, n in enumerate(shape) if n <= 3]))
        part = (*shape[:d], *shape[d + 1:])
        return Stack([draw(_expr(part, depth - 1, leaves)) for _ in range(shape[d])], d)
    d = draw(st.integers(0, len(shape) - 1))
    groups = draw(st.sampled_from([g for g in (1, 2, 3) if shape[d] % g == 0]))
    per_group = shape[d] // groups
    k = draw(st.integers(1, min(3, per_group)))
    cuts = sorted(draw(st.lists(st.integers(1, per_group - 1), min_size=k - 1, max_size=k - 1, unique=True))) \
        if per_group > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, per_group], strict=True)]
    parts = [draw(_expr((*shape[:d], groups * s, *shape[d + 1:]), depth - 1, leaves)) for s in sizes]
    return Concat(parts, d, groups)


@st.composite
def _case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    leaves: dict[str, tuple[int, ...]] = {}
    source = draw(_expr(shape, 2, leaves))
    cuts = {n: [draw(st.lists(st.integers(1, max(1, s - 1)), max_size=2)) for s in sh] for n, sh in leaves.items()}
    dtypes = {n: draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])) for n in leaves}
    tiles = [draw(st.lists(st.integers(1, max(1, s - 1)), max_size=2)) for s in shape]
    files = draw(st.integers(1, 3))
    return shape, source, leaves, cuts, dtypes, tiles, files


@settings(max_examples=100, deadline=None)
@given(_case())
def test_random_compositions_equal_torch_and_read_each_byte_once(case):
    shape, source, leaves, cuts, dtypes, tiles, files = case
    g = torch.Generator().manual_seed(len(leaves))
    full = {n: torch.randn(sh, generator=g).to(dtypes[n]) for n, sh in leaves.items()}
    expected = cases.evaluate(source, {n: t.float() for n, t in full.items()})
    assert tuple(expected.shape) == shape
    with tempfile.TemporaryDirectory() as path:
        cases.write_chunked(path, full, cuts, files)
        # the destination, tiled at random: each tile is a Chunk under its own key, all
        # composed from the same source
        state, sources = {}, {}
        for j, (offsets, sizes) in enumerate(cases.grid(shape, tiles)):
            state[f"dst.{j}"] = Chunk(torch.full(sizes, float("nan")), shape, offsets)
            sources[f"dst.{j}"] = source
        with open_checkpoint(path) as inner:
            counting = cases.CountingReader(inner)
            report = dcp_load.load(state, storage_reader=counting, sources=sources, no_dist=True)
    for j, (offsets, sizes) in enumerate(cases.grid(shape, tiles)):
        assert torch.equal(state[f"dst.{j}"].tensor, cases.box(expected, offsets, sizes)), (j, source)
    want = cases.expected_counts([source], full)
    for n in leaves:
        assert torch.equal(counting.counts[n], want[n]), (n, source)
    needed = sum(int(w.sum()) * full[n].element_size() for n, w in want.items())
    assert report.bytes_read == needed
    assert dict(report.composed) == {k: len(set(cases_leaves(source))) for k in state}


def cases_leaves(source):
    from dcp_load.layouts._sources import leaves

    return leaves(source)


# -- the Hugging Face names a training layout is built from ----------------------------------

H, KV, HD, D = 4, 2, 2, 6  # heads, KV heads, head dim, model dim


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    full = {}
    for i in range(2):
        p = f"model.layers.{i}."
        full[p + "self_attn.q_proj.weight"] = torch.randn(H * HD, D, generator=g)
        full[p + "self_attn.k_proj.weight"] = torch.randn(KV * HD, D, generator=g)
        full[p + "self_attn.v_proj.weight"] = torch.randn(KV * HD, D, generator=g)
        full[p + "mlp.gate_proj.weight"] = torch.randn(8, D, generator=g)
        full[p + "mlp.up_proj.weight"] = torch.randn(8, D, generator=g)
        for e in range(3):
            full[p + f"mlp.experts.{e}.w1.weight"] = torch.randn(4, D, generator=g)
    full["model.embed_tokens.weight"] = torch.randn(10, D, generator=g)
    path = str(tmp_path_factory.mktemp("hf"))
    save_file(full, path + "/model.safetensors")
    return path, full


def _sources() -> dict:
    p = "model.layers.{i}."
    return {
        "layers.{i}.attention.wqkv": Concat([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                             p + "self_attn.v_proj.weight"], dim=0, groups=KV),
        "layers.{i}.mlp.w13": Concat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], dim=0, groups=2),
        "layers.{i}.moe.w1": Stack([p + f"mlp.experts.{e}.w1.weight" for e in range(3)], dim=0),
        "tok_embeddings.weight": "model.embed_tokens.weight",
    }


def _layout(nan: float = float("nan")) -> dict[str, torch.Tensor]:
    out = {"tok_embeddings.weight": torch.full((10, D), nan)}
    for i in range(2):
        out[f"layers.{i}.attention.wqkv"] = torch.full(((H + 2 * KV) * HD, D), nan)
        out[f"layers.{i}.mlp.w13"] = torch.full((16, D), nan)
        out[f"layers.{i}.moe.w1"] = torch.full((3, 4, D), nan)
    return out


def test_hf_checkpoint_into_fused_layout(hf):
    path, full = hf
    state = _layout()
    report = dcp_load.load(state, checkpoint_id=path, sources=_sources(), no_dist=True)
    for i in range(2):
        p = f"model.layers.{i}."
        q, k, v = (full[p + f"self_attn.{x}_proj.weight"].view(KV, -1, D) for x in "qkv")
        assert torch.equal(state[f"layers.{i}.attention.wqkv"], torch.cat([q, k, v], 1).reshape(-1, D))
        gate, up = full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]
        assert torch.equal(state[f"layers.{i}.mlp.w13"], torch.cat([gate[:4], up[:4], gate[4:], up[4:]]))
        assert torch.equal(state[f"layers.{i}.moe.w1"],
                           torch.stack([full[p + f"mlp.experts.{e}.w1.weight"] for e in range(3)]))
    assert torch.equal(state["tok_embeddings.weight"], full["model.embed_tokens.weight"])
    assert report.bytes_read == report.bytes_needed == sum(t.nbytes for t in state.values())
    assert dict(report.composed) == {"tok_embeddings.weight": 1, **{
        f"layers.{i}.{k}": n for i in range(2) for k, n in (("attention.wqkv", 3), ("mlp.w13", 2), ("moe.w1", 3))}}


def test_split_back_with_slice_and_unmatched_keys_load_their_own_names(hf):
    path, full = hf
    fused = {"qkv": torch.cat([full["model.layers.0.self_attn.q_proj.weight"],
                               full["model.layers.0.self_attn.k_proj.weight"]]), "emb": full["model.embed_tokens.weight"]}
    save_file(fused, path + "/../fused.safetensors")
    fdir = Path(path).parent / "fused"
    fdir.mkdir(exist_ok=True)
    (Path(path).parent / "fused.safetensors").rename(fdir / "model.safetensors")
    state = {"q": torch.full((H * HD, D), -1.0), "k": torch.full((KV * HD, D), -1.0), "emb": torch.zeros(10, D)}
    dcp_load.load(state, checkpoint_id=fdir, no_dist=True,
                  sources={"q": Slice("qkv", 0, 0, H * HD), "k": Slice("qkv", 0, H * HD, (H + KV) * HD)})
    assert torch.equal(state["q"], fused["qkv"][:H * HD]) and torch.equal(state["k"], fused["qkv"][H * HD:])
    assert torch.equal(state["emb"], fused["emb"])


def test_placeholders_match_one_segment_and_are_enumerated_from_the_checkpoint():
    m = SourceMap({"a.{i}.b": Concat(["x.{i}.p", "x.{i}.q"]), "c.{i}.{i}": "y.{i}"})
    assert m.match("a.3.b") == ("a.{i}.b", Concat(["x.3.p", "x.3.q"]))
    assert m.match("a.3.4.b") is None and m.match("c.1.1") == ("c.{i}.{i}", "y.1") and m.match("c.1.2") is None
    saved = {"x.0.p": 0, "x.0.q": 0, "x.1.p": 0, "y.7": 0, "y.a.b": 0}
    assert m.enumerate(saved) == {"a.0.b": Concat(["x.0.p", "x.0.q"]), "c.7.7": "y.7"}



def test_a_segment_of_two_placeholders_loads_the_source_that_match_names(tmp_path):
    """``{a}_{b}.w`` matches ``p_q_r.w`` as a=p_q, b=r (the match names 'p_q.r'); the
    checkpoint's 'p.q_r' also gives that name (a=p, b=q_r) and must not be what is loaded."""
    save_file({"p.q_r": torch.zeros(2), "p_q.r": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    sources = {"{a}_{b}.w": "{a}.{b}"}
    assert SourceMap(sources).match("p_q_r.w") == ("{a}_{b}.w", "p_q.r")
    assert SourceMap(sources).enumerate({"p.q_r": 0, "p_q.r": 0}) == {"p_q_r.w": "p_q.r"}
    state = {"p_q_r.w": torch.full((2,), float("nan"))}
    dcp_load.load(state, checkpoint_id=tmp_path, no_dist=True, sources=sources)
    assert state["p_q_r.w"].tolist() == [1.0, 1.0]

@pytest.mark.parametrize("sources, match", [
    ({"a.{i}": "b"}, r"placeholder\(s\) \{i\} of the key appear in no source name"),
    ({"a": "b.{i}"}, r"uses placeholder\(s\) \{i\} that the key lacks"),
    ({"a": 3}, "a source must be a str"),
    ({"a": ("b",)}, "a source must be a str"),
    (["a"], "sources must be a mapping"),
])
def test_bad_sources_argument_is_refused_before_anything(sources, match):
    with pytest.raises(LoadError, match=match):  # a LoadError, raised on every rank alike
        dcp_load.load({"a": torch.zeros(1)}, checkpoint_id="/nonexistent", sources=sources, no_dist=True)
    with pytest.raises(ValueError, match="stop .* must be above start"):
        Slice("a", 0, 3, 3)
    with pytest.raises(ValueError, match="groups must be an int >= 1"):
        Concat(["b"], groups=0)
    with pytest.raises(TypeError, match="parts must be a non-empty list"):
        Stack("ab")


@pytest.mark.parametrize("state, sources, match", [
    ({"layers.0.attention.wqkv": torch.zeros(16, D)},
     {"layers.{i}.attention.wqkv": Concat(["model.layers.{i}.self_attn.q_proj.weight",
                                           "model.layers.{i}.self_attn.k_proj.weigth"])},
     r"destination 'layers.0.attention.wqkv' \(sources\['layers.\{i\}.attention.wqkv'\]\): source\(s\) "
     r"'model.layers.0.self_attn.k_proj.weigth' .* are not tensors of the checkpoint; nearest checkpoint keys: "
     r"'model.layers.0.self_attn.k_proj.weigth' -> 'model.layers.0.self_attn.k_proj.weight'"),
    ({"w": torch.zeros(12, D)},
     {"w": Concat(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"], groups=3)},
     r"destination 'w' .*groups=3 does not divide part 'model.layers.0.self_attn.q_proj.weight', which has 8 "
     r"along dim 0"),
    ({"w": torch.zeros(15, D)},
     {"w": Concat(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"])},
     r"destination 'w' .* gives shape \(12, 6\) but the destination's global shape is \(15, 6\) \(dim 0 differs\); "
     r"along dim 0 the parts .* add up to 12"),
    ({"w": torch.zeros(8, D)},
     {"w": Concat(["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"], dim=1)},
     r"destination 'w' .*part 'model.embed_tokens.weight' has shape \(10, 6\) but part "
     r"'model.layers.0.self_attn.q_proj.weight' has \(8, 6\); the parts' shapes must agree outside dim 1"),
    ({"w": torch.zeros(4, D)}, {"w": Slice("model.layers.0.self_attn.k_proj.weight", 0, 2, 6)},
     r"destination 'w' .*Slice\('model.layers.0.self_attn.k_proj.weight', dim=0, 2:6\) is out of range: .* "
     r"has shape \(4, 6\) \(4 along dim 0\)"),
    ({"w": torch.zeros(2, 4, D)},
     {"w": Stack(["model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight"])},
     r"part 'model.layers.0.mlp.gate_proj.weight' has shape \(8, 6\) but part .* has \(4, 6\)"),
    ({"w.0": torch.zeros(10, D)}, {"w.{i}": "model.embed_tokens.weight".replace("tokens", "{i}"),
                                   "{j}.0": "model.embed_tokens.weight".replace("tokens", "{j}")},
     r"destination 'w.0' matches 2 sources entries \('w.\{i\}', '\{j\}.0'\); make the keys match one each"),
])
def test_bad_mappings_fail_before_any_write(hf, state, sources, match):
    path, _ = hf
    for t in state.values():
        t.fill_(-7.0)
    with pytest.raises(LoadError, match=match):
        dcp_load.load(state, checkpoint_id=path, sources=sources, no_dist=True)
    assert all(bool((t == -7.0).all()) for t in state.values())


def test_parts_of_other_dtypes_follow_the_cast_rules(tmp_path):
    a, b = torch.randn(2, 3), torch.randn(4, 3).bfloat16()
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    src = {"w": Concat(["a", "b"])}
    state = {"w": torch.full((6, 3), float("nan"))}
    report = dcp_load.load(state, checkpoint_id=tmp_path, sources=src, no_dist=True)
    assert torch.equal(state["w"], torch.cat([a, b.float()])) and report.cast == ("w",)
    state = {"w": torch.full((6, 3), -7.0)}
    with pytest.raises(LoadError, match=r"destination 'w' \(sources\['w'\]\): part 'b' is bfloat16 but the "
                                        r"destination is float32 \(allow_dtype_cast=False refuses casts\)"):
        dcp_load.load(state, checkpoint_id=tmp_path, sources=src, no_dist=True, allow_dtype_cast=False)
    assert bool((state["w"] == -7.0).all())


def test_stacked_experts_read_narrowed_and_sum_to_the_needed_bytes(hf):
    path, full = hf
    # rank-like halves of the stacked experts along the expert and the row dims
    state = {f"e{j}": Chunk(torch.full((sz[0], sz[1], D), float("nan")), (3, 4, D), (o[0], o[1], 0))
             for j, (o, sz) in enumerate([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (1, 4))])}
    src = {k: Stack([f"model.layers.1.mlp.experts.{e}.w1.weight" for e in range(3)]) for k in state}
    report = dcp_load.load(state, checkpoint_id=path, sources=src, no_dist=True)
    whole = torch.stack([full[f"model.layers.1.mlp.experts.{e}.w1.weight"] for e in range(3)])
    assert torch.equal(state["e0"].tensor, whole[:2, :2]) and torch.equal(state["e2"].tensor, whole[2:])
    assert report.bytes_read == math.prod(whole.shape) * 4


def test_scalars_stack_and_strict_false_skips_destinations_whose_sources_are_missing(tmp_path):
    save_file({"s.0": torch.tensor(1.5), "s.1": torch.tensor(2.5), "w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    state = {"stacked": torch.zeros(2), "gone": torch.full((2,), -7.0), "w": torch.zeros(2)}
    report = dcp_load.load(state, checkpoint_id=tmp_path, no_dist=True, strict=False,
                           sources={"stacked": Stack(["s.0", "s.1"]), "gone": Concat(["s.0", "s.9"])})
    assert state["stacked"].tolist() == [1.5, 2.5] and state["w"].tolist() == [1.0, 1.0]
    assert state["gone"].tolist() == [-7.0, -7.0] and report.missing == ("gone",)
    assert dict(report.composed) == {"stacked": 2}


def test_every_rank_plans_from_the_same_virtual_metadata_whatever_it_holds(hf):
    """The virtual tensors come from the checkpoint and ``sources`` alone: a rank holding
    only layer 0 (a pipeline stage) and one holding only layer 1 compare equal digests."""
    from dcp_load.layouts._sourced_reader import apply_sources
    from dcp_load.layouts._state import Leaf
    from dcp_load.layouts._target_for import target_for
    from dcp_load.plan._derived import metadata_digest

    path, _ = hf
    layout = _layout()
    digests = []
    for layer in ("layers.0.", "layers.1."):
        targets = [target_for(Leaf(n, t, layout, n)) for n, t in layout.items() if n.startswith(layer)]
        with open_checkpoint(path) as reader:
            applied = apply_sources(reader, targets, SourceMap(_sources()), True)
            assert not applied.errors and len(applied.targets) == 3
            digests.append(metadata_digest(applied.reader.metadata.tensors))
            assert "layers.1.attention.wqkv" in applied.reader.metadata.tensors
    assert digests[0] == digests[1]


def test_stack_along_the_last_dim_reads_into_one_element_views(tmp_path):
    """A stacked piece read into a (1, 1) box of a (2, 2) destination: the box without its
    stacked dim must be a view with its own strides (found by the random test above)."""
    save_file({"t0": torch.tensor([[1.0, 2.0]]), "t1": torch.tensor([3.0]), "t2": torch.tensor([4.0])},
              str(tmp_path / "model.safetensors"))
    w = torch.full((2, 2), float("nan"))
    dcp_load.load({"w": w}, checkpoint_id=tmp_path, no_dist=True,
                  sources={"w": Concat(["t0", Stack(["t1", "t2"], dim=1)])})
    assert w.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_a_sources_key_matching_a_non_tensor_value_is_refused(hf):
    path, _ = hf
    state = {"w": torch.full((10, D), -7.0), "step": 3}
    with pytest.raises(LoadError, match=r"sources= matches 'step', a non-tensor value of the state dict"):
        dcp_load.load(state, checkpoint_id=path, no_dist=True, sources={"w": "model.embed_tokens.weight",
                                                                       "step": "model.embed_tokens.weight"})
    assert bool((state["w"] == -7.0).all()) and state["step"] == 3


def test_a_source_naming_a_non_tensor_value_of_the_checkpoint_says_so(tmp_path):
    dcp_load.save({"a": torch.ones(2), "step": 5}, checkpoint_id=tmp_path, no_dist=True)
    state = {"w": torch.full((2,), -7.0)}
    with pytest.raises(LoadError, match=r"destination 'w' \(sources\['w'\]\): source\(s\) 'step' of 'step' are "
                                        r"not tensors of the checkpoint; 'step' is a non-tensor value there"):
        dcp_load.load(state, checkpoint_id=tmp_path, no_dist=True, sources={"w": "step"})
    assert state["w"].tolist() == [-7.0, -7.0]


def test_a_rename_per_key_matches_in_time_linear_in_the_keys():
    """A generated mapping of one plain rename per key (tens of thousands for a MoE model)
    matched each destination against every key's regex: 10k keys took ~35 s here."""
    import time

    names = [f"layers.{i // 100}.experts.{i % 100}.w" for i in range(10_000)]
    sources = {n: "model." + n for n in names}
    sources["extra.{i}.w"] = "model.extra.{i}.w"
    start = time.perf_counter()
    m = SourceMap(sources)
    assert [m.match(n) for n in names] == [(n, "model." + n) for n in names]
    assert m.match("extra.3.w") == ("extra.{i}.w", "model.extra.3.w") and m.match("other") is None
    assert time.perf_counter() - start < 5.0
    both = SourceMap({"extra.3.w": "a", "extra.{i}.w": "b.{i}"})
    with pytest.raises(ValueError, match=r"matches 2 sources entries \('extra.3.w', 'extra.\{i\}.w'\)"):
        both.match("extra.3.w")


@pytest.mark.parametrize("parts, kw, match", [
    (["c", "a"], {"allow_dtype_cast": False},
     r"part 'c' is bfloat16 but the destination is float32 \(allow_dtype_cast=False refuses casts\)"),
    (["z", "a"], {}, r"part 'z' is complex64 but the destination is float32 \(complex and real do not mix\)"),
])
def test_a_first_part_that_cannot_be_cast_is_named_like_the_others(tmp_path, parts, kw, match):
    """The composed tensor takes its first part's dtype: that part's refusal named only the
    destination ("checkpoint bfloat16"), where a later part's named the part."""
    save_file({"a": torch.randn(2, 3), "c": torch.randn(4, 3).bfloat16(), "z": torch.randn(4, 3).to(torch.complex64)},
              str(tmp_path / "model.safetensors"))
    state = {"w": torch.full((6, 3), -7.0)}
    with pytest.raises(LoadError, match=r"destination 'w' \(sources\['w'\]\): " + match):
        dcp_load.load(state, checkpoint_id=tmp_path, no_dist=True, sources={"w": Concat(parts)}, **kw)
    assert bool((state["w"] == -7.0).all())


def test_strict_false_a_tied_key_whose_source_is_missing_is_filled_through_its_alias(tmp_path):
    """Keys ``tok`` and ``out`` hold one tensor; ``tok``'s source is missing, ``out``'s is
    saved. strict=False loads ``out``, which writes ``tok`` too: the report lists ``tok``
    as tied through ``out``, not as missing with its values kept."""
    emb = torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": emb}, str(tmp_path / "model.safetensors"))
    t = torch.full((10, 4), -7.0)
    report = dcp_load.load({"tok": t, "out": t}, checkpoint_id=tmp_path, no_dist=True, strict=False,
                           sources={"tok": "model.missing", "out": "model.embed_tokens.weight"})
    assert torch.equal(t, emb)
    assert report.missing == () and report.tied == (("tok", "out"),) and dict(report.composed) == {"out": 1}


def test_a_float32_part_after_a_bfloat16_one_keeps_its_precision(tmp_path):
    """A composed tensor takes its first part's dtype; a later part of a wider dtype read
    into a float32 destination must not be staged (rounded) through the first one's."""
    first = torch.randn(1, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    second = torch.randn(4, generator=torch.Generator().manual_seed(1))
    save_file({"t0": first, "t1": second}, str(tmp_path / "model.safetensors"))
    state = {"w": torch.full((5,), float("nan"))}
    dcp_load.load(state, checkpoint_id=str(tmp_path), sources={"w": Concat(["t0", "t1"])}, no_dist=True)
    assert torch.equal(state["w"], torch.cat([first.float(), second]))
