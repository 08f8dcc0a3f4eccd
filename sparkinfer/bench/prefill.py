"""Prefill forwards of a realistic model: R prompt chunks of Q tokens as rows of one
captured forward, batch-invariant (`gemm` projections) against batch-dependent (cuBLAS),
and the prefill projections alone.

    sparkinfer bench prefill --preset qwen3-30b-a3b --layers 8 [--rows 1,2,4,8] [--chunk 256]
    sparkinfer bench prefill --beside 32,64 --rows 1,2,4   # mixed steps (bench/prefill_mixed.py)
    sparkinfer bench prefill --dry-run       # CPU, interpreter, the tiny preset

Rows "prefill": ms per forward (a CUDA graph replay with its input copy, median of
`--replays`), us per prompt token, and two checks: row 0's last-token logits and cache
entries equal those of the same chunk run alone (bitwise; batch invariance), and the
relative error of the alone logits against the other mode's. Rows "projection": `gemm`
against torch's matmul at the preset's projection shapes (qkv, o, and the LM head at R
rows), us and TFLOP/s at M = R x Q. The model is `bench decode`'s (random weights).
"""

from __future__ import annotations

import time

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="1,2,4,8", help="chunks per forward")
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens per row")
    p.add_argument("--replays", type=int, default=9)
    p.add_argument("--beside", default="", help="decode rows of mixed steps (e.g. 32,64): time those "
                   "instead of the prefill forwards (bench/prefill_mixed.py)")
    p.add_argument("--context", type=int, default=512, help="the mixed steps' decode rows' context")
    p.add_argument("--out", default=None, help="default benchmarks/results/prefill_<machine>.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes")


