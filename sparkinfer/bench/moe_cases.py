"""The measured cases of `sparkinfer bench moe`: random layers at real shapes, the
correctness checks, and the timings of sparkinfer and the torch baselines.

Legend: M (= T) tokens, E experts, K top-k, H hidden, I intermediate per rank.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Layer", "checks", "time_ours", "time_baselines"]


class Layer:
    """One shape's random weights: bf16 (also the baselines') and NVFP4 sources."""

    def __init__(self, ctx, name, shape, max_tokens):
        torch = ctx.torch
        from sparkinfer.quant import NVFP4Tensor
        self.ctx, self.name, self.shape, self.max_tokens = ctx, name, shape, max_tokens
        e, h, i = shape["num_experts"], shape["hidden"], shape["intermediate"]
        self.e, self.k, self.h, self.i = e, shape["top_k"], h, i
        gen = dict(device=ctx.dev)
        self.w1 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, **gen).mul_(h ** -0.5)
        self.w2 = torch.randn(e, h, i, dtype=torch.bfloat16, **gen).mul_(i ** -0.5)

        def fp4(n, r):  # random codes; E4M3 scales in [0.5, 1.875]; global ~ 1/(3 sqrt(r))
            packed = torch.randint(0, 256, (e, n, r // 2), dtype=torch.uint8, **gen)
            scales = torch.randint(0x30, 0x40, (e, n, r // 16), dtype=torch.uint8, **gen)
            gs = torch.full((e,), 1.0 / (3.0 * math.sqrt(r)), dtype=torch.float32, **gen)
            return NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), gs)

        self.q1, self.q2 = fp4(2 * i, h), fp4(h, i)
        self.dsv3 = e == 256

    def spec(self, fmt):
        from sparkinfer.moe import MoESpec

        if self.dsv3:  # DeepSeek-V3 routing: 8 groups, keep 4, scale 2.5
            return MoESpec(weight_format=fmt, routing="sigmoid_grouped", n_group=8,
                           topk_group=4, routed_scaling_factor=2.5)
        return MoESpec(weight_format=fmt)

    def build(self, fmt, decode=None):
        """(plan, prepared weights, scratch, source weights) for `fmt`, with the
        NVFP4 decode forced to `decode` (None: the plan's)."""
        from sparkinfer.moe import MoECaps, allocate_scratch, plan, prepare_weights

        caps = MoECaps(max_tokens=self.max_tokens, **self.shape)
        p = plan(caps, self.spec(fmt))
        p = p.with_changes(decode=decode) if decode else p
        src = (self.w1, self.w2) if fmt == "bf16" else (self.q1, self.q2)
        return p, prepare_weights(p, *src), allocate_scratch(p, self.ctx.dev), src

    def routing(self, m, seed):
        torch = self.ctx.torch
        g = torch.Generator(device=self.ctx.dev).manual_seed(seed)
        ids = torch.rand(m, self.e, generator=g, device=self.ctx.dev).topk(self.k).indices
        w = torch.rand(m, self.k, generator=g, device=self.ctx.dev) + 0.1
        return ids.to(torch.int32), w / w.sum(-1, keepdim=True)


def check(ctx, layer, fmt, ts, decode, kind="check") -> list[dict]:
    """Correctness rows for token counts `ts` (one per family/config the plan uses).
    kind "probe": the same checks of a non-default option, reported, never a failure."""
    torch = ctx.torch
    from sparkinfer.moe import bind, moe_reference, run
    from sparkinfer.moe.routing import route_reference

    p, w, scratch, src = layer.build(fmt, decode)
    rows = []
    for t in ts:
        spec = p.spec
        x = torch.randn(t, layer.h, device=ctx.dev).bfloat16()
        logits = torch.randn(t, layer.e, device=ctx.dev)
        bias = (torch.randn(layer.e, device=ctx.dev) * 0.1 if spec.routing == "sigmoid_grouped"
                else None)
        out = torch.full((t, layer.h), float("nan"), dtype=torch.bfloat16, device=ctx.dev)
        b = bind(p, scratch, w, x=x, out=out, logits=logits, bias=bias)
        run(b)
        eager = out.clone()
        rid, _ = route_reference(logits, spec, layer.k, bias=bias)
        ids_match = (b.topk_ids == rid).float().mean().item()
        ref = moe_reference(x, src, (b.topk_ids, b.topk_weights), spec=spec)
        cos = torch.nn.functional.cosine_similarity(eager.float().flatten(), ref.flatten(),
                                                    dim=0).item()
        out.fill_(float("nan"))
        run(b)
        repeat = torch.equal(out, eager)
        replay = None
        if ctx.cuda:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run(b)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            replay = torch.equal(out, eager)
            del g
        ok = cos >= 0.9999 and repeat and replay is not False and ids_match >= 0.999
        decode = b.config.decode if fmt == "nvfp4" else None
        rows.append(dict(kind=kind, shape=layer.name, format=fmt, M=t, decode=decode,
                         family=b.config.family, block_m=b.config.block_m, cosine=cos,
                         ids_match=ids_match, repeat_bitwise=repeat, replay_bitwise=replay,
                         ok=ok))
        if not ok:
            print(f"{kind} FAILED: {layer.name} {fmt} decode={decode} M={t} {b.config.family} "
                  f"BM={b.config.block_m} cos={cos:.6f} ids={ids_match:.4f} repeat={repeat} replay={replay}",
                  flush=True)
    return rows


def checks(ctx, layer, fmt, ms, decode) -> list[dict]:
    """Check rows of one format at M = 4, 64 and max(ms). NVFP4: a failing ptx
    decode falls back to arith (decode[fmt] then says so); the arith decode
    probes ptx at M = 4 (micro), reported as "probe" rows, never a failure."""
    ts = sorted({min(4, max(ms)), min(64, max(ms)), max(ms)})
    rows = check(ctx, layer, fmt, ts, decode[fmt])
    if fmt != "nvfp4":
        return rows
    if rows[0]["decode"] == "ptx" and not all(r["ok"] for r in rows):
        print("!! NVFP4 PTX decode failed a check; re-checking with the arithmetic "
              "decode, which then serves the timings (rows say decode=arith)", flush=True)
        decode[fmt] = "arith"
        rows += check(ctx, layer, fmt, ts, "arith")
    elif rows[0]["decode"] == "arith":
        rows += check(ctx, layer, fmt, ts[:1], "ptx", kind="probe")
    return rows


def _row(ctx, layer, lim, m, fmt, impl, sec, mode, expert_bytes, active):
    k, h, i = layer.k, layer.h, layer.i
    nbytes = active * expert_bytes
    floor = nbytes / (lim["copy_gbs"] * 1e9)
    flops = 2.0 * m * k * (2 * i * h + h * i)
    return dict(kind="time", shape=layer.name, M=m, format=fmt, impl=impl, mode=mode,
                us=sec * 1e6, active_experts=active, weight_bytes=nbytes,
                floor_us=floor * 1e6, frac_floor=floor / sec, tflops=flops / sec / 1e12,
                frac_tc=flops / sec / 1e12 / lim["bf16_tflops"],
                E=layer.e, K=k, H=h, I=i, copy_gbs=lim["copy_gbs"],
                tc_tflops=lim["bf16_tflops"])


def _error_row(layer, m, fmt, impl, exc) -> dict:
    """A timing that failed, as a row; a CUDA error poisons the context, so it re-raises."""
    err = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(f"time  {layer.name:8s} {fmt:5s} M={m:<5d} {impl}: {err}", flush=True)
    if "CUDA error" in str(exc):
        raise exc
    return dict(kind="time", shape=layer.name, M=m, format=fmt, impl=impl, error=err)


def time_ours(ctx, layer, lim, fmt, ms, decode, advance) -> list[dict]:
    """Timing rows of sparkinfer for one format at every M (--sweep: the plan, then the
    configs tuning.candidates proposes at each M); advance() once per M."""
    p0, w, _, _ = layer.build(fmt, decode)
    rows = []
    for m in ms:
        rows += _time_ours_at(ctx, layer, lim, fmt, m, p0, w)
        advance(f"{layer.name} {fmt} M={m}")
    return rows


def _time_ours_at(ctx, layer, lim, fmt, m, p0, w) -> list[dict]:
    torch = ctx.torch
    from sparkinfer.moe import allocate_scratch, bind, run
    from sparkinfer.moe.tuning import candidates

    rows = []
    variants = candidates(p0, m) if ctx.args.sweep else [("planned", None)]
    for variant, c in variants:
        p = p0 if variant == "planned" else p0.forced(c)
        if ctx.over_budget():
            print(f"budget: skipping {layer.name} {fmt} M={m} {variant}", flush=True)
            continue
        scratch = allocate_scratch(p, ctx.dev)
        g_calls = ctx.calls_per_graph(m)
        x = torch.randn(m, layer.h, device=ctx.dev).bfloat16()
        calls, active = [], 0
        for s in range(g_calls):
            ids, tw = layer.routing(m, 1000 * m + s)
            active += torch.unique(ids).numel() / g_calls
            out = torch.empty(m, layer.h, dtype=torch.bfloat16, device=ctx.dev)
            b = bind(p, scratch, w, x=x, out=out, topk_ids=ids, topk_weights=tw)
            calls.append(lambda b=b: run(b))
        impl = "sparkinfer" if variant == "planned" else f"sparkinfer:{variant}"
        try:
            sec, mode = ctx.time_calls(calls)
        except Exception as exc:  # noqa: BLE001 - e.g. a sweep variant out of resources
            rows.append(_error_row(layer, m, fmt, impl, exc))
            continue
        r = _row(ctx, layer, lim, m, fmt, impl, sec, mode, w.expert_bytes(), active)
        r.update(dataclasses.asdict(b.config), decode=b.config.decode if fmt == "nvfp4" else None)
        rows.append(r)
        del scratch, calls
    return rows


def _grouped_mm_call(ctx, layer, x, ids, tw, out):
    torch = ctx.torch
    e_idx = torch.arange(layer.e, device=ctx.dev)
    w1t, w2t = layer.w1.transpose(1, 2), layer.w2.transpose(1, 2)

    def call():
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum((flat[:, None] == e_idx[None, :]).sum(0), 0).to(torch.int32)
        tok = order // layer.k
        h1 = torch._grouped_mm(x[tok], w1t, offs=offs)
        g, u = h1.chunk(2, dim=-1)
        h2 = torch._grouped_mm(torch.nn.functional.silu(g) * u, w2t, offs=offs)
        h2 = h2.float() * tw.flatten()[order][:, None]
        out.zero_()
        out.index_add_(0, tok, h2)

    return call


def _loop_call(ctx, layer, x, ids, tw, out):
    torch = ctx.torch
    work = []
    for e in torch.unique(ids).tolist():  # host-side routing, outside the timed region
        t_idx, k_idx = torch.nonzero(ids == e, as_tuple=True)
        work.append((e, t_idx, tw[t_idx, k_idx][:, None]))

    def call():
        out.zero_()
        for e, t_idx, wr in work:
            g, u = (x[t_idx] @ layer.w1[e].t()).chunk(2, dim=-1)
            h2 = (torch.nn.functional.silu(g) * u) @ layer.w2[e].t()
            out.index_add_(0, t_idx, h2.float() * wr)

    return call


def time_baselines(ctx, layer, lim, ms, advance) -> list[dict]:
    """bf16 timing rows of torch._grouped_mm and a per-expert loop; advance() once per (impl, M)."""
    torch = ctx.torch
    rows = []
    ebytes = 3 * layer.h * layer.i * 2
    for m in ms:
        for impl, make in (("torch_grouped_mm", _grouped_mm_call), ("torch_loop", _loop_call)):
            advance(f"{layer.name} {impl} M={m}")
            if ctx.over_budget():
                print(f"budget: skipping {layer.name} {impl} M={m}", flush=True)
                continue
            g_calls = ctx.calls_per_graph(m, baseline=True)
            x = torch.randn(m, layer.h, device=ctx.dev).bfloat16()
            calls, active = [], 0
            try:
                for s in range(g_calls):
                    ids, tw = layer.routing(m, 1000 * m + s)
                    active += torch.unique(ids).numel() / g_calls
                    out = torch.empty(m, layer.h, dtype=torch.float32, device=ctx.dev)
                    calls.append(make(ctx, layer, x, ids.long(), tw, out))
                sec, mode = ctx.time_calls(calls)
            except Exception as exc:  # noqa: BLE001 - a missing baseline is a row, not a crash
                rows.append(_error_row(layer, m, "bf16", impl, exc))
                continue
            rows.append(_row(ctx, layer, lim, m, "bf16", impl, sec, mode, ebytes, active))
    return rows
