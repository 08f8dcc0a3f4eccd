"""The kernels each family launches compile for the H200 (sm_90) and fit its
shared memory, at a real model's dims, on a CPU machine (ptxas only, no GPU).

Runs in a subprocess without TRITON_INTERPRET (interpreted kernels cannot be
compiled), one subprocess for all cases.
"""

import json

import pytest

from tests.sm90 import run_sm90_module

pytest.importorskip("triton.backends.nvidia")

H200_MAX_SHARED = 232448  # bytes of dynamic shared memory per block on sm_90
QWEN3 = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
DSV3_TP8 = dict(num_experts=256, top_k=8, hidden=7168, intermediate=256)
DSV3_ROUTING = dict(routing="sigmoid_grouped", n_group=8, topk_group=4)
MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336)
GLM_AIR_TP8 = dict(num_experts=128, top_k=8, hidden=4096, intermediate=176)  # padded to 192, chunk 64
CASES = [("qwen3", fmt, t) for fmt in ("bf16", "nvfp4") for t in (1, 64, 1024)] + [
    ("dsv3_tp8", "nvfp4", 1), ("dsv3_tp8", "bf16", 4096), ("qwen3-ptx", "nvfp4", 64),
    ("mixtral", "nvfp4", 4), ("mixtral-ptx", "nvfp4", 4),
    # fp8_block: micro (FC1 split: the act kernel quantizes; unsplit: FC1's epilogue), grouped
    ("qwen3", "fp8_block", 1), ("mixtral", "fp8_block", 4), ("qwen3", "fp8_block", 64),
    ("dsv3_tp8", "fp8_block", 4096),
    # NVFP4 at 256 rows per expert: its own grouped tiles, BN1 128 (plan.NVFP4_GROUPED_BN1);
    # from 2,048: decoded to bf16 in expert chunks, bf16 tiles (in NVFP4's K order, so
    # batch-invariant plans take it too)
    ("qwen3_4k-ptx", "nvfp4", 4096), ("mixtral_8k-ptx", "nvfp4", 8192),
    # a per-rank I the plan pads (176 -> 192)
    ("glm_air_tp8-ptx", "nvfp4", 1), ("glm_air_tp8", "bf16", 64)]


# Known: NVFP4 steps of 64 (a padded I of 192 takes chunk 64) leave FC2's scale tile of
# BN 64 rows x 4 bytes a synchronous load (ttgir tt.load of i8 [64, 4]): that step waits on
# HBM once; at chunk 128 (8 bytes a row) and at BN 128 it rides the cp.async pipeline. Its
# cost is not yet measured: `sparkinfer bench moe --shapes glm_air_tp8,glm_air_tp8_i256`
# times 176 padded to 192 (chunk 64) against the same layer at 256 (chunk 128).
SYNC_SCALE_TILE = {("glm_air_tp8-ptx", "nvfp4", 1): "moe_fc2_kernel"}


def _compile(cases: list) -> list:
    """Rows of `tests.moe.sm90_compile` for each case (one subprocess for all)."""
    return run_sm90_module("tests.moe.sm90_compile", json.dumps(cases))


@pytest.fixture(scope="module")
def compiled():
    shapes = {"qwen3": (QWEN3, 1024, {}), "dsv3_tp8": (DSV3_TP8, 4096, DSV3_ROUTING),
              "mixtral": (MIXTRAL, 16, {}), "qwen3_4k": (QWEN3, 4096, {}),
              "mixtral_8k": (MIXTRAL, 8192, {}),
              "glm_air_tp8": (GLM_AIR_TP8, 64, {})}
    case = [(*shapes[name.split("-")[0]], "ptx" if name.endswith("-ptx") else "arith")
            for name, _, _ in CASES]
    return dict(zip(CASES, _compile([[s, fmt, t, mt, kw, dec]
                                     for (s, mt, kw, dec), (_, fmt, t) in zip(case, CASES)])))


@pytest.mark.parametrize("name,fmt,t", CASES, ids=[f"{n}-{f}-T{t}" for n, f, t in CASES])
def test_launches_compile_for_sm90(compiled, name, fmt, t):
    rows = compiled[(name, fmt, t)]
    names = [r["kernel"] for r in rows]
    assert names[0] == "routing_kernel" and names[-1] == "moe_reduce_kernel"
    assert ("sort_count_kernel" in names) == (rows[0]["family"] == "grouped")
    assert rows[0]["family"] == ("micro" if t <= 16 else "grouped")
    micro = rows[0]["family"] == "micro"
    for r in rows:
        assert r["sm90"] and r["shared"] <= H200_MAX_SHARED and r["spill"] == 0, r
        # programmatic dependent launch: a kernel launched early waits for its predecessor's
        # grid before reading (the routing behind the router projection at any T, the
        # micro family's FC1 and later kernels); the routing lets its successor launch at entry
        # (runner.FC1_PDL), FC1 and FC2 once their loops end
        dependent = r["kernel"] == "routing_kernel" or micro and r["kernel"] in (
            "moe_fc1_kernel", "moe_act_kernel", "moe_fc2_kernel", "moe_reduce_kernel")
        assert r["launch_pdl"] == dependent and (r["pdl_waits"] > 0) == dependent, r
        assert (r["pdl_triggers"] > 0) == (r["kernel"] == "routing_kernel" or micro and r["kernel"] in (
            "moe_fc1_kernel", "moe_act_kernel", "moe_fc2_kernel")), r
        # NVFP4 codes and E4M3 scales ride the cp.async pipeline: no step waits on HBM
        known = SYNC_SCALE_TILE.get((name, fmt, t)) == r["kernel"]
        assert r["sync_u8_loads"] == known or not r["kernel"].startswith("moe_fc"), r



