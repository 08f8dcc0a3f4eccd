"""The plan's data: `TileConfig` (the tiles of one bucket of token counts) and
`MoEPlan` (a layer's buckets). `plan.py` chooses them; the binding and the
runner read them. Pure dataclasses: no device, no compilation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparkinfer.errors import CapacityError
from sparkinfer.moe.spec import MoECaps, MoESpec

__all__ = ["TileConfig", "MoEPlan"]


@dataclass(frozen=True)
class TileConfig:
    """The tile plan of one bucket of token counts: kernel family, tile sizes,
    reduction splits, pipeline depths and warps.

    family: "micro" or "grouped". block_m: routed rows per tile. block_n1 /
    block_n2: weight rows per FC1 / FC2 program. split1 / split2: programs per
    FC1 / FC2 reduction (micro only; grouped uses 1). num_warps: both GEMMs.
    stages1 / stages2: software-pipeline depth of FC1 / FC2 (Triton num_stages).
    block_k: reduction elements per step, 0 for the plan's chunk; only bf16
    plans (and NVFP4's dequantized path) use another (bind rejects it for NVFP4
    kernels, whose K order within a step follows the step: kernels/common.py
    k_order, and for fp8_block, whose step is the 128-element scale block).
    dequant_experts: NVFP4 only, grouped only: > 0 dequantizes the call's
    experts to bf16, this many at a time, and runs the bf16 tiles of this
    config on them (NVFP4_DEQUANT_MIN_ROWS); 0 runs the NVFP4 kernels.
    decode: NVFP4 weight decode on the GPU, "ptx" (rotate + mask + bf16x2
    multiply in inline PTX) or "arith" (the same bit operations as Triton
    integer ops and an fp32 multiply); both exact, same bits. SASS per weight
    in the Mixtral micro loop (benchmarks/sweeps/nvfp4_decode_sweep.py, ptxas
    sm_90a): FC1 3.3 (ptx) vs 5.2 (arith), FC2 4.2 vs 6.3. Default "ptx": on the
    H200 at ac6412e it repeated bitwise and matched arith bitwise
    (tests/moe/test_gpu.py, 12 passed) and was faster at every NVFP4 point of
    `bench_moe.py --quick` (moe_h200.json vs moe_h200_arith_ac6412e.json; e.g.
    Mixtral M = 8: 342 vs 398 us, DeepSeek-V3 M = 4096: 15542 vs 17308 us).
    group_m (grouped only): 0 launches a (tile, weight block) grid, tiles first, so
    one wave of programs covers every tile at a few weight blocks and re-reads the
    activations for each block; G > 0 launches one program per (tile, block) in
    groups of G consecutive tiles (one or a few experts) times every weight block,
    tiles first within a group, so a wave shares both its weight tiles and its
    activation rows in L2. Same sums, same bits. tma (grouped only, bf16 /
    fp8_block weights or NVFP4's dequantized copies): weight tiles (and FC2's
    activation rows) arrive by TMA descriptors instead of per-thread loads.
    fc1_passes (fp8_block grouped only): 2 runs each FC1 program's 128 rows (one
    activation group) as two K passes of 64 (kernels/fc1.py), so BM 128 fits the
    registers; same bytes. Never planned: slower than one pass on the H200 (tuning.TILES_FP8).
    block_m2 (grouped only): FC2's routed rows per program, 0 for block_m; a divisor of
    block_m, >= 16. FC2 then runs block_m / block_m2 programs a sorted tile, each on
    block_m2 consecutive sorted rows (of their tile's expert); one whose rows are all the
    tile's padding returns at once. Each row's sums are the same K chain at either width,
    so the bits are block_m's. FC2 is not FC1: its one weight matrix per tile fits a wider
    BN2 at fewer rows (a sweep candidate, tuning.TILES_NVFP4).
    fp8_rescale (fp8_block): the accumulation kept in units of each K step's scales, and
    grouped tiles of BM >= 64 with their routed rows on the MMA's M side (kernels/fp8.py
    RESCALE, ROWS; `rows_on_mma_m`): BM 128 in one pass fits the registers. Other sums than
    without it, so a plan sets it in every bucket or none (FP8_RESCALE).
    """

    family: str
    block_m: int
    block_n1: int
    block_n2: int
    split1: int = 1
    split2: int = 1
    num_warps: int = 4
    stages1: int = 3
    stages2: int = 3
    decode: str = "ptx"
    block_k: int = 0
    dequant_experts: int = 0
    group_m: int = 0
    tma: bool = False
    fc1_passes: int = 1
    fp8_rescale: bool = False
    block_m2: int = 0

    @property
    def fc2_block_m(self) -> int:
        """FC2's routed rows per program (`block_m2`, or block_m)."""
        return self.block_m2 or self.block_m

    @property
    def rows_on_mma_m(self) -> bool:
        """RESCALE's grouped tiles of BM >= 64 put the routed rows on the MMA's M side (a
        wgmma's M is 64: BM 32 there left half of each MMA idle, and the DeepSeek-V3 TP8
        shard at M 1024 took 775 us against the scaled dot's 711 on an H100 at 79e4281);
        the rest keep them on N (swap-AB), as the scaled dot does."""
        return self.fp8_rescale and self.family == "grouped" and self.block_m >= 64


@dataclass(frozen=True)
class MoEPlan:
    """caps, spec, chunk (BK, the reduction elements per kernel step; NVFP4
    steps always take the chunk) and buckets: ((max T, config), ...)
    in increasing T, the last one covering caps.max_tokens. intermediate: the I
    the kernels run, caps.intermediate rounded up to a multiple of the chunk
    (PAD_MULTIPLE); prepared weights and scratch have this I, and the indices
    past caps.intermediate hold zero weights (plan.py's docstring)."""

    caps: MoECaps
    spec: MoESpec
    chunk: int
    buckets: tuple[tuple[int, TileConfig], ...]
    intermediate: int

    def config_for(self, tokens: int) -> TileConfig:
        """TileConfig that serves `tokens` (1..caps.max_tokens). Pure."""
        if not 1 <= tokens <= self.caps.max_tokens:
            raise CapacityError(f"MoEPlan: T={tokens} outside 1..max_tokens="
                                f"{self.caps.max_tokens}; plan with a larger MoECaps.max_tokens")
        for bound, cfg in self.buckets:
            if tokens <= bound:
                return cfg
        raise AssertionError("buckets cover max_tokens")  # internal invariant

    def with_changes(self, **changes) -> MoEPlan:
        """This plan with `changes` (TileConfig fields) applied to every bucket,
        e.g. decode="arith". Pure; for tuning and benchmarks."""
        return dataclasses.replace(self, buckets=tuple(
            (t, dataclasses.replace(c, **changes)) for t, c in self.buckets))

    def forced(self, config: TileConfig) -> MoEPlan:
        """This plan serving every token count with `config` (benchmarks compare
        the planner's choice with alternatives this way). Pure."""
        return dataclasses.replace(self, buckets=((self.caps.max_tokens, config),))
