"""FP8 blockwise destinations of ``transfer`` (transferring/_fp8.py): the quantization
against a block-by-block reference, and the planning rewrite (who quantizes what, the
scales' composition, the problems named per rank)."""

from __future__ import annotations

import pytest
import torch
from dcp_load import Concat, Slice
from dcp_load.layouts._sources import SourceMap
from dcp_load.transferring._fp8 import derive, plan_layouts, quantize_blockwise


def reference(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: scale = amax / 448 (1 for an all-zero block), q = x / scale as e4m3fn."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // block), -(-cols // block))
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            tile = x[i:i + block, j:j + block].float()
            amax = tile.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scales[i // block, j // block] = scale
            q[i:i + block, j:j + block] = (tile / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scales


@pytest.mark.parametrize("shape", [(256, 128), (200, 136), (5, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_matches_the_block_by_block_reference(shape, dtype):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[:, :2] = 0  # no block is all zero here, but a zero column must not matter
    if shape[0] > 128:
        x[128:, :128] = 0  # an all-zero block: scale 1
    q, s = quantize_blockwise(x)
    want_q, want_s = reference(x)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    out, scales = torch.empty_like(q), torch.empty_like(s)
    quantize_blockwise(x, out, scales)
    assert torch.equal(out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales, s)


def _layouts(wq_boxes, qkv_dtype="float8_e4m3fn", scale=True):
    """2 trainer ranks holding wq, wk, wv (256 rows each, 128 cols); 2 engine ranks wanting qkv."""
    src = [[("wq", (256, 128), "bfloat16", (wq_boxes[r],)),
            ("wk", (256, 128), "bfloat16", (((128 * r, 0), (128, 128)),)),
            ("wv", (256, 128), "bfloat16", (((128 * r, 0), (128, 128)),))] for r in range(2)]
    dst = [[("qkv", (768, 128), qkv_dtype, (((384 * r, 0), (384, 128)),))]
           + ([("qkv_scale_inv", (6, 1), "float32", (((3 * r, 0), (3, 1)),))] if scale else []) for r in range(2)]
    return [(s, []) for s in src] + [([], d) for d in dst]


SOURCES = SourceMap({"qkv": Concat(["wq", "wk", "wv"], dim=0, groups=2)}, owner="transfer")
ALIGNED = [((0, 0), (128, 128)), ((128, 0), (128, 128))]


def test_derive_quantizes_the_sources_of_fp8_destinations_and_composes_their_scales():
    fp8 = derive(_layouts(ALIGNED), SOURCES)
    assert fp8.errors == {} and set(fp8.quantized) == {"wq", "wk", "wv"}
    rank1 = dict((e[0], e) for e in fp8.layouts[1][0])
    assert rank1["wq"][2] == "float8_e4m3fn"
    assert rank1["wq_scale_inv"] == ("wq_scale_inv", (2, 1), "float32", (((1, 0), (1, 1)),))
    _, scale_source = fp8.source_map.match("qkv_scale_inv")
    assert scale_source == Concat(["wq_scale_inv", "wk_scale_inv", "wv_scale_inv"], dim=0, groups=2)
    plan, quantizer = plan_layouts(_layouts(ALIGNED), SOURCES, allow_cast=True, batch_bytes=0, stage_bytes=1 << 20)
    assert plan.errors == {} and quantizer is not None
    assert {p.wire for p in plan.pieces if p.dst == "qkv"} == {"float8_e4m3fn"}  # only FP8 bytes travel
    assert {p.dst for p in plan.pieces} == {"qkv", "qkv_scale_inv"}


def test_without_a_scale_destination_fp8_is_a_plain_cast():
    assert derive(_layouts(ALIGNED, scale=False), SOURCES) is None
    assert derive(_layouts(ALIGNED, qkv_dtype="bfloat16"), SOURCES) is None


def test_a_box_across_blocks_is_named_with_its_rank():
    fp8 = derive(_layouts([((0, 0), (100, 128)), ((100, 0), (156, 128))]), SOURCES)
    assert list(fp8.errors) == [0, 1]
    assert "src 'wq': the box offsets=(100, 0) sizes=(156, 128)" in fp8.errors[1][0]
    assert "does not start and end on 128 x 128 blocks" in fp8.errors[1][0]
    plan, _ = plan_layouts(_layouts([((0, 0), (100, 128)), ((100, 0), (156, 128))]), SOURCES, allow_cast=True,
                           batch_bytes=0, stage_bytes=1 << 20)
    assert plan.errors == fp8.errors and not plan.pieces


def test_a_sliced_source_and_a_shared_source_are_refused():
    sliced = SourceMap({"qkv": Slice(Concat(["wq", "wk", "wv", "wq"], dim=0, groups=1), 0, 0, 768)}, owner="t")
    assert "its source" in derive(_layouts(ALIGNED), sliced).errors[2][0]
    layouts = _layouts(ALIGNED)
    layouts[2][1].append(("wq_copy", (256, 128), "bfloat16", (((0, 0), (256, 128)),)))
    shared = SourceMap({"qkv": Concat(["wq", "wk", "wv"], dim=0, groups=2), "wq_copy": "wq"}, owner="t")
    errors = derive(layouts, shared).errors
    assert "src 'wq' feeds the blockwise FP8 dst 'qkv' and also dst 'wq_copy'" in errors[2][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_sender_quantizes_to_the_same_bits_as_the_cpu():
    # CUDA divides by a Python number through its reciprocal: before the scale's divisor was a
    # tensor, about half the scales of a 4096 x 14336 bf16 weight differed in the last bit (H200)
    x = (torch.randn(4096, 14336, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    q, s = quantize_blockwise(x)
    q_gpu, s_gpu = quantize_blockwise(x.cuda())
    assert torch.equal(s_gpu.cpu(), s)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8))


def test_a_nan_element_stays_nan_and_its_block_keeps_the_scale_of_the_others():
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    x[5, 7] = float("nan")
    q, s = quantize_blockwise(x)
    clean = x.clone()
    clean[5, 7] = 0  # the scale of block (0, 0) as if the NaN were not there
    want_q, want_s = reference(clean)
    assert torch.equal(s, want_s), s
    assert torch.isnan(q[5, 7].float()) and torch.isnan(q.float()).sum() == 1
    keep = ~torch.isnan(q.float())
    assert torch.equal(q.view(torch.uint8)[keep], want_q.view(torch.uint8)[keep])


def test_a_block_of_subnormal_values_gets_a_positive_scale_and_no_nan():
    x = torch.full((128, 128), 1e-44, dtype=torch.float32)  # amax / 448 underflows to 0
    x[0, 0] = -2e-43
    q, s = quantize_blockwise(x)
    assert s.item() > 0 and not torch.isnan(q.float()).any()
    back = q.float() * s  # within e4m3fn's rounding (3 mantissa bits: 1/16 relative)
    assert ((back - x).abs() <= x.abs() / 16).all(), (back[0, 0], back[1, 1])


def _transfer(src, dst, sources):
    from dcp_load import transfer
    from dcp_load._errors import LoadError

    with pytest.raises(LoadError) as caught:
        transfer(src, dst, sources=sources)
    return str(caught.value)


def test_a_fused_part_off_the_blocks_is_refused_naming_the_part():
    poison = torch.full((228, 128), 7.0).to(torch.float8_e4m3fn)
    dst = {"qkv": poison.clone(), "qkv_scale_inv": torch.full((2, 1), -1.0)}
    message = _transfer({"q": torch.randn(100, 128), "k": torch.randn(128, 128)}, dst,
                        {"qkv": Concat(["q", "k"], dim=0)})
    assert "dst 'qkv' is FP8 with 'qkv_scale_inv', but its source Concat(['q', 'k'], dim=0) puts part 'q' at " \
        "[0, 100) along dim 0 of 228" in message, message
    assert "q_scale_inv" not in message, message
    assert torch.equal(dst["qkv"].view(torch.uint8), poison.view(torch.uint8)) and (dst["qkv_scale_inv"] == -1).all()
    # groups: q's second group lands at row 320 of qkv, after v's first 64 rows
    message = _transfer({"q": torch.randn(256, 128), "k": torch.randn(256, 128), "v": torch.randn(128, 128)},
                        {"qkv": torch.zeros(640, 128).to(torch.float8_e4m3fn), "qkv_scale_inv": torch.zeros(5, 1)},
                        {"qkv": Concat(["q", "k", "v"], dim=0, groups=2)})
    assert "puts part 'q' at [320, 448) along dim 0 of 640" in message, message


def test_a_scale_destination_not_float32_is_refused():
    dst = {"w": torch.zeros(256, 128).to(torch.float8_e4m3fn), "w_scale_inv": torch.zeros(2, 1, dtype=torch.bfloat16)}
    message = _transfer({"w": torch.randn(256, 128)}, dst, None)
    assert "dst 'w_scale_inv' is bfloat16: blockwise FP8 scales are float32" in message, message
