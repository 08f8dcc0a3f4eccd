"""`sparkinfer serve`: a checkpoint on N ranks behind an OpenAI-compatible HTTP API.

    sparkinfer serve --model DIR|ORG/NAME [--tp 2] [--dcp 2] [--moe-format bf16|nvfp4|fp8_block]
                     [--draft DIR | --self-draft L --spec-k K] [--max-batch B] [--max-context T]
                     [--max-waiting N] [--host H] [--port P] [--backend auto|cpu|cuda|cuda_shared]
                     [--timeout S] [--served-model-name NAME] [--grace S]
                     [--api-key KEY] [--allowed-origins ORIGIN ...]
    sparkinfer serve --demo [--preset qwen3_moe-tiny] [--tp 2]    # a tiny random checkpoint, no GPU needed

Then point any OpenAI client at it:

    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "qwen3_moe-tiny", "prompt": "hello", "max_tokens": 8}'

The engine starts first (every rank loads and captures), then uvicorn serves in
this process's main thread. SIGINT/SIGTERM: stop admitting, let in-flight requests
finish for `--grace` seconds, abort the rest, close the ranks, exit 0. A rank that
dies: in-flight requests end with errors and the command exits non-zero naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

__all__ = ["add_parser", "engine_config", "serve_engine"]

# argparse dest -> EngineConfig field, for flags that map one to one (None: the engine's default)
_ENGINE_FIELDS = {"tp": "tp", "dcp": "dcp", "moe_format": "moe_format", "draft": "draft",
                  "self_draft": "self_draft", "spec_k": "spec_k", "max_batch": "max_batch",
                  "max_context": "max_context", "max_waiting": "max_waiting", "backend": "backend",
                  "timeout": "timeout_s", "served_model_name": "name", "batch_invariant": "batch_invariant",
                  "prefill_chunk": "prefill_chunk", "step_tokens": "step_tokens",
                  "prefill_wait_steps": "prefill_wait_steps", "mixed_steps": "mixed_steps",
                  "prefix_reuse": "prefix_reuse"}


def engine_config(args, model: str):
    """The EngineConfig of the parsed flags; unset flags keep EngineConfig's defaults."""
    from sparkinfer.engine.config import EngineConfig

    given = {field: getattr(args, dest) for dest, field in _ENGINE_FIELDS.items() if getattr(args, dest) is not None}
    return EngineConfig(model=model, **given)


def serve_engine(engine, options) -> int:
    """Serve `engine` until a signal stops the server (0) or the engine fails
    (EngineFailed: the command prints it and exits 2); close the engine either way."""
    from sparkinfer.serve.server import OpenAIServer

    try:
        OpenAIServer(engine, options).run(announce=lambda line: print(line, flush=True))
    finally:
        engine.close()
    return 0


def _options(args):
    from sparkinfer.envs import serve_api_key
    from sparkinfer.serve.server import ServeOptions
    from sparkinfer.serve.state import ServerLimits

    return ServeOptions(host=args.host, port=args.port, limits=ServerLimits(grace_s=args.grace),
                        log_level=args.log_level, access_log=args.log_level in ("debug", "info"),
                        api_key=args.api_key or serve_api_key(),
                        allowed_origins=tuple(args.allowed_origins or ()))


def run(args) -> int:
    from sparkinfer.models.hub import resolve_model

    with contextlib.ExitStack() as stack:
        model = args.model
        if args.demo:
            from sparkinfer.cli.demo import SEEDS
            from sparkinfer.models.presets import TINY_PRESETS, make_checkpoint

            if args.preset not in TINY_PRESETS:
                print(f"sparkinfer serve: unknown preset {args.preset!r}; choose one of {sorted(TINY_PRESETS)}",
                      file=sys.stderr)
                return 2
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sparkinfer_serve_demo_")))
            model = str(make_checkpoint(args.preset, tmp / args.preset, seed=SEEDS.get(args.preset, 0)))
            print(f"wrote a tiny random {args.preset} checkpoint (transformers save_pretrained) to {model}")
        else:  # a Hub id: fetched once, here, and served under its name
            ref = resolve_model(model)
            if ref.repo_id is not None:
                print(f"--model {ref.repo_id}: {ref.path}", flush=True)
                if args.served_model_name is None:
                    args.served_model_name = ref.repo_id
            model = ref.path
        if args.draft is not None:
            args.draft = resolve_model(args.draft, what="--draft").path
        config = engine_config(args, model)
        from sparkinfer.engine.serving import ServingEngine
        print(f"starting the engine: {config.tp} rank(s), backend {config.backend}, {config.model}", flush=True)
        engine = ServingEngine.launch(config)  # EngineFailed / SetupError: one line (cli.main)
        return serve_engine(engine, _options(args))


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
                       description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="checkpoint directory (config.json, *.safetensors, tokenizer files), or a "
                      "Hugging Face model id (org/name[@revision]), fetched into the Hub's cache and served by "
                      "that name")
    what.add_argument("--demo", action="store_true", help="write a tiny random checkpoint and serve it")
    p.add_argument("--preset", default="qwen3_moe-tiny", help="--demo's tiny preset")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default 1)")
    p.add_argument("--dcp", type=int, default=None, help="1, or --tp to split the KV cache over the ranks")
    p.add_argument("--moe-format", default=None, choices=("bf16", "nvfp4", "fp8_block"))
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft", default=None, help="draft checkpoint directory or Hub id (same tokenizer)")
    draft.add_argument("--self-draft", type=int, default=None, metavar="L", help="the first L layers as the draft")
    p.add_argument("--spec-k", type=int, default=None, metavar="K", help="draft tokens per speculative round")
    p.add_argument("--max-batch", type=int, default=None, help="requests decoding at once (cache slots)")
    p.add_argument("--max-context", type=int, default=None, help="cache positions per request (prompt + new tokens)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests queued for a slot before new ones get 429")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens per prefill row (default 256)")
    p.add_argument("--step-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens prefilled per engine step, in one forward of N / chunk rows (default 2048)")
    p.add_argument("--prefill-wait-steps", type=int, default=None, metavar="W",
                   help="while requests decode, prefill waits up to W steps for a fuller forward (default 0: never)")
    p.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="run new prompt chunks beside the next step's decode rows in one forward "
                        "(default: on where the ranks can: a GPU, no draft, DCP 1; docs/serving.md)")
    p.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=None,
                   help="a request starts after the whole prompt chunks its cache slot's last request left, where "
                        "its prompt begins with them (a chat's next turn; default on, off with a draft model)")
    p.add_argument("--backend", default=None, choices=("auto", "cpu", "cuda", "cuda_shared"))
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds a rank may stall before the engine fails and names it (default 60; 300 on CPU ranks)")
    p.add_argument("--batch-dependent", dest="batch_invariant", action="store_false", default=None,
                   help="let a request's logits depend on its neighbours for speed: cuBLAS projections "
                        "(default: batch-invariant, docs/performance.md says what it costs)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the directory's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the URL is printed)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="/v1/ requests must send 'Authorization: Bearer KEY' (default: $SPARKINFER_API_KEY, "
                        "which `ps` does not show; neither set: no key asked)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed to call the server, e.g. http://localhost:3000, or '*' (CORS; "
                        "default none)")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests may finish before they are aborted")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(run=run)
