"""Pure-torch fp32 reference of top-k routing.

Legend: T tokens, E experts, K top-k, G groups.
"""

from __future__ import annotations

import torch

from sparkinfer.moe.spec import MoESpec


def route_reference(logits: torch.Tensor, spec: MoESpec, top_k: int, *,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, K] int32, weights [T, K] fp32), descending by selection score.

    A token with a NaN logit gets NaN in every weight (softmax does so by
    itself; sigmoid would leave the other experts' weights finite). Allocates;
    no host sync.
    """
    x = logits.float()
    t, e = x.shape
    if spec.routing == "softmax":
        p = torch.softmax(x, dim=-1)
        sel = p
    else:
        p = torch.sigmoid(x)
        sel = p + (bias.float() if bias is not None else 0.0)
        if spec.n_group > 1:
            grouped = sel.view(t, spec.n_group, e // spec.n_group)
            top = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
            keep_g = torch.zeros_like(top, dtype=torch.bool)
            keep_g.scatter_(1, top.topk(spec.topk_group, dim=-1).indices, True)
            keep = keep_g.repeat_interleave(e // spec.n_group, dim=1)
            sel = sel.masked_fill(~keep, float("-inf"))
    ids = sel.topk(top_k, dim=-1).indices
    w = p.gather(1, ids)
    if spec.renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = torch.where(x.isnan().any(-1, keepdim=True), float("nan"), w)  # [T, K]
    return ids.to(torch.int32), w * spec.routed_scaling_factor
