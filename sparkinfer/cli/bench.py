"""`sparkinfer bench <name> [options]`: run a benchmark of `sparkinfer.bench`.

    sparkinfer bench comm --quick          # collectives on 2 GPUs
    sparkinfer bench fused --dry-run       # fused norm and dcp_merge, 2 CPU ranks
    sparkinfer bench moe --shapes qwen3    # the MoE layer on one GPU
    sparkinfer bench attention --sweep     # decode attention and its split sweep on one GPU
    sparkinfer bench decode ...            # generation, tokens/s
    sparkinfer bench prefill ...           # prefill forwards of several prompt chunks (1 GPU)
    sparkinfer bench broadcast             # the step-plan ring to N rank processes and back (CPU)
    sparkinfer bench serve ...             # the OpenAI server under load
    sparkinfer bench scheduler             # the serving loop's host time per engine step (CPU)
    sparkinfer bench summarize             # the docs tables from benchmarks/results/
    sparkinfer bench suite --out-dir DIR   # the GPU benchmarks behind those tables, in a time budget

Each name is a module `sparkinfer.bench.<name>` with `add_arguments(parser)` and
`main(args) -> int` (see `sparkinfer.bench`). The module is imported only when its
benchmark runs, so `sparkinfer --help` stays fast; its options are parsed then.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_parser", "BENCHMARKS"]

BENCHMARKS = {
    "comm": "all-reduce, reduce-scatter, all-gather against NCCL and SymmetricMemory (2 GPUs)",
    "fused": "fused all-reduce + residual + RMSNorm and dcp_merge against their compositions (2 GPUs)",
    "moe": "the fused MoE layer against the HBM floor and torch._grouped_mm (1 GPU)",
    "attention": "decode attention against flash-attn and torch SDPA, GB/s of KV read (1 GPU)",
    "decode": "model generation: tokens/s per batch size",
    "prefill": "prefill forwards of R prompt chunks, invariant (gemm) vs cuBLAS, and the projections (1 GPU)",
    "broadcast": "the shared-memory step-plan ring to N rank processes and back, us per step (CPU)",
    "serve": "the OpenAI server under load: TTFT, TPOT, ITL, throughput (any URL, or a server it starts)",
    "scheduler": "the serving loop's host time per step against a decode step (CPU)",
    "summarize": "print the docs' results tables from benchmarks/results/",
    "suite": "the one-GPU benchmarks behind the docs' tables and the GPU tests, in a time budget (1 GPU)",
}


def run(args) -> int:
    try:
        mod = importlib.import_module(f"sparkinfer.bench.{args.name}")
    except ModuleNotFoundError as e:
        if e.name != f"sparkinfer.bench.{args.name}":
            raise
        print(f"sparkinfer bench {args.name}: not available in this version of sparkinfer")
        return 2
    p = argparse.ArgumentParser(prog=f"sparkinfer bench {args.name}", description=(mod.__doc__ or "").split("\n")[0])
    mod.add_arguments(p)
    bench_args = p.parse_args(args.options)
    # the command as typed, for the result rows (common.metadata scrubs machine paths)
    bench_args.argv = ["sparkinfer", "bench", args.name, *args.options]
    return mod.main(bench_args)


def add_parser(sub) -> None:
    lines = "\n".join(f"  {name:10s} {text}" for name, text in BENCHMARKS.items())
    p = sub.add_parser("bench", help="run a benchmark (comm, fused, moe, attention, decode, broadcast, serve) or "
                       "summarize results",
                       description=f"benchmarks:\n{lines}\n\n`sparkinfer bench <name> --help` lists its options.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=tuple(BENCHMARKS), metavar="name", help=", ".join(BENCHMARKS))
    p.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options")
    p.set_defaults(run=run)
