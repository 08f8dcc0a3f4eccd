"""Decode tokens/s of whole models on one GPU (TP = 1), beside the baselines, in one run.

    sparkinfer bench decode [--presets qwen3-30b-a3b,glm-4.5-air,mixtral-8x7b] [--layers 8 | --full-depth]
                            [--weights transformers|random-direct] [--impls sparkinfer,torch]
                            [--batches 1,8,32,64] [--formats bf16,nvfp4] [--context 512] [--tp 2 [--dcp 2]]
                            [--overlap-batches 1,8,32] [--spec-k 3] [--invariance on|off|both] [--profile]
                            [--dry-run]
    sparkinfer bench decode --model DIR|ORG/NAME [--batches 1,8,32,64] [--formats bf16,nvfp4] [--tp 2]

`--model`: a checkpoint of one's own (a directory, or a Hugging Face id fetched as
`generate` fetches it) instead of the presets: its tensors through the loader, at its
own depth, ours and the torch ops (on --tp ranks too), rows named by the id (or the
directory) with `weights` "checkpoint"; no transformers or speculative rows.

Per preset (realistic dimensions, random weights made on the GPU by transformers'
own model class, `--layers` decoder layers): our decoder with bf16 and NVFP4
experts, (b) the same decoder code with torch ops (SDPA, `torch._grouped_mm`,
torch norms), and (a) transformers' `generate` on the same weights (`--hf-batches`).
A decode step of ours and of (b) is a CUDA graph, timed over replays at a context
of `--context` tokens. Its floor is the bytes it must read (every non-expert
weight, the distinct experts a batch hits on average under uniform routing, the
KV cache) over the copy bandwidth measured in the same run. Checked in the same
run on every timed configuration: the replayed step against eager (bitwise; the
torch baseline's `index_add_` uses atomics, so its replays are not held to it) and
finite prefill logits; the prefill error against transformers is recorded.
Each row reads a context of its own (`decode_model.prefill_rows`): rows sharing one
routed alike and read fewer experts than a served batch. The floor assumes uniform
routing: where the random routers spread tokens less evenly, a step reads less.
Presets with shared experts also time the step with the shared-expert overlap on
and off (`--overlap-batches`). `--spec-k K`: generation tokens/s at batch 1 of
plain decoding and of speculative decoding with a self-draft of the first half of
the layers, on a model whose later layers are zeroed so the draft agrees by
construction (acceptance near 1: this measures the machinery's cost and gain,
not a real draft's acceptance). `--profile`: each of our rows also lists the
kernels of one replayed step (CUDA profiler), slowest first. `--tp N`: the same step on
N ranks, ours beside the torch ops with NCCL all-reduces (`bench/decode_tp.py`).
`--invariance`: our decoder batch-invariant (on, the default), with the faster
batch-dependent choices (off), or both, each configuration built and timed once per
mode in the same run; rows carry `batch_invariant`, and `both` prints the pairs with
the invariance's cost (docs/design.md, batch invariance).

`--weights random-direct`: the weights are drawn straight on the GPU, one tensor at
a time, with the same distributions (`models/random_source.py`), and go through the
same loader; no transformers model is built, so there are no transformers rows and
no prefill error against it, and a preset fits at its real depth (`--full-depth`:
each preset's own layer count; Qwen3-30B-A3B's 48 layers are 61 GB of bf16, and
the transformers path would hold them twice). Before anything is built, each preset
and format is checked against the device's free memory (`bench/decode_memory.py`):
one that cannot fit (GLM-4.5-Air at 46 layers in bf16: 214 GB of weights) raises
CapacityError naming both numbers. Rows carry `weights` (the source) and `layers`,
and on a GPU `mem_estimate_bytes` beside the measured `peak_mem_bytes`.
`--dry-run`: a tiny preset on the CPU with small sizes; options given explicitly
keep their values.
"""

from __future__ import annotations

from pathlib import Path

from sparkinfer.bench.decode_memory import max_cache_len, preset_layers

__all__ = ["add_arguments", "main"]

