"""ModelSpec: agrees with transformers' own config classes; unsupported keys are refused by name."""

import json

import pytest
import torch
import transformers

from sparkinfer.errors import UnsupportedModelError
from sparkinfer.models import load_spec, preset_config
from sparkinfer.models.config import FAMILIES, rope_inv_freq
from sparkinfer.models.presets import REALISTIC_PRESETS
from tests.models.conftest import PRESETS

CONFIG_CLASSES = {"Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
                  "Glm4MoeForCausalLM": transformers.Glm4MoeConfig,
                  "MixtralForCausalLM": transformers.MixtralConfig}


def agrees_with_transformers(spec, hf):
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = hf.rope_parameters
    assert spec.vocab_size == hf.vocab_size and spec.hidden == hf.hidden_size
    assert spec.num_layers == hf.num_hidden_layers and spec.num_heads == hf.num_attention_heads
    assert spec.num_kv_heads == hf.num_key_value_heads and spec.head_dim == head_dim
    assert spec.rms_eps == hf.rms_norm_eps and spec.rope_theta == rope["rope_theta"]
    assert spec.rotary_dim == int(head_dim * rope.get("partial_rotary_factor", 1.0))
    assert spec.num_experts == hf.num_local_experts and spec.top_k == hf.num_experts_per_tok
    assert spec.max_position_embeddings == hf.max_position_embeddings
    assert spec.bos_token_id == hf.bos_token_id
    eos = hf.eos_token_id
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    assert spec.eos_token_ids == tuple(eos)
    assert spec.renormalize == getattr(hf, "norm_topk_prob", True)
    assert spec.tie_word_embeddings == hf.tie_word_embeddings


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_defaults_match_transformers(arch):
    # GLM's default 4096 / 96 heads does not divide: transformers would floor it to 42.
    extra = {"head_dim": 128} if arch == "Glm4MoeForCausalLM" else {}
    spec = load_spec({"architectures": [arch], **extra})
    hf = CONFIG_CLASSES[arch](**extra)
    agrees_with_transformers(spec, hf)
    assert spec.moe_intermediate == getattr(hf, "moe_intermediate_size", hf.intermediate_size)


@pytest.mark.parametrize("preset", PRESETS)
def test_saved_tiny_checkpoint_parses(preset, ckpt_dir, hf_model):
    path = ckpt_dir(preset)
    spec = load_spec(path)
    as_dict = json.loads((path / "config.json").read_text())
    assert spec == load_spec(path / "config.json") == load_spec(as_dict)
    agrees_with_transformers(spec, transformers.AutoConfig.from_pretrained(path))
    model = hf_model(preset)
    assert spec.moe_layers == tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert spec.torch_dtype == torch.bfloat16 and spec.quant is None
    rotary = model.model.rotary_emb.inv_freq
    assert torch.equal(rope_inv_freq(spec), rotary)
    assert spec.attn_scale == model.model.layers[0].self_attn.scaling


def test_family_specifics_of_the_tiny_presets(ckpt_dir):
    qwen, glm, mix = (load_spec(ckpt_dir(p)) for p in PRESETS)
    assert (qwen.qk_norm, qwen.routing, qwen.moe_layers, qwen.dense_intermediate) == \
        (True, "softmax", (False, True, True), 192)
    assert (glm.routing, glm.n_group, glm.topk_group, glm.routed_scaling_factor) == \
        ("sigmoid_grouped", 1, 1, 2.5)
    assert (glm.rotary_dim, glm.head_dim, glm.attention_bias, glm.qk_norm) == (16, 32, True, False)
    assert (glm.num_shared_experts, glm.shared_intermediate, glm.moe_layers) == \
        (1, 192, (False, True, True))
    assert (mix.renormalize, mix.moe_layers, mix.dense_intermediate, mix.rope_theta) == \
        (True, (True, True), 0, 1e6)
    assert all(s.rope_style == "neox" for s in (qwen, glm, mix))


def test_qwen_dense_layers_follow_sparse_step_and_mlp_only_layers():
    spec = load_spec(preset_config("qwen3_moe-tiny", layers=6, decoder_sparse_step=2,
                                   mlp_only_layers=[3]))
    assert spec.moe_layers == (False, True, False, False, False, True)


