"""Batch invariance of `linear`: a row's output is the same bits at every M up to
LINEAR_MAX_ROWS, at any position in the batch, whatever the other rows hold
(the one requirement continuous batching puts on a projection: a sequence's
logits must not depend on which sequences share its step, nor on its row).

Each schedule is checked at M across every row-block count (1..8 blocks of 16)
and their edges; the probe rows sit at fresh random positions among fresh random
rows each time; outputs are poisoned with NaN first. On the CPU the stream
schedule is the interpreter's plan and the preload one an H200's (132 SMs)."""

import pytest
import torch

from sparkinfer.linear import LINEAR_MAX_ROWS, LinearTile, launch, linear, linear_sync, linear_tile

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MS = (1, 2, 15, 16, 17, 33, 64, 65, 97, LINEAR_MAX_ROWS)
# id -> (N, K, dtype, SMs the plan assumes); N and K leave partial feature blocks and K steps
CASES = {
    "stream-bf16": (80, 200, torch.bfloat16, 1, False),
    "preload-split-bf16": (80, 300, torch.bfloat16, 132, False),
    "preload-split-fp32": (72, 160, torch.float32, 132, False),
    "stream-gated": (64, 96, torch.bfloat16, 1, True),  # silu(gate) * up computed as x loads
    "preload-groups-bf16": (256, 2048, torch.bfloat16, 8, False),  # above 16 rows: 2 groups of 2 slices
}


@pytest.mark.parametrize("name", CASES)
def test_rows_do_not_depend_on_the_batch(monkeypatch, name):
    n, k, dtype, sms, gated = CASES[name]
    width = 2 * k if gated else k
    monkeypatch.setattr(launch, "_num_sms", lambda device: sms)
    assert linear_tile(n, k, torch.tensor([], dtype=dtype).element_size(), sms).stream == (sms == 1)
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    probes = torch.randn(2, width, generator=g).to(dtype).to(DEV)
    sync = linear_sync(w)
    alone = torch.cat([linear(p[None], w, b, sync=sync, gated=gated) for p in probes])
    for m in MS:
        x = torch.randn(m, width, generator=g).to(dtype).to(DEV)
        rows = torch.randperm(m, generator=g)[:2]
        x[rows] = probes[:len(rows)]
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        linear(x, w, b, out=out, sync=sync, gated=gated)
        assert torch.isfinite(out).all(), m
        assert torch.equal(out[rows], alone[:len(rows)]), (m, rows.tolist())
    assert not sync.any()


# id -> (N, K, gated, tile): the planned tile of "preload-groups-bf16", and all of K's 4 slices in
# one group (no partials: the program stores 0 + its group's sum, as the finisher would)
COARSE = {
    "two-groups": (256, 2048, False, linear_tile(256, 2048, 2, 8)),
    "one-group-gated": (200, 1000, True, LinearTile(stream=False, block_n=64, block_k=64, k_slice=256, split=4,
                                                    group=4)),
}


@pytest.mark.parametrize("name", COARSE)
def test_coarse_calls_give_the_split_sums(monkeypatch, name):
    """A call of many rows runs one program per group of slices (config.py); each
    element gets the same bits as from one program per slice at the same M."""
    n, k, gated, tile = COARSE[name]
    assert tile.group > 1 and not tile.stream
    monkeypatch.setattr(launch.config, "COARSE_GATED", True)  # gated calls stay fine by default
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16().to(DEV)
    b = torch.randn(n, generator=g).bfloat16().to(DEV)
    x = torch.randn(70, 2 * k if gated else k, generator=g).bfloat16().to(DEV)
    sync = linear_sync(w)
    coarse = linear(x, w, b, sync=sync, gated=gated, tile=tile)
    monkeypatch.setattr(launch.config, "COARSE_MIN_ROWS", LINEAR_MAX_ROWS)
    fine = torch.full_like(coarse, float("nan"))
    linear(x, w, b, sync=sync, gated=gated, tile=tile, out=fine)
    assert torch.equal(coarse.view(torch.int16), fine.view(torch.int16))
    assert not sync.any()


def test_coarse_programs_of_128_features_match_the_reference(monkeypatch):
    """config.COARSE_BLOCK_N = 128 (not the default): every element of a coarse call of
    128-feature programs (partials of 2 groups, a partial last block) within one bf16
    rounding of the fp64 product, outputs poisoned first. Not bitwise against 64: the
    interpreter's numpy matmul orders sums by operand shape."""
    monkeypatch.setattr(launch.config, "COARSE_BLOCK_N", 128)
    tile = linear_tile(320, 2048, 2, 6)
    assert tile.groups > 1 and not tile.stream
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(320, 2048, generator=g) * 2048 ** -0.5).bfloat16().to(DEV)
    x = torch.randn(40, 2048, generator=g).bfloat16().to(DEV)
    sync = linear_sync(w)
    out = torch.full((40, 320), float("nan"), dtype=torch.bfloat16, device=DEV)
    linear(x, w, sync=sync, tile=tile, out=out)
    ref = x.double() @ w.double().t()
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-4).all()
    assert not sync.any()
