"""Execution plans: which kernel family and tiles serve each token count.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate per rank,
R = T*K routes, S split count along a reduction, BM/BN/BK tile sizes.

`plan(caps, spec)` is pure: no device, no allocation, no compilation. It cuts
1..max_tokens into power-of-two buckets and gives each one a `TileConfig`.

Any I >= 1 plans: the kernels step through I in chunks of 32, 64 or 128, so an
I that is not a multiple of 32 (GLM-4.5-Air at TP 8: 1408 / 8 = 176;
Qwen3-30B-A3B at TP 16: 48) runs as `MoEPlan.intermediate`, I rounded up to
PAD_MULTIPLE, with zero weights in the added rows of FC1 and columns of FC2
(`prepare_weights`). Those add exactly nothing: an added I index gets gate = up
= 0 from FC1, every activation maps (0, 0) to 0, and FC2 multiplies it by a
zero column, so each output sums exact zeros on top of the unpadded terms.
"""

from __future__ import annotations

import dataclasses

import triton

from sparkinfer.errors import PlanError
from sparkinfer.moe.spec import MoECaps, MoESpec
from sparkinfer.moe.tile_config import MoEPlan, TileConfig

__all__ = ["TileConfig", "MoEPlan", "plan", "plan_supports_aux_stream_overlap", "FAMILIES"]

# No family runs micro's work as one persistent cooperative kernel: such a
# kernel was slower than micro at every measured point on the H200, NVFP4
# M = 1 / 4 / 8 on all four bench shapes and bf16 Qwen3 M = 1 / 8, with 1 or 2
# programs per SM (benchmarks/results/sweeps/moe_resident_ab_h200.json, 8bfc66a; best
# variant vs micro, us: Qwen3 NVFP4 M=1 27.2 vs 19.6, TP8 shard M=1 27.9 vs
# 20.2, DeepSeek-V3 M=1 82.3 vs 76.2, Mixtral M=8 368.1 vs 250.3), so it left
# the package (git history keeps it as kernels/resident.py).
FAMILIES = ("micro", "grouped")
# An I that no chunk divides is padded to a multiple of this, the smallest chunk
# (the tensor-core K step, and two NVFP4 scale groups). Not a multiple of 128,
# which would allow the 128 chunk: a decode step reads every weight byte, and at
# I = 176 padding to 192 reads 9% more than the checkpoint's experts, to 256
# 45% more. But chunk 64 leaves NVFP4 FC2's scale tile at BN 64 a synchronous
# load (tests/moe/test_compile_sm90.py), so which is faster is a measurement:
# `sparkinfer bench moe --shapes glm_air_tp8,glm_air_tp8_i256` times 192
# (against the floor of the unpadded bytes) beside 256. Not yet run on a GPU.
PAD_MULTIPLE = 32
# Families whose kernels never wait for other programs (safe beside work on an
# auxiliary stream, `plan_supports_aux_stream_overlap`): both.
OVERLAP_SAFE_FAMILIES = ("micro", "grouped")

