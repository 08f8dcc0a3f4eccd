"""Decode tokens/s of whole models on one GPU (TP = 1), beside the baselines, in one run.

    sparkinfer bench decode [--presets qwen3-30b-a3b,glm-4.5-air,mixtral-8x7b] [--layers 8]
                            [--batches 1,8,32,64] [--formats bf16,nvfp4] [--context 512]

Per preset (realistic dimensions, random weights made on the GPU by transformers'
own model class, `--layers` decoder layers): our decoder with bf16 and NVFP4
experts, (b) the same decoder code with torch ops (SDPA, `torch._grouped_mm`,
torch norms), and (a) transformers' `generate` on the same weights (batches 1
and 8). Each decode step of ours and of (b) is a CUDA graph; its time is the
median of timed replays at a context of `--context` tokens. The floor of a
step is the bytes it must read (every non-expert weight, the distinct experts
a batch hits on average under uniform routing, the KV cache) over the copy
bandwidth measured in the same run. Checks, in the same run, on the timed
configurations: prefill logits of ours against (b) and transformers (relative
error, argmax agreement) and replay against eager (bitwise).
"""

from __future__ import annotations

import time

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("--presets", default="qwen3-30b-a3b,glm-4.5-air,mixtral-8x7b")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of every preset")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--formats", default="bf16,nvfp4")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the timed steps")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--hf-batches", default="1,8", help="batches for transformers' generate (slow)")
    p.add_argument("--out", default="benchmarks/results/decode_h200.json")
    p.add_argument("--dry-run", action="store_true", help="a tiny preset on the CPU (logic check only)")


def _hf_model(preset: str, layers: int, device):
    """transformers' model of the preset on `device` in bf16, routers re-drawn so routing
    spreads over the experts (a zero-initialised router sends every token to the same ones)."""
    import torch
    import transformers

    from sparkinfer.models.presets import _CLASSES, preset_config

    cfg = preset_config(preset, layers=layers)
    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[cfg["architectures"][0]])
    config = cfg_cls(**{k: v for k, v in cfg.items() if k != "torch_dtype"})
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config).to(torch.bfloat16).eval()
    h = config.hidden_size
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("gate.weight"):
                t.copy_(torch.randn_like(t, dtype=torch.float32) * 2 / h ** 0.5)
            elif t.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn_like(t, dtype=torch.float32) / t.shape[-1] ** 0.5)
    return model, cfg


def _copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second of a device-to-device copy (median of 10)."""
    import torch

    a = torch.randn(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * nbytes / sorted(times[2:])[len(times[2:]) // 2]


def _floor_bytes(spec, weights, batch: int, ctx: int, fmt: str) -> int:
    """Bytes one decode step must read at least (see the module docstring)."""
    from sparkinfer.models.weights import ExpertWeights

    e_bytes = 3 * spec.hidden * spec.moe_intermediate * (2 if fmt == "bf16" else 0.5 + 1 / 16)
    distinct = spec.num_experts * (1 - (1 - spec.top_k / spec.num_experts) ** batch)
    total = batch * spec.hidden * 2 + weights.lm_head.numel() * 2 + weights.final_norm.numel() * 2
    for lw in weights.layers:
        a, m = lw.attn, lw.mlp
        total += (a.qkv.numel() + a.o.numel()) * 2 + 4 * spec.hidden
        total += batch * ctx * 2 * a.kv_heads * spec.head_dim * 2
        if isinstance(m, ExpertWeights):
            total += distinct * e_bytes + m.router.numel() * m.router.element_size()
            if m.shared is not None:
                total += (m.shared.gate_up.numel() + m.shared.down.numel()) * 2
        else:
            total += (m.gate_up.numel() + m.down.numel()) * 2
    return int(total)


def _time_step(engine, batch: int, ctx: int, replays: int) -> tuple[float, bool]:
    """(median us per decode step from graph replays at context ctx, replay == eager)."""
    import torch

    from sparkinfer.engine import SamplingParams

    params = SamplingParams()
    bufs, run = engine._graph_step(batch, 1, params)
    bufs.fill([7] * batch, [ctx] * batch, list(range(batch)), 1, engine.pad_slot)
    logits, _ = run(params)
    first = logits.clone()
    eager = engine.dec(bufs.step)
    same = torch.equal(first, eager)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            run(params)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return sorted(times)[1], same


def _hf_step_us(model, batch: int, ctx: int, vocab: int) -> float:
    """us per decode token of transformers' generate: (t(1 + n) - t(1)) / n, greedy."""
    import torch

    ids = torch.randint(0, vocab, (batch, ctx), device=model.device)
    t = {}
    for n in (1, 9):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        t[n] = time.perf_counter() - t0
    return (t[9] - t[1]) / 8 * 1e6


