"""`sparkinfer generate`: text from a Hugging Face MoE checkpoint on N ranks.

    sparkinfer generate --model DIR|ORG/NAME [--tp N] [--dcp N] [--moe-format bf16|nvfp4]
                        [--max-new-tokens 64] [--temperature 0] [--top-p 1]
                        [--draft DIR | --self-draft N] [--spec-k 3] --prompt "..."

--model (and --draft) is a checkpoint directory or a Hugging Face model id, fetched
here once (`models.hub`). Before any rank starts, the launch is checked on this process: the config
against the world size, DCP, expert format and the prompt's length
(`models.validate.validate_launch`), and every checkpoint file's header; what
cannot run is refused in one line. The tokenizer comes from the checkpoint
directory; rank 0 prints the prompt and streams the text from the first new
token on, and the command ends with what it counted and decode tokens/s.
Generation stops at the checkpoint's end-of-sequence tokens (and any
--stop-id). With --draft (a checkpoint sharing the tokenizer) or --self-draft
N (the target's first N layers), decoding is speculative with --spec-k draft
tokens per round, and the acceptance is printed.
"""

from __future__ import annotations

import time

__all__ = ["add_parser"]


def generate(args) -> int:
    from rich.console import Console

    from sparkinfer import envs
    from sparkinfer.engine import SamplingParams
    from sparkinfer.engine.session import GenerateRequest
    from sparkinfer.models.checkpoint import Checkpoint
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.hub import resolve_model
    from sparkinfer.models.tokenizer import load_tokenizer
    from sparkinfer.models.validate import validate_launch
    from sparkinfer.runtime.ranks import resolve_backend, run_ranks

    con = Console(stderr=True)
    for dest, flag in (("model", "--model"), ("draft", "--draft")):  # a Hub id: fetched once, here
        if getattr(args, dest) is not None:
            ref = resolve_model(getattr(args, dest), what=flag)
            if ref.repo_id is not None:
                con.print(f"[dim]{flag} {ref.repo_id}: {ref.path}", soft_wrap=True)
            setattr(args, dest, ref.path)
    spec = load_spec(args.model)
    ids = load_tokenizer(args.model).encode(args.prompt)
    launch = dict(tp=args.tp, dcp=args.dcp, moe_format=args.moe_format)
    validate_launch(spec, **launch, prompt_tokens=len(ids), max_new_tokens=args.max_new_tokens,
                    self_draft=args.self_draft)
    if args.draft is not None:
        validate_launch(load_spec(args.draft), **launch)
    for path in (args.model, args.draft):
        if path is not None:
            Checkpoint(path).open_all()  # a truncated shard: one line now, not in every rank
    backend = resolve_backend(args.backend, args.tp)
    stops = tuple(args.stop_id or ()) + tuple(spec.eos_token_ids)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop_ids=stops)
    req = GenerateRequest(args.model, [ids], params, moe_format=args.moe_format, dcp=args.dcp,
                          max_len=len(ids) + args.max_new_tokens + 1, draft=args.draft,
                          self_draft=args.self_draft, spec_k=args.spec_k)
    con.print(f"[dim]{len(ids)} prompt tokens; TP={args.tp} DCP={args.dcp} on {backend}; experts {args.moe_format}")
    env = envs.cpu_rank_env(backend)
    t0 = time.perf_counter()
    res = run_ranks(_generate_on_rank, args.tp, backend=backend, args=(req, args.prompt),
                    timeout_s=args.timeout, env=env)[0]
    print()
    spec_note = f", draft acceptance {res.acceptance:.2f}" if hasattr(res, "acceptance") else ""
    con.print(f"[bold]{len(res.tokens[0])} new tokens[/] (the first from the prefill, {res.prefill_s:.2f} s; "
              f"{res.decode_tokens} by decode steps at {res.decode_tokens_per_s:.1f} tokens/s); "
              f"{time.perf_counter() - t0:.1f} s with loading{spec_note}")
    return 0


def _generate_on_rank(world, req, prompt: str):
    """`engine.session.generate_on_rank` with rank 0 printing the prompt when the first
    new token arrives (so a run that fails while loading prints nothing), then the text."""
    from sparkinfer.engine.session import ModelSession

    session = ModelSession(world, req)
    try:
        on_token = _printer(req.path, prompt) if world.rank == 0 else None
        if session.speculative is not None:
            return session.speculative.generate(req.prompts, req.params, on_token=on_token)
        return session.engine.generate(req.prompts, req.params, on_token=on_token)
    finally:
        session.close()


def _printer(path: str, prompt: str):
    """on_token(seq, token) that prints the prompt, then sequence 0's text as it grows."""
    from sparkinfer.models.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    shown = {"ids": [], "text": ""}

    def on_token(seq: int, token: int) -> None:
        if seq != 0:
            return
        if not shown["ids"]:
            print(prompt, end="", flush=True)
        shown["ids"].append(token)
        text = tok.decode(shown["ids"])
        print(text[len(shown["text"]):], end="", flush=True)
        shown["text"] = text
    return on_token


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a Hugging Face MoE checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer), "
                   "or a Hugging Face model id (org/name[@revision]), fetched into the Hub's cache")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--dcp", type=int, default=1, help="1, or --tp to split the KV cache over the ranks")
    p.add_argument("--moe-format", default="bf16", choices=("bf16", "nvfp4"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-id", type=int, action="append", help="token id that ends generation (repeatable)")
    p.add_argument("--draft", default=None, help="draft checkpoint directory or Hub id (same tokenizer) for "
                   "speculative decoding")
    p.add_argument("--self-draft", type=int, default=0, help="speculative decoding with the target's first N layers")
    p.add_argument("--spec-k", type=int, default=3, help="draft tokens per speculative round")
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda", "cuda_shared"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped")
    p.set_defaults(run=generate)
