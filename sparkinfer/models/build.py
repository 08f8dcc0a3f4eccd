"""From a checkpoint directory to one rank's ready `Decoder` (and its communicator's size).

    dec = build_decoder(path, Sharding(rank, world), comm=comm, device=dev, max_batch=8, max_len=2048)

Every rank calls it with its own `Sharding`; it reads only that rank's slices.
"""

from __future__ import annotations

from sparkinfer.models.checkpoint import Checkpoint
from sparkinfer.models.config import load_spec
from sparkinfer.models.decoder import Decoder, KVCache, prepare_moe
from sparkinfer.models.loader import load_weights
from sparkinfer.models.weights import Sharding

__all__ = ["build_decoder", "comm_capacity", "self_draft"]

# Prefill chunk: tokens per eager forward when a prompt is longer (sizes the MoE plan).
PREFILL_CHUNK = 256


def comm_capacity(spec, world: int, max_batch: int, max_tokens: int) -> int:
    """Staging bytes a communicator needs so no step of this model leaves the kernels:
    the gathered logits of a decode step ([B, V/W] bf16 from each rank) and the
    hidden states of a prefill chunk ([T, H] bf16). At least 8 MiB."""
    v_l = -(-spec.vocab_size // world)
    need = max(max_batch * v_l * 2 * world, max_tokens * spec.hidden * 2)
    return max(8 << 20, 1 << (need - 1).bit_length())


def build_decoder(path, sharding: Sharding, *, comm=None, device="cpu", moe_format: str = "bf16",
                  max_batch: int = 8, max_len: int = 2048, max_tokens: int | None = None,
                  progress=None, batch_invariant: bool = True) -> Decoder:
    """Load this rank's weights and build its decoder with a KV cache of max_batch + 1
    slots (one for padding) of max_len positions. max_tokens: the largest step
    (default max(PREFILL_CHUNK, max_batch)); batch_invariant: see `Decoder`.
    Allocates; not capture-legal."""
    import torch

    device = torch.device(device)
    spec = load_spec(path)
    weights = load_weights(Checkpoint(path), spec, sharding, device=device, moe_format=moe_format,
                           progress=progress)
    kv = weights.layers[0].attn.kv_heads
    cache = KVCache(spec.num_layers, max_batch + 1, max_len, kv, spec.head_dim, sharding, device)
    max_tokens = max_tokens or max(PREFILL_CHUNK, max_batch)
    moe = prepare_moe(spec, weights, moe_format=moe_format, max_tokens=max_tokens, batch_invariant=batch_invariant)
    return Decoder(spec, weights, sharding, comm=comm, cache=cache, max_tokens=max_tokens, moe_format=moe_format,
                   batch_invariant=batch_invariant, share_moe=moe)


def self_draft(target: Decoder, layers: int, *, max_batch: int, max_len: int) -> Decoder:
    """A draft model made of the target's first `layers` layers, its final norm and LM
    head: the same weights and MoE layers (nothing copied), its own KV cache of
    max_batch + 1 slots. Allocates the cache; not capture-legal."""
    from dataclasses import replace

    from sparkinfer.errors import ShapeError
    from sparkinfer.models.weights import ModelWeights

    n = len(target.w.layers)
    if not 1 <= layers < n:
        raise ShapeError(f"a self-draft takes 1 to {n - 1} of the target's {n} layers; got {layers}")
    w = target.w
    weights = ModelWeights(w.embed, w.lm_head, w.final_norm, w.layers[:layers], w.vocab_start)
    cache = KVCache(layers, max_batch + 1, max_len, w.layers[0].attn.kv_heads, target.spec.head_dim,
                    target.sh, target.device)
    return Decoder(replace(target.spec, num_layers=layers), weights, target.sh, comm=target.comm, cache=cache,
                   max_tokens=target.max_tokens, share_moe=target.moe[:layers],
                   batch_invariant=target.batch_invariant)