FP8_CASES = [c for c in CASES if c[1] == "fp8_block"]


@pytest.mark.parametrize("name,fmt,t", FP8_CASES, ids=[f"{n}-{f}-T{t}" for n, f, t in FP8_CASES])
def test_fp8_kernels_use_e4m3_tensor_cores(compiled, name, fmt, t):
    """Every FP8 GEMM issues e4m3 x e4m3 wgmma (fp32 accumulate) and nothing
    else; the activation quantization converts with cvt.rn.satfinite.e4m3x2
    where it happens (FC1's epilogue or the act kernel, and x: in micro FC1,
    in moe_quant_kernel for grouped)."""
    rows = {r["kernel"]: r for r in compiled[(name, fmt, t)]}
    for k in ("moe_fc1_kernel", "moe_fc2_kernel"):
        mma = rows[k]["mma"]
        assert mma and all(m.startswith("wgmma.mma_async") and m.endswith(".f32.e4m3.e4m3")
                           for m in mma), (k, mma)
    assert rows["moe_fc1_kernel"]["cvt_e4m3"] > 0
    assert ("moe_quant_kernel" in rows) == (t > 16)
    if "moe_quant_kernel" in rows:
        assert rows["moe_quant_kernel"]["cvt_e4m3"] > 0
    if "moe_act_kernel" in rows:
        assert rows["moe_act_kernel"]["cvt_e4m3"] > 0


def test_nvfp4_grouped_fc1_warpgroups_own_their_weight_rows(compiled):
    """Qwen3 at T 4096 (256 rows per expert, BM 128): FC1 at BN1 128 issues m64n128k16
    (each warpgroup decodes its own 64 weight rows for all 128 routed rows; BN1 64 had
    the two split BM, m64n64k16, each decoding the same tile) without a spill; FC2 runs 64
    routed rows a program over the same tiles (block_m2, BN2 256: m64n64k16), no spill either."""
    rows = {r["kernel"]: r for r in compiled[("qwen3_4k-ptx", "nvfp4", 4096)]}
    assert "nvfp4_dequant_kernel" not in rows
    for k, mma in (("moe_fc1_kernel", ".m64n128k16."), ("moe_fc2_kernel", ".m64n64k16.")):
        assert rows[k]["dequant_experts"] == 0 and rows[k]["spill"] == 0, rows[k]
        assert rows[k]["mma"] and all(mma in m for m in rows[k]["mma"]), rows[k]


def test_nvfp4_dequantized_path_launches_decode_then_bf16_tiles(compiled):
    """Mixtral at T 8192 (2,048 rows per expert): per chunk of 2 experts, decode
    FC1's weights -> FC1 on bf16 tensor cores -> decode FC2's -> FC2. FC1's x,
    gathered in NVFP4's K order, rides the cp.async pipeline (no synchronous tile
    load: with the step's offsets unaligned to Triton's analysis it did not)."""
    rows = compiled[("mixtral_8k-ptx", "nvfp4", 8192)]
    names = [r["kernel"] for r in rows]
    gemm = [n for n in names if n in ("nvfp4_dequant_kernel", "moe_fc1_kernel", "moe_fc2_kernel")]
    assert gemm == ["nvfp4_dequant_kernel", "moe_fc1_kernel", "nvfp4_dequant_kernel",
                    "moe_fc2_kernel"] * 4
    for r in rows:
        assert r["dequant_experts"] == 2
        if r["kernel"].startswith("moe_fc"):
            assert r["mma"] and all(m.endswith(".f32.bf16.bf16") for m in r["mma"]), r
            assert r["sync_bf16_tiles"] == 0, r


def test_fp8_rescaled_tiles_fit_bm128():
    """The rescaled FP8 accumulation (plan.FP8_RESCALE; grouped rows on the MMA's M
    side) at Qwen3-30B-A3B's dims, T 4096: FC1 at BM 128 in one pass and FC2 at BM 128
    compile without a spill on e4m3 wgmma, where the scaled dot spills (plan.py's
    FP8_MAX_BLOCK_M); so does the planned BM 64."""
    rows = _compile([[QWEN3, "fp8_block", 4096, 4096, {}, "arith", tile]
                     for tile in ([128, 128, 128, 8, 1, 128, 1, True], [64, 128, 128, 8, 1, 128, 1, True])])
    for case, bm in zip(rows, (128, 64)):
        fc = [r for r in case if r["kernel"].startswith("moe_fc")]
        assert len(fc) == 2, case
        for r in fc:
            assert r["fp8_rescale"] and r["block_m"] == bm and r["spill"] == 0, r
            assert r["shared"] <= H200_MAX_SHARED, r
            assert r["mma"] and all(m.endswith(".f32.e4m3.e4m3") for m in r["mma"]), r

