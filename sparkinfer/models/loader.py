"""`load_weights`: one rank's `ModelWeights` from a checkpoint, reading only its slices.

Legend: H hidden, V vocabulary, D head dim, Hq query heads, KVH key/value heads,
E routed experts, I intermediate, W ranks, r this rank, `_l` this rank's share.

What rank r reads (the rules of `Sharding`):

    q_proj     rows of query heads [r Hq/W, (r+1) Hq/W)           -> qkv rows [0, Hq_l D)
    k/v_proj   KV heads: split like q when KVH >= W (KVH % W == 0);
               else the one head its query heads read; all KVH when dcp = W
    o_proj     columns of its query heads (input-dim shard: partial sums)
    MLP        gate/up rows [r I/W, (r+1) I/W), down columns the same (dense
               layers, shared experts, and every routed expert)
    router     all of it (replicated), and GLM's correction bias
    embed,     rows [r V_l, (r+1) V_l) of the vocabulary padded to a multiple of W
    lm_head    (V_l = ceil(V / W)); rows past V are zero. lm_head is embed when tied.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from sparkinfer.errors import ShapeError
from sparkinfer.models.checkpoint import FLOAT_DTYPES, Checkpoint
from sparkinfer.models.config import ModelSpec
from sparkinfer.models.experts import RoutedExperts, expert_layout, load_routed
from sparkinfer.models.nvfp4_io import FoldStats, read_dense
from sparkinfer.models.weights import (
    AttentionWeights,
    DenseMLPWeights,
    ExpertWeights,
    LayerWeights,
    ModelWeights,
    Sharding,
)

__all__ = ["load_weights", "HeadShard", "head_shard", "vocab_shard"]


@dataclass(frozen=True)
class HeadShard:
    """The heads rank r holds. Query heads [q_start, q_start + q_heads); KV heads
    [kv_start, kv_start + kv_heads). Local query head j reads local KV head
    (q_start + j) // (Hq / KVH) - kv_start."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def head_shard(spec: ModelSpec, sharding: Sharding) -> HeadShard:
    """This rank's heads (see `Sharding`). Pure. ShapeError when Hq % W != 0, when
    KVH >= W but KVH % W != 0, or when KVH < W and a rank's query heads would read
    two KV heads."""
    hq, kvh, w = spec.num_heads, spec.num_kv_heads, sharding.world
    q0, q1 = sharding.split(hq, "num_attention_heads")
    group = hq // kvh
    if sharding.dcp == w and w > 1:
        return HeadShard(q0, q1 - q0, 0, kvh)
    if kvh >= w:
        k0, k1 = sharding.split(kvh, "num_key_value_heads")
        return HeadShard(q0, q1 - q0, k0, k1 - k0)
    if q0 // group != (q1 - 1) // group:
        raise ShapeError(f"num_key_value_heads={kvh} < world={w}, and rank {sharding.rank}'s query "
                         f"heads [{q0}, {q1}) read KV heads {q0 // group} and {(q1 - 1) // group}; "
                         f"choose a world size whose query-head share divides {group}")
    return HeadShard(q0, q1 - q0, q0 // group, 1)


def vocab_shard(vocab_size: int, sharding: Sharding) -> tuple[int, int]:
    """(vocab_start, V_l): this rank's rows of the vocabulary padded to a multiple of W."""
    vl = math.ceil(vocab_size / sharding.world)
    return sharding.rank * vl, vl


def load_weights(ckpt: Checkpoint, spec: ModelSpec, sharding: Sharding, *, device="cpu",
                 moe_format: str = "bf16", progress=None) -> ModelWeights:
    """Read this rank's `ModelWeights` (see `sparkinfer.models.weights`).

    ckpt: the checkpoint; spec: its `load_spec`; sharding: rank, world, dcp.
    moe_format: "bf16", or "nvfp4" for routed experts as NVFP4Tensors (bf16
    checkpoints are quantized here per rank after slicing; ModelOpt NVFP4
    checkpoints load their packed bytes and scales as stored). progress: optional
    callable(done, total, what) after each step (embeddings, each layer, head).
    Allocates everything on `device`; reads only this rank's slices from disk.
    Raises CheckpointError (missing, mis-shaped or mistyped tensor, damaged file:
    the message names the tensor and the file), ShapeError (a size the world
    size does not divide) or PlanError (unknown moe_format).
    """
    heads = head_shard(spec, sharding)  # every size check before the first read
    for n, what in ((spec.moe_intermediate if any(spec.moe_layers) else 0, "moe_intermediate_size"),
                    (spec.dense_intermediate, "intermediate_size"),
                    (spec.shared_intermediate, "shared experts' intermediate size")):
        sharding.split(n, what)
    total = spec.num_layers + 2
    report = progress or (lambda done, total, what: None)
    v0, vl = vocab_shard(spec.vocab_size, sharding)
    embed = _vocab_rows(ckpt, "model.embed_tokens", spec, (v0, vl), device)
    report(1, total, "embeddings")
    layers, fold = [], FoldStats()
    for i in range(spec.num_layers):
        base = f"model.layers.{i}"
        if spec.moe_layers[i]:
            routed = load_routed(ckpt, spec, sharding, i, device=device, moe_format=moe_format)
            mlp = _moe(ckpt, spec, sharding, i, routed, device)
            fold = fold + routed.fold
        else:
            mlp = _mlp(ckpt, f"{base}.mlp", spec.dense_intermediate, spec, sharding, device)
        layers.append(LayerWeights(
            input_norm=_vector(ckpt, f"{base}.input_layernorm.weight", spec.hidden, device),
            post_attn_norm=_vector(ckpt, f"{base}.post_attention_layernorm.weight", spec.hidden,
                                   device),
            attn=_attention(ckpt, f"{base}.self_attn", spec, heads, device),
            mlp=mlp))
        report(i + 2, total, f"layer {i + 1}/{spec.num_layers}")
    if spec.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = _vocab_rows(ckpt, "lm_head", spec, (v0, vl), device)
    final_norm = _vector(ckpt, "model.norm.weight", spec.hidden, device)
    report(total, total, "lm_head")
    if fold.inexact:
        warnings.warn(f"{ckpt.path}: some experts' gate_proj and up_proj have different "
                      "weight_scale_2; each expert's stacked w1 took the larger global scale "
                      "and the ratio was folded into the other side's E4M3 block scales, where "
                      f"{fold.inexact} block scales could not hold it exactly and were rounded "
                      f"to nearest (largest relative change {fold.max_rel:.3g})", stacklevel=2)
    return ModelWeights(embed=embed, lm_head=lm_head, final_norm=final_norm, layers=layers,
                        vocab_start=v0)


def _attention(ckpt: Checkpoint, prefix: str, spec: ModelSpec, hs: HeadShard,
               device) -> AttentionWeights:
    d, h = spec.head_dim, spec.hidden
    q_rows = (hs.q_start * d, (hs.q_start + hs.q_heads) * d)
    kv_rows = (hs.kv_start * d, (hs.kv_start + hs.kv_heads) * d)
    parts = [("q_proj", spec.num_heads, q_rows), ("k_proj", spec.num_kv_heads, kv_rows),
             ("v_proj", spec.num_kv_heads, kv_rows)]
    qkv = torch.cat([read_dense(ckpt, f"{prefix}.{p}", (n * d, h), dim=0, span=rows,
                                device=device) for p, n, rows in parts])
    bias = None
    if spec.attention_bias:
        bias = torch.cat([_vector(ckpt, f"{prefix}.{p}.bias", n * d, device, span=rows)
                          for p, n, rows in parts])
    o = read_dense(ckpt, f"{prefix}.o_proj", (h, spec.num_heads * d), dim=1, span=q_rows,
                   device=device)
    q_norm = k_norm = None
    if spec.qk_norm:
        q_norm = _vector(ckpt, f"{prefix}.q_norm.weight", d, device)
        k_norm = _vector(ckpt, f"{prefix}.k_norm.weight", d, device)
    return AttentionWeights(qkv=qkv, o=o, kv_heads=hs.kv_heads, qkv_bias=bias, q_norm=q_norm,
                            k_norm=k_norm)


def _mlp(ckpt: Checkpoint, prefix: str, inter: int, spec: ModelSpec, sharding: Sharding,
         device) -> DenseMLPWeights:
    h = spec.hidden
    a, b = sharding.split(inter, f"intermediate size of {prefix}")
    gate_up = torch.cat([read_dense(ckpt, f"{prefix}.{p}", (inter, h), dim=0, span=(a, b),
                                    device=device) for p in ("gate_proj", "up_proj")])
    down = read_dense(ckpt, f"{prefix}.down_proj", (h, inter), dim=1, span=(a, b), device=device)
    return DenseMLPWeights(gate_up=gate_up, down=down)


def _moe(ckpt: Checkpoint, spec: ModelSpec, sharding: Sharding, layer: int,
         routed: RoutedExperts, device) -> ExpertWeights:
    prefix = expert_layout(ckpt, spec, layer).prefix
    # transformers computes GLM's sigmoid routing from an fp32 router weight
    # (_keep_in_fp32_modules_strict); the softmax families use the model dtype.
    router_dtype = torch.float32 if spec.routing == "sigmoid_grouped" else torch.bfloat16
    name = f"{prefix}.gate.weight"
    ckpt.expect(name, (spec.num_experts, spec.hidden), FLOAT_DTYPES, what="[E, H] router")
    router = ckpt.read(name, dtype=router_dtype, device=device)
    bias = None
    if spec.routing == "sigmoid_grouped":
        bias = _vector(ckpt, f"{prefix}.gate.e_score_correction_bias", spec.num_experts, device,
                       dtype=torch.float32)
    shared = None
    if spec.num_shared_experts:
        shared = _mlp(ckpt, f"{prefix}.shared_experts", spec.shared_intermediate, spec, sharding,
                      device)
    return ExpertWeights(router=router, w1=routed.w1, w2=routed.w2, correction_bias=bias,
                         shared=shared)


def _vocab_rows(ckpt: Checkpoint, prefix: str, spec: ModelSpec, shard: tuple[int, int],
                device) -> torch.Tensor:
    """Rows [v0, v0 + V_l) of a [V, H] table, zero past V."""
    v0, vl = shard
    out = torch.zeros(vl, spec.hidden, dtype=torch.bfloat16, device=device)  # [V_l, H]
    stop = min(v0 + vl, spec.vocab_size)
    if stop > v0:
        out[:stop - v0] = read_dense(ckpt, prefix, (spec.vocab_size, spec.hidden), dim=0,
                                     span=(v0, stop), device=device)
    return out


def _vector(ckpt: Checkpoint, name: str, n: int, device, *, span=None,
            dtype=torch.bfloat16) -> torch.Tensor:
    ckpt.expect(name, (n,), FLOAT_DTYPES)
    return ckpt.read(name, span=span, dtype=dtype, device=device)
