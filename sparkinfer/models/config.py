"""`ModelSpec`: what a Hugging Face `config.json` says about a model, checked.

Legend: H hidden, V vocabulary, D head dim, Hq query heads, KVH key/value heads,
E routed experts, K experts per token, I intermediate, L layers.

Three families, picked by `architectures[0]`, with the defaults of the
transformers 5.24 configuration classes where a key is absent:

- `Qwen3MoeForCausalLM` ("qwen3_moe"): GQA, per-head RMSNorm of q and k before
  rotary, softmax top-k (renormalized when `norm_topk_prob`), layer i dense when
  i is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0.
- `Glm4MoeForCausalLM` ("glm4_moe"): sigmoid grouped top-k with the score
  correction bias, `routed_scaling_factor`, shared experts, the first
  `first_k_dense_replace` layers dense, rotary on the leading
  `partial_rotary_factor` (default 0.5) of each head, q/k/v biases when
  `attention_bias`, per-head q/k RMSNorm when `use_qk_norm`.
- `MixtralForCausalLM` ("mixtral"): softmax top-k, always renormalized, no dense layers.

Rotary, all three families (transformers' `rotate_half`, "neox" style): with
rd = `rotary_dim`, inv_freq[j] = rope_theta ** (-2j / rd) for j < rd/2, and for
each head x[:rd] -> x[:rd] * cos + cat(-x[rd/2:rd], x[:rd/2]) * sin, where
cos/sin repeat the rd/2 angles twice (dim j and j + rd/2 share frequency j);
x[rd:] passes unchanged (GLM). Attention scale D ** -0.5.

A key whose value changes the maths and that this library does not implement
raises `UnsupportedModelError` naming the key and value.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from sparkinfer.errors import UnsupportedModelError
from sparkinfer.models.fp8_io import fp8_quant_config

__all__ = ["ModelSpec", "load_spec", "FAMILIES", "rope_inv_freq"]

FAMILIES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Glm4MoeForCausalLM": "glm4_moe",
            "MixtralForCausalLM": "mixtral"}

# Defaults of the transformers 5.24 configuration classes (configuration_*.py).
_DEFAULTS = {
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                      rms_norm_eps=1e-6, max_position_embeddings=32768, theta=10000.0,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=False, bos_token_id=None, eos_token_id=None),
    "glm4_moe": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                     num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                     rms_norm_eps=1e-5, max_position_embeddings=131072, theta=10000.0,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
                     norm_topk_prob=True, bos_token_id=None, eos_token_id=None),
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    rms_norm_eps=1e-5, max_position_embeddings=131072, theta=1000000.0,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
                    norm_topk_prob=True, bos_token_id=1, eos_token_id=2),
}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelSpec:
    """A checked model configuration (see the module docstring for the maths).

    family: "qwen3_moe" | "glm4_moe" | "mixtral". vocab_size V, hidden H,
    num_layers L, num_heads Hq, num_kv_heads KVH, head_dim D (may differ from
    H / Hq), rms_eps (every RMSNorm), rope_theta, rotary_dim (leading dims of
    each head that rotate; D, or D * partial_rotary_factor for GLM),
    rope_style "neox" (rotate_half halves within rotary_dim, never interleaved
    pairs). attention_bias: q/k/v biases (never o). qk_norm: per-head RMSNorm
    [D] of q and k, applied before rotary.
    MoE: num_experts E, top_k K, moe_intermediate I of one routed expert,
    routing "softmax" | "sigmoid_grouped", renormalize (top-k weights divided by
    their sum), n_group / topk_group (group-limited selection), routed_scaling_factor
    (multiplies the routed weights; 1.0 outside GLM), num_shared_experts and
    shared_intermediate (their concatenated I; 0 when none), dense_intermediate
    (I of the dense MLP layers; 0 when the model has none), moe_layers (per layer,
    True for a MoE MLP).
    tie_word_embeddings: lm_head is the embedding. bos_token_id (or None),
    eos_token_ids (every stop id). max_position_embeddings. torch_dtype: the
    checkpoint's declared dtype (None when absent). quant: None, "nvfp4" for
    a ModelOpt NVFP4 checkpoint, or "fp8_block" for an FP8 block-scaled one.
    """

    family: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rotary_dim: int
    rope_style: str
    attention_bias: bool
    qk_norm: bool
    num_experts: int
    top_k: int
    moe_intermediate: int
    routing: str
    renormalize: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    num_shared_experts: int
    shared_intermediate: int
    dense_intermediate: int
    moe_layers: tuple[bool, ...]
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    torch_dtype: torch.dtype | None
    quant: str | None = None

    @property
    def attn_scale(self) -> float:
        """Softmax scale of attention scores: D ** -0.5 (all three families)."""
        return self.head_dim ** -0.5


def rope_inv_freq(spec: ModelSpec, device="cpu") -> torch.Tensor:
    """fp32 [rotary_dim / 2] inverse frequencies, computed as transformers does. Allocates."""
    rd = spec.rotary_dim
    exponents = torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd
    return 1.0 / (spec.rope_theta ** exponents)


def load_spec(src: str | os.PathLike | dict) -> ModelSpec:
    """Parse a checkpoint directory (its `config.json`, and `hf_quant_config.json`
    when present), a path to a `config.json`, or a config dict. Pure host work.

    Raises UnsupportedModelError for another architecture or a key whose value
    this library does not implement; the message names the key and its value.
    """
    cfg, where, quant_file = _read(src)
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"{where}: architectures[0]={arch!r} is not supported; "
                                    f"supported: {sorted(FAMILIES)}")
    family = FAMILIES[arch]
    d = _DEFAULTS[family]

    def get(key, default_key=None):
        v = cfg.get(key)
        return d[default_key or key] if v is None else v

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        _unsupported(where, "hidden_act", act, "only silu-gated MLPs are implemented")
    heads = int(get("num_attention_heads"))
    kv = cfg.get("num_key_value_heads", d["num_key_value_heads"])
    kv = int(heads if kv is None else kv)  # an explicit null means one KV head per query head
    hidden = int(get("hidden_size"))
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            _unsupported(where, "hidden_size", hidden, f"no head_dim is given and it does not "
                         f"divide over num_attention_heads={heads}; add head_dim")
        head_dim = hidden // heads
    head_dim = int(head_dim)
    if heads % kv:
        _unsupported(where, "num_key_value_heads", kv,
                     f"num_attention_heads={heads} is not a multiple of it")
    layers = int(get("num_hidden_layers"))
    theta, rotary_dim = _rope(cfg, where, family, head_dim, d["theta"])
    eos = cfg.get("eos_token_id", d["eos_token_id"])  # an explicit null means none
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else
                                     ([] if eos is None else [eos])))
    bos = cfg.get("bos_token_id", d["bos_token_id"])
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
    common = dict(
        family=family, vocab_size=int(get("vocab_size")), hidden=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rms_eps=float(get("rms_norm_eps")), rope_theta=theta, rotary_dim=rotary_dim,
        rope_style="neox", tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
        max_position_embeddings=int(get("max_position_embeddings")),
        torch_dtype=_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
        quant=_quant(cfg.get("quantization_config"), quant_file, where),
        num_experts=int(next((cfg[k] for k in ("num_experts", "num_local_experts",
                                               "n_routed_experts") if cfg.get(k) is not None),
                             d["num_experts"])),
        top_k=int(get("num_experts_per_tok")))
    moe = {"qwen3_moe": _qwen3, "glm4_moe": _glm4, "mixtral": _mixtral}[family](cfg, where, get,
                                                                               common)
    spec = ModelSpec(**common, **moe)
    if spec.num_experts and not 1 <= spec.top_k <= spec.num_experts:
        _unsupported(where, "num_experts_per_tok", spec.top_k,
                     f"must lie in [1, num_experts={spec.num_experts}]")
    return spec


def _qwen3(cfg, where, get, common) -> dict:
    if cfg.get("use_sliding_window"):
        _unsupported(where, "use_sliding_window", cfg["use_sliding_window"],
                     "sliding-window attention is not implemented; set it to false")
    if cfg.get("attention_bias"):
        _unsupported(where, "attention_bias", cfg["attention_bias"], "Qwen3-MoE would then also "
                     "add an o_proj bias, which this library does not implement")
    step = cfg.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    if step < 1:
        _unsupported(where, "decoder_sparse_step", step, "must be >= 1")
    dense_only = set(cfg.get("mlp_only_layers") or [])
    e = common["num_experts"]
    moe_layers = tuple(i not in dense_only and e > 0 and (i + 1) % step == 0
                       for i in range(common["num_layers"]))
    return dict(attention_bias=False, qk_norm=True,
                moe_intermediate=int(get("moe_intermediate_size")), routing="softmax",
                renormalize=bool(get("norm_topk_prob")), n_group=1, topk_group=1,
                routed_scaling_factor=1.0, num_shared_experts=0, shared_intermediate=0,
                dense_intermediate=int(get("intermediate_size")) if not all(moe_layers) else 0,
                moe_layers=moe_layers)


def _glm4(cfg, where, get, common) -> dict:
    e, k = common["num_experts"], common["top_k"]
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if e % n_group or e // n_group < 2:
        _unsupported(where, "n_group", n_group, f"n_routed_experts={e} must split into groups "
                     "of at least 2 experts (each group is scored by its top-2 sum)")
    if not 1 <= topk_group <= n_group or k > topk_group * (e // n_group):
        _unsupported(where, "topk_group", topk_group, f"need 1 <= topk_group <= n_group={n_group} "
                     f"and num_experts_per_tok={k} <= topk_group * {e // n_group}")
    first_dense = int(cfg.get("first_k_dense_replace", 1))
    shared = int(cfg.get("n_shared_experts", 1) or 0)
    moe_i = int(get("moe_intermediate_size"))
    moe_layers = tuple(i >= first_dense for i in range(common["num_layers"]))
    return dict(attention_bias=bool(cfg.get("attention_bias", False)),
                qk_norm=bool(cfg.get("use_qk_norm", False)), moe_intermediate=moe_i,
                routing="sigmoid_grouped", renormalize=bool(get("norm_topk_prob")),
                n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                num_shared_experts=shared, shared_intermediate=shared * moe_i,
                dense_intermediate=int(get("intermediate_size")) if first_dense > 0 else 0,
                moe_layers=moe_layers)


def _mixtral(cfg, where, get, common) -> dict:
    window = cfg.get("sliding_window")
    if window is not None and int(window) < common["max_position_embeddings"]:
        _unsupported(where, "sliding_window", window, "sliding-window attention is not "
                     "implemented; set it to null")
    return dict(attention_bias=False, qk_norm=False, moe_intermediate=int(get("intermediate_size")),
                routing="softmax", renormalize=True, n_group=1, topk_group=1,
                routed_scaling_factor=1.0, num_shared_experts=0, shared_intermediate=0,
                dense_intermediate=0, moe_layers=(True,) * common["num_layers"])


def _rope(cfg, where, family, head_dim, default_theta) -> tuple[float, int]:
    """(theta, rotary_dim) following transformers' `convert_rope_params_to_dict`:
    `rope_scaling` wins over `rope_parameters`; a key inside the dict wins over the
    top-level key, which wins over the class default."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = dict(cfg.get(key) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        _unsupported(where, key, params, "only plain rotary (rope_type 'default') is implemented")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if family == "glm4_moe":
        factor = 0.5 if factor is None else float(factor)
        rotary_dim = int(head_dim * factor)
    else:
        if factor is not None and float(factor) != 1.0:
            _unsupported(where, "partial_rotary_factor", factor, f"transformers' {family} "
                         "rotates the whole head and ignores it; remove it or set 1.0")
        rotary_dim = head_dim
    if rotary_dim < 2 or rotary_dim % 2:
        _unsupported(where, "partial_rotary_factor", factor, f"gives rotary_dim={rotary_dim} "
                     f"of head_dim={head_dim}; need an even number >= 2")
    return theta, rotary_dim


