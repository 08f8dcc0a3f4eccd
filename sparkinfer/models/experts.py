"""The routed experts of one MoE layer, read for one rank and stacked for `MoELayer`.

Legend: E experts, H hidden, I intermediate of one expert, W ranks, `_l` this
rank's share (I_l = I / W, rows [a, b) = [r * I_l, (r + 1) * I_l)).

Checkpoint layouts read (the first that the checkpoint holds):

- per-expert 2-D tensors, as the Hub checkpoints and transformers 5.24
  `save_pretrained` write them: `<moe>.experts.{e}.{gate,up,down}_proj.weight`
  (Qwen3-MoE, GLM-4.5) or `<moe>.experts.{e}.{w1,w3,w2}.weight` (Mixtral: w1
  gate, w3 up, w2 down), with `<moe>` = `model.layers.{i}.mlp` or
  `model.layers.{i}.block_sparse_moe` (Mixtral);
- fused 3-D tensors, transformers' in-memory layout: `<moe>.experts.gate_up_proj`
  [E, 2I, H] (gate rows then up rows) and `<moe>.experts.down_proj` [E, H, I];
- ModelOpt NVFP4 per-expert linears (see `nvfp4_io`);
- FP8 block-scaled per-expert linears, `weight` + `weight_scale_inv` (see `fp8_io`).

Output: w1 [E, 2 * I_l, H] (this rank's gate rows, then its up rows) and
w2 [E, H, I_l], bf16 tensors, NVFP4Tensors with global_scale [E], or
FP8BlockTensors (scales [E, 2 * I_l / 128, H / 128] and [E, H / 128, I_l / 128]).
NVFP4 quantized here takes I_l rounded up to 16 (zero rows and columns); the
MoE plan pads any I_l further to its kernels' multiple (`moe/plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparkinfer.errors import PlanError, ShapeError
from sparkinfer.models.checkpoint import FLOAT_DTYPES, Checkpoint
from sparkinfer.models.config import ModelSpec
from sparkinfer.models.fp8_io import is_fp8, read_experts_fp8
from sparkinfer.models.nvfp4_io import FoldStats, is_nvfp4, join_gate_up, read_dense, read_nvfp4
from sparkinfer.models.weights import Sharding
from sparkinfer.quant.fp8 import FP8_BLOCK, quantize_fp8_block
from sparkinfer.quant.nvfp4 import BLOCK, NVFP4Tensor, quantize_nvfp4

__all__ = ["ExpertLayout", "RoutedExperts", "expert_layout", "load_routed", "MOE_FORMATS"]

MOE_FORMATS = ("bf16", "nvfp4", "fp8_block")


@dataclass(frozen=True)
class ExpertLayout:
    """Where one layer's routed experts live. prefix: the MoE module
    (`model.layers.{i}.mlp`); fused: 3-D `experts.gate_up_proj` / `experts.down_proj`;
    else gate, up, down: the per-expert projection names; nvfp4: ModelOpt packed;
    fp8: E4M3 with 128 x 128 block scales (`fp8_io`)."""

    prefix: str
    fused: bool
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    nvfp4: bool = False
    fp8: bool = False

    def expert(self, e: int, proj: str) -> str:
        """Module name of expert e's projection `proj` (no `.weight`)."""
        return f"{self.prefix}.experts.{e}.{proj}"


@dataclass(frozen=True)
class RoutedExperts:
    """One rank's routed experts of a layer: w1 [E, 2 * I_l, H], w2 [E, H, I_l]
    (bf16 tensors or NVFP4Tensors), and what joining an NVFP4 checkpoint's gate
    and up global scales rounded (see `join_gate_up`)."""

    w1: object
    w2: object
    fold: FoldStats = field(default_factory=FoldStats)


