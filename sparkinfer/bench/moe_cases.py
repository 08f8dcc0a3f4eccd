"""The measured cases of `sparkinfer bench moe`: random layers at real shapes, the
correctness checks, and the timings of sparkinfer and the torch baselines.

Legend: M (= T) tokens, E experts, K top-k, H hidden, I intermediate per rank.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Layer", "checks", "time_ours", "time_baselines", "BASELINES"]


class Layer:
    """One shape's random weights: bf16 (also the baselines'), and NVFP4 and
    fp8_block sources made the first time a format is built."""

    def __init__(self, ctx, name, shape, max_tokens):
        torch = ctx.torch
        from sparkinfer.bench.moe_weights import random_fp8_block, random_nvfp4
        self.ctx, self.name, self.shape, self.max_tokens = ctx, name, shape, max_tokens
        e, h, i = shape["num_experts"], shape["hidden"], shape["intermediate"]
        self.e, self.k, self.h, self.i = e, shape["top_k"], h, i
        gen = dict(device=ctx.dev)
        self.w1 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, **gen).mul_(h ** -0.5)
        self.w2 = torch.randn(e, h, i, dtype=torch.bfloat16, **gen).mul_(i ** -0.5)
        self.src = {"bf16": (self.w1, self.w2)}
        self.make = {fmt: (lambda f=f: (f(e, 2 * i, h, ctx.dev), f(e, h, i, ctx.dev)))
                     for fmt, f in (("nvfp4", random_nvfp4), ("fp8_block", random_fp8_block))}
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
        src = self.src[fmt] if fmt in self.src else self.src.setdefault(fmt, self.make[fmt]())
        return p, prepare_weights(p, *src), allocate_scratch(p, self.ctx.dev), src

    def routing(self, m, seed):
        torch = self.ctx.torch
        g = torch.Generator(device=self.ctx.dev).manual_seed(seed)
        ids = torch.rand(m, self.e, generator=g, device=self.ctx.dev).topk(self.k).indices
        w = torch.rand(m, self.k, generator=g, device=self.ctx.dev) + 0.1
        return ids.to(torch.int32), w / w.sum(-1, keepdim=True)


def _tol_row(tol) -> dict:
    return dict(tol_cosine_min=tol.cosine_min, tol_rel_norm_max=tol.rel_norm_max,
                tol_max_rel_max=tol.max_rel_max)


def check(ctx, layer, fmt, ts, decode, kind="check") -> list[dict]:
    """Correctness rows for token counts `ts` (one per family/config the plan uses):
    router + layer against the fp32 reference with the reference's own routing
    (`sparkinfer.moe.reference.compare_to_reference`: cosine, relative error norm,
    worst element), eager repeat and graph replay bitwise equal to eager.
    kind "probe": the same checks of a non-default option, reported, never a failure."""
    torch = ctx.torch
    from sparkinfer.moe import bind, moe_reference, run
    from sparkinfer.moe.reference import compare_to_reference
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
        routing = route_reference(logits, spec, layer.k, bias=bias)
        ids_match = (b.topk_ids == routing[0]).float().mean().item()
        # The reference routes by itself: a routing bug shows as an output error.
        # Tokens whose expert sets differ are left out of the output comparison and
        # counted instead (at most 0.1% of tokens, none below M = 1000): an fp32
        # near-tie between the K-th and (K+1)-th score, 1 ulp apart, is not a kernel
        # bug; estimated from the score spacing (~1/E) at ~3e-5 per DeepSeek-V3
        # token, so ~10% of M = 4096 checks would see one (not yet measured).
        same = (b.topk_ids.sort(-1).values == routing[0].to(b.topk_ids.dtype).sort(-1).values).all(-1)
        diff_tokens = int((~same).sum())
        ref, ties = moe_reference(x, src, routing, spec=spec, ties=True)
        cmp = compare_to_reference(eager[same], ref[same], weight_format=fmt, ties=ties.select(same))
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
        ok = cmp.ok and repeat and replay is not False and diff_tokens <= t // 1000
        decode = b.config.decode if fmt == "nvfp4" else None
        rows.append(dict(kind=kind, shape=layer.name, format=fmt, M=t, decode=decode,
                         family=b.config.family, block_m=b.config.block_m, **cmp.as_row(),
                         **_tol_row(cmp.tol), ids_match=ids_match, tokens_routed_differently=diff_tokens,
                         repeat_bitwise=repeat,
                         replay_bitwise=replay, ok=ok))
        if not ok:
            print(f"{kind} FAILED: {layer.name} {fmt} decode={decode} M={t} {b.config.family} "
                  f"BM={b.config.block_m} {cmp} ids={ids_match:.4f} ({diff_tokens} tokens routed differently) "
                  f"repeat={repeat} replay={replay}",
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


def layer_bytes(m: int, k: int, h: int, i: int, weight_bytes: float, fmt: str) -> float:
    """The least HBM traffic of one call in this layer's structure: the active experts'
    weights once, x read and the output written once (bf16), FC1's activation written and
    read by FC2 (e4m3 for fp8_block, else bf16; its scales left out), and FC2's routed rows
    written and read by the top-k sum (bf16). Pure."""
    routes = m * k
    act = 1 if fmt == "fp8_block" else 2
    return weight_bytes + 2 * (2 * m * h) + 2 * act * routes * i + 2 * 2 * routes * h


def _row(ctx, layer, lim, m, fmt, impl, sec, mode, expert_bytes, active):
    k, h, i = layer.k, layer.h, layer.i
    nbytes = active * expert_bytes
    floor = nbytes / (lim["copy_gbs"] * 1e9)
    flops = 2.0 * m * k * (2 * i * h + h * i)
    # every byte of the layer at the measured copy rate, and the most of the bf16 tensor-core
    # rate a call could then reach: max(MMA time, byte time) bounds it from below
    bytes_us = layer_bytes(m, k, h, i, nbytes, fmt) / (lim["copy_gbs"] * 1e9) * 1e6
    r = dict(kind="time", shape=layer.name, M=m, format=fmt, impl=impl, mode=mode,
             us=sec * 1e6, active_experts=active, weight_bytes=nbytes,
             floor_us=floor * 1e6, frac_floor=floor / sec, tflops=flops / sec / 1e12,
             frac_tc=flops / sec / 1e12 / lim["bf16_tflops"],
             E=layer.e, K=k, H=h, I=i, copy_gbs=lim["copy_gbs"],
             tc_tflops=lim["bf16_tflops"], layer_bytes_us=bytes_us)
    if "spec_hbm_gbs" in lim:  # the part's specified peaks, beside the measured rates
        spec_floor = nbytes / (lim["spec_hbm_gbs"] * 1e9)
        tc_us = flops / (lim["spec_bf16_tflops"] * 1e12) * 1e6
        r.update(spec_hbm_gbs=lim["spec_hbm_gbs"], spec_bf16_tflops=lim["spec_bf16_tflops"],
                 spec_floor_us=spec_floor * 1e6, frac_spec_hbm=spec_floor / sec,
                 frac_spec_tc=flops / sec / 1e12 / lim["spec_bf16_tflops"],
                 max_frac_spec_tc=tc_us / max(tc_us, bytes_us))
    return r


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
    p0, w, _, src = layer.build(fmt, decode)
    rows = []
    for m in ms:
        rows += _time_ours_at(ctx, layer, lim, fmt, m, p0, (w, src))
        advance(f"{layer.name} {fmt} M={m}")
    return rows


def _check_timed(ctx, layer, spec, src, cases) -> dict:
    """Check the outputs the timed graph wrote (its first and last call: two
    routings) against the fp32 reference with those calls' routing; the row's
    `ok` is the verdict, which `sparkinfer bench summarize` refuses when False."""
    from sparkinfer.moe import moe_reference
    from sparkinfer.moe.reference import compare_to_reference

    cmps = []
    for x, ids, tw, out in ([cases[0], cases[-1]] if len(cases) > 1 else cases):
        ref, ties = moe_reference(x, src, (ids, tw), spec=spec, ties=True)
        cmps.append(compare_to_reference(out, ref, weight_format=spec.weight_format, ties=ties))
    worst = max(cmps, key=lambda c: (not c.ok, c.rel_norm))
    return dict(check_cosine=worst.cosine, check_rel_norm=worst.rel_norm,
                check_max_rel=worst.max_rel, check_flips=worst.flips, check_raw_rel_norm=worst.raw_rel_norm,
                checked_calls=len(cmps), **_tol_row(worst.tol),
                ok=all(c.ok for c in cmps))


def _time_ours_at(ctx, layer, lim, fmt, m, p0, w) -> list[dict]:
    torch = ctx.torch
    w, src = w
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
        calls, cases, active = [], [], 0
        for s in range(g_calls):
            ids, tw = layer.routing(m, 1000 * m + s)
            active += torch.unique(ids).numel() / g_calls
            out = torch.empty(m, layer.h, dtype=torch.bfloat16, device=ctx.dev)
            b = bind(p, scratch, w, x=x, out=out, topk_ids=ids, topk_weights=tw)
            calls.append(lambda b=b: run(b))
            cases.append((x, ids, tw, out))
        impl = "sparkinfer" if variant == "planned" else f"sparkinfer:{variant}"
        try:
            sec, mode = ctx.time_calls(calls, outs=[c[3] for c in cases])
        except Exception as exc:  # noqa: BLE001 - e.g. a sweep variant out of resources
            rows.append(_error_row(layer, m, fmt, impl, exc))
            continue
        # The floor counts the checkpoint's bytes, not the padding's: a plan that pads I
        # (glm_air_tp8: 176 -> 192) reads every expert matrix I_pad / I times over, all
        # linear in I, and the time lost to it shows as a lower fraction of the floor.
        floor_bytes = w.expert_bytes() * layer.i // p.intermediate
        r = _row(ctx, layer, lim, m, fmt, impl, sec, mode, floor_bytes, active)
        r.update(dataclasses.asdict(b.config), decode=b.config.decode if fmt == "nvfp4" else None,
                 I_padded=p.intermediate, read_bytes=active * w.expert_bytes())
        r.update(_check_timed(ctx, layer, p.spec, src, cases))
        if not r["ok"]:
            print(f"check FAILED on the timed graph: {layer.name} {fmt} M={m} {impl} "
                  f"rel_norm {r['check_rel_norm']:.2e} max_rel {r['check_max_rel']:.2e}", flush=True)
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
    """Per-expert torch loop; its routing setup (which experts, which rows: a host
    sync) runs inside the call, so it is timed, eager (it cannot be captured)."""
    torch = ctx.torch

    def call():
        out.zero_()
        for e in torch.unique(ids).tolist():
            t_idx, k_idx = torch.nonzero(ids == e, as_tuple=True)
            g, u = (x[t_idx] @ layer.w1[e].t()).chunk(2, dim=-1)
            h2 = (torch.nn.functional.silu(g) * u) @ layer.w2[e].t()
            out.index_add_(0, t_idx, h2.float() * tw[t_idx, k_idx][:, None])

    return call


# (impl, call factory, capturable): the torch bf16 baselines; summarize shows the
# faster of the two per point
BASELINES = (("torch_grouped_mm", _grouped_mm_call, True), ("torch_loop", _loop_call, False))


def time_baselines(ctx, layer, lim, ms, advance) -> list[dict]:
    """bf16 timing rows of torch._grouped_mm and a per-expert loop, routing setup
    timed in both, outputs of the timed run checked; advance() once per (impl, M)."""
    torch = ctx.torch
    rows = []
    ebytes = 3 * layer.h * layer.i * 2
    spec = layer.spec("bf16")
    for m in ms:
        for impl, make, capturable in BASELINES:
            advance(f"{layer.name} {impl} M={m}")
            if ctx.over_budget():
                print(f"budget: skipping {layer.name} {impl} M={m}", flush=True)
                continue
            g_calls = ctx.calls_per_graph(m, baseline=True)
            x = torch.randn(m, layer.h, device=ctx.dev).bfloat16()
            calls, cases, active = [], [], 0
            try:
                for s in range(g_calls):
                    ids, tw = layer.routing(m, 1000 * m + s)
                    active += torch.unique(ids).numel() / g_calls
                    out = torch.empty(m, layer.h, dtype=torch.float32, device=ctx.dev)
                    calls.append(make(ctx, layer, x, ids.long(), tw, out))
                    cases.append((x, ids, tw, out))
                sec, mode = ctx.time_calls(calls, outs=[c[3] for c in cases], graph=capturable)
            except Exception as exc:  # noqa: BLE001 - a missing baseline is a row, not a crash
                rows.append(_error_row(layer, m, "bf16", impl, exc))
                continue
            r = _row(ctx, layer, lim, m, "bf16", impl, sec, mode, ebytes, active)
            r.update(_check_timed(ctx, layer, spec, (layer.w1, layer.w2), cases))
            rows.append(r)
    return rows
