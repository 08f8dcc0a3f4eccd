"""The reference every model check uses: transformers running the same checkpoint in fp32.

    ref = transformers_greedy(path, prompts, new_tokens=8)
    ref.tokens[i], ref.logits[i]  # greedy continuation; fp32 logits [1 + new, V] of each step

`compare` states the tolerance: logits within `atol` + `rtol` * max|ref| at every
step (teacher-forced on the reference tokens), greedy tokens identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Reference", "transformers_greedy", "compare"]

# bf16 weights and activations against an fp32 forward: measured on the tiny presets
# the worst logit error is a few bf16 ulps of the largest logit; 2% leaves room, 10x
# below the logit spread a wrong head, expert or norm produces.
RTOL = 2e-2


@dataclass
class Reference:
    """tokens[i]: greedy new tokens of prompt i; logits[i]: fp32 [1 + new, V], row 0 the
    prompt's last position, row j the logits after the j-th new token."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]


def transformers_greedy(path, prompts: list[list[int]], new_tokens: int) -> Reference:
    """Greedy decoding with transformers' own model class, fp32, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    tokens, logits = [], []
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
    return Reference(tokens, logits)


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
