"""Online serving through the OpenAI API: latency and throughput under load, beside
the static decode step of `bench decode`.

    sparkinfer bench serve --preset qwen3-30b-a3b --layers 8 [--tp 1] [--moe-format bf16]
                           [--concurrency 1,8,32,64 | --rate 4,16 [--max-concurrency C]]
                           [--input-len 512] [--output-len 128] [--num-requests N] [--decode-results PATH]
    sparkinfer bench serve --model DIR ...              # `sparkinfer serve --model DIR` started here
    sparkinfer bench serve --url http://host:8000 ...   # any OpenAI-compatible server already running
                                                        # ($OPENAI_API_KEY: the key it asks for)
    sparkinfer bench serve --dry-run                    # `sparkinfer serve --demo` on a CPU rank, tiny sizes
    sparkinfer bench serve ... --turns 4 [--no-prefix-reuse]   # chats: each turn's prompt extends the last

With --preset (a realistic preset, random weights written to --checkpoint-dir by
`models.random_checkpoint`, as `bench decode` draws them) or --model, the benchmark
starts `sparkinfer serve` in a subprocess with room for the largest level (max batch,
context, queue), waits for /health, and stops it with SIGTERM afterwards. Each level
(a concurrency, or a Poisson rate) first sends `--warmup` requests that are not
measured (graphs are captured on first use), then `--num-requests` streaming
completions (`bench/serve_load.py`): TTFT, TPOT, ITL and E2E (mean, p50, p90, p99),
request and token throughput. A row's `ok`: every request completed with exactly
`--output-len` tokens. At a fixed concurrency C the row also carries `bench decode`'s
static tokens/s at batch C for the same preset, layers, experts and context (the
newest such row in --decode-results), and the ratios of the whole level's output
tokens/s and of its steady window's (`serve_load.steady`: every stream busy, the
start's burst of prompts and the drain left out) to it: what scheduling, prefill and
HTTP cost against back-to-back decode steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path

__all__ = ["add_arguments", "main"]

# A level's default request count: enough for p99 to mean something at low
# concurrency (64 requests), and WAVES waves at high concurrency. With four, the
# start (C prompts at once) and the drain (the last C requests) were a quarter of
# the C = 64 run: 690 engine steps for 512 of steady decode (serve_h200.json at f79710c).
MIN_REQUESTS = 64
WAVES = 8
# The served context is rounded up to the engine's prefill chunk (EngineConfig.prefill_chunk, 256).
CONTEXT_ROUND = 256


def add_arguments(p) -> None:
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", help="an OpenAI-compatible server already running (http://host:port)")
    target.add_argument("--model", help="a checkpoint directory or Hub id: `sparkinfer serve --model` is started")
    target.add_argument("--preset", help="a realistic preset with random weights (e.g. qwen3-30b-a3b)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of --preset")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where --preset's checkpoint is written (reused if it holds the same preset and layers); "
                        "default: a temporary directory, removed afterwards")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--moe-format", default="bf16", choices=("bf16", "nvfp4", "fp8_block"))
    p.add_argument("--backend", default=None, choices=("auto", "cpu", "cuda", "cuda_shared"))
    p.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="start the server with --mixed-steps / --no-mixed-steps (default: the server's default)")
    p.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=None,
                   help="start the server with --prefix-reuse / --no-prefix-reuse (default: the server's default)")
    p.add_argument("--turns", type=int, default=1,
                   help="requests a conversation: each turn's prompt is the last one's and --input-len new tokens "
                        "(a chat; a server that keeps prefixes finds them)")
    p.add_argument("--prefill-wait-steps", type=int, default=None, metavar="W",
                   help="start the server with --prefill-wait-steps W (default: the server's default)")
    p.add_argument("--concurrency", default="1,8,32,64", help="fixed-concurrency levels")
    p.add_argument("--rate", default=None, help="Poisson arrival rates (requests/s) instead of --concurrency")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --rate: requests in flight at most")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"per level (default: max({MIN_REQUESTS}, {WAVES} x concurrency))")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured requests before each level "
                                                            "(default: the level's concurrency, at least 2)")
    p.add_argument("--vocab", type=int, default=None,
                   help="prompt token ids are drawn from [0, vocab) (default: --preset's vocabulary, else 256, "
                        "which every checkpoint's vocabulary holds)")
    p.add_argument("--client-procs", type=int, default=None,
                   help="load-generator processes (default: one per 8 streams, at most half the cores)")
    p.add_argument("--decode-results", default=None,
                   help="bench decode's rows to compare with (default benchmarks/results/decode_<machine>.json)")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds for the server to load and answer")
    p.add_argument("--out", default=None, help="default benchmarks/results/serve_<machine>.json")
    p.add_argument("--dry-run", action="store_true", help="`sparkinfer serve --demo` on a CPU rank, tiny sizes")


def _levels(args) -> list[tuple[int | None, float | None]]:
    """(concurrency, rate) of each level."""
    if args.rate:
        return [(args.max_concurrency, float(r)) for r in args.rate.split(",")]
    return [(int(c), None) for c in args.concurrency.split(",")]


def _max_batch(args, levels) -> int:
    return max((c or args.max_concurrency or 64) for c, _ in levels)


def _server_command(args, levels, model: str | None) -> list[str]:
    batch = _max_batch(args, levels)
    requests = args.num_requests or max(MIN_REQUESTS, WAVES * batch)
    context = -(-(args.turns * args.input_len + args.output_len) // CONTEXT_ROUND) * CONTEXT_ROUND
    cmd = [sys.executable, "-m", "sparkinfer.cli", "serve", *(["--demo"] if model is None else ["--model", model]),
           "--tp", str(args.tp), "--moe-format", args.moe_format, "--max-batch", str(batch),
           "--max-context", str(context), "--max-waiting", str(requests), "--port", "0", "--log-level", "warning"]
    cmd += ["--served-model-name", args.preset] if args.preset else []
    return cmd + (["--backend", args.backend] if args.backend else []) + (
        [] if args.mixed_steps is None else ["--mixed-steps" if args.mixed_steps else "--no-mixed-steps"]) + (
        [] if args.prefill_wait_steps is None else ["--prefill-wait-steps", str(args.prefill_wait_steps)]) + (
        [] if args.prefix_reuse is None else ["--prefix-reuse" if args.prefix_reuse else "--no-prefix-reuse"])


def _api_key(args) -> str | None:
    """The key a server given by --url asks for: $OPENAI_API_KEY, as OpenAI's clients read it
    (no flag: a key on the command line would be recorded in the rows' `command`)."""
    from sparkinfer.envs import client_api_key

    return client_api_key() if args.url else None


def _server_setting(args, name: str):
    """A setting of the server this level ran against (`EngineConfig.<name>`): the flag,
    else the default for a server started here; None for one at --url."""
    from sparkinfer.engine.config import EngineConfig

    if args.url:
        return None
    flag = getattr(args, name)
    return getattr(EngineConfig, name) if flag is None else flag


def _policy_steps(args, levels, conc: int, requests: int, mixed: bool) -> int:
    """`serve_policy.policy_steps` for a level of the server started here (its max batch
    from `_server_command`, the engine's defaults otherwise; announced chunks where the
    level ran mixed steps)."""
    from sparkinfer.bench.serve_policy import policy_steps
    from sparkinfer.engine.config import EngineConfig
    from sparkinfer.engine.engine import MIXED_ROWS

    chunk = EngineConfig.prefill_chunk
    return policy_steps(conc, requests, args.input_len, args.output_len,
                        slots=_max_batch(args, levels), chunk=chunk,
                        step_tokens=EngineConfig.step_tokens, announce=MIXED_ROWS * chunk if mixed else 0,
                        prefill_wait_steps=_server_setting(args, "prefill_wait_steps"))


# The server's TTFT histograms (serve_load.TTFT_PARTS) and their rows' names: <name>_ms_mean over
# the level, steady_<name>_ms_mean over the steady window's first tokens
_TTFT_ROWS = (("pickup", "pickup"), ("queue", "queue"), ("prefill", "prefill"), ("return", "return"),
              ("ttft", "server_ttft"))


def _whole_steady(row: dict, part: str) -> str:
    """A TTFT part's mean ms over the level, and over the steady window's first tokens in brackets."""
    from sparkinfer.bench.report import fmt

    steady = row.get(f"steady_{part}_ms_mean")
    return fmt(row.get(f"{part}_ms_mean"), 2) + ("" if steady is None else f" ({fmt(steady, 2)})")


def _static_rows(args, meta) -> dict[int, dict]:
    """bench decode's newest row per batch for this preset, layers, experts, TP and context, of the
    batch-invariant decoder (the one `sparkinfer serve` runs)."""
    from sparkinfer.bench.common import default_out, load_rows

    path = args.decode_results or default_out("decode", meta, args.tp, dry_run=False)
    best: dict[int, dict] = {}
    for r in load_rows(path):
        if (r.get("bench"), r.get("impl"), r.get("preset"), r.get("layers"), r.get("experts"), r.get("context"),
                r.get("tp", 1)) == ("decode", "sparkinfer", args.preset, args.layers, args.moe_format,
                                    args.input_len, args.tp) and r.get("ok", True) \
                and r.get("batch_invariant", True):  # the server's decoder is the invariant one
            best[r["batch"]] = r  # the file is in run order: the last one wins
    return best


def _run_levels(args, url: str, model: str, levels, static, con) -> list[dict]:
    from sparkinfer.bench.report import progress
    from sparkinfer.bench.serve_load import (
        LoadSpec,
        StepSampler,
        client_procs,
        run_load,
        run_load_procs,
        steady_window,
        summarize,
    )

    rows = []
    key = _api_key(args)
    for conc, rate in levels:
        n = args.num_requests or max(MIN_REQUESTS, WAVES * (conc or 16))
        n = -(-n // args.turns) * args.turns  # whole conversations
        spec = LoadSpec(url=url, model=model, input_len=args.input_len, output_len=args.output_len, requests=n,
                        concurrency=conc, rate=rate, vocab=args.vocab, api_key=key, turns=args.turns)
        warm = args.warmup if args.warmup is not None else max(2, conc or 2)
        if warm:
            asyncio.run(run_load(LoadSpec(url=url, model=model, input_len=args.input_len,
                                          output_len=min(args.output_len, 16), requests=warm,
                                          concurrency=conc or warm, vocab=args.vocab, seed=1, api_key=key)))
        label = f"C={conc}" if rate is None else f"rate={rate:g}/s"
        procs = client_procs(conc, asked=args.client_procs)
        with StepSampler(url) as sampler, progress(total=n, label=label) as advance:
            results, wall = run_load_procs(spec, procs, on_done=lambda r: advance("ok" if r.ok else "failed"))
        steps0, steps1 = sampler.first, sampler.last  # the server's counters before and after the level
        row = dict(bench="serve", target=args.url or args.model or args.preset or "demo", preset=args.preset,
                   layers=args.layers if args.preset else None, tp=args.tp, experts=args.moe_format,
                   mixed_steps=_server_setting(args, "mixed_steps"),
                   prefill_wait_steps=_server_setting(args, "prefill_wait_steps"),
                   prefix_reuse=_server_setting(args, "prefix_reuse"),
                   model=model, client_procs=procs, **summarize(results, wall, spec))
        if steps0 is not None and steps1 is not None and steps1["steps"] > steps0["steps"]:  # the server's side
            n_steps = steps1["steps"] - steps0["steps"]
            row.update(engine_steps=n_steps, ms_per_engine_step=wall * 1e3 / n_steps,
                       mixed_engine_steps=steps1["mixed_steps"] - steps0["mixed_steps"])
            # the steady window's steps: steady tok/s = tokens a step / ms a step, the two
            # apart (slots filled, against what a step costs beside prompt chunks)
            window = steady_window(results, spec)
            got = sampler.within(*window) if window is not None else None
            if got is not None and got[0] > 0:
                span = window[1] - window[0]
                row.update(steady_engine_steps=got[0], steady_ms_per_engine_step=span * 1e3 / got[0],
                           steady_tokens_per_engine_step=row["steady_output_tokens_per_s"] * span / got[0],
                           steady_mixed_step_frac=got[1] / got[0])
                for k, name in _TTFT_ROWS:  # the parts of first tokens that came in the window (no start burst)
                    part = sampler.within(*window, keys=(f"{k}_sum", f"{k}_count"))
                    if part is not None and part[1] >= 1:
                        row[f"steady_{name}_ms_mean"] = part[0] / part[1] * 1e3
            # CPU seconds a wall second of the HTTP and engine processes (near 1.0: a saturated core)
            for key, name in (("server_cpu_s", "server_cpu_frac"), ("engine_cpu_s", "engine_cpu_frac")):
                if steps0[key] is not None and steps1[key] is not None:
                    row[name] = (steps1[key] - steps0[key]) / wall
            if rate is None and not args.url and args.turns == 1:  # what the scheduler's policy alone needs
                row["policy_engine_steps"] = _policy_steps(args, levels, conc, n, row["mixed_engine_steps"] > 0)
            # TTFT's parts, mean ms a request: the way into the engine process (pipe, the step in
            # progress), queued in the engine (slot, budget), the prompt's steps, the first token's way
            # back to its handler; and the handler's TTFT (its submit to the first token in hand), so the
            # client's TTFT less it is the transport's and the HTTP stack's share
            for k, name in _TTFT_ROWS:
                count = (steps1[f"{k}_count"] or 0) - (steps0[f"{k}_count"] or 0)
                if count > 0:
                    row[f"{name}_ms_mean"] = (steps1[f"{k}_sum"] - steps0[f"{k}_sum"]) / count * 1e3
        if rate is None and conc in static:
            s = static[conc]
            tok_s = s.get("tokens_per_s") or conc / s["us_per_step"] * 1e6
            steady = row["steady_output_tokens_per_s"]
            row.update(static_tokens_per_s=tok_s, static_commit=s.get("commit"),
                       serve_vs_static=row["output_tokens_per_s"] / tok_s,
                       steady_vs_static=None if steady is None else steady / tok_s)
        rows.append(row)
        for e in row["errors"]:
            con.print(f"[red]  {label}: {e}")
    return rows


def main(args) -> int:
    from sparkinfer.bench.common import append_rows, default_out, metadata
    from sparkinfer.bench.report import console, fmt, print_table
    from sparkinfer.bench.serve_load import served_model

    con = console()
    if args.dry_run:
        args.url = args.model = args.preset = None
        args.backend, args.tp, args.concurrency, args.rate = "cpu", 1, "1,2", None
        args.input_len, args.output_len, args.num_requests, args.warmup = 8, 4, 4, 1
    if args.vocab is None:
        from sparkinfer.models.presets import preset_config

        args.vocab = preset_config(args.preset)["vocab_size"] if args.preset else 256
    levels = _levels(args)
    meta = metadata(args)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            model_dir = args.model
            if args.preset:
                from sparkinfer.models.random_checkpoint import write_random_checkpoint

                where = args.checkpoint_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="serve_ckpt_"))
                with con.status(f"writing a random {args.preset} checkpoint of {args.layers} layers to {where}"):
                    model_dir = str(write_random_checkpoint(args.preset, Path(where), layers=args.layers))
            cmd = _server_command(args, levels, model_dir)
            con.print("starting: " + " ".join(cmd[1:]))
            from sparkinfer.bench.serve_process import started_server

            url = stack.enter_context(started_server(cmd, args.startup_timeout, con.print)).url
        model = served_model(url, api_key=_api_key(args))
        rows = _run_levels(args, url, model, levels, _static_rows(args, meta) if args.preset else {}, con)
    turns = f", {args.turns}-turn chats (prompt tokens found cached: " + ", ".join(
        f"{r['cached_prompt_frac']:.0%}" for r in rows) + ")" if args.turns > 1 else ""
    print_table(f"serving {model}: {args.input_len}-token prompts, {args.output_len}-token outputs{turns} (ms)",
                ["level", "done", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
                 "ITL p90", "ITL p99", "static tok/s", "serve/static", "steady/static", "CPU http / engine", "ok"],
                [[f"C={r['concurrency']}" if r["rate"] is None else f"{r['rate']:g}/s", r["completed"],
                  fmt(r["request_throughput"]), fmt(r["output_tokens_per_s"], 1), fmt(r["ttft_ms_p50"], 1),
                  fmt(r["ttft_ms_p99"], 1), fmt(r["tpot_ms_p50"], 2), fmt(r["tpot_ms_p99"], 2),
                  fmt(r["itl_ms_p50"], 2), fmt(r["itl_ms_p90"], 2), fmt(r["itl_ms_p99"], 2),
                  fmt(r.get("static_tokens_per_s"), 0), fmt(r.get("serve_vs_static")),
                  fmt(r.get("steady_vs_static")),
                  f"{fmt(r.get('server_cpu_frac'))} / {fmt(r.get('engine_cpu_frac'))}", r["ok"]] for r in rows])
    parts = [name for _, name in _TTFT_ROWS]
    if any(r.get("server_ttft_ms_mean") is not None for r in rows):  # a server that exports the histograms
        print_table("mean TTFT and its parts (ms): the server's (its submit to the first token in hand) = into the "
                    "engine process + queued + prefill + back to the handler; the client's adds the HTTP stacks; "
                    "in brackets the steady window's first tokens (the start's burst left out)",
                    ["level", "client", *parts],
                    [[f"C={r['concurrency']}" if r["rate"] is None else f"{r['rate']:g}/s", fmt(r["ttft_ms_mean"], 2),
                      *(_whole_steady(r, p) for p in parts)] for r in rows])
    if any(r.get("steady_engine_steps") for r in rows):  # a server that exports its step count
        print_table("the steady window's engine steps: steady tok/s = tokens a step / ms a step",
                    ["level", "steady s", "steps", "tokens / step", "ms / step", "mixed"],
                    [[f"C={r['concurrency']}", fmt(r["steady_s"], 2), fmt(r["steady_engine_steps"], 0),
                      fmt(r["steady_tokens_per_engine_step"], 1), fmt(r["steady_ms_per_engine_step"], 2),
                      fmt(r["steady_mixed_step_frac"])] for r in rows if r.get("steady_engine_steps")])
    out = args.out or default_out("serve", meta, args.tp, dry_run=args.dry_run)
    con.print(f"rows -> {append_rows(out, rows, meta)}")
    return 0 if all(r["ok"] for r in rows) else 1
