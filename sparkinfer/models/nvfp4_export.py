"""`write_nvfp4_checkpoint`: a bf16 checkpoint's routed experts rewritten in the
ModelOpt NVFP4 layout, for tests of the pre-quantized loading path.

Each routed expert projection `<p>` (e.g. `model.layers.1.mlp.experts.3.up_proj`)
becomes `<p>.weight` uint8 [N, R/2], `<p>.weight_scale` float8_e4m3fn [N, R/16],
`<p>.weight_scale_2` fp32 [] and `<p>.input_scale` fp32 [] (1.0; unused), as
`quantize_nvfp4` makes them (global scale amax / (6 * 448) per matrix).
Everything else is copied unchanged. config.json gains a `quantization_config`
and an `hf_quant_config.json` is written, as ModelOpt exports do.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from sparkinfer.errors import CheckpointError
from sparkinfer.models.checkpoint import Checkpoint
from sparkinfer.models.config import load_spec
from sparkinfer.models.experts import expert_layout
from sparkinfer.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from sparkinfer.quant.reference import E2M1_MAX, E4M3_MAX

__all__ = ["write_nvfp4_checkpoint"]

_COPY = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "special_tokens_map.json")


def write_nvfp4_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *,
                           shared_gate_up_scale: bool = False, reference: str | os.PathLike | None = None) -> Path:
    """Write `src`'s checkpoint to `dst` with NVFP4 routed experts (ModelOpt layout).

    shared_gate_up_scale: give each expert's gate and up one weight_scale_2 (the
    larger amax), as ModelOpt does when it fuses them; False quantizes each
    matrix on its own amax, so the loader has to join two global scales.
    reference: also write there a plain checkpoint whose experts are the NVFP4
    values dequantized to fp32 (what transformers runs as the reference of the
    NVFP4 model; the other tensors as in `src`).
    Holds the whole checkpoint in host memory: for tiny and test checkpoints.
    Returns `dst`.
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    spec = load_spec(src)
    if spec.quant is not None:
        raise CheckpointError(f"{src} is already quantized ({spec.quant}); pass a bf16 checkpoint")
    out: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    with Checkpoint(src) as ckpt:
        for layer in range(spec.num_layers):
            if not spec.moe_layers[layer]:
                continue
            lay = expert_layout(ckpt, spec, layer)
            if lay.fused:
                raise CheckpointError(f"{lay.prefix}.experts.gate_up_proj in {src}: the fused "
                                      "expert layout has no ModelOpt counterpart; re-save it "
                                      "per expert")
            for e in range(spec.num_experts):
                names = [lay.expert(e, p) for p in (lay.gate, lay.up, lay.down)]
                mats = [ckpt.read(f"{n}.weight", dtype=torch.float32) for n in names]
                scales = [None, None, None]
                if shared_gate_up_scale:
                    amax = torch.maximum(mats[0].abs().amax(), mats[1].abs().amax())
                    scales[0] = scales[1] = amax / (E2M1_MAX * E4M3_MAX)
                for name, w, gs in zip(names, mats, scales):
                    q = quantize_nvfp4(w, gs)
                    plain[f"{name}.weight"] = dequantize_nvfp4(q)
                    out[f"{name}.weight"] = q.packed
                    out[f"{name}.weight_scale"] = q.scales
                    out[f"{name}.weight_scale_2"] = q.global_scale.reshape(()).clone()
                    out[f"{name}.input_scale"] = torch.ones((), dtype=torch.float32)
                    quantized.add(f"{name}.weight")
        for name in ckpt.names:
            if name not in quantized:
                out[name] = plain[name] = ckpt.read(name)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    exclude = ["lm_head", "model.embed_tokens", "*self_attn*", "*mlp.gate", "*shared_experts*",
               "*block_sparse_moe.gate"]
    exclude += [f"model.layers.{i}.mlp" for i in range(spec.num_layers) if not spec.moe_layers[i]]
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                  "group_size": 16, "kv_cache_quant_algo": None,
                                  "ignore": exclude}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "sparkinfer-test"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": exclude}}, indent=2))
    for f in _COPY:
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    if reference is not None:
        ref = Path(reference)
        ref.mkdir(parents=True, exist_ok=True)
        save_file(plain, str(ref / "model.safetensors"), metadata={"format": "pt"})
        for f in ("config.json", *_COPY):
            if (src / f).is_file():
                shutil.copy(src / f, ref / f)
    return dst
