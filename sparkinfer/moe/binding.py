"""Scratch and bind: the stateful half of a MoE plan (`run` is in runner.py).

Legend: T tokens, E experts, K top-k, H hidden, I intermediate per rank,
N1 = 2I (gated) or I, R = T*K routes, P padded sorted rows, S splits.

`scratch_specs(plan)` lists the buffers a plan needs at its largest bucket;
`bind` checks the call's tensors and makes views (the one allocation it may
make is `out`, and never during capture); `run` only launches kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from sparkinfer import envs
from sparkinfer.errors import CapacityError, CaptureError, DeviceError, DTypeError, LayoutError, PlanError, ShapeError
from sparkinfer.moe.kernels.common import ACT_RELU2, ACT_SILU, ACT_SWIGLU_OAI
from sparkinfer.moe.plan import FAMILIES, FP8_BLOCK, MICRO_BLOCK_M, MoEPlan, TileConfig
from sparkinfer.moe.weights import MoEWeights, nvfp4_shapes

__all__ = ["ScratchSpec", "MoEBinding", "scratch_specs", "allocate_scratch", "bind",
           "sort_chunk", "sort_split", "max_tiles"]

_ACT = {"silu": ACT_SILU, "relu2": ACT_RELU2, "swiglu_oai": ACT_SWIGLU_OAI}


@dataclass(frozen=True)
class ScratchSpec:
    """One scratch buffer: name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def sort_chunk(num_experts: int) -> int:
    """Routes per counting-sort chunk: keeps the [CH, E] one-hot tile at <= 8192 elements."""
    return max(16, min(1024, 8192 // triton.next_power_of_2(num_experts)))


# One-hot tiles per counting-sort program: enough that about SORT_PROGRAMS
# programs cover the routes (kernels/sort.py: the offsets kernel walks one
# row of counts per program, serially), at most SORT_MAX_SUB.
SORT_PROGRAMS = 128
SORT_MAX_SUB = 16


def sort_split(routes: int, num_experts: int) -> tuple[int, int]:
    """(one-hot tiles per sort program, programs) for `routes` routes. Pure."""
    tiles = triton.cdiv(routes, sort_chunk(num_experts))
    sub = max(1, min(SORT_MAX_SUB, tiles // SORT_PROGRAMS))
    return sub, triton.cdiv(tiles, sub)


def max_tiles(routes: int, num_experts: int, block_m: int) -> int:
    """Upper bound of grouped tiles: every active expert may leave one partial tile."""
    return triton.cdiv(routes, block_m) + min(num_experts, routes)


def scratch_specs(plan: MoEPlan) -> tuple[ScratchSpec, ...]:
    """Buffers `bind` needs for any T up to caps.max_tokens. Pure.

    fp8_block: FC2's input rows are e4m3 with fp32 scales [rows, I/128]
    (`*_scale`), and the grouped family quantizes x once into x_fp8 / x_scale.
    NVFP4 plans with a dequantized bucket hold w_bf16: bf16 copies of
    `dequant_experts` experts' larger matrix (`plan.dequant_chunk`).
    fc2_partial (micro's FC2 output per split) is fp32, or out_dtype in
    batch-invariant plans whose FC2 never splits: the grouped family rounds its
    route_out so too, and a route must round alike in both (plan.py: batch invariance)."""
    c = plan.caps
    k, h, i, e = c.top_k, c.hidden, plan.intermediate, c.num_experts  # I as padded (plan.py)
    n1 = (2 if plan.spec.gated else 1) * i
    fp8 = plan.spec.weight_format == "fp8_block"
    act = torch.float8_e4m3fn if fp8 else torch.bfloat16
    specs = [ScratchSpec("topk_ids", (c.max_tokens, k), torch.int32),
             ScratchSpec("topk_weights", (c.max_tokens, k), torch.float32)]
    micro = [(t, cfg) for t, cfg in plan.buckets if cfg.family == "micro"]
    rm = min(c.max_tokens, MICRO_BLOCK_M) * k  # routes of a micro call
    if micro:
        s1 = max(cfg.split1 for _, cfg in micro)
        s2 = max(cfg.split2 for _, cfg in micro)
        part2 = c.out_dtype if c.batch_invariant and s2 == 1 else torch.float32
        specs += [ScratchSpec("fc1_partial", (s1, rm, n1), torch.float32),
                  ScratchSpec("fc1_act", (rm, i), act),
                  ScratchSpec("fc2_partial", (s2, rm, h), part2)]
        if fp8:
            specs.append(ScratchSpec("fc1_act_scale", (rm, i // FP8_BLOCK), torch.float32))
    grouped = [(t, cfg) for t, cfg in plan.buckets if cfg.family == "grouped"]
    if grouped:
        r = c.max_tokens * k
        tiles = max(max_tiles(t * k, e, cfg.block_m) for t, cfg in grouped)
        rows = max(max_tiles(t * k, e, cfg.block_m) * cfg.block_m for t, cfg in grouped)
        nch = triton.cdiv(r, sort_chunk(e))
        ep = triton.next_power_of_2(e)
        specs += [ScratchSpec("sort_counts", (nch, ep), torch.int32),
                  ScratchSpec("tile_expert", (tiles,), torch.int32),
                  ScratchSpec("sorted_route", (rows,), torch.int32),
                  ScratchSpec("inter", (rows, i), act),
                  ScratchSpec("route_out", (r, h), c.out_dtype)]
        if fp8:
            specs += [ScratchSpec("inter_scale", (rows, i // FP8_BLOCK), torch.float32),
                      ScratchSpec("x_fp8", (c.max_tokens, h), torch.float8_e4m3fn),
                      ScratchSpec("x_scale", (c.max_tokens, h // FP8_BLOCK), torch.float32)]
        experts = max(cfg.dequant_experts for _, cfg in grouped)
        if experts:
            specs.append(ScratchSpec("w_bf16", (experts * max(n1 * h, h * i),), torch.bfloat16))
    return tuple(specs)


def allocate_scratch(plan: MoEPlan, device, *, share: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Allocate every buffer of `scratch_specs(plan)` on `device`, uninitialized.
    share: the scratch of calls that never overlap this plan's (another MoE layer of
    the same model: layers run one after another on one stream, and a layer's last
    reader of its scratch, the top-k sum, runs before the next layer starts); a
    buffer of the same name, shape, dtype and device is taken from it instead of
    allocated. A model's MoE layers then hold one scratch, not one each: at
    Qwen3-30B-A3B's dims and 4,096 tokens a layer's is 212 MB (route_out 134 MB),
    48 layers' 10 GB; NVFP4 experts add the dequantized path's bf16 copies, 535 MB
    a layer there (within MoECaps.dequant_scratch_bytes). Allocates; not capture-legal."""
    dev = torch.device(device)
    out = {}
    for s in scratch_specs(plan):
        t = (share or {}).get(s.name)
        if t is None or tuple(t.shape) != s.shape or t.dtype != s.dtype or t.device != dev:
            t = torch.empty(s.shape, dtype=s.dtype, device=dev)
        out[s.name] = t
    return out


@dataclass(frozen=True)
class MoEBinding:
    """Everything `run` launches with: plan, config of this T, weights, the
    call's tensors and the scratch views. Fixed for a captured graph: replays
    read the same buffers, so refill x / logits / ids in place."""

    plan: MoEPlan
    config: TileConfig
    weights: MoEWeights
    tokens: int
    x: torch.Tensor
    out: torch.Tensor
    logits: torch.Tensor | None
    bias: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    scratch: dict
    interpret: bool


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check(t, name, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"bind: {name} is {type(t).__name__}; expected a tensor")
    if tuple(t.shape) != tuple(shape):
        raise ShapeError(f"bind: {name} shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.dtype != dtype:
        raise DTypeError(f"bind: {name} dtype {t.dtype}; expected {dtype}")
    if t.device != device:
        raise DeviceError(f"bind: {name} on {t.device}; expected {device} (where x lives)")
    if not t.is_contiguous():
        raise LayoutError(f"bind: {name} strides {t.stride()}; pass a contiguous tensor")


def _check_weights(plan: MoEPlan, w: MoEWeights, device):
    c = plan.caps
    if w.weight_format != plan.spec.weight_format or w.chunk != plan.chunk:
        raise LayoutError(f"bind: weights prepared as {w.weight_format}/chunk {w.chunk}, plan "
                          f"wants {plan.spec.weight_format}/chunk {plan.chunk}; call "
                          "prepare_weights(plan, w1, w2)")
    e, h, i = c.num_experts, c.hidden, plan.intermediate
    n1 = (2 if plan.spec.gated else 1) * i
    if w.weight_format == "bf16":
        _check(w.w1, "weights.w1", (e, n1, h), torch.bfloat16, device)
        _check(w.w2, "weights.w2", (e, h, i), torch.bfloat16, device)
        return
    if w.weight_format == "fp8_block":
        b = FP8_BLOCK
        for name, shape, dt in (("w1", (e, n1, h), torch.float8_e4m3fn),
                                ("w2", (e, h, i), torch.float8_e4m3fn),
                                ("s1", (e, n1 // b, h // b), torch.float32),
                                ("s2", (e, h // b, i // b), torch.float32)):
            if getattr(w, name) is None:
                raise LayoutError(f"bind: weights.{name} is None; fp8_block weights need E4M3 "
                                  "values and their 128 x 128 block scales: call "
                                  "prepare_weights(plan, w1, w2) with FP8BlockTensors")
            _check(getattr(w, name), f"weights.{name}", shape, dt, device)
        return
    for (n, r), names in (((n1, h), ("w1", "s1", "g1")), ((h, i), ("w2", "s2", "g2"))):
        shapes = (*nvfp4_shapes(e, n, r, plan.chunk), (e,))
        for name, shape, dt in zip(names, shapes, (torch.uint8, torch.uint8, torch.float32)):
            _check(getattr(w, name), f"weights.{name}", shape, dt, device)


def bind(plan: MoEPlan, scratch: dict, weights: MoEWeights, *, x: torch.Tensor,
         out: torch.Tensor | None = None, logits: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
         topk_weights: torch.Tensor | None = None) -> MoEBinding:
    """Check one call's tensors and bind them to the plan's scratch.

    x: bf16 [T, H], T <= max_tokens. out: [T, H] in caps.out_dtype, or None
    (allocated here, outside capture only: CaptureError during capture).
    Routing: either logits [T, E] (bf16/fp16/fp32; bias fp32 [E] for
    "sigmoid_grouped") routed by `run`, or topk_ids int32 [T, K] with
    topk_weights fp32 [T, K] (ids outside [0, E) add nothing; a token's K ids
    must be distinct; `check_topk_ids` checks both eagerly). Makes views only;
    no host sync.
    """
    c = plan.caps
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != c.hidden:
        raise ShapeError(f"bind: x shape {tuple(getattr(x, 'shape', ()))}; expected [T, "
                         f"H={c.hidden}]")
    t, dev = x.shape[0], x.device
    if not 1 <= t <= c.max_tokens:
        raise CapacityError(f"bind: T={t} outside 1..max_tokens={c.max_tokens}")
    _check(x, "x", (t, c.hidden), torch.bfloat16, dev)
    if out is None:
        if _capturing(dev):
            raise CaptureError("bind: out=None during CUDA graph capture would allocate; pass "
                               "a preallocated out [T, H]")
        out = torch.empty(t, c.hidden, dtype=c.out_dtype, device=dev)
    _check(out, "out", (t, c.hidden), c.out_dtype, dev)
    _check_weights(plan, weights, dev)
    for s in scratch_specs(plan):
        if s.name not in scratch:
            raise ShapeError(f"bind: scratch lacks {s.name!r}; use allocate_scratch(plan, device)")
        _check(scratch[s.name], f"scratch[{s.name!r}]", s.shape, s.dtype, dev)
    if (logits is None) == (topk_ids is None):
        raise ShapeError("bind: pass either logits or topk_ids + topk_weights (exactly one)")
    k = c.top_k
    if logits is not None:
        if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise DTypeError(f"bind: logits dtype {logits.dtype}; use bf16, fp16 or fp32")
        _check(logits, "logits", (t, c.num_experts), logits.dtype, dev)
        if bias is not None:
            _check(bias, "bias", (c.num_experts,), torch.float32, dev)
        topk_ids, topk_weights = scratch["topk_ids"][:t], scratch["topk_weights"][:t]
    else:
        _check(topk_ids, "topk_ids", (t, k), torch.int32, dev)
        if topk_weights is None:
            raise ShapeError("bind: topk_ids given without topk_weights")
        _check(topk_weights, "topk_weights", (t, k), torch.float32, dev)
    cfg = plan.config_for(t)
    if cfg.family not in FAMILIES:
        raise PlanError(f"bind: config family {cfg.family!r} for T={t}; the kernel families are {FAMILIES}")
    if cfg.family == "micro" and t > cfg.block_m:
        raise PlanError(f"bind: the {cfg.family} family serves T <= block_m={cfg.block_m} tokens, "
                        f"got T={t}; use the plan's own config for this T (plan.config_for)")
    fmt = plan.spec.weight_format
    if cfg.dequant_experts and (fmt != "nvfp4" or cfg.family != "grouped"):
        raise PlanError(f"bind: config dequant_experts={cfg.dequant_experts} for {fmt} weights, "
                        f"family {cfg.family!r}; only grouped NVFP4 buckets dequantize")
    if fmt == "fp8_block" and (plan.chunk != FP8_BLOCK or cfg.block_n1 != FP8_BLOCK):
        raise PlanError(f"bind: fp8_block plan with chunk {plan.chunk}, block_n1 "
                        f"{cfg.block_n1}; both must be {FP8_BLOCK}: a K step is one scale block "
                        "and an FC1 program quantizes whole 128-column groups of its output")
    if (cfg.group_m or cfg.tma) and cfg.family != "grouped" or cfg.group_m < 0:
        raise PlanError(f"bind: config group_m={cfg.group_m}, tma={cfg.tma} for the {cfg.family!r} "
                        "family; only grouped configs take them, group_m >= 0")
    if cfg.tma and fmt == "nvfp4" and not cfg.dequant_experts:
        raise PlanError("bind: config tma=True for NVFP4 kernels, whose weights are prepared "
                        "tiles a descriptor cannot walk; use tma=False (or dequant_experts > 0)")
    if fmt == "fp8_block" and (cfg.block_n2 > FP8_BLOCK or FP8_BLOCK % cfg.block_n2):
        raise PlanError(f"bind: fp8_block config with block_n2 {cfg.block_n2}; FC2 programs take "
                        f"one weight scale per K step, so block_n2 must divide {FP8_BLOCK} (one "
                        "128-row scale block)")
    if cfg.fc1_passes != 1 and (cfg.fc1_passes != 2 or fmt != "fp8_block" or cfg.family != "grouped"):
        raise PlanError(f"bind: config fc1_passes={cfg.fc1_passes} for a {cfg.family!r} {fmt} bucket; "
                        "only grouped fp8_block configs take 2 (an activation group in two halves), else 1")
    if cfg.fp8_rescale and fmt != "fp8_block":
        raise PlanError(f"bind: config fp8_rescale=True for {fmt} weights; only fp8_block configs take it")
    if cfg.block_m2 and (cfg.family != "grouped" or cfg.block_m2 < 16 or cfg.block_m % cfg.block_m2):
        raise PlanError(f"bind: config block_m2={cfg.block_m2} for a {cfg.family!r} bucket of block_m="
                        f"{cfg.block_m}; FC2's rows must be a grouped tile's divisor of at least 16, or 0")
    bk = cfg.block_k
    if cfg.dequant_experts and bk and plan.chunk % bk:
        raise PlanError(f"bind: dequantized config with block_k={bk}; its copies keep the NVFP4 kernels' "
                        f"K order within chunks of {plan.chunk}, so block_k must divide {plan.chunk}")
    dense = fmt == "bf16" or cfg.dequant_experts > 0  # plain bf16 rows: any step
    if bk and (not dense or bk % 32 or c.hidden % bk or plan.intermediate % bk):
        raise PlanError(f"bind: config block_k={bk} for {fmt} weights, H={c.hidden}, "
                        f"I={plan.intermediate}; block_k must be 0 (the plan's chunk) or, for bf16 weights, a "
                        "multiple of 32 dividing H and I")
    return MoEBinding(plan, cfg, weights, t, x, out, logits, bias, topk_ids,
                      topk_weights, scratch, envs.triton_interpret())


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise CapacityError when an id of topk_ids [T, K] is outside [0, E), and
    ShapeError when a token names one expert twice.

    Syncs with the host; not capture-legal (use it while debugging or in eager paths).
    """
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        raise CapacityError(f"topk_ids hold expert ids in [{lo}, {hi}], outside [0, E="
                            f"{num_experts}); ids must index this layer's experts")
    srt = topk_ids.sort(dim=-1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=-1)
    if bool(dup.any()):
        t = int(dup.nonzero()[0, 0])
        raise ShapeError(f"topk_ids row {t} names an expert twice: {topk_ids[t].tolist()}; "
                         "each token's K experts must be distinct")

