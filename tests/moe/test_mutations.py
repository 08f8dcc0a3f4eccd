"""Mutation tests: break the layer on purpose and assert that the suite's own
check (`tests/moe/_util.check_moe`, the bounds of
`sparkinfer.moe.reference.TOLERANCES`) flags it. Kept in CI so the checks
cannot silently go blind again (cosine alone passed a 1.5x output).

Mutations, each applied by monkeypatching what the layer runs:
- scale: the final top-k reduction's output times 1.5 (`runner.moe_reduce_kernel`);
- drop: one route of token 0 dropped after routing (`runner.route` writes id -1,
  which the kernels skip);
- swap: experts 0 and 1 exchange their prepared weights (the reference keeps
  the source weights).
Run on a micro (bf16) and a grouped (NVFP4) case; unmutated, both pass.
"""

import pytest
import torch

import sparkinfer.moe.runner as runner
import tests.moe._util as util
from sparkinfer.moe import MoESpec
from sparkinfer.moe.routing import route_reference

CASES = [  # id, format, T, E, K
    ("bf16-micro", "bf16", 4, 4, 2),
    ("nvfp4-grouped", "nvfp4", 20, 4, 2),
]


class _ScaledLaunch:
    """Stands in for moe_reduce_kernel: launches it, then scales its output (argument 3)."""

    def __init__(self, kernel, factor):
        self.kernel, self.factor = kernel, factor

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def scaled(*args, **kw):
            launch(*args, **kw)
            args[3].mul_(self.factor)

        return scaled


def _scale(monkeypatch):
    monkeypatch.setattr(runner, "moe_reduce_kernel", _ScaledLaunch(runner.moe_reduce_kernel, 1.5))


def _drop(monkeypatch):
    real = runner.route

    def dropped(logits, spec, out, *, bias=None):
        real(logits, spec, out, bias=bias)
        out[0][0, 0] = -1  # token 0's first route goes nowhere

    monkeypatch.setattr(runner, "route", dropped)


def _swap(monkeypatch):
    real = util.prepare_weights

    def swapped(p, w1, w2):
        w = real(p, w1, w2)
        for t in (w.w1, w.w2, w.s1, w.s2, w.g1, w.g2):
            if t is not None:
                t[[0, 1]] = t[[1, 0]].clone()
        return w

    monkeypatch.setattr(util, "prepare_weights", swapped)


MUTATIONS = {"scale": _scale, "drop": _drop, "swap": _swap}


def _case(fmt, t, e, k, seed=0):
    torch.manual_seed(seed)  # fixed routing, so the swapped experts are routed
    spec = MoESpec(weight_format=fmt)
    b, ref = util.run_case(spec, t, e, k)
    return b, ref, spec


@pytest.mark.parametrize("fmt,t,e,k", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_unmutated_case_passes(fmt, t, e, k):
    b, ref, _ = _case(fmt, t, e, k)
    c = util.check_moe(b.out, ref)
    assert c.ok, str(c)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("fmt,t,e,k", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_flags_mutation(monkeypatch, mutation, fmt, t, e, k):
    MUTATIONS[mutation](monkeypatch)
    b, ref, spec = _case(fmt, t, e, k)
    if mutation == "swap":  # not vacuous: the reference routes to expert 0 or 1
        ids, _ = route_reference(b.logits, spec, k)
        assert bool(((ids == 0) | (ids == 1)).any())
    c = util.check_moe(b.out, ref)
    assert not c.ok, f"{mutation} mutation not flagged: {c}"
    if mutation == "scale":  # the blind spot these bounds close: cosine cannot see it
        assert c.cosine >= c.tol.cosine_min and c.rel_norm > c.tol.rel_norm_max