# micro serves every token of a batch in one tile of BM = 16 rows (the
# smallest tensor-core N), so it stops at 16 tokens; below that it beats
# grouped (BM 16) in all 24 measured cases. H200 `bench_moe.py --sweep --m
# 4,8,16,32,64,256` at f0ff9ac (benchmarks/results/moe_sweep_h200_f0ff9ac.json),
# us micro vs grouped at M = 4 / 8 / 16, NVFP4: DeepSeek-V3 240 vs 284 / 420
# vs 495 / 739 vs 864; Qwen3 37.4 vs 49.5 / 58.6 vs 72.0 / 87.9 vs 110.6; TP8
# shard 53.8 vs 78.5 / 82.2 vs 102.5 / 146 vs 176; Mixtral 220 vs 261 / 252 vs
# 306 / 270 vs 324 (grouped 1.17-1.46x slower); bf16 grouped 1.007-1.14x
# slower (closest: DeepSeek-V3 M = 16 1976 vs 1990).
MICRO_MAX_TOKENS = 16
MICRO_BLOCK_M = 16
# Launch at least this many programs per SM before splitting a reduction
# (2 programs per SM hide one program's tail). Same sweep, micro at M = 4 / 8
# / 16 against twice both splits (about 4 programs per SM): the plan is faster
# in 19 of 24 cases (DeepSeek-V3 NVFP4 M = 8 420 vs 454 us, Qwen3 NVFP4 M = 16
# 87.9 vs 97.7, Mixtral NVFP4 M = 16 270 vs 327); twice the splits win at the
# TP8 shard M = 4 (bf16 104.8 vs 93.8, NVFP4 53.8 vs 50.9) and by <= 2.3%
# elsewhere (TP8 bf16 M = 16 308 vs 301, Mixtral NVFP4 M = 4 220 vs 217,
# Mixtral bf16 M = 8 a tie).
PROGRAMS_PER_SM = 2
MAX_SPLIT = 8
# FC2 of micro pipelines S1 fp32 partials per step (16 KiB each at BK 128), so
# FC1 splits stop at 4 to keep two stages within shared memory.
MAX_SPLIT1 = 4
# FC1 splits only while its unsplit grid is under half the SMs: a split FC1
# stores fp32 gate/up partials that `moe_act_kernel` then sums and activates.
# H200 `bench_moe.py --sweep --m 1,8 --formats nvfp4` at e9512d3
# (moe_sweep_h200.json, when every FC2 program still did that itself), planned
# (split by PROGRAMS_PER_SM) vs FC1 unsplit: DeepSeek-V3 M=1 (256 unsplit
# programs) 154.4 vs 107.8 us; Qwen3 M=1 (96) 33.4 vs 24.9; TP8 shard M=8 (256)
# 155.7 vs 104.0; but TP8 shard M=1 (32 programs) 38.9 split vs 46.9 unsplit.
# With the act kernel (adfdd5d, moe_micro_ab_h200.json) the rule still holds
# within noise: DeepSeek-V3 M=1 77.8 unsplit vs 76.6 / 77.2 / 78.0 at 2 / 3 /
# 4 splits, Mixtral M=1 82.4 vs 81.0 / 83.8 / 84.4, Qwen3 M=1 21.3 vs 21.2 /
# 20.4 (2 / 4), TP8 shard M=1 22.8 at its 4 splits vs 41.9 unsplit.
FC1_SPLIT_MAX_PROGRAMS_PER_SM = 0.5
# micro NVFP4 FC2: BN 128 (128 weight rows a step: 3.2 SASS instructions per
# weight in the loop instead of 4.2 at BN 64, benchmarks/sweeps/
# nvfp4_decode_sweep.py) while its grid keeps >= 3 programs per SM; a 6-deep
# pipeline where a program's reduction runs >= 64 steps. H200 at 189bc87
# (benchmarks/results/moe_layout_ab_h200.json), us planned vs BN2 128:
# DeepSeek-V3 M=1 (448 programs at BN 128) 80.3 vs 78.3, M=8 457.4 vs 423.7,
# Qwen3 M=8 (1024) 63.7 vs 60.3, TP8 shard M=1 (448) 36.7 vs 33.2, M=8 94.0 vs
# 83.9; fewer programs lose: Mixtral M=1 (64) 82.7 vs 85.1, M=8 (256) 300.5
# vs 313.3; Qwen3 M=1 (128) 23.3 vs 22.8. FC2 6 stages: Mixtral M=8 (112
# steps) 300.5 vs 254.0; DeepSeek-V3 M=8 (16 steps) 457.4 vs 467.7.
MICRO_FC2_WIDE_MIN_PROGRAMS_PER_SM = 3
MICRO_FC2_DEEP_MIN_STEPS = 64
MICRO_FC2_DEEP_STAGES = 6
# micro bf16 FC1: (waves, stages) - where its grid (splits included) fits in one
# wave of the SMs, 4 pipeline stages (147 KiB at BN 64, BK 128: one program
# per SM), in two waves 3; and splits only up to half the SMs' worth of programs
# (a power of two). H200 at b2e0991, coordinate descent over FC1 then FC2 tiles
# (benchmarks/results/sweeps/moe_micro_sweep_h200.json), us before -> after:
# Qwen3 M=1 (96 FC1 programs) 36.5 -> 27.6 at 4 stages (28.5 at 3, 36.5 at 2),
# M=2 (192) 46.3 -> 43.2 at 3 (44.9 at 4); TP8 shard M=1 (32 programs, 4 splits
# at 2 stages) 37.9 -> 34.0 at 2 splits and 4 stages (40.2 unsplit), M=2 56.3 ->
# 53.8. Deeper stages beat more splits once the weight stream is pipelined.
MICRO_BF16_FC1_STAGES = ((1.0, 4), (2.0, 3))
# Shared memory per program: two programs per SM for the memory-bound shapes,
# one for the large grouped tiles (the H200 has 227 KiB per SM). SMEM_FIXED is
# what Triton stages besides the pipelined loads (dequantized operand, epilogue).
# Budgets checked against ptxas for every benchmark shape
# (tests/moe/test_compile_sm90.py); their speed is not yet measured.
SMEM_TWO_PER_SM = 112 * 1024
SMEM_ONE_PER_SM = 220 * 1024
SMEM_FIXED = 8 * 1024
# grouped: rows per tile from the mean routes per active expert, (mean rows
# <=, BM). H200 sweeps (moe_sweep_h200_f0ff9ac.json; moe_sweep_h200_57e880e.json
# for M = 128, 512), us planned vs the neighbour BMs:
# - NVFP4, BM 16 up to 16 rows: BM 32 loses at every mean <= 16 (M = 32..256
#   at means 1-8: 1.32-1.49x slower; mean 16: Qwen3 M = 256 208 vs 221,
#   Mixtral M = 64 413 vs 431, TP8 shard M = 512 533 vs 569).
# - NVFP4 above 16 rows: BM 64, and BM 128 above 96 rows, both at BN1 128 (NVFP4_GROUPED_BN1;
#   FC2 at BN2 256 since, at 64 rows a program over BM 128 tiles: NVFP4_GROUPED_BN2).
#   An H100 at 7c17a69 (`moe_tile_sweep.py --formats nvfp4 --tiles n128,bm64-n128`,
#   sweeps/moe_tile_sweep_nvfp4_n128_h100.json, every config checked), us BM 64 / BM 128
#   (both BN1 128) / the BM 32 or 16 planned before: mean 32 rows: Qwen3 M 512 278 / 449 /
#   309, Mixtral M 128 521 / 835 / 616, TP8 shard M 1024 756 / 1,267 / 833, DeepSeek-V3 M
#   1024 4,122 / 6,651 / 4,976; mean 16: Qwen3 M 256 271 / 428 / 202 (BM 16), TP8 shard M 512
#   699 / 1,184 / 520; mean 64: Qwen3 M 1024 399 / 469, Mixtral M 256 803 / 851, TP8 shard M
#   2048 1,117 / 1,369, DeepSeek-V3 M 2048 6,077 / 7,196; mean 128: Mixtral M 512 1,262 /
#   1,217, TP8 shard M 4096 1,897 / 2,101, DeepSeek-V3 M 4096 12,173 / 10,728, Qwen3 M 2048
#   683 / 706; mean 256: Qwen3 M 4096 1,196 / 1,138, Mixtral M 1024 2,221 / 2,128. Means 17-31
#   are not measured (BM 64 there, as at 32).
# - bf16, BM 32 above 8 rows: at mean 16 BM 32 wins (Qwen3 M = 256 317 vs 332
#   at BM 16, Mixtral M = 64 677 vs 707, TP8 shard M = 512 760 vs 834); at
#   mean 8 BM 16 still does (Qwen3 M = 128 305 vs 313, TP8 shard M = 256 700
#   vs 718, DeepSeek-V3 M = 256 5275 vs 5407, Mixtral M = 32 654 vs 672).
# bf16 above BF16_WIDE_MIN_ROWS takes the wide tiles below instead.
GROUPED_BLOCK_M = ((16, 16), (96, 64))
GROUPED_BLOCK_M_BF16 = ((8, 16), (32, 32), (96, 64))
GROUPED_BLOCK_M_LARGE = 128
# bf16 weights above 16 mean rows per expert: "wide" tiles, BN1 128 (gate and up:
# 256 rows a step), BN2 256, BK 64 (bf16 weights are plain rows, so BK is a
# launch choice, not a layout), 4 stages, 8 warps; BM 64 up to 96 mean rows,
# else 128. H200 tile sweep (benchmarks/results/moe_tile_sweep_h200.json,
# 0f22f11), us vs the previous plan: DeepSeek-V3 M=1024 (mean 32) 6036 vs 7052,
# TP8 shard 902 vs 995, Qwen3 M=1024 (mean 64) 425 vs 489; M=4096 at BM 128:
# DeepSeek-V3 9087 vs 10605, TP8 1618 vs 1964, Qwen3 851 vs 1048, Mixtral 5574
# vs 6648 (its best, BN2 128, 5543, within 1%); Mixtral M=1024 1539 vs 1712.
# NVFP4 keeps BN1 64 and the plan's chunk (the sweep's NVFP4 tiles: moe_tile_sweep_h200.json).
BF16_WIDE_MIN_ROWS = 16
# A bucket's tiles serve every T up to its bound, whose mean this is: bound 1,024 of
# Qwen3 (mean 64) also serves T from 513 (mean 32). BM 64 against 128 by mean rows, us,
# every config bitwise equal (sweeps/moe_tile_sweep_bm_h100.json, an H100 at 7522f89):
# Qwen3 mean 36 / 52 / 60 / 68 / 84: 470.4 / 481.8 / 496.4 / 528.7 / 559.9 vs 485.2 /
# 495.9 / 500.6 / 515.8 / 525.1; the DeepSeek-V3 TP8 shard mean 48 / 56 / 64: 1,192.8 /
# 1,265.4 / 1,313.8 vs 1,202.3 / 1,245.0 / 1,270.8. A bound of 52 would take BM 128 from
# bucket 1,024 on: a mixed step of 64 decode rows and two 256-token chunks (T 576, mean 36)
# then took 1.315 ms more than its decode step against 1.214 (four chunks, T 1,088 planned
# at a bound of 1,088: 2.011 vs 2.055; `bench prefill --beside 64`,
# sweeps/prefill_mixed_bm_ab_h100.json), so 96 stays.
BF16_WIDE_BM64_MAX_ROWS = 96
# Not taken: BM 32 tiles (BN1 64, BN2 128, 4 warps, the wide order and loads) at 16-20
# mean rows. The tile sweep's uniform routing had them 1-6% faster on four shapes
# (`moe_tile_sweep.py --small-tiles`, sweeps/moe_tile_sweep_small_h200.json), but in
# the decoder's mixed step (Qwen3-30B-A3B, 8 layers, 64 decode rows + one 256-token
# chunk, `bench prefill --beside`, 7c6540f against 4588897) FC1 + FC2 took 102 us a
# step more (why is not measured: a likely cause, the model's routing crowds some experts, whose
# rows then take two BM 32 tiles that read their weights twice).
# The wide bf16 tiles and the fp8_block tiles above BF16_WIDE_MIN_ROWS run in
# groups of GROUP_M tiles (TileConfig.group_m) with TMA loads. H200 at 36cdf87
# (benchmarks/results/sweeps/moe_order_sweep_h200.json), us planned -> both:
# bf16 M = 4096 DeepSeek-V3 8872 -> 8018, TP8 shard 1506 -> 1398, Qwen3 812 ->
# 739, Mixtral 5418 -> 5020 (TMA alone 4997); M = 1024 6007 -> 5597, 874 -> 841,
# 414 -> 390, 1517 -> 1394. fp8_block M = 4096 8327 -> 7839, Qwen3 1009 -> 977,
# Mixtral 6530 -> 6336, but the TP8 shard 1718 -> 1783 (TMA slows its FC2,
# 864 -> 974 us); M = 1024 3748 -> 3341, 627 -> 623, 345 -> 340, 1799 -> 1776.
# Same bits in every case. Below, the narrow tiles keep the plain order (not measured).
GROUP_M = 8
# NVFP4 grouped tiles at BM >= 64: BN1 128, so FC1's two warpgroups each own 64 weight
# rows at n = BM (m64n128k16 at BM 128) where BN1 64 had them split BM and each decode the
# same 64-row tile (m64n64k16): half the decode work per MMA (tuning.TILES_NVFP4 has the
# sm_90 compile). H100 at 7c17a69 (sweeps/moe_tile_sweep_nvfp4_n128_h100.json), us BN1 128 /
# 64 at the planned BM 128: Qwen3 M 4096 1,138 / 1,495, Mixtral M 1024 2,128 / 2,877, M
# 4096 6,846 / 9,536, TP8 shard M 4096 2,101 / 2,549, DeepSeek-V3 M 4096 10,728 / 13,991.
NVFP4_GROUPED_BN1 = 128
# NVFP4 grouped FC2: 256 weight rows a program, two accumulation chains a warpgroup where
# 128 gave one chain of 8 HGMMA.64x128x16 a step (sm_90 compile at BM 64: 228 registers, no
# spill). H200 at 0812327 (`moe_tile_sweep.py --formats nvfp4 --tiles
# n128-bn2-256,bm64-n128-bn2-256`, sweeps/moe_tile_sweep_nvfp4_bn2_256_h200.json, every config
# checked against the fp32 reference), us BN2 256 / 128 at the planned BM 64: DeepSeek-V3 M
# 1024 3,791 / 4,001 (FC2 1,340 / 1,548), its TP8 shard 690 / 745, Qwen3 381 / 396.
# At BM 128 FC2 at BN2 256 spills 292 bytes (tuning.TILES_NVFP4), and FC1 runs fastest at BM 128 while
# FC2 runs fastest at 64 rows, so BM 128 tiles run FC2 at 64 rows a program (TileConfig.block_m2,
# NVFP4_GROUPED_FC2_ROWS; 229 registers, no spill; the same bits). H100 at 1326b74, two runs in one
# lease (`moe_tile_sweep.py --formats nvfp4 --m 1024,4096 --tiles
# n128-fc2-bm64-bn2-256,n128-bn2-256,bm64-n128-bn2-256`, the second in the git history of
# sweeps/moe_tile_sweep_nvfp4_block_m2_h100.json, every config checked), us FC2 at 64 rows / the BN2
# 128 planned before: Qwen3 M 4096 1,091 / 1,240 and 1,082 / 1,231, Mixtral M 1024 2,031 / 2,179 and
# 2,034 / 2,178, M 4096 6,809 / 7,137 and 7,588 / 7,415, the TP8 shard M 4096 1,856 / 2,124 and 1,885
# / 2,110, DeepSeek-V3 M 4096 9,269 / 10,830 and 10,266 / 10,778. A third H100 run, planned at 91ff03f
# (the file now): 1,089 / 1,197, 2,001 / 2,136, 7,102 / 7,200, 1,856 / 1,991, 9,557 / 10,362.
NVFP4_GROUPED_BN2 = 256
NVFP4_GROUPED_FC2_ROWS = 64


