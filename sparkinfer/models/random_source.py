"""`RandomSource`: a preset's checkpoint whose tensors are drawn at random when read.

    src = RandomSource(preset_config("qwen3-30b-a3b"), device="cuda")   # 48 layers, nothing drawn yet
    weights = load_weights(src, load_spec(cfg), Sharding(0, 1), device="cuda")

The benchmark's full-depth models: no transformers model beside ours (that held a
second copy of every weight) and no file. The names and shapes are transformers
5.24's in-memory layout of the config (`checkpoint_layout`, from the `ModelSpec`
the loader reads), so the loader, its slicing, the expert stacking and the NVFP4 /
FP8 conversion are the code that reads a real checkpoint. Each read draws its whole
tensor on `device` from a generator seeded by (seed, name), keeps the slice asked
for and drops the rest: peak memory is what was loaded plus one tensor, and every
rank of a tensor-parallel model sees the same tensor whatever slice it reads.

Values follow `bench/decode_model.hf_model` (transformers' init, then matrices
re-drawn): matrices (linears [out, in], fused experts [E, out, in], lm_head)
N(0, 1/fan_in); routers N(0, 4/H), so router logits have std ~2 and tokens spread
over the experts (transformers' zero router would send every token to the same
ones); embeddings N(0, initializer_range^2); RMSNorm weights 1; biases and GLM's
score-correction bias 0. The same seed on the same kind of device gives the same
bits (CPU and CUDA generators draw different numbers from one seed).

Legend: L layers, H hidden, E routed experts, I expert intermediate, V vocabulary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from sparkinfer.errors import CheckpointError
from sparkinfer.models.checkpoint import Checkpoint
from sparkinfer.models.config import ModelSpec, load_spec

__all__ = ["RandomTensor", "RandomSource", "checkpoint_layout"]

# Elements drawn per randn call: 2^26 fp32 values are 256 MiB of scratch, against the
# 805 MB bf16 `gate_up_proj` [128, 1536, 2048] of one Qwen3-30B-A3B layer, which an
# fp32 draw of the whole would have doubled (1.6 GB) on top of the tensor itself.
DRAW_CHUNK = 1 << 26


@dataclass(frozen=True)
class RandomTensor:
    """One checkpoint tensor: shape, stored dtype, and its values: N(0, std^2) when
    std > 0, else every element equal to `fill`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    std: float = 0.0
    fill: float = 0.0

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def checkpoint_layout(cfg: dict) -> dict[str, RandomTensor]:
    """Every tensor of the config dict `cfg` in transformers 5.24's in-memory layout
    (what `model.state_dict()` holds), with its stored dtype and distribution (see the
    module docstring). Pure: reads the config only; UnsupportedModelError as `load_spec`."""
    spec = load_spec(cfg)
    h, bf = spec.hidden, torch.bfloat16
    # GLM's router and its bias stay fp32 in transformers (_keep_in_fp32_modules_strict)
    router_dtype = torch.float32 if spec.routing == "sigmoid_grouped" else bf

    def mat(*shape, dtype=bf):
        return RandomTensor(tuple(shape), dtype, std=shape[-1] ** -0.5)

    def ones(n):
        return RandomTensor((n,), bf, fill=1.0)

    out = {"model.embed_tokens.weight": RandomTensor((spec.vocab_size, h), bf,
                                                     std=float(cfg.get("initializer_range", 0.02)))}
    for i in range(spec.num_layers):
        out.update(_layer(spec, f"model.layers.{i}", i, mat, ones, router_dtype))
    out["model.norm.weight"] = ones(h)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = mat(spec.vocab_size, h)
    return out


def _layer(spec: ModelSpec, base: str, i: int, mat, ones, router_dtype) -> dict[str, RandomTensor]:
    h, d = spec.hidden, spec.head_dim
    att = f"{base}.self_attn"
    out = {f"{base}.input_layernorm.weight": ones(h), f"{base}.post_attention_layernorm.weight": ones(h)}
    for proj, heads in (("q_proj", spec.num_heads), ("k_proj", spec.num_kv_heads), ("v_proj", spec.num_kv_heads)):
        out[f"{att}.{proj}.weight"] = mat(heads * d, h)
        if spec.attention_bias:
            out[f"{att}.{proj}.bias"] = RandomTensor((heads * d,), torch.bfloat16)
    out[f"{att}.o_proj.weight"] = mat(h, spec.num_heads * d)
    if spec.qk_norm:
        out[f"{att}.q_norm.weight"] = ones(d)
        out[f"{att}.k_norm.weight"] = ones(d)
    mlp = f"{base}.mlp"
    if not spec.moe_layers[i]:
        out.update(_dense(f"{mlp}", spec.dense_intermediate, h, mat))
        return out
    e, inter = spec.num_experts, spec.moe_intermediate
    out[f"{mlp}.gate.weight"] = RandomTensor((e, h), router_dtype, std=2.0 / h ** 0.5)
    if spec.routing == "sigmoid_grouped":
        out[f"{mlp}.gate.e_score_correction_bias"] = RandomTensor((e,), torch.float32)
    out[f"{mlp}.experts.gate_up_proj"] = mat(e, 2 * inter, h)  # [E, 2I, H]: gate rows, then up rows
    out[f"{mlp}.experts.down_proj"] = mat(e, h, inter)  # [E, H, I]
    if spec.num_shared_experts:
        out.update(_dense(f"{mlp}.shared_experts", spec.shared_intermediate, h, mat))
    return out


