"""Will a decode benchmark's model fit? The bytes one rank needs, counted before anything is built.

    need = memory_need(load_spec(preset_config("glm-4.5-air")), "bf16", source="random-direct", batch=8,
                       max_len=576)
    check_fits(need, torch.cuda.mem_get_info()[0], "glm-4.5-air, 46 layers, bf16 experts")  # CapacityError

Legend: L layers, H hidden, D head dim, E routed experts, I_l this rank's expert
intermediate, V_l this rank's vocabulary rows, B batch, W ranks.

What is counted (one rank):

    weights     what the loader returns for its shard (`loader.load_weights`), experts in the
                format asked: bf16 2 bytes per weight, NVFP4 0.5 + 1/16 (E2M1 codes and one
                E4M3 scale per 16), with I_l padded to the MoE plan's 32 (`moe/plan.py`)
    transient   the largest temporary of the build, the larger of: reading the largest tensor
                (a `RandomSource` draws it whole: the tensor, its slice and one fp32 draw
                chunk), and for NVFP4 one layer's bf16 experts staged for `quantize_nvfp4` plus
                its fp32 temporaries (measured on the CPU: 1.1 GB over a 64M-element bf16
                input, 4.3x the input's fp32 size; counted as 5x) over the matrices it takes at
                a time (`quant.nvfp4.QUANTIZE_CHUNK_BYTES` of fp32, at least one matrix). The
                decoder's MoE layers copy one layer at a time (`decode_model.build`), which the
                first term covers.
    kv_cache    2 (k, v) x L x (B + 1) slots x max_len x KVH_l x D x 2 bytes
    reference   with weights from transformers, its whole model in bf16 beside ours
    reserve     CUDA graphs, MoE and attention scratch, cuBLAS / Triton workspaces and the
                allocator's slack: 4 GB, a guess until a full-depth run records its peak
                (rows carry `peak_mem_bytes`)

Pure host arithmetic: no device, no allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkinfer.errors import CapacityError, PlanError

__all__ = ["MemoryNeed", "memory_need", "check_fits", "EXPERT_BYTES", "spec_config", "preset_layers", "max_cache_len"]

# Bytes per expert weight in each format the decoder runs.
EXPERT_BYTES = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 16}
SOURCES = ("transformers", "random-direct", "checkpoint")
RESERVE_BYTES = 4_000_000_000
QUANTIZE_FP32_FACTOR = 5  # quantize_nvfp4's temporaries over its input's fp32 size (4.3x measured)
PAD_MULTIPLE = 32  # moe/plan.py PAD_MULTIPLE: the prepared experts' I is a multiple of it


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one rank needs, by part (see the module docstring). total: their sum."""

    weights: int
    transient: int
    kv_cache: int
    reference: int
    reserve: int = RESERVE_BYTES
    fmt: str = "bf16"  # the experts' format (check_fits suggests NVFP4 only to bf16)

    @property
    def total(self) -> int:
        return self.weights + self.transient + self.kv_cache + self.reference + self.reserve

    def describe(self) -> str:
        parts = [("weights", self.weights), ("build temporaries", self.transient), ("KV cache", self.kv_cache),
                 ("transformers model", self.reference), ("reserve", self.reserve)]
        return ", ".join(f"{what} {n / 1e9:.1f}" for what, n in parts if n)


