"""The reference every model check uses: transformers running the same checkpoint in fp32.

    ref = transformers_greedy(path, prompts, new_tokens=8)
    ref.tokens[i], ref.logits[i]  # greedy continuation; fp32 logits [1 + new, V] of each step

`compare` states the tolerance: logits within RTOL * max|ref| at every step,
greedy tokens identical. Identical greedy tokens are only a fair demand where
the reference's choice is not a near-tie that bf16 rounding may flip (with
random tiny models, transformers' own bf16 forward differs from its fp32 one
by 0.6-34% of the largest logit on the presets' prompts, through router
near-ties): `decidable_checkpoint` picks the first seed whose reference greedy
path has a top-1 / top-2 gap of at least MIN_MARGIN x its largest logit at
every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Reference", "transformers_greedy", "compare"]

# bf16 activations against an fp32 forward on the tiny presets: our worst step was
# 2.4% of the largest logit (GLM, 0.168 of 6.94), while a wrong rotary, head map,
# norm or expert moves logits by tens of percent.
RTOL = 3e-2
# A greedy step is decidable when its top-1 / top-2 gap is at least this fraction of
# its largest logit: twice the worst step error we measured (1.4%, 0.119 of 8.36);
# a smaller gap is a near-tie that bf16 rounding may legitimately flip.
MIN_MARGIN = 0.03


@dataclass
class Reference:
    """tokens[i]: greedy new tokens of prompt i; logits[i]: fp32 [new, V], row j the
    logits that chose token j."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    router_margin: float = float("inf")

    @property
    def margin(self) -> float:
        """The smallest top-1 / top-2 logit gap of any step, over that step's largest |logit|."""
        return min(((lg.topk(2, dim=-1)[0].diff(dim=-1).abs()[:, 0] / lg.abs().amax(dim=-1)).min().item()
                    for lg in self.logits), default=0.0)


# A routing decision is decidable when the last chosen and first unchosen expert's
# scores differ by at least this much, in router-logit units (the presets' router
# logits have std 1-2; bf16 activations move them by about 1%: twice that).
MIN_ROUTER_MARGIN = 0.02


def transformers_greedy(path, prompts: list[list[int]], new_tokens: int) -> Reference:
    """Greedy decoding with transformers' own model class, fp32, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    tokens, logits = [], []
    margins = []
    for name, mod in model.named_modules():
        if name.endswith((".mlp.gate", ".block_sparse_moe.gate")) and hasattr(mod, "top_k"):
            mod.register_forward_hook(lambda m, inp, out: margins.append(_router_margin(m, inp[0])))
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = []
            for _ in range(new_tokens):
                step = model(ids).logits[0, -1].float()
                out.append(step)
                ids = torch.cat([ids, step.argmax().view(1, 1)], dim=1)
            tokens.append(ids[0, len(p):].tolist())
            logits.append(torch.stack(out))
    return Reference(tokens, logits, min(margins, default=float("inf")))


def _router_margin(gate, x) -> float:
    """The smallest gap, over tokens, between the last chosen and the first unchosen
    routing score, in router-logit units (softmax: the logits; grouped sigmoid: the
    group scores and the biased sigmoid scores, divided by the sigmoid's largest
    slope 1/4, so an error of e in the logits moves them by at most e)."""
    logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), gate.weight.float())
    k = gate.top_k
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None:
        top = logits.topk(k + 1, dim=-1)[0]
        return (top[:, k - 1] - top[:, k]).min().item()
    choice = logits.sigmoid() + bias.float()
    t, e = choice.shape
    groups = choice.view(t, gate.num_group, e // gate.num_group).topk(2, dim=-1)[0].sum(-1)
    gaps = []
    if gate.topk_group < gate.num_group:
        gtop = groups.topk(gate.topk_group + 1, dim=-1)[0]
        gaps.append((gtop[:, -2] - gtop[:, -1]).min().item())
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(gate.topk_group, dim=-1)[1], 1.0)
    masked = choice.masked_fill(~keep.repeat_interleave(e // gate.num_group, dim=1).bool(), float("-inf"))
    top = masked.topk(k + 1, dim=-1)[0]
    gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return 4 * min(gaps)


def decidable_checkpoint(preset: str, root, prompts: list[list[int]], new_tokens: int, *, seeds: int = 64,
                         **kwargs):
    """(path, reference) of the first seed's checkpoint of `preset` (written under root/seed-N)
    whose reference greedy path has margin >= MIN_MARGIN. kwargs go to make_checkpoint."""
    from pathlib import Path

    from sparkinfer.models.presets import make_checkpoint

    for seed in range(seeds):
        path = make_checkpoint(preset, Path(root) / f"seed-{seed}", seed=seed, **kwargs)
        ref = transformers_greedy(path, prompts, new_tokens)
        if ref.margin >= MIN_MARGIN and ref.router_margin >= MIN_ROUTER_MARGIN:
            return path, ref
    raise RuntimeError(f"no seed below {seeds} gives {preset} a greedy path with margin >= {MIN_MARGIN}")


def compare(ref: Reference, tokens: list[list[int]], logits: list[torch.Tensor], rtol: float = RTOL) -> list[str]:
    """Problems found (empty when ours matches): greedy tokens must be identical and
    every step's logits within rtol * max|ref logits| of the reference."""
    bad = []
    for i, (rt, rl) in enumerate(zip(ref.tokens, ref.logits)):
        n = min(len(rt), len(tokens[i]), rl.shape[0], logits[i].shape[0])
        if tokens[i][:len(rt)] != rt:
            bad.append(f"prompt {i}: tokens {tokens[i]} differ from transformers' {rt}")
        err = (logits[i][:n].float() - rl[:n]).abs().max().item()
        scale = rl[:n].abs().max().item()
        if not err <= rtol * scale:
            bad.append(f"prompt {i}: max logit error {err:.4g} exceeds {rtol} x max|logit| {scale:.4g}")
    return bad
