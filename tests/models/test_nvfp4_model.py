"""A model whose routed experts are NVFP4 (a ModelOpt checkpoint) against transformers
running the same model with those experts dequantized to fp32: on 1 and 2 CPU ranks,
tokens identical and logits within `hf_reference.RTOL` (the seed is one on which the
dequantized reference has no near-tie, checked here)."""

import pytest

from sparkinfer.cli.demo import PROMPTS
from sparkinfer.engine import SamplingParams
from sparkinfer.engine.session import GenerateRequest, generate_on_rank
from sparkinfer.models.hf_reference import MIN_MARGIN, MIN_ROUTER_MARGIN, compare, transformers_greedy
from sparkinfer.models.nvfp4_export import write_nvfp4_checkpoint
from sparkinfer.models.presets import make_checkpoint
from sparkinfer.runtime import run_ranks

SEED = 14  # mixtral-tiny: decidable once its experts are NVFP4 (decidable_checkpoint's test)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_nvfp4_experts_match_the_dequantized_reference(tmp_path, world):
    src = make_checkpoint("mixtral-tiny", tmp_path / "bf16", seed=SEED)
    path = write_nvfp4_checkpoint(src, tmp_path / "nvfp4", shared_gate_up_scale=True, reference=tmp_path / "ref")
    ref = transformers_greedy(tmp_path / "ref", PROMPTS, 8)
    assert ref.margin >= MIN_MARGIN and ref.router_margin >= MIN_ROUTER_MARGIN
    req = GenerateRequest(str(path), PROMPTS, SamplingParams(max_new_tokens=8), moe_format="nvfp4",
                          keep_logits=True, max_len=32)
    results = run_ranks(generate_on_rank, world, backend="cpu", args=(req,), timeout_s=900)
    assert compare(ref, results[0].tokens, results[0].logits) == []
    assert all(r.tokens == results[0].tokens for r in results)