def expert_layout(ckpt: Checkpoint, spec: ModelSpec, layer: int) -> ExpertLayout:
    """Find layer `layer`'s MoE module and expert layout from the tensor names
    (headers only). Raises CheckpointError naming the router tensor when no
    candidate module has one."""
    base = f"model.layers.{layer}"
    cands = ([f"{base}.block_sparse_moe", f"{base}.mlp"] if spec.family == "mixtral"
             else [f"{base}.mlp"])
    prefix = next((p for p in cands if ckpt.has(f"{p}.gate.weight")), None)
    if prefix is None:
        ckpt.file_of(f"{cands[0]}.gate.weight")  # raises: missing, naming the checkpoint
    if ckpt.has(f"{prefix}.experts.gate_up_proj"):
        return ExpertLayout(prefix, fused=True)
    names = [("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")]
    if spec.family != "mixtral":
        names.reverse()
    for gate, up, down in names:
        lay = ExpertLayout(prefix, False, gate, up, down)
        if ckpt.has(f"{lay.expert(0, gate)}.weight"):
            return ExpertLayout(prefix, False, gate, up, down,
                                nvfp4=is_nvfp4(ckpt, lay.expert(0, gate)),
                                fp8=is_fp8(ckpt, lay.expert(0, gate)))
    return ExpertLayout(prefix, False, *names[0])  # reads will name the missing tensor


def load_routed(ckpt: Checkpoint, spec: ModelSpec, sharding: Sharding, layer: int, *,
                device="cpu", moe_format: str = "bf16") -> RoutedExperts:
    """Read this rank's share of layer `layer`'s routed experts.

    Returns w1 [E, 2 * I_l, H], w2 [E, H, I_l] as bf16 tensors (moe_format
    "bf16"), NVFP4Tensors with global_scale [E] ("nvfp4") or FP8BlockTensors
    ("fp8_block"). Stored bytes are kept where the format is the checkpoint's:
    NVFP4 checkpoints with "nvfp4" and FP8 checkpoints with "fp8_block" (the
    rank's slice of I must then be whole 16-element scale groups of down_proj,
    or whole 128 x 128 blocks: ShapeError otherwise). Every other pairing reads
    the rank's slice as bf16, dequantizing a quantized checkpoint (any slice),
    and quantizes it here where asked: "nvfp4" one global scale per expert's
    stacked w1 and per w2, after zero gate/up rows and down columns pad an I_l
    that is not a multiple of 16 (they add nothing, as the MoE plan's own
    padding: moe/plan.py); "fp8_block" per 128 x 128 block (I_l a multiple of 128).
    Allocates on `device`; reads only this rank's rows/columns.
    """
    if moe_format not in MOE_FORMATS:
        raise PlanError(f"moe_format={moe_format!r}; choose one of {MOE_FORMATS}")
    e, h, i = spec.num_experts, spec.hidden, spec.moe_intermediate
    a, b = sharding.split(i, "moe_intermediate_size")
    lay = expert_layout(ckpt, spec, layer)
    stored_nvfp4, stored_fp8 = lay.nvfp4 and moe_format == "nvfp4", lay.fp8 and moe_format == "fp8_block"
    if (moe_format == "nvfp4" and h % BLOCK) or (stored_nvfp4 and (b - a) % BLOCK):
        raise ShapeError(f"layer {layer}: NVFP4 experts need hidden ({h}) and, read as stored, the "
                         f"per-rank moe_intermediate_size ({i} / {sharding.world} = {b - a}) to be "
                         f"multiples of {BLOCK} (down_proj shards on its reduction axis I); "
                         "choose another world size or moe_format='bf16'")
    if moe_format == "fp8_block" and ((b - a) % FP8_BLOCK or h % FP8_BLOCK):
        raise ShapeError(f"layer {layer}: FP8 block experts need hidden ({h}) and the per-rank "
                         f"moe_intermediate_size ({i} / {sharding.world} = {b - a}) to be "
                         f"multiples of {FP8_BLOCK} (the 128 x 128 scale blocks); choose another "
                         "world size or moe_format='bf16'")
    if stored_fp8:
        w1, w2 = read_experts_fp8(ckpt, lambda x: (lay.expert(x, lay.gate), lay.expert(x, lay.up),
                                                   lay.expert(x, lay.down)), (e, h, i), (a, b),
                                  device)
        return RoutedExperts(w1, w2)
    if stored_nvfp4:
        gate = _stack([read_nvfp4(ckpt, lay.expert(x, lay.gate), (i, h), dim=0, span=(a, b),
                                  device=device) for x in range(e)])
        up = _stack([read_nvfp4(ckpt, lay.expert(x, lay.up), (i, h), dim=0, span=(a, b),
                                device=device) for x in range(e)])
        w2 = _stack([read_nvfp4(ckpt, lay.expert(x, lay.down), (h, i), dim=1, span=(a, b),
                                device=device) for x in range(e)])
        w1, fold = join_gate_up(gate, up)
        return RoutedExperts(w1, w2, fold)
    w1, w2 = _read_bf16(ckpt, lay, spec, (a, b), device)
    if moe_format == "nvfp4":
        w1, w2 = _pad_intermediate(w1, w2, -(b - a) % BLOCK)
        return RoutedExperts(quantize_nvfp4(w1), quantize_nvfp4(w2))
    if moe_format == "fp8_block":
        return RoutedExperts(quantize_fp8_block(w1), quantize_fp8_block(w2))
    return RoutedExperts(w1, w2)


