"""A checkpoint directory of a realistic preset with random weights, for serving
benchmarks without downloading a model.

    path = write_random_checkpoint("qwen3-30b-a3b", "ckpt/", layers=8)   # ~11 GB of bf16, no tokenizer
    sparkinfer serve --model ckpt/ ...

Tensor names, shapes and dtypes come from transformers' own model class built on
the meta device (no memory): its in-memory layout, with each layer's experts fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), which
the loader reads (`models/experts.py`). No model is held in memory: each tensor is
drawn with torch (on the GPU when there is one), moved to the host and written to
safetensors shards of about `shard_bytes`, with the usual index. Values are drawn as
`bench decode` draws them (`bench/decode_model.hf_model`): matrices N(0, 1/fan_in),
routers N(0, 4/H) so routing spreads, embeddings N(0, initializer_range^2)
(transformers' init), norm weights 1, biases 0. A `sparkinfer_random.json` beside
the weights names preset, layers and seed; a directory that already holds the same
is reused as it is (writing 11 GB takes a while).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from sparkinfer.models.presets import _CLASSES, preset_config

__all__ = ["write_random_checkpoint", "MARKER"]

MARKER = "sparkinfer_random.json"
# safetensors shards of about 2 GiB, as published checkpoints cut them (Qwen3-30B-A3B's
# 16 files are 3.7-4.0 GB): a shard is assembled in host memory before it is written.
SHARD_BYTES = 2 << 30


def write_random_checkpoint(preset: str, path: str | os.PathLike, *, layers: int | None = None, seed: int = 0,
                            device: str | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write preset `preset` (tiny or realistic, `layers` decoder layers) with random
    weights into `path` (config.json, model-*.safetensors, model.safetensors.index.json);
    returns the directory. device: where values are drawn ("cuda" when available).
    Raises UnsupportedModelError for an unknown preset."""
    import transformers
    from safetensors.torch import save_file

    cfg = preset_config(preset, layers=layers)
    out = Path(path)
    marker = {"preset": preset, "layers": cfg["num_hidden_layers"], "seed": seed}
    if _holds(out, marker):
        return out
    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[cfg["architectures"][0]])
    config = cfg_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    config.architectures = list(cfg["architectures"])
    with torch.device("meta"):
        shapes = model_cls._from_config(config, dtype=torch.bfloat16).state_dict()
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(dev).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(shapes):
        t = _draw(name, shapes[name], config, gen, dev).cpu()
        if size and size + t.numel() * t.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    if dev.type == "cuda":  # the caller (bench serve) keeps running beside the server that loads these
        torch.cuda.empty_cache()
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(out)
    (out / MARKER).write_text(json.dumps(marker))
    return out


def _holds(path: Path, marker: dict) -> bool:
    try:
        return json.loads((path / MARKER).read_text()) == marker and (path / "model.safetensors.index.json").exists()
    except (OSError, ValueError):
        return False


def _draw(name: str, like: torch.Tensor, config, gen: torch.Generator, dev) -> torch.Tensor:
    """One tensor's random values (see the module docstring), in `like`'s shape and dtype."""
    shape, dtype = like.shape, like.dtype
    if like.dim() == 1:
        fill = 1.0 if name.endswith("norm.weight") else 0.0
        return torch.full(shape, fill, dtype=dtype, device=dev)
    if name.endswith("embed_tokens.weight"):
        std = config.initializer_range
    elif name.endswith("gate.weight"):  # the router: logits of std ~2, so tokens spread over experts
        std = 2.0 / config.hidden_size ** 0.5
    else:  # linears [out, in] and fused experts [E, out, in]
        std = 1.0 / shape[-1] ** 0.5
    return (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * std).to(dtype)