def _forward_rows(preset, model, cfg, args, dev, say) -> list[dict]:
    import torch

    from sparkinfer.bench.decode_model import build

    rows_list = [int(r) for r in args.rows.split(",")]
    q, most = args.chunk, max(rows_list)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg["vocab_size"], (q,), generator=g).tolist() for _ in range(most)]
    out, solo = [], {}
    for inv in (True, False):
        spec, dec, eng = build(model, cfg, fmt="bf16", ops="sparkinfer", batch=most, max_len=q, max_tokens=most * q,
                               batch_invariant=inv)
        with torch.no_grad():
            alone = eng.prefill_rows([(prompts[0], 0, 0)], q)[0].float().clone()
            k0 = dec.cache.k[:, 0, :q].clone()
            solo[inv] = alone
            for r in rows_list:
                chunks = [(prompts[i], 0, i) for i in range(r)]
                first = eng.prefill_rows(chunks, q)[0].float()  # compiles, captures
                same = torch.equal(first, alone) and torch.equal(dec.cache.k[:, 0, :q], k0)
                times = []
                for _ in range(args.replays):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    eng.prefill_rows(chunks, q)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                ms = sorted(times)[len(times) // 2] * 1e3
                out.append(dict(bench="prefill", kind="prefill", preset=preset, layers=spec.num_layers,
                                batch_invariant=inv, rows=r, chunk=q, tokens=r * q, graphs=eng.graphs,
                                ms_per_forward=ms, us_per_token=ms * 1e3 / (r * q), row_equals_alone=same,
                                ok=same or not inv))
                say(out[-1])
        del eng, dec
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    err = ((solo[True] - solo[False]).norm() / solo[False].norm()).item()
    for r in out:
        r["alone_rel_err_vs_other_mode"] = err
        r["ok"] = r["ok"] and err < 2e-2  # bf16 sums in another order over 8 layers
    return out


def _projection_rows(preset, cfg, args, dev, say) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from sparkinfer.linear import gemm

    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    shapes = [("qkv", qkv, h), ("o", h, cfg["num_attention_heads"] * d), ("lm_head", cfg["vocab_size"], h)]
    out = []
    inner = 10 if dev.type == "cuda" else 1  # calls per timing (the interpreter: one, for the logic only)
    for r in [int(x) for x in args.rows.split(",")]:
        for name, n, k in shapes:
            m = r if name == "lm_head" else r * args.chunk
            x = torch.randn(m, k, device=dev).bfloat16()
            w = (torch.randn(n, k, device=dev) / k ** 0.5).bfloat16()
            ref = F.linear(x, w).float()
            err = ((gemm(x, w).float() - ref).norm() / ref.norm()).item()
            us = {}
            for impl, fn in (("gemm", gemm), ("torch", F.linear)):
                fn(x, w)
                times = []
                for _ in range(args.replays):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fn(x, w)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) / inner)
                us[impl] = sorted(times)[len(times) // 2] * 1e6
            flop = 2 * m * n * k
            out.append(dict(bench="prefill", kind="projection", preset=preset, name=name, m=m, n=n, k=k,
                            gemm_us=us["gemm"], torch_us=us["torch"], gemm_tflops=flop / us["gemm"] / 1e6,
                            torch_tflops=flop / us["torch"] / 1e6, rel_err_vs_torch=err, ok=err < 1e-2))
            say(out[-1])
    return out


def main(args) -> int:
    if args.dry_run:  # CPU kernels: the interpreter, set before Triton is imported
        import os

        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from sparkinfer.bench.common import append_rows, default_out, metadata
    from sparkinfer.bench.decode_model import hf_model
    from sparkinfer.bench.report import console, print_table

    con = console()
    cuda = torch.cuda.is_available() and not args.dry_run
    if args.dry_run:
        args.preset, args.layers, args.rows, args.chunk, args.replays = "qwen3_moe-tiny", 2, "1,2", 8, 1
        args.beside, args.context = "3" if args.beside else "", 16
    elif not cuda:
        con.print("[red]the prefill benchmark needs a GPU; --dry-run checks its logic on the CPU")
        return 2
    dev = torch.device("cuda" if cuda else "cpu")

    def say(r):
        con.print("  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                                  if k not in ("bench",)))
    model, cfg = hf_model(args.preset, args.layers, dev)
    if args.beside:
        return _mixed_main(model, cfg, args, dev, say, con)
    rows = _forward_rows(args.preset, model, cfg, args, dev, say)
    del model
    rows += _projection_rows(args.preset, cfg, args, dev, say)
    fwd = [r for r in rows if r["kind"] == "prefill"]
    print_table(f"prefill forwards, {args.preset} x {args.layers} layers, rows of {args.chunk} tokens",
                ["invariant", "rows", "tokens", "ms / forward", "us / token", "row = alone", "ok"],
                [[r["batch_invariant"], r["rows"], r["tokens"], f"{r['ms_per_forward']:.2f}",
                  f"{r['us_per_token']:.2f}", r["row_equals_alone"], r["ok"]] for r in fwd])
    meta = metadata(args)
    out = args.out or default_out("prefill", meta, 1, dry_run=args.dry_run)
    path = append_rows(out, rows, meta)
    con.print(f"rows -> {path}")
    return 0 if all(r["ok"] for r in rows) else 1


def _mixed_main(model, cfg, args, dev, say, con) -> int:
    from sparkinfer.bench.common import append_rows, default_out, metadata
    from sparkinfer.bench.prefill_mixed import mixed_rows
    from sparkinfer.bench.report import print_table

    rows = mixed_rows(model, cfg, args, dev, say)
    print_table(f"mixed steps, {args.preset} x {args.layers} layers, chunks of {args.chunk} tokens, "
                f"decode rows at context {args.context}",
                ["decode rows", "chunks", "decode ms", "prefill ms", "mixed ms", "marginal ms", "us / prompt token",
                 "bitwise", "ok"],
                [[r["decode_rows"], r["chunks"], f"{r['decode_ms']:.3f}", f"{r['prefill_ms']:.3f}",
                  f"{r['mixed_ms']:.3f}", f"{r['marginal_ms']:.3f}", f"{r['marginal_us_per_prompt_token']:.2f}",
                  r["decode_equal"] and r["chunks_equal"], r["ok"]] for r in rows])
    meta = metadata(args)
    out = args.out or default_out("prefill_mixed", meta, 1, dry_run=args.dry_run)
    path = append_rows(out, rows, meta)
    con.print(f"rows -> {path}")
    return 0 if all(r["ok"] for r in rows) else 1