def _pad_intermediate(w1: torch.Tensor, w2: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 [E, 2 I_l, H] (gate rows, then up rows), w2 [E, H, I_l] -> the same with `pad`
    zero rows after the gate rows and after the up rows, and `pad` zero columns of w2."""
    if not pad:
        return w1, w2
    gate, up = w1.chunk(2, dim=1)
    z = w1.new_zeros(w1.shape[0], pad, w1.shape[2])
    return torch.cat([gate, z, up, z], dim=1), torch.cat([w2, w2.new_zeros(*w2.shape[:2], pad)], dim=2)


def _read_bf16(ckpt: Checkpoint, lay: ExpertLayout, spec: ModelSpec, span: tuple[int, int],
               device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's experts as bf16: float weights cast, NVFP4 and FP8 ones dequantized
    (`read_dense`: any slice, the scale groups it cuts read whole)."""
    e, h, i = spec.num_experts, spec.hidden, spec.moe_intermediate
    a, b = span
    il = b - a
    bf = torch.bfloat16
    w1 = torch.empty(e, 2 * il, h, dtype=bf, device=device)  # [E, 2 I_l, H]
    w2 = torch.empty(e, h, il, dtype=bf, device=device)  # [E, H, I_l]
    if lay.fused:
        gu, dn = f"{lay.prefix}.experts.gate_up_proj", f"{lay.prefix}.experts.down_proj"
        ckpt.expect(gu, (e, 2 * i, h), what="[E, 2*I, H], gate rows then up rows")
        ckpt.expect(dn, (e, h, i), what="[E, H, I]")
        w1[:, :il] = ckpt.read(gu, dim=1, span=(a, b), dtype=bf)
        w1[:, il:] = ckpt.read(gu, dim=1, span=(i + a, i + b), dtype=bf)
        w2.copy_(ckpt.read(dn, dim=2, span=(a, b), dtype=bf))
        return w1, w2
    quantized = lay.nvfp4 or lay.fp8
    for x in range(e):
        for rows, proj in ((slice(0, il), lay.gate), (slice(il, 2 * il), lay.up)):
            if quantized:
                w1[x, rows] = read_dense(ckpt, lay.expert(x, proj), (i, h), dim=0, span=(a, b))
                continue
            name = f"{lay.expert(x, proj)}.weight"
            ckpt.expect(name, (i, h), FLOAT_DTYPES, what="[moe_intermediate_size, hidden_size]")
            w1[x, rows] = ckpt.read(name, dim=0, span=(a, b), dtype=bf)  # host -> device copy
        if quantized:
            w2[x] = read_dense(ckpt, lay.expert(x, lay.down), (h, i), dim=1, span=(a, b))
            continue
        name = f"{lay.expert(x, lay.down)}.weight"
        ckpt.expect(name, (h, i), FLOAT_DTYPES, what="[hidden_size, moe_intermediate_size]")
        w2[x] = ckpt.read(name, dim=1, span=(a, b), dtype=bf)
    return w1, w2


def _stack(parts: list[NVFP4Tensor]) -> NVFP4Tensor:
    """[E] per-expert NVFP4Tensors -> one with a leading E axis (global_scale [E])."""
    return NVFP4Tensor(torch.stack([p.packed for p in parts]),
                       torch.stack([p.scales for p in parts]),
                       torch.stack([p.global_scale for p in parts]))
