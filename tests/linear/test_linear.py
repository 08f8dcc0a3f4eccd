"""`sparkinfer.linear.linear` against its fp32 reference, its split K and its
rejections (interpreter on the CPU; the same tests run compiled on a GPU).

The CPU plans for one SM (one program per 64 features, the stream schedule);
cases marked `preload` plan for an H200's 132 SMs instead, which picks the
preload schedule and splits K, as the decode projections run on the GPU."""

import dataclasses
from unittest import mock

import pytest
import torch

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import AliasingError, DTypeError, LayoutError, ShapeError
from sparkinfer.linear import LINEAR_MAX_ROWS, LinearTile, config, launch, linear, linear_sync, linear_tile
from sparkinfer.linear.reference import linear_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# id -> (M, N, K, dtype, schedule): stream = as the CPU plans it, preload = an H200's plan
CASES = {
    "stream-m1": (1, 1024, 64, torch.bfloat16, "stream"),
    "stream-m3-oddk": (3, 1090, 100, torch.bfloat16, "stream"),
    "stream-m40-3blocks": (40, 130, 512, torch.bfloat16, "stream"),
    "preload-m5-split": (5, 200, 700, torch.bfloat16, "preload"),
    "preload-m33-split": (33, 96, 1024, torch.float16, "preload"),
    "preload-fp32-router": (6, 128, 512, torch.float32, "preload"),
}
# |out - ref| <= rel * |ref| + abs * max|ref|: one rounding of an fp32 sum to the
# output dtype (half a spacing; the interpreter truncates: a whole one) plus fp32
# summation noise; fp32 weights: the GPU's tf32x3 products (~2^-21 of each product's
# size, bounded by |x| @ |w|), exact fp32 products in the interpreter
ULP = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -23}
FP32_PRODUCTS = 2 ** -20


def _h200(monkeypatch):
    monkeypatch.setattr(launch, "_num_sms", lambda device: 132)