def _dense(prefix: str, inter: int, h: int, mat) -> dict[str, RandomTensor]:
    return {f"{prefix}.gate_proj.weight": mat(inter, h), f"{prefix}.up_proj.weight": mat(inter, h),
            f"{prefix}.down_proj.weight": mat(h, inter)}


# The output projections whose zeroing makes a layer add nothing to the residual stream
# (`zero_from`): attention's o_proj, and every MLP's down projection.
_OUTPUTS = (".self_attn.o_proj.weight", ".down_proj.weight", ".experts.down_proj")


class RandomSource(Checkpoint):
    """The tensors of config dict `cfg` (`checkpoint_layout`), drawn on `device` when read.

    seed: with a tensor's name, seeds its generator (a tensor's bits do not depend on
    which tensors were read before it). zero_from=N: the output projections of layers
    N.. read as zeros, so those layers add nothing and a self-draft of the first N
    layers agrees with the whole model (as `hf_model(agree_after=N)`).
    Host work only until `read`; reads allocate on `device`, then move to theirs.
    """

    def __init__(self, cfg: dict, *, seed: int = 0, device="cpu", zero_from: int | None = None):
        self.layout = checkpoint_layout(cfg)
        self.seed, self.device, self.zero_from = seed, torch.device(device), zero_from
        self.path = Path(f"<random {cfg['architectures'][0]}, seed {seed}>")
        self._where = str(self.path)
        self._file_of = {name: self.path for name in self.layout}
        self._handles = {}

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor at its stored dtype (what a checkpoint of it would hold)."""
        return sum(t.nbytes for t in self.layout.values())

    def shape(self, name: str) -> tuple[int, ...]:
        self.file_of(name)
        return self.layout[name].shape

    def dtype(self, name: str) -> torch.dtype:
        self.file_of(name)
        return self.layout[name].dtype

    def open_all(self) -> None:
        """Nothing to open: there are no files."""

    def read(self, name: str, *, dim: int = 0, span: tuple[int, int] | None = None,
             dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        """Draw `name` on the source's device, keep indices [span) along `dim`, cast to
        `dtype` and move to `device` (as `Checkpoint.read`). Allocates the whole tensor
        for the duration of the call; no host sync beyond a move to the host."""
        self.file_of(name)
        info = self.layout[name]
        if span is not None and (not 0 <= dim < len(info.shape) or not 0 <= span[0] <= span[1] <= info.shape[dim]):
            raise CheckpointError(f"tensor {name!r} in {self._where}: slice {span} along dim {dim} "
                                  f"is outside its shape {info.shape}")
        t = self.draw(name)
        if span is not None:
            t = t.narrow(dim, span[0], span[1] - span[0])
        return t.to(device=device, dtype=dtype or info.dtype).contiguous()

    def draw(self, name: str) -> torch.Tensor:
        """The whole tensor `name` on the source's device, stored dtype. Allocates."""
        info = self.layout[name]
        out = torch.empty(info.shape, dtype=info.dtype, device=self.device)
        if not info.std or self._zeroed(name):
            return out.fill_(0.0 if info.std else info.fill)
        gen = torch.Generator(self.device).manual_seed(_name_seed(self.seed, name))
        flat = out.view(-1)
        for start in range(0, flat.numel(), DRAW_CHUNK):
            n = min(DRAW_CHUNK, flat.numel() - start)
            draw = torch.randn(n, generator=gen, device=self.device, dtype=torch.float32)
            flat[start:start + n] = draw.mul_(info.std)
        return out

    def _zeroed(self, name: str) -> bool:
        if self.zero_from is None or not name.startswith("model.layers."):
            return False
        return int(name.split(".")[2]) >= self.zero_from and name.endswith(_OUTPUTS)

    def __repr__(self):
        return f"RandomSource({self._where!r}, {len(self.layout)} tensors, {self.nbytes / 1e9:.2f} GB)"


def _name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, name); stable across processes (unlike hash())."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
