"""fp32 reference of the decode-context-parallel merge (pure torch).

Symbols: W ranks (KV shards), T tokens, H heads, D head dim.
"""

import torch


def merge_partials(o_parts, lse_parts, lse_base: str = "e"):
    """Merge partial attention over W shards by log-sum-exp.

    o_parts: [W, T, H, D] (any float dtype; rows of empty shards may be NaN).
    lse_parts: [W, T, H], natural log (lse_base "e") or log2 ("2"); -inf = empty shard.
    Returns (o [T, H, D] fp32, lse [T, H] fp32). An empty shard's o is ignored;
    every other shard's o is multiplied by its weight even where that underflows
    to 0, so a NaN or inf in it reaches the row (0 * NaN = NaN, as in attention
    over the whole sequence). A row whose every shard is empty gives o = 0,
    lse = -inf; a +inf lse on any shard gives o = NaN, lse = +inf (softmax with
    a +inf score is NaN, its logsumexp +inf); a NaN lse on any shard makes the
    row's o and lse NaN (a NaN is never dropped as an empty shard). Allocates;
    used by the NCCL fallback too.
    """
    lse = lse_parts.float()
    nan = lse.isnan().any(dim=0)  # [T, H]
    pinf = (lse == float("inf")).any(dim=0)  # [T, H]
    b_max = lse.amax(dim=0)  # [T, H]
    # finite: a +inf max made every weight inf - inf = NaN and the row zeros (it is overwritten below)
    b_ref = torch.where(b_max.isfinite(), b_max, torch.zeros_like(b_max))
    w = torch.exp2(lse - b_ref) if lse_base == "2" else torch.exp(lse - b_ref)  # [W, T, H]
    wx = w.unsqueeze(-1)
    live = (lse != float("-inf")).unsqueeze(-1)  # not `w > 0`: that dropped a NaN o whose weight underflowed
    contrib = torch.where(live, o_parts.float() * wx, torch.zeros((), dtype=torch.float32, device=wx.device))
    den = w.sum(dim=0)
    full = den > 0
    safe = torch.where(full, den, torch.ones_like(den))
    o = contrib.sum(dim=0) / safe.unsqueeze(-1)
    log = torch.log2 if lse_base == "2" else torch.log
    lse_out = torch.where(full, b_max + log(safe), torch.full_like(den, float("-inf")))
    o = torch.where((nan | pinf).unsqueeze(-1), float("nan"), o)
    lse_out = torch.where(pinf, float("inf"), lse_out)
    return o, torch.where(nan, float("nan"), lse_out)


def dcp_merge_reference(o_list: list, lse_list: list, lse_base: str = "e"):
    """Every rank's o [T, H, D] and lse [T, H], in rank order -> merged (o in o's dtype, lse fp32), on the CPU."""
    o, lse = merge_partials(torch.stack([o.cpu() for o in o_list]), torch.stack([x.cpu() for x in lse_list]), lse_base)
    return o.to(o_list[0].dtype), lse