@pytest.mark.parametrize("name", sorted(REALISTIC_PRESETS))
def test_realistic_presets_parse_with_a_layer_override(name):
    full, short = load_spec(preset_config(name)), load_spec(preset_config(name, layers=3))
    assert short.num_layers == 3 and len(short.moe_layers) == 3
    assert full.hidden == short.hidden and full.num_experts == short.num_experts
    cfg = preset_config(name)
    arch = cfg.pop("architectures")[0]
    cfg.pop("torch_dtype")
    agrees_with_transformers(full, CONFIG_CLASSES[arch](**cfg))


def test_published_dimensions():
    qwen = load_spec(preset_config("qwen3-30b-a3b"))
    assert (qwen.head_dim, qwen.num_experts, qwen.top_k, qwen.moe_intermediate) == \
        (128, 128, 8, 768)
    glm = load_spec(preset_config("glm-4.5-air"))
    assert (glm.rotary_dim, glm.num_heads, glm.eos_token_ids) == (64, 96, (151329, 151336, 151338))
    mix = load_spec(preset_config("mixtral-8x7b"))
    assert (mix.head_dim, mix.moe_intermediate, mix.num_kv_heads) == (128, 14336, 8)


REJECTED = [  # (preset, overrides, message fragment)
    ("mixtral-tiny", {"architectures": ["LlamaForCausalLM"]},
     r"architectures\[0\]='LlamaForCausalLM'"),
    ("mixtral-tiny", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ("qwen3_moe-tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling=.*yarn"),
    ("glm4_moe-tiny", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     r"rope_parameters=.*linear"),
    ("qwen3_moe-tiny", {"use_sliding_window": True}, r"use_sliding_window=True"),
    ("mixtral-tiny", {"sliding_window": 128}, r"sliding_window=128"),
    ("qwen3_moe-tiny", {"attention_bias": True}, r"attention_bias=True.*o_proj bias"),
    ("qwen3_moe-tiny", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ("glm4_moe-tiny", {"n_group": 3}, r"n_group=3"),
    ("glm4_moe-tiny", {"topk_group": 5}, r"topk_group=5"),
    ("mixtral-tiny", {"head_dim": None, "hidden_size": 100}, r"hidden_size=100.*add head_dim"),
    ("mixtral-tiny", {"num_key_value_heads": 5}, r"num_key_value_heads=5"),
    ("qwen3_moe-tiny", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9"),
    ("qwen3_moe-tiny", {"decoder_sparse_step": 0}, r"decoder_sparse_step=0"),
    ("qwen3_moe-tiny", {"quantization_config": {"quant_method": "fp8"}},  # per-tensor FP8
     r"quantization_config.weight_block_size=None"),
    ("qwen3_moe-tiny", {"quantization_config": {"quant_method": "fp8",
                                                "weight_block_size": [128, 128],
                                                "activation_scheme": "static"}},
     r"quantization_config.activation_scheme='static'"),
    ("qwen3_moe-tiny", {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
     r"quantization_config=.*FP8"),
]


@pytest.mark.parametrize("preset,over,match", REJECTED, ids=[m[:24] for _, _, m in REJECTED])
def test_unsupported_configs_name_the_key(preset, over, match):
    with pytest.raises(UnsupportedModelError, match=match):
        load_spec(preset_config(preset, **over))


def test_fp8_block_quantization_config():
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]}  # DeepSeek-V3, GLM-4.5-FP8, Qwen3-FP8
    assert load_spec(preset_config("qwen3_moe-tiny", quantization_config=fp8)).quant == "fp8_block"


def test_accepted_but_irrelevant_keys():
    spec = load_spec(preset_config("mixtral-tiny", sliding_window=512, attention_dropout=0.1,
                                   output_router_logits=True, router_jitter_noise=0.1))
    assert spec.num_layers == 2  # a window of max_position_embeddings never masks anything


def test_hf_quant_config_file_marks_nvfp4(ckpt_dir, tmp_path):
    (tmp_path / "config.json").write_text((ckpt_dir("glm4_moe-tiny") / "config.json").read_text())
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    assert load_spec(tmp_path).quant == "nvfp4"
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(UnsupportedModelError, match="W4A8_AWQ"):
        load_spec(tmp_path)
    with pytest.raises(UnsupportedModelError, match="missing does not exist; pass a Hugging Face checkpoint"):
        load_spec(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match="no config.json in .*empty: it is not a Hugging Face"):
        load_spec(tmp_path / "empty")
