"""micro FC2's weight preload (`runner.FC2_PRELOAD`: the first K steps' bf16 weight tiles
loaded before the wait for FC1, then multiplied in the loop's order) gives the bits of
the plain loop, through the Triton interpreter: none, some and all of a route's K steps
preloaded; NVFP4 and FP8 weights never preload. The early FC2 launch
(`runner.FC1_LETS_FC2_EARLY`) is a GPU launch attribute only (programmatic dependent
launch is off here); tests/moe/test_compile_sm90.py compiles both for sm_90."""

import pytest
import torch

from sparkinfer.moe import MoECaps, MoESpec, allocate_scratch, bind, moe_reference, run
from sparkinfer.moe import runner as moe_runner
from sparkinfer.moe.routing import route_reference
from tests.moe._util import assert_moe_close, poison_scratch, random_layer

E, K, H, I = 8, 2, 64, 128


class _Spy:
    """moe_fc2_kernel[grid](...) as usual, recording each launch's PRE."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs.get("PRE", 0))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _run(fmt, t, preload, monkeypatch, seed=0, h=H, i=I, invariant=True, split2=None):
    caps = MoECaps(max_tokens=16, num_experts=E, top_k=K, hidden=h, intermediate=i, batch_invariant=invariant)
    spec = MoESpec(weight_format=fmt)
    p, w, src, scratch = random_layer(caps, spec, seed=seed)
    if split2 is not None:  # FC2's K steps over this many programs (a heuristic plan's split)
        p = p.with_changes(split2=split2)
        scratch = allocate_scratch(p, "cpu")
    assert p.config_for(t).family == "micro" and i // p.chunk >= 2, "the layer must have micro K steps to preload"
    g = torch.Generator().manual_seed(seed + 1)
    x, logits = torch.randn(t, h, generator=g).bfloat16(), torch.randn(t, E, generator=g)
    seen = []
    monkeypatch.setattr(moe_runner, "FC2_PRELOAD", preload)
    monkeypatch.setattr(moe_runner, "moe_fc2_kernel", _Spy(moe_runner.moe_fc2_kernel, seen))
    poison_scratch(scratch)
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16)
    run(bind(p, scratch, w, x=x, out=out, logits=logits))
    ref = moe_reference(x, src, route_reference(logits, spec, K), spec=spec)
    return out, ref, seen, i // p.chunk


@pytest.mark.parametrize("t", [1, 5])
def test_preloaded_k_steps_give_the_plain_loops_bits(t, monkeypatch):
    plain, ref, seen, steps = _run("bf16", t, 0, monkeypatch)
    assert seen == [0]
    assert_moe_close(plain, ref)
    for preload in (1, steps - 1, steps + 3):  # some, all but one, more than the route has (capped)
        out, _, seen, _ = _run("bf16", t, preload, monkeypatch)
        assert seen == [min(preload, steps)]
        assert torch.equal(out.view(torch.int16), plain.view(torch.int16)), f"FC2_PRELOAD={preload}"


def test_a_split_fc2_preloads_at_most_its_last_splits_steps(monkeypatch):
    """A heuristic plan splits FC2's K steps over programs, and the last split may hold fewer:
    here 3 steps of 32 in splits of 2 and 1, so one step is preloaded, never a step past
    the split's own (the first split's 2 would take the last split past the matrix)."""
    plain, ref, _, steps = _run("bf16", 1, 0, monkeypatch, i=96, invariant=False, split2=2)
    assert steps == 3
    assert_moe_close(plain, ref)
    out, _, seen, _ = _run("bf16", 1, 8, monkeypatch, i=96, invariant=False, split2=2)
    assert seen == [1]
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block"])
def test_quantized_weights_do_not_preload(fmt, monkeypatch):
    out, ref, seen, _ = _run(fmt, 2, 4, monkeypatch, h=128, i=256)  # fp8_block: 128 x 128 blocks
    assert seen == [0]
    assert_moe_close(out, ref, fmt)
