"""`sparkinfer generate`: text from a Hugging Face MoE checkpoint on N ranks.

    sparkinfer generate --model DIR [--tp N] [--dcp N] [--moe-format bf16|nvfp4]
                        [--max-new-tokens 64] [--temperature 0] [--top-p 1]
                        [--draft DIR | --self-draft N] [--spec-k 3] --prompt "..."

The tokenizer comes from the checkpoint directory; rank 0 streams the text as
it is generated and the command ends with decode tokens/s. Generation stops at the
checkpoint's end-of-sequence tokens (and any --stop-id). With --draft (a checkpoint
sharing the tokenizer) or --self-draft N (the target's first N layers), decoding
is speculative with --spec-k draft tokens per round, and the acceptance is printed.
"""

from __future__ import annotations

import time

__all__ = ["add_parser"]


def generate(args) -> int:
    from rich.console import Console

    from sparkinfer.engine import SamplingParams
    from sparkinfer.engine.session import GenerateRequest, generate_on_rank
    from sparkinfer.errors import SparkInferError
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.tokenizer import load_tokenizer
    from sparkinfer.runtime.ranks import resolve_backend, run_ranks

    con = Console(stderr=True)
    if not 1 <= args.tp <= 16 or args.dcp not in (1, args.tp):
        con.print(f"[red]--tp {args.tp} --dcp {args.dcp}: tp must be 1..16 and dcp 1 or tp")
        return 2
    try:
        backend = resolve_backend(args.backend, args.tp)
        spec = load_spec(args.model)
        tok = load_tokenizer(args.model)
        ids = tok.encode(args.prompt)
        stops = tuple(args.stop_id or ()) + tuple(spec.eos_token_ids)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                max_new_tokens=args.max_new_tokens, stop_ids=stops)
    except SparkInferError as e:
        con.print(f"[red]{type(e).__name__}: {e}")
        return 2
    req = GenerateRequest(args.model, [ids], params, moe_format=args.moe_format, dcp=args.dcp,
                          max_len=len(ids) + args.max_new_tokens + 1, stream=True, draft=args.draft,
                          self_draft=args.self_draft, spec_k=args.spec_k)
    con.print(f"[dim]{len(ids)} prompt tokens; TP={args.tp} DCP={args.dcp} on {backend}; experts {args.moe_format}")
    print(args.prompt, end="", flush=True)
    t0 = time.perf_counter()
    res = run_ranks(generate_on_rank, args.tp, backend=backend, args=(req,), timeout_s=args.timeout)[0]
    print()
    spec_note = f", draft acceptance {res.acceptance:.2f}" if hasattr(res, "acceptance") else ""
    con.print(f"[bold]{res.decode_tokens} tokens, decode {res.decode_tokens_per_s:.1f} tokens/s[/] "
              f"(prefill {res.prefill_s:.2f} s; {time.perf_counter() - t0:.1f} s with loading{spec_note})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a Hugging Face MoE checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--dcp", type=int, default=1, help="1, or --tp to split the KV cache over the ranks")
    p.add_argument("--moe-format", default="bf16", choices=("bf16", "nvfp4"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-id", type=int, action="append", help="token id that ends generation (repeatable)")
    p.add_argument("--draft", default=None, help="draft checkpoint directory (same tokenizer) for speculative decoding")
    p.add_argument("--self-draft", type=int, default=0, help="speculative decoding with the target's first N layers")
    p.add_argument("--spec-k", type=int, default=3, help="draft tokens per speculative round")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "cuda_shared"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped")
    p.set_defaults(run=generate)