def memory_need(spec, fmt: str, *, source: str, batch: int, max_len: int, sharding=None) -> MemoryNeed:
    """Bytes one rank (`sharding`, default the whole model) needs to build `spec` with
    experts in `fmt` ("bf16" or "nvfp4") from weights of `source` ("transformers",
    "random-direct" or "checkpoint": a directory's own tensors) and a KV cache of batch + 1 slots of max_len positions.
    PlanError for an unknown fmt or source; ShapeError where the loader would raise one."""
    from sparkinfer.models.loader import head_shard, vocab_shard
    from sparkinfer.models.weights import Sharding

    if fmt not in EXPERT_BYTES or source not in SOURCES:
        raise PlanError(f"memory_need: fmt={fmt!r}, source={source!r}; choose fmt in {sorted(EXPERT_BYTES)} "
                        f"and source in {SOURCES}")
    sh = sharding or Sharding()
    hs = head_shard(spec, sh)
    h, d, e = spec.hidden, spec.head_dim, spec.num_experts
    _, vl = vocab_shard(spec.vocab_size, sh)
    weights = vl * h * 2 * (1 if spec.tie_word_embeddings else 2) + h * 2
    rows = (hs.q_heads + 2 * hs.kv_heads) * d
    attn = (rows * h + h * hs.q_heads * d) * 2 + 4 * h + (rows * 2 if spec.attention_bias else 0) + \
        (4 * d if spec.qk_norm else 0)
    i_l = spec.moe_intermediate // sh.world
    i_pad = -(-i_l // PAD_MULTIPLE) * PAD_MULTIPLE
    sigmoid = spec.routing == "sigmoid_grouped"  # GLM: fp32 router and correction bias
    moe = int(3 * e * h * i_pad * EXPERT_BYTES[fmt]) + e * h * (4 if sigmoid else 2) + (4 * e if sigmoid else 0) + \
        (8 * e if fmt == "nvfp4" else 0) + 3 * h * (spec.shared_intermediate // sh.world) * 2  # + global scales
    dense = 3 * h * (spec.dense_intermediate // sh.world) * 2
    weights += sum(attn + (moe if is_moe else dense) for is_moe in spec.moe_layers)
    full = _largest_tensor_bytes(spec)
    transient = 2 * full + 4 * (1 << 26)  # the drawn tensor, its slice, one fp32 chunk (random_source.DRAW_CHUNK)
    if fmt != "bf16" and any(spec.moe_layers):
        from sparkinfer.quant.nvfp4 import QUANTIZE_CHUNK_BYTES

        staged = 3 * e * h * i_l * 2  # one layer's bf16 w1 + w2
        at_once = min(2 * e * i_l * h * 4, max(QUANTIZE_CHUNK_BYTES, 2 * i_l * h * 4))  # fp32 bytes a chunk
        transient = max(transient, staged + QUANTIZE_FP32_FACTOR * at_once)
    kv = 2 * spec.num_layers * (batch + 1) * -(-max_len // sh.dcp) * hs.kv_heads * d * 2
    reference = _checkpoint_params(spec) * 2 if source == "transformers" else 0
    return MemoryNeed(weights=int(weights), transient=int(transient), kv_cache=int(kv), reference=int(reference),
                      fmt=fmt)


def check_fits(need: MemoryNeed, free_bytes: int, what: str) -> None:
    """Raise CapacityError naming `what`, the bytes needed (by part) and `free_bytes`
    when need.total > free_bytes. Pure."""
    if need.total <= free_bytes:
        return
    smaller = (f"--formats nvfp4 (experts at {EXPERT_BYTES['nvfp4']:.2f} instead of 2 bytes per weight), "
               if need.fmt == "bf16" else "")
    raise CapacityError(
        f"{what} needs about {need.total / 1e9:.1f} GB on one device ({need.describe()} GB), but the device "
        f"has {free_bytes / 1e9:.1f} GB free; use {smaller}fewer --layers instead of --full-depth, or more "
        "ranks with --tp")


def _largest_tensor_bytes(spec) -> int:
    """Bytes of the largest bf16 tensor of the checkpoint (`random_source.checkpoint_layout`):
    a fused gate_up_proj [E, 2I, H], the embedding / lm_head [V, H], or a dense MLP matrix."""
    h = spec.hidden
    sizes = [spec.vocab_size * h, spec.dense_intermediate * h, spec.shared_intermediate * h]
    if any(spec.moe_layers):
        sizes.append(spec.num_experts * 2 * spec.moe_intermediate * h)
    return 2 * max(sizes)


def _checkpoint_params(spec) -> int:
    """Parameters of the whole checkpoint (transformers' model of it holds them all, on every rank)."""
    h, d, e = spec.hidden, spec.head_dim, spec.num_experts
    rows = (spec.num_heads + 2 * spec.num_kv_heads) * d
    attn = rows * h + h * spec.num_heads * d + 2 * h + (rows if spec.attention_bias else 0) + \
        (2 * d if spec.qk_norm else 0)
    moe = 3 * e * h * spec.moe_intermediate + e * h + (e if spec.routing == "sigmoid_grouped" else 0) + \
        3 * h * spec.shared_intermediate
    dense = 3 * h * spec.dense_intermediate
    layers = sum(attn + (moe if is_moe else dense) for is_moe in spec.moe_layers)
    return layers + spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2) + h


def spec_config(preset: str, layers: int | None, weights: str):
    """What `load_spec` reads for one row of `bench decode`: the checkpoint directory with
    --weights checkpoint (`--model`, its own depth), else the preset's config at `layers`."""
    from sparkinfer.models.presets import preset_config

    return preset if weights == "checkpoint" else preset_config(preset, layers=layers)


def preset_layers(args) -> int | None:
    """Decoder layers of every preset: None (each preset's own count) with --full-depth."""
    return None if args.full_depth else args.layers


def max_cache_len(args) -> int:
    """Positions of the longest KV cache the run builds: the prompt and 64 decode steps, or
    speculative generation's 128 new tokens + 16."""
    return args.context + (144 if args.spec_k else 64)