def nvfp4_grouped_tiles(bm: int) -> tuple[int, int, int]:
    """(BN1, BN2, FC2 rows a program: TileConfig.block_m2, 0 for BM) of NVFP4 grouped tiles of
    BM >= 64 rows (NVFP4_GROUPED_BN1, NVFP4_GROUPED_BN2, NVFP4_GROUPED_FC2_ROWS)."""
    bm2 = NVFP4_GROUPED_FC2_ROWS if bm > NVFP4_GROUPED_FC2_ROWS else 0
    return NVFP4_GROUPED_BN1, NVFP4_GROUPED_BN2, bm2


# NVFP4 from NVFP4_DEQUANT_MIN_ROWS mean routed rows per active expert: the call
# dequantizes its experts to bf16 once (`kernels/convert.py`, a chunk of experts
# at a time within MoECaps.dequant_scratch_bytes) and runs the bf16 grouped
# tiles on the copies, instead of the NVFP4 grouped kernel that decodes every
# weight tile again for each BM-row tile. Mixtral, H100 at 7c17a69 (the same file), us
# copies / the NVFP4 kernel at BN1 128: 256 rows (M 1024) 3,517 / 2,128, 512 (M 2048)
# 4,679 / 3,643, 1,024 (M 4096) 7,835 / 6,846, 2,048 (M 8192) 13,036 / 13,196, 4,096 (M
# 16384) 25,558 / 26,954; Qwen3 at 256 rows (M 4096) 1,572 / 1,138. Before BN1 128 the
# threshold was 160 rows (H200 at 4edaaed, sweeps/moe_sweep_nvfp4_h200.json).
# Batch-invariant plans (MoECaps' default, and `bench moe`'s) take the copies too:
# they are stored in the NVFP4 kernels' K order (kernels/convert.py), FC1 gathers x
# in it and stores FC2's input in it (`step_k_order`, `k_position`), so a route's sums
# are the NVFP4 kernels' to the bit (tests/moe/test_dequant_order.py) whichever path T
# picks.
NVFP4_DEQUANT_MIN_ROWS = 2048
# fp8_block: one weight scale per 128 x 128 block and one activation scale per
# 128 elements of a row, so a K step is one block (BK 128) and FC1 programs
# span whole activation groups (BN1 128: its epilogue quantizes FC2's input).
FP8_BLOCK = 128
# Without FP8_RESCALE, fp8_block grouped tiles stop at BM 64 (8 warps): at BM 128 ptxas -v (sm_90a)
# spills 1128 bytes in FC1 and 204 in FC2 at 255 registers (Qwen3 dims, 8
# warps; BM 64 at 4 warps spills 960 in FC1): the fp32 accumulators, each K
# step's dot result (the block scales keep it out of the MMA accumulation) and
# the per-column scales of this step and the next (`kernels/fp8.py`) do not
# fit beside each other. BM 64 at 8 warps: 255 / 191 registers, no spill.
FP8_MAX_BLOCK_M = 64
# The rescaled accumulation with the routed rows on the MMA's M side (TileConfig.fp8_rescale,
# kernels/fp8.py) compiles at BM 128 without a spill (sm_90 on the CPU: FC1 one pass 248
# registers, FC2 166; in swap-AB the rescaling alone left FC1 spilling 580 bytes, FC2 216:
# the per-column scales spread over every thread's accumulator columns). On in every plan
# since an H100 timed it (`sparkinfer bench moe --formats fp8_block --shapes
# qwen3,mixtral,dsv3_tp8`, off at 79e4281 / on at bbc5a7a, the same kernels otherwise;
# sweeps/moe_fp8_rescale_ab_h100.json, every row checked), us off / on: M 4096 Qwen3 956 /
# 665, Mixtral 6,296 / 3,972, DeepSeek-V3 TP8 shard 1,760 / 1,286; M 1024 356 / 294, 1,718 /
# 1,137, but the TP8 shard (BM 32, rows on N) 711 / 754 (+6%); decode sizes (M 1, 8, 64)
# +0.4% to +1.8% on every shape (one more multiply and divide a K step). The GPU tests and
# the MoE probe token's batch invariance (tests/models/test_gpu_invariance.py) passed with
# it on. A plan takes it for every bucket or none (other sums), so that trade is whole.
FP8_RESCALE = True
# With it, grouped tiles reach BM 128 above FP8_RESCALE_BM128_MIN_ROWS mean rows an expert.
# An H100 at 79e4281 (sweeps/moe_tile_sweep_fp8_rescale_h100.json, every config checked),
# us BM 128 / BM 64 rescaled / the scaled dot's planned BM 64: 256 rows (Qwen3 M 4096,
# Mixtral M 1024) 673 / 723 / 969, 1,140 / 1,359 / 1,772; 1,024 rows (Mixtral M 4096) 3,940
# / 5,022 / 6,273; 128 rows (the DeepSeek-V3 TP8 shard at M 4096) 1,354 / 1,295 / 1,766;
# 64 rows (Qwen3 M 1024) 313 / 295 / 357. From 128 rows since BM 128 tiles with FC2 at 64 rows
# a program (FP8_GROUPED_FC2_ROWS) beat BM 64 there: an H100 at 91ff03f
# (sweeps/moe_tile_sweep_fp8_fc2_rows_h100.json, `moe_tile_sweep.py --formats fp8_block --m
# 1024,2048,4096 --tiles bm128-rescale-fc2-bm64,bm128-rescale`, every config checked and bitwise
# equal to the planned one), us at 128 rows BM 128 + FC2 at 64 / BM 128 / the BM 64 planned
# before: Qwen3 M 2048 396 / 411 / 427, the TP8 shard M 4096 1,272 / 1,357 / 1,303, DeepSeek-V3
# M 4096 5,846 / 6,308 / 6,870; at 64 rows (BM 64 stays) Qwen3 M 1024 298 / 313 / 297,
# DeepSeek-V3 M 2048 4,487 / 4,567 / 4,603.
FP8_RESCALE_BM128_MIN_ROWS = 128
# FC2's routed rows a program on BM 128 tiles below FP8_FC2_FULL_MIN_ROWS mean rows an expert
# (TileConfig.block_m2; the same sums). At 256 rows and more FC2 reads each weight tile for half as
# many rows and loses, the same run, us FC2 at 64 / BM 128: Mixtral M 1024 (256 rows) 1,182 / 1,132,
# M 2048 2,096 / 1,900, M 4096 4,200 / 3,721; Qwen3 M 4096 (256 rows) 644 / 662.
FP8_GROUPED_FC2_ROWS = 64
FP8_FC2_FULL_MIN_ROWS = 256
# And BM 64 (rows on the MMA's M side) from FP8_RESCALE_BM64_MIN_ROWS, where the bf16 table
# keeps BM 32 (rows on N, half of each m64 wgmma idle). An H100 at 0d11bab
# (sweeps/moe_tile_sweep_fp8_rescale_small_h100.json, sweeps/moe_tile_sweep_fp8_bm64_h100.json;
# `moe_tile_sweep.py --formats fp8_block --tiles bm64-rescale`, every config checked), us planned
# BM 32 / BM 64 by mean rows an expert: 32 rows, the DeepSeek-V3 TP8 shard (M 1024) 743.6 / 643.3,
# Qwen3 (M 512) 274.5 / 249.4; 24 rows, TP8 shard (M 768) 702.4 / 621.7, Qwen3 (M 384) 249.9 /
# 245.8, DeepSeek-V3 (M 768) 4,031.8 / 3,888.9; 16 rows, TP8 shard (M 512) 583.5 / 587.2, Qwen3
# (M 256) 242.5 / 245.6, DeepSeek-V3 (M 512) 4,218.0 / 4,083.9. Same bits at any BM.
FP8_RESCALE_BM64_MIN_ROWS = 24
# Batch invariance (MoECaps.batch_invariant): a token's output must not depend on
# T, at decode sizes (rows of a step, queries of a speculative verify) as at
# prefill sizes (a forward of several requests' prompt chunks). A route's sum
# over H (FC1) and over I (FC2) then runs unsplit in every family: a split's
# partials add in another order, and the split count
# follows T (more active experts fill the SMs). The kernels accumulate each K step
# into one fp32 accumulator in K order whatever the tile (BM routed rows, BN weight
# rows, BK), so micro and grouped tiles give a route the same FC1 and FC2 sums;
# both round FC2's output to out_dtype (binding.scratch_specs) before the top-k
# sum, which adds routes in k order (kernels/reduce.py). NVFP4's dequantized path,
# chosen by the mean rows per expert (so by T), sums in its kernels' K order.
# What unsplit costs where the heuristic split, H200 micro sweep at b2e0991
# (benchmarks/results/sweeps/moe_micro_sweep_h200.json), us at M = 1, bf16:
# Qwen3-30B-A3B FC2 (2 splits planned) 27.6 planned vs 25.2 unsplit (3 stages),
# faster; the DeepSeek-V3 TP8 shard FC1 (2) 34.0 vs 40.2 unsplit (4 stages),
# +18%; NVFP4 TP8 shard FC1 (4) 22.8 vs 41.9 unsplit (moe_micro_ab_h200.json,
# adfdd5d), +84%. Mixtral's FC2 (3 at M = 1, 2 at M = 2): not measured. The
# decoder's presets split only there (Qwen3 M = 1, Mixtral M <= 2).


