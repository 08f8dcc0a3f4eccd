"""Token sampling: greedy, or temperature + top-p, on logits that every rank holds
bitwise alike (so every rank samples the same token from the same seed).

Legend: N rows, V vocabulary.
"""

from __future__ import annotations

import torch

from sparkinfer.engine.request import SamplingParams

__all__ = ["SamplingParams", "sample", "probabilities"]


def _filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / temperature) with the tokens outside top-p zeroed (not renormalized)."""
    p = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sp, idx = p.sort(dim=-1, descending=True)
        drop = (sp.cumsum(dim=-1) - sp) >= params.top_p  # mass before this token already reaches top_p
        p = p.scatter(-1, idx, sp.masked_fill(drop, 0.0))
    return p


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 [N, V]: the distribution `sample` draws from (temperature > 0)."""
    p = _filtered(logits, params)
    return p / p.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids int64 [N] from logits [N, V]. Greedy takes the first maximum.
    Sampling draws u ~ U(0, 1) per token and takes argmax p / -log(u) (an exact
    draw from p, the exponential race), after top-p filtering. No host sync;
    capture-legal (the draw comes from `generator`, or the default one, which
    CUDA graphs advance per replay)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    p = _filtered(logits, params)
    u = torch.rand(p.shape, device=p.device, generator=generator).clamp_(min=1e-20)
    return (p / -torch.log(u)).argmax(dim=-1)
