"""`sparkinfer demo`: a small random MoE checkpoint, run on N ranks, checked against transformers.

    sparkinfer demo [--preset qwen3_moe-tiny] [--world-size 2] [--dcp] [--moe-format bf16]
                    [--backend auto|cpu|cuda|cuda_shared] [--new-tokens 8]

1. writes a checkpoint of the preset with random weights in the Hugging Face
   layout (transformers' own classes, `save_pretrained`);
2. loads it back through our loader on N ranks (GPUs where there are enough,
   every rank on one GPU where there is one, else CPU ranks through the Triton
   interpreter), greedy-decodes two prompts;
3. checks every rank's tokens and logits are the same bits, and against
   transformers' fp32 forward on the same files (tokens identical, logits within
   the stated tolerance); prints tokens/s. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

__all__ = ["add_parser"]


# Prompts and per-preset seeds on which transformers' greedy path and routing have no
# near-ties (see sparkinfer.models.hf_reference.decidable_checkpoint).
PROMPTS = [[5, 17, 3, 99], [7, 1, 250, 13, 64, 2]]
SEEDS = {"qwen3_moe-tiny": 16, "glm4_moe-tiny": 6, "mixtral-tiny": 18}


def _demo_rank(world, req):
    """Plain greedy generation (with every step's logits) and the same with a self-draft
    of the first layer: (plain result, speculative result)."""
    from sparkinfer.engine.session import ModelSession

    session = ModelSession(world, req)
    try:
        plain = session.engine.generate(req.prompts, req.params, keep_logits=True)
        return plain, session.speculative.generate(req.prompts, req.params)
    finally:
        session.close()


def demo(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from sparkinfer.engine import SamplingParams
    from sparkinfer.engine.session import GenerateRequest
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.hf_reference import RTOL, compare, transformers_greedy
    from sparkinfer.models.nvfp4_export import write_nvfp4_checkpoint
    from sparkinfer.models.presets import TINY_PRESETS, make_checkpoint
    from sparkinfer.runtime.ranks import check_world_size, resolve_backend, run_ranks

    con = Console()
    if args.preset not in TINY_PRESETS:
        con.print(f"[red]unknown preset {args.preset!r}; choose one of {sorted(TINY_PRESETS)}")
        return 2
    backend = resolve_backend(args.backend, check_world_size(args.world_size))  # SetupError: one line (cli.main)
    with tempfile.TemporaryDirectory(prefix="sparkinfer_demo_") as tmp:
        with con.status(f"writing a random {args.preset} checkpoint (transformers save_pretrained)"):
            seed = SEEDS[args.preset] if args.seed is None else args.seed
            path = ref_path = make_checkpoint(args.preset, Path(tmp) / args.preset, seed=seed)
            if args.moe_format == "nvfp4":  # a ModelOpt NVFP4 checkpoint, and its experts dequantized
                ref_path = Path(tmp) / "reference"
                path = write_nvfp4_checkpoint(path, Path(tmp) / "nvfp4", shared_gate_up_scale=True,
                                              reference=ref_path)
        spec = load_spec(path)
        prompts = PROMPTS
        with con.status("transformers fp32 reference"):
            ref = transformers_greedy(ref_path, prompts, args.new_tokens)
        req = GenerateRequest(str(path), prompts, SamplingParams(max_new_tokens=args.new_tokens),
                              moe_format=args.moe_format, dcp=args.world_size if args.dcp else 1,
                              keep_logits=True, max_len=64, self_draft=1, spec_k=3)
        where = {"cuda": "one GPU per rank", "cuda_shared": "every rank on cuda:0",
                 "cpu": "CPU ranks, Triton interpreter"}[backend]
        t0 = time.perf_counter()
        with con.status(f"loading and generating on {args.world_size} rank(s), {where}"):
            both = run_ranks(_demo_rank, args.world_size, backend=backend, args=(req,), timeout_s=1800)
            results, spec_results = [b[0] for b in both], [b[1] for b in both]
        wall = time.perf_counter() - t0
    bad = compare(ref, results[0].tokens, results[0].logits)
    for r, res in enumerate(results[1:], 1):
        if res.tokens != results[0].tokens or not all(torch.equal(a, b) for a, b in zip(res.logits, results[0].logits)):
            bad.append(f"rank {r}'s tokens or logits differ from rank 0's")
    table = Table(title=f"{args.preset}: {spec.num_layers} layers, {spec.num_experts} experts, top-{spec.top_k}, "
                        f"TP={args.world_size}{', DCP' if args.dcp else ''}, experts {args.moe_format}")
    for col in ("prompt", "sparkinfer", "transformers (fp32)", "max |logit err|"):
        table.add_column(col)
    for i, p in enumerate(prompts):
        err = (results[0].logits[i].float() - ref.logits[i][:results[0].logits[i].shape[0]]).abs().max().item()
        table.add_row(str(p), str(results[0].tokens[i]), str(ref.tokens[i]), f"{err:.3g}")
    con.print(table)
    res = results[0]
    con.print(f"decode: {res.decode_tokens} tokens in {res.decode_steps} steps, {res.decode_tokens_per_s:.1f} tokens/s "
              f"on {where} (prefill {res.prefill_s:.2f} s; wall {wall:.1f} s with loading)")
    sp = spec_results[0]
    con.print(f"speculative (self-draft: the first layer, k = 3): {sp.decode_tokens_per_s:.1f} tokens/s, "
              f"draft acceptance {sp.acceptance:.2f} over {sp.rounds} rounds")
    if any(s_.tokens != res.tokens for s_ in spec_results):
        bad.append("speculative greedy tokens differ from plain greedy tokens")
    if bad:
        for b in bad:
            con.print(f"[red]MISMATCH: {b}")
        return 1
    con.print(f"[green]OK: {len(results)} rank(s) bitwise equal; tokens identical to transformers; logits within "
              f"{RTOL} x max|logit|")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run a small random MoE checkpoint on N ranks and check it against transformers")
    p.add_argument("--preset", default="qwen3_moe-tiny")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dcp", action="store_true", help="decode-context parallel: the KV cache split over the ranks")
    p.add_argument("--moe-format", default="bf16", choices=("bf16", "nvfp4"))
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "cuda_shared"))
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="weights seed (default: the preset's decidable one)")
    p.set_defaults(run=demo)
