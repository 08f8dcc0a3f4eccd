"""Whole models against transformers: each family's tiny random checkpoint, loaded by our
loader on 1-3 CPU ranks (and DCP = 2), prefill + 8 greedy steps; tokens identical to
transformers' fp32 greedy decode, logits within `hf_reference.RTOL` of it at every
step, and every rank's tokens and logits the same bits.

The seeds are ones `hf_reference.decidable_checkpoint` picked: on them no greedy step
and no routing decision of the reference is a near-tie that bf16 rounding may flip
(the fixture re-checks that, so a change in transformers fails loudly here)."""

import pytest
import torch

from sparkinfer.engine import SamplingParams
from sparkinfer.engine.session import GenerateRequest, generate_on_rank
from sparkinfer.models.hf_reference import MIN_MARGIN, MIN_ROUTER_MARGIN, compare, transformers_greedy
from sparkinfer.models.presets import make_checkpoint
from sparkinfer.runtime import run_ranks

SEEDS = {"qwen3_moe-tiny": 16, "glm4_moe-tiny": 3, "mixtral-tiny": 18}
FAMILIES = list(SEEDS)
LAYOUTS = [(1, 1), (2, 1), (3, 1), (2, 2)]  # (TP ranks, DCP)
NEW = 8
PROMPTS = [[5, 17, 3, 99], [7, 1, 250, 13, 64, 2]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        path = make_checkpoint(fam, tmp_path_factory.mktemp(fam), seed=SEEDS[fam])
        ref = transformers_greedy(path, PROMPTS, NEW)
        assert ref.margin >= MIN_MARGIN and ref.router_margin >= MIN_ROUTER_MARGIN, \
            f"{fam} seed {SEEDS[fam]} is no longer decidable; pick one with decidable_checkpoint"
        out[fam] = (path, ref)
    return out


def _run(path, world, dcp, fmt="bf16"):
    req = GenerateRequest(str(path), PROMPTS, SamplingParams(max_new_tokens=NEW), moe_format=fmt, dcp=dcp,
                          keep_logits=True, max_len=32)
    return run_ranks(generate_on_rank, world, backend="cpu", args=(req,), timeout_s=900)


@pytest.mark.slow
@pytest.mark.parametrize("world,dcp", LAYOUTS, ids=[f"tp{w}_dcp{d}" for w, d in LAYOUTS])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(checkpoints, family, world, dcp):
    path, ref = checkpoints[family]
    results = _run(path, world, dcp)
    assert compare(ref, results[0].tokens, results[0].logits) == []
    for res in results[1:]:
        assert res.tokens == results[0].tokens
        assert all(torch.equal(a, b) for a, b in zip(res.logits, results[0].logits))