def _split(programs: int, chunks: int, caps: MoECaps, cap: int) -> int:
    """Programs per reduction: enough to launch PROGRAMS_PER_SM per SM, within
    cap and the chunks; 1 for batch-invariant plans."""
    num_sms = caps.num_sms
    want = PROGRAMS_PER_SM * num_sms
    if programs >= want or caps.batch_invariant:
        return 1
    return max(1, min(cap, chunks, triton.cdiv(want, programs)))


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _stages(per_stage: int, budget: int) -> int:
    """Pipeline depth whose shared memory (per_stage bytes a step, plus the
    dequantized-operand staging) fits `budget`; 2..4."""
    return max(2, min(4, (budget - SMEM_FIXED) // per_stage))


def _weight_bytes(rows: int, chunk: int, nvfp4: bool, fp8: bool = False) -> int:
    if fp8:
        return rows * chunk
    return rows * (chunk // 2 + chunk // 16 if nvfp4 else 2 * chunk)


def dequant_chunk(caps: MoECaps, spec: MoESpec) -> int:
    """Experts per chunk of the NVFP4 dequantized path: as many bf16 copies of
    the larger of FC1 [N1, H] and FC2 [H, I] as caps.dequant_scratch_bytes
    holds (0: not even one). Pure."""
    n1 = (2 if spec.gated else 1) * caps.intermediate
    per_expert = 2 * max(n1 * caps.hidden, caps.hidden * caps.intermediate)
    return min(caps.num_experts, caps.dequant_scratch_bytes // per_expert)


def _fp8_config(caps: MoECaps, spec: MoESpec, tokens: int) -> TileConfig:
    """fp8_block tiles: the bf16 rules with BN1 = 128 (whole activation groups)
    and 1-byte weights; every bucket with the rescaled accumulation when FP8_RESCALE,
    whose grouped tiles take BM 64 from FP8_RESCALE_BM64_MIN_ROWS and BM 128 from
    FP8_RESCALE_BM128_MIN_ROWS, FC2 at FP8_GROUPED_FC2_ROWS below FP8_FC2_FULL_MIN_ROWS."""
    routes = tokens * caps.top_k
    active = min(caps.num_experts, routes)
    halves = 2 if spec.gated else 1
    ck = FP8_BLOCK
    if tokens <= MICRO_MAX_TOKENS:
        bm = MICRO_BLOCK_M
        programs1 = active * triton.cdiv(caps.intermediate, ck)
        s1 = 1 if programs1 >= FC1_SPLIT_MAX_PROGRAMS_PER_SM * caps.num_sms else _split(
            programs1, caps.hidden // ck, caps, MAX_SPLIT1)
        s2 = _split(active * triton.cdiv(caps.hidden, 64), caps.intermediate // ck, caps, MAX_SPLIT)
        fc1 = halves * _weight_bytes(ck, ck, False, True) + ck * bm * 2
        fc2 = _weight_bytes(64, ck, False, True) + ck * bm
        return TileConfig("micro", bm, ck, 64, s1, s2, num_warps=4,
                          stages1=_stages(fc1, SMEM_TWO_PER_SM),
                          stages2=_stages(fc2, SMEM_TWO_PER_SM), fp8_rescale=FP8_RESCALE)
    mean_rows = routes / active
    cap = 128 if FP8_RESCALE and mean_rows >= FP8_RESCALE_BM128_MIN_ROWS else FP8_MAX_BLOCK_M
    bm = min(cap, next((b for limit, b in GROUPED_BLOCK_M_BF16 if mean_rows <= limit),
                       GROUPED_BLOCK_M_LARGE))
    if FP8_RESCALE and mean_rows >= FP8_RESCALE_BM64_MIN_ROWS:
        bm = max(bm, 64)
    bn2 = 64 if bm <= 32 else 128
    bm2 = FP8_GROUPED_FC2_ROWS if bm > FP8_GROUPED_FC2_ROWS and mean_rows < FP8_FC2_FULL_MIN_ROWS else 0
    budget, warps = (SMEM_TWO_PER_SM, 4) if bm <= 32 else (SMEM_ONE_PER_SM, 8)
    fc1 = halves * _weight_bytes(ck, ck, False, True) + ck * bm
    fc2 = _weight_bytes(bn2, ck, False, True) + ck * (bm2 or bm)
    wide = mean_rows > BF16_WIDE_MIN_ROWS  # GROUP_M
    return TileConfig("grouped", bm, ck, bn2, num_warps=warps,
                      stages1=min(4, _stages(fc1, budget)), stages2=min(4, _stages(fc2, budget)),
                      group_m=GROUP_M if wide else 0, tma=wide, fp8_rescale=FP8_RESCALE, block_m2=bm2)


def _config(caps: MoECaps, spec: MoESpec, tokens: int, chunk: int) -> TileConfig:
    if spec.weight_format == "fp8_block":
        return _fp8_config(caps, spec, tokens)
    routes = tokens * caps.top_k
    active = min(caps.num_experts, routes)
    nvfp4 = spec.weight_format == "nvfp4"
    experts = dequant_chunk(caps, spec) if nvfp4 else 0
    if tokens > MICRO_MAX_TOKENS and experts and routes / active >= NVFP4_DEQUANT_MIN_ROWS:
        bf16 = _config(caps, dataclasses.replace(spec, weight_format="bf16"), tokens, chunk)
        return dataclasses.replace(bf16, dequant_experts=experts)
    halves = 2 if spec.gated else 1  # FC1 weight tiles per step (gate, up)
    if tokens <= MICRO_MAX_TOKENS:
        bn, bm = 64, MICRO_BLOCK_M
        programs1 = active * triton.cdiv(caps.intermediate, bn)
        s1 = 1 if programs1 >= FC1_SPLIT_MAX_PROGRAMS_PER_SM * caps.num_sms else _split(
            programs1, caps.hidden // chunk, caps, MAX_SPLIT1)
        s2 = _split(active * triton.cdiv(caps.hidden, bn), caps.intermediate // chunk, caps, MAX_SPLIT)
        bn2 = bn
        if nvfp4 and active * triton.cdiv(caps.hidden, 2 * bn) >= (
                MICRO_FC2_WIDE_MIN_PROGRAMS_PER_SM * caps.num_sms):
            bn2 = 2 * bn
            s2 = _split(active * triton.cdiv(caps.hidden, bn2), caps.intermediate // chunk, caps, MAX_SPLIT)
        fc1 = halves * _weight_bytes(bn, chunk, nvfp4) + chunk * bm * 2
        stages1 = _stages(fc1, SMEM_TWO_PER_SM)
        if not nvfp4:  # bf16: a deeper FC1 pipeline on small grids (MICRO_BF16_FC1_STAGES)
            s1 = min(s1, _pow2_floor(max(1, triton.cdiv(caps.num_sms // 2, programs1))))
            waves = programs1 * s1 / caps.num_sms
            deep = next((st for most, st in MICRO_BF16_FC1_STAGES if waves <= most), 0)
            stages1 = max(stages1, min(deep, _stages(fc1, SMEM_ONE_PER_SM)))
        # FC2's operand per step: bf16 activation rows. A split FC1's partials
        # are summed and activated once per route by `moe_act_kernel` (TP8 shard
        # M=1 22.7 vs 31.8 us when every FC2 program did it from S1 x 16 KiB of
        # staged partials per step; moe_layout_ab_h200.json, 14cdea2). Unsplit
        # keeps the budget every H200 measurement so far ran with (16 KiB).
        act = chunk * bm * 2 if s1 > 1 else halves * chunk * bm * 4
        fc2 = _weight_bytes(bn2, chunk, nvfp4) + act
        stages2 = _stages(fc2, SMEM_TWO_PER_SM)
        if nvfp4 and s1 == 1 and caps.intermediate // chunk >= s2 * MICRO_FC2_DEEP_MIN_STEPS:
            stages2 = MICRO_FC2_DEEP_STAGES
        return TileConfig("micro", bm, bn, bn2, s1, s2, num_warps=4, stages1=stages1, stages2=stages2)
    mean_rows = routes / active
    if not nvfp4 and mean_rows > BF16_WIDE_MIN_ROWS and caps.hidden % 64 == 0 and caps.intermediate % 64 == 0:
        bm = 64 if mean_rows <= BF16_WIDE_BM64_MAX_ROWS else 128
        return TileConfig("grouped", bm, 128, 256, num_warps=8, stages1=4, stages2=4, block_k=64,
                          group_m=GROUP_M, tma=True)
    table = GROUPED_BLOCK_M if nvfp4 else GROUPED_BLOCK_M_BF16
    bm = next((b for limit, b in table if mean_rows <= limit), GROUPED_BLOCK_M_LARGE)
    bm2 = 0
    if bm <= 32:
        bn1 = bn2 = 64
        budget, warps, deep = SMEM_TWO_PER_SM, 4, 3
    elif nvfp4:  # each warpgroup decodes its own 64 weight rows (NVFP4_GROUPED_BN1)
        bn1, bn2, bm2 = nvfp4_grouped_tiles(bm)
        budget, warps, deep = SMEM_ONE_PER_SM, 8, 4
    else:
        # FC1 loads gate and up tiles per step, so it keeps BN at 64.
        bn1, bn2 = 64, 128
        budget, warps, deep = SMEM_ONE_PER_SM, 8, 3
    fc1 = halves * _weight_bytes(bn1, chunk, nvfp4) + chunk * bm * 2
    fc2 = _weight_bytes(bn2, chunk, nvfp4) + chunk * (bm2 or bm) * 2
    return TileConfig("grouped", bm, bn1, bn2, num_warps=warps, stages1=min(deep, _stages(fc1, budget)),
                      stages2=min(deep, _stages(fc2, budget)), block_m2=bm2)


def plan(caps: MoECaps, spec: MoESpec) -> MoEPlan:
    """Plan every token count 1..caps.max_tokens for `spec`. Pure: no device work.

    Any I: one that is not a multiple of 32 is padded (`MoEPlan.intermediate`);
    the tiles are those of the padded I, so an I that needs no padding plans as
    it always did. Raises PlanError when H is not a multiple of 32 (FC1's
    reduction: the tensor-core step, and NVFP4's 16-element scale groups, need
    it; H is the model's hidden size, never split), and for fp8_block when H or
    the per-rank I is not a multiple of 128: its 128 x 128 scale blocks cannot
    be padded exactly where gate and up rows share one.
    """
    if spec.weight_format == "fp8_block" and (caps.hidden % FP8_BLOCK or
                                              caps.intermediate % FP8_BLOCK):
        raise PlanError(f"plan: weight_format='fp8_block' with H={caps.hidden}, I={caps.intermediate} "
                        f"per rank (tp_size={caps.tp_size}); both must be multiples of "
                        f"{FP8_BLOCK} (the 128 x 128 scale blocks). Choose a tp_size that "
                        "keeps I / tp_size a multiple of 128, or use 'bf16' / 'nvfp4' weights")
    if caps.hidden % PAD_MULTIPLE:
        raise PlanError(f"plan: H={caps.hidden}; the hidden size must be a multiple of "
                        f"{PAD_MULTIPLE} (of 128 for full speed)")
    inter = -(-caps.intermediate // PAD_MULTIPLE) * PAD_MULTIPLE
    chunk = next(c for c in (128, 64, 32) if caps.hidden % c == 0 and inter % c == 0)
    padded = dataclasses.replace(caps, intermediate=inter)  # the tiles see the I they run
    bounds = []
    b = 1
    while b < caps.max_tokens:
        bounds.append(b)
        b *= 2
    bounds.append(caps.max_tokens)
    # fp8_block: the rescaled accumulation in every bucket or none (_fp8_config, FP8_RESCALE)
    return MoEPlan(caps, spec, chunk, tuple((t, _config(padded, spec, t, chunk)) for t in bounds),
                   intermediate=inter)


def plan_supports_aux_stream_overlap(p: MoEPlan) -> bool:
    """Whether shared-expert work on an auxiliary stream may overlap this plan's
    kernels. False would mean a bucket runs a kernel whose programs wait for each
    other (launched cooperatively; the serving contract then applies: submit the
    shared experts on the auxiliary stream first, join it before the MoE launch);
    no family does today. The micro and grouped kernels never wait for other
    programs, and the micro family's programmatic dependent launches wait only
    for the previous grid of the same call, whose programs have all started
    before the dependents may launch, so they cannot hold SMs that it still
    needs. Pure."""
    return all(cfg.family in OVERLAP_SAFE_FAMILIES for _, cfg in p.buckets)
