"""Batch invariance of the MoE layer through the Triton interpreter: a probe
token's output is the same bits alone (micro, T = 1) and beside random tokens
at every decode bucket up to 64 in bf16 (micro up to 16, grouped above at
block_m 16 and, T = 64, 32), and micro against grouped in NVFP4; the heuristic plan (batch_invariant=False: FC1 split at
T = 1, fp32 FC2 partials in micro against bf16 route rows in grouped) moves it,
so the comparison can fail.

Planned for 132 SMs (so the heuristic splits); small dims (H 64, I 32, E 8, K 2)
because the interpreter runs every program in series.
"""

import dataclasses

import pytest
import torch

from sparkinfer.moe import MoECaps, MoELayer, MoESpec, allocate_scratch
from tests.moe._util import poison_scratch, random_layer

E, K, H, I = 8, 2, 64, 32
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _layer(fmt: str, invariant: bool, seed: int, max_tokens: int = max(BUCKETS)):
    caps = MoECaps(max_tokens=max_tokens, num_experts=E, top_k=K, hidden=H, intermediate=I,
                   batch_invariant=invariant)
    spec = MoESpec(weight_format=fmt)
    _, _, (w1, w2), _ = random_layer(caps, spec, seed=seed)
    return MoELayer(caps, spec, (w1, w2), device="cpu")


def _probe_out(layer, probe, t: int, seed: int):
    """The probe (x [H], logits [E]) at a random row among t - 1 random tokens: its output [H]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    logits = (2 * torch.randn(t, E, generator=g)).bfloat16()
    i = int(torch.randint(0, t, (1,), generator=g))
    x[i], logits[i] = probe
    poison_scratch(layer.scratch)
    return layer(x, logits)[i]


@pytest.mark.parametrize("fmt,buckets", [("bf16", BUCKETS), ("nvfp4", (1, 8, 32))])
def test_probe_token_is_the_same_bits_at_every_bucket(fmt, buckets):
    layer = _layer(fmt, True, seed=1)
    g = torch.Generator().manual_seed(2)
    probe = (torch.randn(H, generator=g).bfloat16(), (2 * torch.randn(E, generator=g)).bfloat16())
    families = {layer.plan.config_for(t).family for t in buckets}
    assert families == {"micro", "grouped"}
    alone = _probe_out(layer, probe, 1, 0)
    for t in buckets[1:]:
        got = _probe_out(layer, probe, t, 10 + t)
        assert torch.equal(got.view(torch.int16), alone.view(torch.int16)), \
            f"T = {t} ({layer.plan.config_for(t).family}): the probe token's output differs from T = 1"


def test_nvfp4_probe_token_through_the_wide_grouped_tiles():
    """NVFP4 at T 96 (24 rows an expert: BM 64, BN1 128, plan.NVFP4_GROUPED_BN1) and forced
    to BM 128, to BN1 64 (the tiles planned before) and to FC2 programs of fewer rows than
    the sorted tiles (TileConfig.block_m2: 32 and 16 of 64, 64 of 128, BN2 128 and 256):
    the probe's bits at T = 1 (micro)."""
    layer = _layer("nvfp4", True, seed=3, max_tokens=128)
    cfg = layer.plan.config_for(96)
    assert (cfg.family, cfg.block_m, cfg.block_n1, cfg.num_warps) == ("grouped", 64, 128, 8)
    g = torch.Generator().manual_seed(4)
    probe = (torch.randn(H, generator=g).bfloat16(), (2 * torch.randn(E, generator=g)).bfloat16())
    alone = _probe_out(layer, probe, 1, 0)
    planned = layer.plan
    fewer = [dataclasses.replace(cfg, block_m2=32), dataclasses.replace(cfg, block_m2=16, block_n2=128),
             dataclasses.replace(cfg, block_m=128, block_m2=64)]
    for forced in (None, dataclasses.replace(cfg, block_m=128), dataclasses.replace(cfg, block_n1=64), *fewer):
        layer.plan = planned if forced is None else planned.forced(forced)
        layer.scratch = allocate_scratch(layer.plan, "cpu")
        got = _probe_out(layer, probe, 96, 7)
        assert torch.equal(got.view(torch.int16), alone.view(torch.int16)), \
            f"T = 96 at {layer.plan.config_for(96)}: the probe token's output differs from T = 1"


def test_the_heuristic_plan_moves_the_bits():
    layer = _layer("bf16", False, seed=1)
    assert layer.plan.config_for(1).split1 > 1
    g = torch.Generator().manual_seed(2)
    probe = (torch.randn(H, generator=g).bfloat16(), (2 * torch.randn(E, generator=g)).bfloat16())
    alone, beside = _probe_out(layer, probe, 1, 0), _probe_out(layer, probe, 32, 42)
    assert not torch.equal(alone.view(torch.int16), beside.view(torch.int16))
