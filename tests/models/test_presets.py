"""Tiny presets: seeded, well-scaled, with a tokenizer that round-trips text."""

import pytest
import torch
import transformers
from safetensors.torch import load_file

from sparkinfer.errors import UnsupportedModelError
from sparkinfer.models import make_checkpoint, preset_config
from sparkinfer.models.presets import BOS, EOS
from tests.models.conftest import PRESETS


def test_same_seed_same_weights_other_seed_other_weights(ckpt_dir, tmp_path):
    a = load_file(str(ckpt_dir("mixtral-tiny") / "model.safetensors"))
    b = load_file(str(make_checkpoint("mixtral-tiny", tmp_path / "b") / "model.safetensors"))
    c = load_file(str(make_checkpoint("mixtral-tiny", tmp_path / "c", seed=1) / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize("preset", PRESETS)
def test_forward_is_well_scaled_and_routing_has_no_ties(preset, ckpt_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt_dir(preset),
                                                              dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    out = model(ids, output_router_logits=True)
    logits = out.logits[0]
    assert torch.isfinite(logits).all() and 0.5 < logits.std() < 20
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # greedy picks are not ties
    for router in out.router_logits:
        top = router.float().topk(3, dim=-1).values
        assert (top[:, :-1] - top[:, 1:]).min() > 1e-4  # top-k selection is not a tie


def test_glm_router_and_bias_are_fp32_and_nonzero(ckpt_dir):
    t = load_file(str(ckpt_dir("glm4_moe-tiny") / "model.safetensors"))
    bias = t["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_tokenizer_round_trips_text(ckpt_dir):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt_dir("qwen3_moe-tiny"))
    text = "Hello, MoE! é ∑"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS, EOS)


def test_unknown_preset():
    with pytest.raises(UnsupportedModelError, match="preset 'llama-tiny' is unknown"):
        preset_config("llama-tiny")
