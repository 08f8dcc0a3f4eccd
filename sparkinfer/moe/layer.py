"""`MoELayer`: the plan, prepared weights and scratch of one MoE layer, behind one call.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate per rank.

    layer = MoELayer(caps, spec, (w1, w2), device="cuda")  # plans, prepares, allocates
    out = layer(x, logits)                                 # eager: allocates out
    layer(x, logits, out=out)                              # graph-safe with a fixed out

For CUDA graphs, bind once and capture `run(binding)` (see `bind`), or call the
layer with the same x / logits / out tensors inside the capture.
"""

from __future__ import annotations

import torch

from sparkinfer.errors import ShapeError
from sparkinfer.moe.binding import allocate_scratch, bind
from sparkinfer.moe.plan import MoEPlan, plan
from sparkinfer.moe.runner import RouteSum, run
from sparkinfer.moe.spec import MoECaps, MoESpec
from sparkinfer.moe.weights import prepare_weights

__all__ = ["MoELayer"]


class MoELayer:
    """One MoE layer on one rank.

    caps, spec: see `MoECaps`, `MoESpec`. weights: (w1, w2), FC1 [E, N1, H] and
    FC2 [E, H, I] (dense tensors for "bf16", `NVFP4Tensor` for "nvfp4"; full or
    this rank's shard of I, see `prepare_weights`). bias: fp32 [E] routing correction bias
    ("sigmoid_grouped"). share_scratch: a layer whose calls never overlap this one's
    (an earlier layer of the same model): its scratch buffers are reused where they
    fit (`allocate_scratch`). Construction plans, prepares the weights and allocates
    scratch on `device`: not capture-legal.
    """

    def __init__(self, caps: MoECaps, spec: MoESpec, weights: tuple, *, device="cuda",
                 bias: torch.Tensor | None = None, share_scratch: MoELayer | None = None):
        if not isinstance(weights, (tuple, list)) or len(weights) != 2:
            got = f"{len(weights)} tensors" if isinstance(weights, (tuple, list)) else type(weights).__name__
            raise ShapeError(f"MoELayer weights must be (w1, w2): FC1 [E, N1, H] and FC2 [E, H, I]; got {got} "
                             "(gate and up go together in w1, in spec.gate_up_order)")
        self.plan: MoEPlan = plan(caps, spec)
        w1, w2 = (w.to(device) if isinstance(w, torch.Tensor) else w for w in weights)
        self.weights = prepare_weights(self.plan, w1, w2)
        self.scratch = allocate_scratch(self.plan, device,
                                        share=share_scratch.scratch if share_scratch is not None else None)
        self.bias = bias

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, *,
                 out: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor | RouteSum:
        """x: bf16 [T, H]; logits: [T, E] router logits; out: optional [T, H].

        Returns out; reduce False: a `RouteSum` (out's dtype) for the residual add +
        RMSNorm after the layer to sum, out untouched. Allocates only when out is None
        (refused during capture); no host sync; capture-legal with out given.
        """
        b = bind(self.plan, self.scratch, self.weights, x=x, out=out, logits=logits,
                 bias=self.bias)
        if not reduce:
            return run(b, reduce=False)
        run(b)
        return b.out

    def forward_topk(self, x: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor], *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Like __call__ with routing already done: topk = (ids int32 [T, K], weights fp32 [T, K])."""
        b = bind(self.plan, self.scratch, self.weights, x=x, out=out, topk_ids=topk[0],
                 topk_weights=topk[1])
        run(b)
        return b.out