# What a row's `ok` asserts: the replayed step equals the eager one bitwise (ours; the
# torch baseline's index_add_ is atomic) and the prefill logits are finite. The prefill
# error against transformers' bf16 forward is recorded, not gated: over 512 tokens x 8
# layers of random routers both sides flip near-tie routing decisions, and NVFP4
# experts add their quantization error (measured 9-63%, decode_h200.json). The exact
# checks are the tiny-checkpoint tests against transformers' fp32 forward
# (tests/models) and the MoE layer against its dequantized reference (tests/moe).


# Defaults of a GPU run and of `--dry-run` (a tiny preset on the CPU, logic only); an
# option given on the command line keeps its value in both.
_GPU_DEFAULTS = dict(presets="qwen3-30b-a3b,glm-4.5-air,mixtral-8x7b", layers=8, batches="1,8,32,64",
                     formats="bf16,nvfp4", context=512, replays=30, hf_batches="1,8", spec_k=0)
_DRY_DEFAULTS = dict(presets="qwen3_moe-tiny", layers=2, batches="1,2", formats="bf16", context=8, replays=2,
                     hf_batches="1", spec_k=2)
WEIGHTS = ("transformers", "random-direct")


def add_arguments(p) -> None:
    p.add_argument("--presets", default=None, help=f"default {_GPU_DEFAULTS['presets']}")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of every preset (default 8)")
    p.add_argument("--full-depth", action="store_true",
                   help="each preset at its own layer count (qwen3-30b-a3b 48, glm-4.5-air 46, mixtral-8x7b 32)")
    p.add_argument("--weights", choices=WEIGHTS, default="transformers",
                   help="random weights from transformers' model class (and its rows), or drawn directly on the "
                        "device through the loader (random-direct: one copy, no transformers rows)")
    p.add_argument("--impls", default="sparkinfer,torch", help="our decoder, and the torch-ops baseline with bf16")
    p.add_argument("--batches", default=None, help="default 1,8,32,64")
    p.add_argument("--formats", default=None, help="default bf16,nvfp4")
    p.add_argument("--context", type=int, default=None, help="prompt tokens before the timed steps (default 512)")
    p.add_argument("--replays", type=int, default=None, help="default 30")
    p.add_argument("--hf-batches", default=None, help="batches for transformers' generate (slow; default 1,8)")
    p.add_argument("--overlap-batches", default="1,8,32", help="shared-expert overlap on/off at these batches")
    p.add_argument("--profile", action="store_true",
                   help="record the kernels of one decode step (CUDA profiler) in each of our rows")
    p.add_argument("--spec-k", type=int, default=None, help="speculative decoding tokens/s with k draft tokens")
    p.add_argument("--tp", type=int, default=1,
                   help="ranks (one GPU each; CPU ranks with --dry-run): ours and the torch ops with NCCL, "
                        "slowest rank's time; no transformers, overlap or speculative rows")
    p.add_argument("--dcp", type=int, default=1, help="decode-context parallelism with --tp: 1 or the rank count")
    p.add_argument("--invariance", choices=("on", "off", "both"), default="on",
                   help="our decoder batch-invariant (on), batch-dependent (off), or both in paired rows")
    p.add_argument("--out", default=None, help="default benchmarks/results/decode_<machine>.json "
                                               "(decode_full_depth_<machine>.json with --full-depth)")
    p.add_argument("--model", default=None, help="a checkpoint directory or Hugging Face id (org/name): our "
                   "decoder on its own weights instead of the presets' random ones")
    p.add_argument("--dry-run", action="store_true", help="a tiny preset on the CPU (logic check only)")


