"""Model presets: tiny random checkpoints for tests and the demo, realistic
dimensions (config dicts, no weights) for benchmarks.

    path = make_checkpoint("qwen3_moe-tiny", tmp_path / "ckpt")   # transformers' own classes
    spec = load_spec(preset_config("qwen3-30b-a3b", layers=4))       # dims only

Tiny presets: hidden 64, 8 experts, top-2, head_dim 32, at least one dense
layer where the family has them, head counts that divide over 1, 2 and 3
ranks, and vocabularies that need padding for some world sizes:

    name              L  Hq KVH  I_moe  I_dense  V    notes
    qwen3_moe-tiny    3  12  6  192     192      320  layer 0 dense (mlp_only_layers)
    glm4_moe-tiny     3   6  1  192     192      272  layer 0 dense, 1 shared expert,
                                                      4 groups / top 2, bias, rotary 16 of 32
    mixtral-tiny      2  12  6  192     -        288  every layer MoE

`transformers` and `tokenizers` are imported only when a checkpoint is made.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import torch

from sparkinfer.errors import UnsupportedModelError
from sparkinfer.models.nvfp4_export import write_nvfp4_checkpoint

__all__ = ["TINY_PRESETS", "REALISTIC_PRESETS", "preset_config", "make_checkpoint",
           "write_nvfp4_checkpoint"]

# The tokenizer of every tiny checkpoint: 256 byte tokens (ids = byte values),
# then these two specials. Vocabularies are larger; the extra ids are never produced.
BOS, EOS = 256, 257

TINY_PRESETS: dict[str, dict] = {
    "qwen3_moe-tiny": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=320, hidden_size=64,
        intermediate_size=192, num_hidden_layers=3, num_attention_heads=12,
        num_key_value_heads=6, head_dim=32, moe_intermediate_size=192, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False),
    "glm4_moe-tiny": dict(
        architectures=["Glm4MoeForCausalLM"], vocab_size=272, hidden_size=64,
        intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=1, head_dim=32, moe_intermediate_size=192, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=512, bos_token_id=BOS, eos_token_id=[EOS],
        tie_word_embeddings=False),
    "mixtral-tiny": dict(
        architectures=["MixtralForCausalLM"], vocab_size=288, hidden_size=64,
        intermediate_size=192, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=6,
        head_dim=32, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_theta=1000000.0, sliding_window=None, max_position_embeddings=512,
        bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False),
}

# Dimensions of published checkpoints (their config.json), for benchmarks with
# random weights; `layers` in `preset_config` shortens them.
REALISTIC_PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None, torch_dtype="bfloat16"),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_theta=1000000.0, sliding_window=None, max_position_embeddings=32768,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "glm-4.5-air": dict(
        architectures=["Glm4MoeForCausalLM"], vocab_size=151552, hidden_size=4096,
        intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408, n_routed_experts=128,
        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
        rope_theta=1000000.0, max_position_embeddings=131072, pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338], tie_word_embeddings=False,
        torch_dtype="bfloat16"),
}

_CLASSES = {  # architecture -> (config class, model class) names in transformers
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "MixtralForCausalLM": ("MixtralConfig", "MixtralForCausalLM"),
}


def preset_config(name: str, *, layers: int | None = None, **overrides) -> dict:
    """A fresh config dict of preset `name` (tiny or realistic), with
    `num_hidden_layers` = layers when given and other keys overridden. Pure."""
    table = {**TINY_PRESETS, **REALISTIC_PRESETS}
    if name not in table:
        raise UnsupportedModelError(f"preset {name!r} is unknown; choose one of {sorted(table)}")
    cfg = copy.deepcopy(table[name])
    if layers is not None:
        if layers < 1:
            raise UnsupportedModelError(f"layers={layers}; need at least 1")
        cfg["num_hidden_layers"] = layers
    cfg.update(overrides)
    return cfg


def make_checkpoint(preset: str, path: str | os.PathLike, *, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = None,
                    **overrides) -> Path:
    """Build tiny preset `preset` with transformers' own config and model classes,
    fill it with seeded random weights, and `save_pretrained` it (safetensors,
    sharded when `max_shard_size` is given, e.g. "40KB") into `path`, with a
    byte-level tokenizer (tokenizer.json). Returns the directory.

    Weights keep activations O(1): linears ~ N(0, 1/fan_in), embeddings N(0, 1),
    lm_head N(0, 4/H), routers N(0, 4/H) (router logits of std ~2: no ties),
    RMSNorm weights 1 + N(0, 0.01), q/k/v biases and GLM's correction bias
    N(0, 0.01). GLM's router and bias stay fp32, as transformers keeps them.
    Host-only; a tiny preset takes well under a second.
    """
    import transformers

    cfg = preset_config(preset, **overrides)
    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[cfg["architectures"][0]])
    config = cfg_cls(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = list(cfg["architectures"])
    torch_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)  # transformers' own init, overwritten below
        model = model_cls._from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(torch_state)
    _fill(model, cfg["hidden_size"], seed)
    out = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if cfg["vocab_size"] >= EOS + 1:
        _write_tokenizer(out, cfg["max_position_embeddings"])
    return out


LM_HEAD_ROW_SPREAD = 0.75


def _fill(model, hidden: int, seed: int):
    """Overwrite every parameter and the correction-bias buffers, in name order."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers()
                    if n.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if name.endswith("norm.weight"):
                std, mean = 0.1, 1.0
            elif name.endswith((".bias", "e_score_correction_bias")):
                std, mean = 0.1, 0.0
            elif name.endswith("embed_tokens.weight"):
                std, mean = 1.0, 0.0
            elif name.endswith("gate.weight") and "e_score_correction_bias" in " ".join(tensors):
                # sigmoid routing: logits of std 1 keep the sigmoid off its flat ends;
                # at std 2 many scores saturate near 1 and tie within bf16 noise
                std, mean = 1.0 / math.sqrt(hidden), 0.0
            elif name.endswith(("lm_head.weight", "gate.weight")):
                std, mean = 2.0 / math.sqrt(hidden), 0.0
            else:  # linears [out, in] and fused experts [E, out, in]
                std, mean = 1.0 / math.sqrt(t.shape[-1]), 0.0
            vals = torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean
            if name.endswith("lm_head.weight"):
                # log-normal row norms: a few tokens stand out, so greedy steps are rarely
                # near-ties that bf16 rounding could flip (see hf_reference.MIN_MARGIN)
                vals *= torch.exp(LM_HEAD_ROW_SPREAD * torch.randn(t.shape[0], 1, generator=gen))
            t.copy_(vals.to(t.dtype))


# The tiny checkpoints' chat template (`sparkinfer serve --demo`'s /v1/chat/completions):
# "role: content" lines, then the assistant's turn opened.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def _write_tokenizer(path: Path, max_len: int):
    """Byte-level BPE without merges: token id b is byte b; then <|bos|>, <|eos|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    vocab.update({"<|bos|>": BOS, "<|eos|>": EOS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
        "eos_token": "<|eos|>", "model_max_length": max_len, "chat_template": CHAT_TEMPLATE}, indent=2))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out