def _case(m, n, k, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if bias else None
    return x, w, b


def _check(out, x, w, b):
    ref = linear_reference(x, w, b)
    ulp = ULP[x.dtype] * (2 if triton_interpret() else 1)
    bound = ref.abs() * ulp + 1e-5 * ref.abs().max()
    if x.dtype == torch.float32:
        bound = bound + FP32_PRODUCTS * (x.double().abs() @ w.double().abs().t()).float()
    err = (out.float() - ref).abs()
    assert torch.isfinite(out).all() and (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_fp32_reference(monkeypatch, name, bias):
    m, n, k, dtype, schedule = CASES[name]
    if schedule == "preload":
        _h200(monkeypatch)
    assert linear_tile(n, k, torch.tensor([], dtype=dtype).element_size(), 132 if schedule == "preload" else 1
                       ).stream == (schedule == "stream")
    x, w, b = _case(m, n, k, dtype, m * n + k, bias)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    sync = linear_sync(w)
    assert linear(x, w, b, out=out, sync=sync) is out
    _check(out, x, w, b)
    assert not sync.any()  # the split's semaphores are zero again


def test_split_k_repeats_bitwise_and_rearms(monkeypatch):
    """Split over an H200's SMs: the same bits on a second call and for a row alone;
    the semaphores are zero after every call (a graph replays them)."""
    _h200(monkeypatch)
    x, w, b = _case(19, 256, 1024, torch.bfloat16, 5)
    tile = linear_tile(256, 1024, 2, 132)
    assert not tile.stream and tile.split > 1
    sync = linear_sync(w)
    first = linear(x, w, b, sync=sync)
    assert not sync.any()
    out = torch.full_like(first, float("nan"))
    assert torch.equal(linear(x, w, b, out=out, sync=sync), first)
    assert torch.equal(linear(x[7:8], w, b, sync=sync), first[7:8])
    assert not sync.any()


def test_tiles_of_the_presets_depend_on_the_weight_and_device_only():
    """The decode projections of the three presets on an H200 (132 SMs): preload with
    K split where the feature blocks leave SMs idle, stream where they fill them."""
    expect = {  # (N, K, bytes) -> (stream, KS, split)
        (5120, 2048, 2): (False, 256, 8),  # Qwen3-30B-A3B qkv
        (2048, 4096, 2): (False, 512, 8),  # its o
        (128, 2048, 2): (False, 128, 16),  # its router
        (151936, 2048, 2): (True, 2048, 1),  # its LM head
        (128, 4096, 4): (False, 128, 32),  # GLM-4.5-Air's fp32 router
        (14336, 4096, 2): (True, 4096, 1),  # its qkv: 224 blocks
        (8, 4096, 2): (False, 128, 32),  # Mixtral-8x7B's router: 8 rows, 2 KB a program
    }
    for (n, k, e), (stream, ks, split) in expect.items():
        t = linear_tile(n, k, e, 132)
        assert (t.stream, t.k_slice, t.split) == (stream, ks, split), (n, k, e, t)
        assert t.block_n == 64 and t.num_warps == 4
    assert linear_tile(5120, 2048, 2, 1).stream  # the interpreter: one program per feature block
    t = linear_tile(1090, 1000, 2, 132)
    assert (t.split - 1) * t.k_slice < 1000 <= t.split * t.k_slice


def test_stages_follow_rows_but_never_the_sums():
    t = linear_tile(151936, 2048, 2, 132)
    assert t.num_stages(1, 2) == t.num_stages(8, 2) == 4
    deep = dataclasses.replace(t, block_k=128, stages=6)  # 8 row blocks: 48 KB a step, 3 fit 180 KB
    assert deep.num_stages(1, 2) == 6 and deep.num_stages(8, 2) == 3


def test_what_the_kernel_does_not_serve_goes_to_torch():
    """More rows than LINEAR_MAX_ROWS (prefill) and a weight with a strided K: torch."""
    x, w, b = _case(LINEAR_MAX_ROWS + 1, 64, 32, torch.bfloat16, 9)
    assert torch.equal(linear(x, w, b), torch.addmm(b, x, w.t()))
    x, w2, b = _case(2, 64, 32, torch.bfloat16, 9)
    wt = torch.empty(32, 64, dtype=torch.bfloat16, device=DEV).t()
    wt.copy_(w2)
    assert torch.equal(linear(x, wt, b), torch.addmm(b, x, wt.t()))


@pytest.mark.parametrize("m", [3, LINEAR_MAX_ROWS + 1], ids=["kernel", "torch"])
def test_fp32_weights_take_a_16bit_x_upcast_exactly(monkeypatch, m):
    """GLM-4.5's router: fp32 weights, bf16 hidden states, fp32 out, within the fp32
    bound of the upcast x; on a GPU the same bits as upcasting first (the kernel
    converts x in registers before the same MMA; the interpreter's numpy sums a
    transposed fp32 operand in another order than a converted one)."""
    _h200(monkeypatch)
    x, w, b = _case(m, 128, 256, torch.float32, 4)
    x16 = x.bfloat16()
    out = torch.full((m, 128), float("nan"), device=DEV)
    sync = linear_sync(w)
    linear(x16, w, b, out=out, sync=sync)
    assert out.dtype == torch.float32
    _check(out, x16.float(), w, b)
    if DEV == "cuda" or m > LINEAR_MAX_ROWS:
        assert torch.equal(out, linear(x16.float(), w, b, sync=sync))


@pytest.mark.parametrize("schedule", ["stream", "preload"])
@pytest.mark.parametrize("m", [2, 21, LINEAR_MAX_ROWS + 1], ids=["m2", "m21", "torch"])
def test_gated_down_projection_matches_the_unfused_activation(monkeypatch, schedule, m):
    """gated=True: (silu(gate) * up) @ w.T with the activation computed as x loads, against
    the fp32 reference of torch's bf16 `F.silu(g) * u`: one output rounding plus one
    activation rounding (the kernel's exp may differ from torch's in the last fp32 bit,
    which can move an activation by one bf16 spacing, 2^-8 of it)."""
    if schedule == "preload":
        _h200(monkeypatch)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2 * 320, generator=g).bfloat16().to(DEV)
    w = (torch.randn(96, 320, generator=g) * 320 ** -0.5).bfloat16().to(DEV)
    out = torch.full((m, 96), float("nan"), dtype=torch.bfloat16, device=DEV)
    sync = linear_sync(w)
    linear(x, w, out=out, sync=sync, gated=True)
    gate, up = x.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    ref = linear_reference(act, w)
    bound = ref.abs() * ULP[torch.bfloat16] * 2 + 1e-5 * ref.abs().max() + \
        2 ** -8 * (act.double().abs() @ w.double().abs().t()).float()
    assert torch.isfinite(out).all() and ((out.float() - ref).abs() <= bound).all()
    assert not sync.any()
    with pytest.raises(ShapeError, match=r"x \[M, 2K\]"):
        linear(x[:, :320], w, gated=True)


def test_strided_x_empty_batch_and_pdl_off_under_the_interpreter():
    """A strided x; M = 0; pdl=True changes no bit (the interpreter cannot run the
    griddepcontrol inline assembly, so there the flag is off and launch_pdl unset)."""
    x, w, b = _case(4, 96, 128, torch.bfloat16, 2)
    wide = torch.zeros(4, 256, dtype=torch.bfloat16, device=DEV)
    wide[:, ::2] = x
    assert torch.equal(linear(wide[:, ::2], w, b), linear(x, w, b, pdl=False))
    assert torch.equal(linear(x, w, b, pdl=True), linear(x, w, b, pdl=False))
    assert linear(x[:0], w, b).shape == (0, 96)


def test_rejects_bad_input():
    x, w, _ = _case(2, 1024, 64, torch.bfloat16, 1, bias=False)
    with pytest.raises(ShapeError, match="same K"):
        linear(x, w[:, :32])
    with pytest.raises(DTypeError, match="share a float dtype"):
        linear(x.float(), w)
    with pytest.raises(DTypeError, match="share a float dtype"):
        linear(x.to(torch.int32), w.to(torch.int32))
    with pytest.raises(ShapeError, match="bias"):
        linear(x, w, torch.zeros(7, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(LayoutError, match="out must be"):
        linear(x, w, out=torch.empty(2, 9, dtype=torch.bfloat16, device=DEV))
    for bad in (torch.zeros(16, dtype=torch.int64, device=DEV), torch.zeros(3, dtype=torch.int32, device=DEV)):
        with pytest.raises(LayoutError, match="sync must be linear_sync"):
            linear(x, w, sync=bad)
    with pytest.raises(LayoutError, match="needs the call site's semaphores"):
        linear(x, w, tile=LinearTile(stream=False, block_n=64, block_k=64, k_slice=64, split=2))
    buf = torch.zeros(2, 1088, dtype=torch.bfloat16, device=DEV)
    buf[:, :64] = x
    with pytest.raises(AliasingError, match="overlaps x"):  # out's first row starts inside x's
        linear(buf[:, :64], w, out=torch.as_strided(buf, (2, 1024), (1088, 1), 32))


def test_coarse_calls_at_every_m_only_where_the_fine_split_takes_waves():
    """config.py: slices beyond one wave of preloads (2 x 64 KB an SM: Mixtral's qkv and o,
    GLM-4.5-Air's shared gate_up, Qwen3-30B-A3B's qkv in 32 KB slices) take coarse calls at
    every M; one wave or less (Qwen3-30B-A3B's o, the routers, GLM-4.5-Air's shared down)
    only above COARSE_MIN_ROWS rows; COARSE_SMALL_SLICES False counts 64 KB slices alone."""
    for n, k in ((6144, 4096), (4096, 4096), (2816, 4096), (5120, 2048)):
        assert linear_tile(n, k, 2, 132).coarse_always, (n, k)
    with mock.patch.object(config, "COARSE_SMALL_SLICES", False):
        assert not linear_tile(5120, 2048, 2, 132).coarse_always
    for n, k in ((2048, 4096), (128, 2048), (4096, 1408)):
        t = linear_tile(n, k, 2, 132)
        assert not t.stream and t.split > 1 and not t.coarse_always, (n, k)