def resolve(args) -> str | None:
    """Fill the options left unset from the GPU or dry-run defaults (in place); returns
    why the combination is refused, or None."""
    if args.full_depth and args.layers is not None:
        return f"--full-depth with --layers {args.layers}: give one of them"
    if args.model is not None:
        given = [f for f, v in (("--presets", args.presets), ("--layers", args.layers),
                                ("--full-depth", args.full_depth), ("--hf-batches", args.hf_batches),
                                ("--spec-k", args.spec_k)) if v]
        given += [f"--weights {args.weights}"] * (args.weights != "transformers")
        if given:
            return (f"--model with {', '.join(given)}: a checkpoint runs with its own weights and depth "
                    "(ours and the torch ops; no transformers or speculative rows)")
        from sparkinfer.models.hub import resolve_model

        args.model_ref = resolve_model(args.model)  # a Hub id: fetched once, here
        args.presets, args.weights, args.hf_batches, args.spec_k = args.model_ref.path, "checkpoint", "", 0
    explicit_hf = args.hf_batches
    for k, v in (_DRY_DEFAULTS if args.dry_run else _GPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.weights == "random-direct":
        if explicit_hf:
            return f"--hf-batches {explicit_hf} with --weights random-direct: there is no transformers model"
        args.hf_batches = ""
    impls = args.impls.split(",")
    if not impls or not set(impls) <= {"sparkinfer", "torch"}:
        return f"--impls {args.impls}: a comma-separated subset of sparkinfer,torch"
    return None


def _checkpoint_name(args) -> str | None:
    """--model's name in the rows: its Hub id, or its directory's name (None: presets)."""
    return (args.model_ref.repo_id or Path(args.model_ref.path).name) if args.model else None


def check_memory(args, free_bytes: int) -> None:
    """Refuse (CapacityError, `decode_memory.check_fits`) before anything is built when a
    preset and format of this run would not fit in `free_bytes` of one device."""
    from sparkinfer.bench.decode_memory import check_fits, memory_need, spec_config
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.weights import Sharding

    batch = max(int(b) for b in args.batches.split(","))
    for preset in args.presets.split(","):
        spec = load_spec(spec_config(preset, preset_layers(args), args.weights))
        for fmt in args.formats.split(","):
            need = memory_need(spec, fmt, source=args.weights, batch=batch, max_len=max_cache_len(args),
                               sharding=Sharding(0, args.tp, args.dcp))
            check_fits(need, free_bytes, f"{preset} at {spec.num_layers} layers with {fmt} experts and "
                                         f"--weights {args.weights}" + (f" (one of {args.tp} ranks)" if args.tp > 1
                                                                        else ""))


def _invariance_pairs(rows) -> list[list]:
    """[preset, experts, B, overlap, invariant us, batch-dependent us, cost] of each
    configuration timed both ways."""
    pairs: dict = {}
    for r in rows:
        if r.get("bench") == "decode" and "batch_invariant" in r:
            key = (r["preset"], r["experts"], r["batch"], r.get("overlap_shared"))
            pairs.setdefault(key, {})[r["batch_invariant"]] = r["us_per_step"]
    return [[p, e, b, o, f"{v[True]:.1f}", f"{v[False]:.1f}", f"{100 * (v[True] / v[False] - 1):+.1f}%"]
            for (p, e, b, o), v in sorted(pairs.items(), key=lambda kv: (*kv[0][:3], str(kv[0][3]))) if len(v) == 2]


def _rows_for(preset, args, dev, bw, say) -> list[dict]:
    import torch

    from sparkinfer.bench.decode_model import (
        build,
        build_modes,
        floor_bytes,
        hf_step_us,
        model_source,
        prefill_rows,
        step_kernels,
        step_us,
    )
    from sparkinfer.models.config import load_spec

    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    cuda = dev.type == "cuda"
    model, cfg = model_source(preset, preset_layers(args), args.weights, dev)  # --model: `preset` is its directory
    prompt = torch.randint(0, load_spec(cfg).vocab_size, (ctx,)).tolist()
    preset = _checkpoint_name(args) or preset
    ref = None
    if args.weights == "transformers":
        with torch.no_grad():
            ref = model(torch.tensor([prompt], device=dev)).logits[0, -1].float()
    rows = []
    for fmt, ops, inv in build_modes(args):
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        spec, dec, engine = build(model, cfg, fmt=fmt, ops=ops, batch=max(batches), max_len=ctx + 64,
                                  max_tokens=max(max(batches), min(ctx, 512)), batch_invariant=inv, device=dev)
        mem = _memory_fields(args, spec, fmt, dev)
        with torch.no_grad():
            logits = prefill_rows(engine, prompt, max(batches)).float()
            err = ((logits - ref).norm() / ref.norm()).item() if ref is not None else None
            agrees = int(logits.argmax()) == int(ref.argmax()) if ref is not None else None
            has_shared = any(getattr(lw.mlp, "shared", None) is not None for lw in dec.w.layers)
            for b in batches:
                modes = [True, False] if has_shared and ops == "sparkinfer" and str(b) in \
                    args.overlap_batches.split(",") and cuda else [dec.overlap_shared]
                for overlap in modes:
                    dec.overlap_shared = overlap
                    engine._steps.clear()  # recapture with this setting
                    us, same = step_us(engine, b, ctx, args.replays)
                    floor = floor_bytes(spec, dec.w, b, ctx, fmt) / bw * 1e6 if bw else None
                    rows.append(dict(bench="decode", preset=preset, layers=spec.num_layers, weights=args.weights,
                                     impl=ops, experts=fmt, batch=b, context=ctx, overlap_shared=overlap,
                                     **({"batch_invariant": inv} if ops == "sparkinfer" else {}),
                                     us_per_step=us, tokens_per_s=b / us * 1e6, floor_us=floor,
                                     frac_floor=floor / us if floor else None, prefill_rel_err_vs_hf=err,
                                     argmax_agrees_hf=agrees, replay_equals_eager=same,
                                     ok=(same or ops == "torch") and bool(torch.isfinite(logits).all())))
                    if args.profile and engine.graphs:
                        timeline = {}
                        rows[-1]["kernels"] = step_kernels(engine, b, timeline=timeline)
                        rows[-1].update(launches=timeline.get("launches"), idle_us=timeline.get("idle_us"))
                    rows[-1].update(mem, peak_mem_bytes=torch.cuda.max_memory_allocated(dev) if cuda else None)
                    say(rows[-1])
                dec.overlap_shared = cuda
        del engine, dec
        if cuda:
            torch.cuda.empty_cache()
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        us = hf_step_us(model, b, ctx, cfg["vocab_size"])
        rows.append(dict(bench="decode", preset=preset, layers=cfg["num_hidden_layers"], weights=args.weights,
                         impl="transformers", experts="bf16", batch=b, context=ctx, us_per_step=us,
                         tokens_per_s=b / us * 1e6, ok=True))
        say(rows[-1])
    return rows


def _memory_fields(args, spec, fmt, dev) -> dict:
    """The run's estimate of one device's bytes (`decode_memory`), to set beside the
    measured peak on a GPU; {} on the CPU."""
    if dev.type != "cuda":
        return {}
    from sparkinfer.bench.decode_memory import memory_need

    need = memory_need(spec, fmt, source=args.weights, batch=max(int(b) for b in args.batches.split(",")),
                       max_len=max_cache_len(args))
    return dict(mem_estimate_bytes=need.total)


def _speculative(preset, args, dev, say) -> list[dict]:
    """Plain vs speculative generation tokens/s at batch 1 (see the module docstring)."""
    import torch

    from sparkinfer.bench.decode_model import build, hf_model, random_model
    from sparkinfer.engine import Engine, SamplingParams
    from sparkinfer.engine.speculative import SpeculativeEngine
    from sparkinfer.models.build import self_draft
    from sparkinfer.models.presets import preset_config

    half = max(1, preset_config(preset, layers=preset_layers(args))["num_hidden_layers"] // 2)
    make = hf_model if args.weights == "transformers" else random_model
    model, cfg = make(preset, preset_layers(args), dev, agree_after=half)
    new = 16 if args.dry_run else 128
    spec, dec, engine = build(model, cfg, fmt="bf16", ops="sparkinfer", batch=1, max_len=args.context + new + 16,
                              max_tokens=max(args.context, 8))
    draft = Engine(self_draft(dec, half, max_batch=1, max_len=args.context + new + 16), max_batch=1,
                   channel="draft")
    prompt = [torch.randint(0, spec.vocab_size, (args.context,)).tolist()]
    params = SamplingParams(max_new_tokens=new)
    engine.generate(prompt, SamplingParams(max_new_tokens=4))  # warm-up: compiles and captures
    plain = engine.generate(prompt, params)
    spec_engine = SpeculativeEngine(engine, draft, args.spec_k)
    spec_engine.generate(prompt, SamplingParams(max_new_tokens=8))
    fast = spec_engine.generate(prompt, params)
    row = dict(bench="decode_speculative", preset=preset, layers=spec.num_layers, weights=args.weights,
               draft_layers=half, batch=1,
               k=args.spec_k, context=args.context, new_tokens=new, plain_tokens_per_s=plain.decode_tokens_per_s,
               spec_tokens_per_s=fast.decode_tokens_per_s, acceptance=fast.acceptance,
               speedup=fast.decode_tokens_per_s / plain.decode_tokens_per_s, same_tokens=fast.tokens == plain.tokens,
               draft="self-draft of the first half of the layers; later layers zeroed so it agrees by construction")
    # greedy speculative output equals plain output only where no step is a near-tie: the
    # verify forward (k + 1 queries) rounds differently from a one-query step, and random
    # weights over a 151k vocabulary have near-ties (the exact equality is tested on the
    # tiny decidable checkpoints); here the draft agrees by construction up to that rounding
    row["ok"] = row["acceptance"] >= 0.9
    say(row)
    return [row]


def main(args) -> int:
    if args.dry_run:  # CPU kernels: the interpreter, set before Triton is imported (as bench moe does)
        import os

        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from sparkinfer.bench.common import append_rows, default_out, metadata
    from sparkinfer.bench.decode_model import copy_bandwidth
    from sparkinfer.bench.report import console, print_table

    con = console()
    if args.tp < 1 or args.dcp not in (1, args.tp):
        con.print(f"[red]--tp {args.tp} --dcp {args.dcp}: --tp >= 1, and --dcp is 1 or --tp")
        return 2
    refused = resolve(args)
    if refused:
        con.print(f"[red]{refused}")
        return 2
    cuda = torch.cuda.is_available() and not args.dry_run
    if not args.dry_run and (not cuda or torch.cuda.device_count() < args.tp):
        con.print(f"[red]the decode benchmark needs {args.tp} GPU(s); --dry-run checks its logic on the CPU")
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda and args.tp == 1:  # --tp: each rank checks its own device before it builds
        check_memory(args, torch.cuda.mem_get_info(dev)[0])
    bw = copy_bandwidth() if cuda and args.tp == 1 else None  # --tp: each rank measures its own
    if bw:
        con.print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")

    def say(r):
        con.print("  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                                  if k not in ("bench", "draft", "kernels", "launches")))
        for kern in r.get("kernels", [])[:12]:
            cr = kern.get("us_credit")
            con.print(f"      {kern['us_per_step']:8.1f} us {kern['per_step']:5.1f}x  "
                      f"{'' if cr is None else f'credit {cr:7.1f} us  '}{kern['name'][:70]}")
    rows = []
    for preset in args.presets.split(","):
        con.rule(preset)
        if args.tp > 1:
            from sparkinfer.bench.decode_tp import tp_rows

            rows += tp_rows(preset, args, say, name=_checkpoint_name(args))
            continue
        rows += _rows_for(preset, args, dev, bw, say)
        if args.spec_k:
            rows += _speculative(preset, args, dev, say)
        if cuda:
            torch.cuda.empty_cache()
    steps = [r for r in rows if r["bench"] == "decode"]
    print_table(f"decode step (TP = {args.tp}, DCP = {args.dcp}), weights {args.weights}",
                ["preset", "L", "impl", "experts", "B", "overlap", "invariant", "us/step", "tok/s", "% floor", "ok"],
                [[r["preset"], r.get("layers", ""), r["impl"], r["experts"], r["batch"], r.get("overlap_shared", ""),
                  r.get("batch_invariant", ""), f"{r['us_per_step']:.1f}", f"{r['tokens_per_s']:.1f}",
                  f"{100 * r['frac_floor']:.1f}" if r.get("frac_floor") else "", r["ok"]] for r in steps])
    pairs = _invariance_pairs(steps)
    if pairs:
        print_table("batch invariance: our step, invariant vs batch-dependent (same run)",
                    ["preset", "experts", "B", "overlap", "invariant us", "batch-dependent us", "cost"], pairs)
    meta = metadata(args)
    # full-depth rows in a file of their own: the docs' decode table keys rows by preset and batch
    out = args.out or default_out("decode_full_depth" if args.full_depth else "decode", meta, args.tp,
                                  dry_run=args.dry_run)
    path = append_rows(out, [dict(r, copy_bandwidth_Bps=r.get("copy_bandwidth_Bps", bw)) for r in rows], meta)
    con.print(f"rows -> {path}")
    return 0 if all(r["ok"] for r in rows) else 1
