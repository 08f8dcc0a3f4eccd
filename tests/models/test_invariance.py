"""Batch invariance of the whole decoder on the CPU (Triton interpreter), a property
test: a probe request's logits over decode steps are the same bits when it runs
alone and when it runs beside random rows (random slots, contexts, tokens and
cache contents, padding rows that share the padding slot) at a random row of a
random bucket. The model is the Qwen3 tiny preset cut to 2 layers (a dense
layer and a MoE layer; q/k head norms), one rank, the decoder driven directly.
Its MoE plan takes the grouped family from 4 tokens (plan.MICRO_MAX_TOKENS
patched from 16), so the buckets here cross the families as 16 -> 32 does on a
GPU; the batch-dependent decoder (batch_invariant=False) then moves the probe's
logits, so the property can fail.

What is not covered here, and where it is: attention splits (the tiny cache holds
64 positions, under one split): tests/attention/test_invariance.py; buckets above
8 and CUDA graphs: tests/models/test_gpu_invariance.py. The projections and the
LM head run torch.mm on the CPU at these sizes (sparkinfer.linear serves N >= 1024
only), which gives a row the same bits at every M here; the GPU test holds the
linear kernel to it. The interpreter runs a 2-row step in about 2 s, so few examples.
"""

import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sparkinfer.models.build import build_decoder
from sparkinfer.models.decoder import Step
from sparkinfer.models.presets import make_checkpoint
from sparkinfer.models.weights import Sharding

MAX_BATCH, MAX_LEN, STEPS = 8, 64, 2
PROBE_SLOT, PAD_SLOT = 0, MAX_BATCH  # the cache has MAX_BATCH + 1 slots, the last for padding rows
PROMPT = [3, 141, 59, 26, 53]
PROBE_TOKENS = [58, 97]  # fed at the decode steps (fixed, so the probe's cache evolves alike)


def _i32(v):
    return torch.tensor(v, dtype=torch.int32)


def _step(tokens, q_pos, slots, q_len=1):
    """A step of B rows of q_len tokens each: tokens [B * q_len], row positions q_pos [B]."""
    b = len(slots)
    pos = [p + i for p in q_pos for i in range(q_len)]
    return Step(tokens=torch.tensor(tokens), positions=_i32(pos), slots=_i32([s for s in slots for _ in range(q_len)]),
                row_slots=_i32(slots), q_pos=_i32(q_pos), q_len=q_len,
                logit_rows=torch.arange(b) * q_len + q_len - 1)


def _alone(dec, steps: int):
    """Prefill the probe into its slot; (its K/V after prefill, its logits at each of the
    first `steps` decode steps alone)."""
    with torch.no_grad():
        dec(_step(PROMPT, [0], [PROBE_SLOT], q_len=len(PROMPT)))
        saved = (dec.cache.k[:, PROBE_SLOT].clone(), dec.cache.v[:, PROBE_SLOT].clone())
        alone = [dec(_step([t], [len(PROMPT) + i], [PROBE_SLOT]))[0].clone()
                 for i, t in enumerate(PROBE_TOKENS[:steps])]
    return saved, alone


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """(batch-invariant decoder, batch-dependent decoder on the same weights), their MoE
    plans grouped from 4 tokens."""
    path = make_checkpoint("qwen3_moe-tiny", tmp_path_factory.mktemp("qwen3"), num_hidden_layers=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules["sparkinfer.moe.plan"], "MICRO_MAX_TOKENS", 2)  # the package exports plan()
        dec = build_decoder(path, Sharding(), device="cpu", max_batch=MAX_BATCH, max_len=MAX_LEN, max_tokens=16)
        # its own load of the same checkpoint: build_decoder releases the loaded experts it prepared
        dependent = build_decoder(path, Sharding(), device="cpu", max_batch=MAX_BATCH, max_len=MAX_LEN,
                                  max_tokens=16, batch_invariant=False)
    assert dec.moe[1].plan.config_for(4).family == "grouped" and dec.moe[1].plan.config_for(2).family == "micro"
    return dec, dependent


@pytest.fixture(scope="module")
def probe(decoders):
    """(decoder, the probe slot's K/V after prefill, its logits at each decode step alone)."""
    return decoders[0], *_alone(decoders[0], STEPS)


def _beside(dec, saved, b: int, row: int, padding: int, g, steps: int = STEPS):
    """The probe's logits at each decode step at row `row` of `b` rows, `padding` of them
    padding rows, the others random."""
    dec.cache.k[:, PROBE_SLOT].copy_(saved[0])
    dec.cache.v[:, PROBE_SLOT].copy_(saved[1])
    others = (1 + torch.randperm(MAX_BATCH - 1, generator=g))[: b - 1 - padding].tolist()
    for s in others:  # neighbours' contexts: random keys and values
        dec.cache.k[:, s].copy_(torch.randn(dec.cache.k[:, s].shape, generator=g))
        dec.cache.v[:, s].copy_(torch.randn(dec.cache.v[:, s].shape, generator=g))
    slots = others + [PAD_SLOT] * padding
    q_pos = torch.randint(0, MAX_LEN - STEPS, (len(others),), generator=g).tolist() + [0] * padding
    slots.insert(row, PROBE_SLOT)
    q_pos.insert(row, len(PROMPT))
    got = []
    with torch.no_grad():
        for i, t in enumerate(PROBE_TOKENS[:steps]):
            tokens = torch.randint(0, 256, (b,), generator=g).tolist()
            tokens[row] = t
            pos = [p + (i if s != PAD_SLOT else 0) for p, s in zip(q_pos, slots)]
            got.append(dec(_step(tokens, pos, slots))[row])
    return got


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.sampled_from((2, 4, 8)), seed=st.integers(0, 1 << 20), row=st.integers(0, 7), pad=st.integers(0, 7))
@example(b=8, seed=1, row=5, pad=2)  # grouped MoE, padding rows, the probe mid-batch: every time
def test_probe_logits_are_the_same_bits_beside_any_rows(probe, b, seed, row, pad):
    dec, saved, alone = probe
    row, padding = row % b, pad % b  # the probe's row; padding rows among the others
    got = _beside(dec, saved, b, row, padding, torch.Generator().manual_seed(seed))
    for i, (a, w) in enumerate(zip(got, alone)):
        assert torch.equal(a.view(torch.int16), w.view(torch.int16)), \
            f"B = {b}, probe at row {row} with {padding} padding rows: step {i} logits differ from alone"


def test_the_batch_dependent_decoder_moves_the_probe(decoders):
    """Micro's fp32 FC2 partials against grouped's bf16 route rows (and the heuristic's
    other choices): the probe's first logits alone differ from those beside 7 rows."""
    dec = decoders[1]
    saved, (alone,) = _alone(dec, 1)
    (beside,) = _beside(dec, saved, 8, 3, 0, torch.Generator().manual_seed(5), steps=1)
    assert not torch.equal(beside.view(torch.int16), alone.view(torch.int16))