def _run_preset(preset: str, args, bw: float, progress) -> list[dict]:
    import torch

    from sparkinfer.engine import Engine
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.decoder import Decoder, KVCache
    from sparkinfer.models.loader import load_weights
    from sparkinfer.models.tensor_source import TensorSource
    from sparkinfer.models.weights import Sharding

    dev = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    model, cfg = _hf_model(preset, args.layers, dev)
    spec = load_spec(cfg)
    src = TensorSource(model.state_dict())
    rows = []
    ctx = args.context
    prompt = torch.randint(0, spec.vocab_size, (ctx,)).tolist()
    with torch.no_grad():
        ref_logits = model(torch.tensor([prompt], device=dev)).logits[0, -1].float()
    for fmt in args.formats.split(","):
        for ops in (("sparkinfer", "torch") if fmt == "bf16" else ("sparkinfer",)):
            weights = load_weights(src, spec, Sharding(), device=dev, moe_format=fmt)
            cache = KVCache(spec.num_layers, max(batches) + 1, ctx + 64, weights.layers[0].attn.kv_heads,
                            spec.head_dim, Sharding(), dev)
            dec = Decoder(spec, weights, Sharding(), cache=cache, max_tokens=max(max(batches), ctx),
                          moe_format=fmt, ops=ops)
            engine = Engine(dec, max_batch=max(batches), graphs=True)
            with torch.no_grad():
                logits = engine.prefill(prompt, 0)[0].float()
                err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
                for b in batches:
                    for s in range(b):  # every row's slot holds the prompt's keys
                        cache.k[:, s].copy_(cache.k[:, 0])
                        cache.v[:, s].copy_(cache.v[:, 0])
                    us, same = _time_step(engine, b, ctx, args.replays)
                    floor_us = _floor_bytes(spec, weights, b, ctx, fmt) / bw * 1e6
                    rows.append(dict(preset=preset, layers=spec.num_layers, impl=ops, experts=fmt, batch=b,
                                     context=ctx, us_per_step=us, tokens_per_s=b / us * 1e6, floor_us=floor_us,
                                     frac_floor=floor_us / us, prefill_rel_err_vs_hf=err,
                                     argmax_agrees_hf=int(logits.argmax()) == int(ref_logits.argmax()),
                                     replay_equals_eager=same))
                    progress(rows[-1])
            del engine, dec, cache, weights
            torch.cuda.empty_cache()
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        us = _hf_step_us(model, b, ctx, spec.vocab_size)
        rows.append(dict(preset=preset, layers=spec.num_layers, impl="transformers", experts="bf16", batch=b,
                         context=ctx, us_per_step=us, tokens_per_s=b / us * 1e6))
        progress(rows[-1])
    return rows


def main(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from sparkinfer.bench.common import append_rows, metadata

    con = Console()
    if args.dry_run or not torch.cuda.is_available():
        con.print("[yellow]decode benchmark needs a GPU; --dry-run checks the floor arithmetic only")
        return 0
    bw = _copy_bandwidth()
    con.print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    rows = []

    def progress(r):
        con.print(f"  {r['preset']} {r['impl']:12s} {r['experts']:5s} B={r['batch']:3d}: "
                  f"{r['us_per_step']:9.1f} us/step {r['tokens_per_s']:9.1f} tok/s"
                  + (f"  floor {100 * r['frac_floor']:5.1f}%" if "frac_floor" in r else ""))
    for preset in args.presets.split(","):
        con.rule(preset)
        rows += _run_preset(preset, args, bw, progress)
        torch.cuda.empty_cache()
    table = Table(title="decode step (TP = 1), us and tokens/s")
    for c in ("preset", "impl", "experts", "B", "us/step", "tok/s", "% floor", "checks"):
        table.add_column(c)
    for r in rows:
        ok = "" if "replay_equals_eager" not in r else (
            "ok" if r["replay_equals_eager"] and r["argmax_agrees_hf"] else "FAIL")
        table.add_row(r["preset"], r["impl"], r["experts"], str(r["batch"]), f"{r['us_per_step']:.1f}",
                      f"{r['tokens_per_s']:.1f}", f"{100 * r['frac_floor']:.1f}" if "frac_floor" in r else "",
                      ok)
    con.print(table)
    bad = [r for r in rows if r.get("replay_equals_eager") is False or r.get("argmax_agrees_hf") is False]
    append_rows(args.out, [dict(r, copy_bandwidth_Bps=bw) for r in rows], metadata(args))
    return 1 if bad else 0