def _quant(qcfg, quant_file, where) -> str | None:
    """None, "nvfp4" for ModelOpt NVFP4 (config.json `quantization_config` or
    hf_quant_config.json `quantization`), or "fp8_block" for FP8 block-scaled
    checkpoints (`quant_method: "fp8"`, `weight_block_size: [128, 128]`,
    `fp8_io.fp8_quant_config`); anything else is unsupported."""
    sources = []
    if qcfg:
        sources.append(("quantization_config", qcfg))
    if quant_file:
        sources.append(("hf_quant_config.json quantization", quant_file.get("quantization") or {}))
    found = None
    for key, q in sources:
        method = str(q.get("quant_method", "modelopt")).lower()
        if method == "fp8":
            found = fp8_quant_config(q, where, key)
            continue
        algo = str(q.get("quant_algo", "")).upper()
        if method != "modelopt" or algo != "NVFP4":
            _unsupported(where, key, {"quant_method": method, "quant_algo": algo},
                         "only ModelOpt NVFP4 checkpoints (quant_algo NVFP4) are supported; "
                         "use the bf16 checkpoint")
        if int(q.get("group_size", 16)) != 16:
            _unsupported(where, f"{key}.group_size", q["group_size"], "NVFP4 blocks are 16")
        found = "nvfp4"
    return found


def _read(src) -> tuple[dict, str, dict | None]:
    if isinstance(src, dict):
        return src, "config", None
    path = Path(src)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise UnsupportedModelError(f"{path} does not exist; pass a Hugging Face checkpoint directory "
                                    "(config.json, *.safetensors, tokenizer files)")
    if not cfg_path.is_file():
        raise UnsupportedModelError(f"no config.json in {path}: it is not a Hugging Face checkpoint "
                                    "directory (config.json, *.safetensors, tokenizer files)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{cfg_path}: not readable JSON ({exc})") from exc
    qpath = cfg_path.parent / "hf_quant_config.json"
    quant = json.loads(qpath.read_text()) if qpath.is_file() else None
    return cfg, str(cfg_path), quant


def _unsupported(where, key, value, why):
    raise UnsupportedModelError(f"{where}: {key}={value!r} is not supported: {why}")
