"""The benchmark models: which tensors a checkpoint holds and which box of each a TP rank holds.

``ModelSpec`` (a Llama-like decoder) and ``SmallSpec`` (many small replicated tensors) name
every tensor with its shape and tensor-parallel dimension; ``box`` is the part of one
tensor a TP rank holds. The bottom of the harness: it imports nothing of the benchmarks.
"""

from __future__ import annotations

import dataclasses
import math

MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Llama-like decoder saved as a Hugging Face safetensors checkpoint (bf16).

    ``tensors()`` gives (name, shape, tp_dim): tp_dim 0 for column-parallel weights
    (q/k/v/gate/up, embeddings, lm_head), 1 for row-parallel ones (o/down), None for
    replicated ones (norms).
    """

    layers: int = 10
    hidden: int = 2048
    kv_dim: int = 512  # GQA: 4 KV heads of 128
    intermediate: int = 5632
    vocab: int = 32000
    dtype: str = "bfloat16"
    file_bytes: int = 512 * MiB  # target size of one safetensors file

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        h, kv, i, v = self.hidden, self.kv_dim, self.intermediate, self.vocab
        out: list[tuple[str, tuple[int, ...], int | None]] = [("model.embed_tokens.weight", (v, h), 0)]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,), None),
                (p + "self_attn.q_proj.weight", (h, h), 0),
                (p + "self_attn.k_proj.weight", (kv, h), 0),
                (p + "self_attn.v_proj.weight", (kv, h), 0),
                (p + "self_attn.o_proj.weight", (h, h), 1),
                (p + "post_attention_layernorm.weight", (h,), None),
                (p + "mlp.gate_proj.weight", (i, h), 0),
                (p + "mlp.up_proj.weight", (i, h), 0),
                (p + "mlp.down_proj.weight", (h, i), 1),
            ]
        out += [("model.norm.weight", (h,), None), ("lm_head.weight", (v, h), 0)]
        return out


@dataclasses.dataclass(frozen=True)
class SmallSpec:
    """Many small replicated tensors (float32), e.g. 2000 x 16 KiB."""

    count: int = 2000
    nbytes: int = 16 * 1024
    dtype: str = "float32"
    file_bytes: int = 512 * MiB

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        return [(f"small.{n:05d}.weight", (self.nbytes // 4,), None) for n in range(self.count)]


ITEMSIZE = {"bfloat16": 2, "float32": 4, "float16": 2}


def warmup_spec(spec: ModelSpec | SmallSpec) -> ModelSpec | SmallSpec:
    """A tiny checkpoint with the same names, dtypes and sharding as ``spec``."""
    if isinstance(spec, ModelSpec):
        return dataclasses.replace(spec, hidden=64, kv_dim=16, intermediate=128, vocab=256)
    return dataclasses.replace(spec, count=min(spec.count, 64), nbytes=64)


def spec_nbytes(spec: ModelSpec | SmallSpec) -> int:
    item = ITEMSIZE[spec.dtype]
    return sum(math.prod(shape) * item for _, shape, _ in spec.tensors())


def box(shape: tuple[int, ...], tp_dim: int | None, tp: int, tp_rank: int
        ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets = [0] * len(shape)
    sizes = list(shape)
    if tp_dim is not None and tp > 1:
        if shape[tp_dim] % tp:
            raise ValueError(f"dim {tp_dim} of {shape} does not divide by tp={tp}")
        sizes[tp_dim] = shape[tp_dim] // tp
        offsets[tp_dim] = tp_rank * sizes[tp_dim]
    return tuple(offsets), tuple(sizes)
