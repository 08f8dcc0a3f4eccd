"""Decode attention on one GPU: GB/s of KV cache read against the copy bandwidth.

Legend: B batch rows, Hq / KVH query / KV heads, D head dim 128, C context
(every row at position C - 1, so it reads C keys), NS KV splits.

One run: 1. the device's copy bandwidth (large device-to-device copy, bytes
read + written); 2. per model (Hq / KVH of Qwen3-30B-A3B, GLM-4.5-Air, Mixtral
at TP 1), B and C: a check of `decode_attention` against the fp32 reference,
then timing (CUDA graph, median) of `decode_attention` (batch-invariant, the
default, and `sparkinfer-batch-dependent`: batch_invariant=False, the heuristic's
split) and its peers on the same cache: `flash_attn_with_kvcache` (same [S, L, KVH, D] cache and slot
indices; where flash-attn is installed), torch SDPA after gathering the slots
(what the decoder with torch ops would do), and torch SDPA on K / V gathered
beforehand (reading the same bytes, no gather). A graph replays calls on
distinct slots, >= 256 MiB of cache together, so L2 (50 MiB) rarely serves a
repeat. Reported: us per call, KV GB/s (B * C * KVH * D * 2 B * 2 / time), and
that as a fraction of the GPU's specified HBM rate (`common.SPEC_PEAKS`: H200
4.8 TB/s) and of the copy bandwidth measured in the same run. Every timed graph
is checked: its outputs are poisoned (NaN) after the timing, the same graph
replays once more, and the last call's output (sparkinfer's calls share one
output buffer) is compared with the fp32 reference for that call's slots; a
row's `ok` is that verdict.

Appends JSON rows (GPU, versions, commit, date, command; every check and timing
row with an `ok` flag) to --out (default benchmarks/results/attention_<machine>.json,
with --sweep results/sweeps/attention_sweep_<machine>.json) and prints a table.
--sweep: also NS forced to 1, 2, 4, ..., 64 with the heuristic's even split (the
measurements the split heuristic's thresholds need). --capacity L: cache of L positions per slot with
contexts C < L (the heuristic sees L, the kernel the real C). --dry-run: tiny
shapes on CPU through the Triton interpreter, to check this module's logic.

    sparkinfer bench attention                            # ~1-2 min on an H200
    sparkinfer bench attention --sweep --models qwen3
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sparkinfer.bench import common
from sparkinfer.bench.timing import Graph, median, time_calls

__all__ = ["add_arguments", "main", "MODELS"]

MODELS = {"qwen3": (32, 4), "glm-air": (96, 8), "mixtral": (32, 8)}
BATCHES, CONTEXTS, HEAD_DIM = (1, 8, 32, 64), (1024, 4096), 128
DRY = dict(models={"tiny": (4, 2)}, batches=(1, 2), contexts=(64, 160), head_dim=64)
ROTATE_BYTES = 256 << 20
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
PEERS = ("flash_attn", "torch_gather_sdpa", "torch_sdpa_pregathered")


def _model_list(text: str) -> list[str]:
    import argparse

    names = text.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    return names


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def add_arguments(p) -> None:
    p.add_argument("--models", default=list(MODELS), type=_model_list, help="comma list of " + ",".join(MODELS))
    p.add_argument("--batches", default=BATCHES, type=_int_list, help="comma list of batch sizes")
    p.add_argument("--contexts", default=CONTEXTS, type=_int_list, help="comma list of contexts")
    p.add_argument("--capacity", type=int, default=0, help="cache positions per slot (default: the context)")
    p.add_argument("--sweep", action="store_true", help=f"also time NS in {SWEEP_SPLITS}")
    p.add_argument("--no-peers", action="store_true", help="time sparkinfer only")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU, Triton interpreter")
    p.add_argument("--out", default=None,
                   help="JSON rows (default benchmarks/results/attention_<machine>.json; --sweep: results/sweeps/)")


# Bounds of a check against the fp32 reference. The output is rounded to bf16 once
# (relative error norm ~2e-3), so 1e-2 leaves room for the split combine's fp32
# order while a wrong scale, a dropped split or a wrong slot lands far above it
# (a max-abs bound alone would not see a 1.5x scale: outputs are averages of
# ~1e3 random values, |out| ~ 0.03). The max-abs and lse bounds are the ones the
# eager check always used.
OUT_REL_NORM_MAX, OUT_MAX_ERR, LSE_MAX_ERR = 1e-2, 2e-2, 1e-3


def compare(out, ref_out, lse=None, ref_lse=None) -> dict:
    """Check fields of an output [B, 1, Hq, D] (and lse [B, 1, Hq]) against the fp32
    reference's: finite, relative error norm, worst absolute error, and `ok`."""
    import torch

    o = out.float()
    d = o - ref_out
    finite = bool(torch.isfinite(o).all())
    row = dict(out_rel_norm=(d.norm() / ref_out.norm()).item(), out_max_err=d.abs().max().item())
    ok = finite and row["out_rel_norm"] <= OUT_REL_NORM_MAX and row["out_max_err"] <= OUT_MAX_ERR
    if lse is not None:
        row["lse_max_err"] = (lse.float() - ref_lse).abs().max().item()
        ok = ok and row["lse_max_err"] <= LSE_MAX_ERR
    return dict(row, finite=finite, ok=bool(ok))


def time_graph(torch, calls, cuda: bool, reps: int):
    """(seconds per call, the last call's return value) of the callables `calls`, run
    back to back in one CUDA graph (eagerly on CPU), median of `reps` replays. After
    the timing the last call's outputs are poisoned (NaN) and the same graph replays
    once more, so the value returned is what the timed graph computes (a peer's
    outputs live in the graph's memory pool: the tensors captured are the ones each
    replay rewrites)."""
    held = [None]

    def all_calls():
        for c in calls[:-1]:
            c()
        held[0] = calls[-1]()

    if not cuda:
        all_calls()
        sec = median(time_calls(all_calls, reps, cuda=False)) / len(calls)
        replay = all_calls
    else:
        g = Graph(all_calls, torch.cuda.Stream())  # warm-up (compiles, keeps workspaces), then capture
        g.replay()
        torch.cuda.synchronize()
        sec = median(time_calls(g.replay, reps, cuda=True)) / len(calls)
        replay = g.replay
    for t in _tensors(held[0]):
        t.fill_(float("nan"))
    replay()
    if cuda:
        torch.cuda.synchronize()
        g.release()  # the tensors held keep their memory
    return sec, held[0]


def _tensors(value) -> list:
    """The tensors of a call's return value (a tensor or a tuple of them)."""
    return [t for t in (value if isinstance(value, tuple) else (value,)) if hasattr(t, "fill_")]


def copy_gbs(torch, dev: str, cuda: bool) -> float:
    """The device's copy bandwidth, bytes read + written, GB/s."""
    n = (2 << 30) if cuda else (16 << 20)
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = median(time_calls(lambda: dst.copy_(src), 10, cuda=cuda))
    return 2 * n / t / 1e9


class Point:
    """One (model, B, C): a cache of n * B slots and the n calls' slot tensors."""

    def __init__(self, torch, dev, heads, b, context, capacity, head_dim):
        hq, kvh = heads
        self.b, self.context, self.hq, self.kvh, self.d = b, context, hq, kvh, head_dim
        self.kv_bytes = b * context * kvh * head_dim * 2 * 2
        self.n = max(1, min(32, -(-ROTATE_BYTES // self.kv_bytes))) if dev == "cuda" else 1
        L = max(capacity, context)
        shape = (self.n * b, L, kvh, head_dim)
        self.k = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        self.q = torch.randn(b, 1, hq, head_dim, device=dev, dtype=torch.bfloat16)
        i32 = dict(dtype=torch.int32, device=dev)
        self.slots = [torch.arange(i * b, (i + 1) * b, **i32) for i in range(self.n)]
        self.q_pos = torch.full((b,), context - 1, **i32)
        self.out = torch.empty(b, 1, hq, head_dim, device=dev, dtype=torch.bfloat16)
        self.lse = torch.empty(b, 1, hq, device=dev)
        self.scale = head_dim ** -0.5


def reference(p: Point, slots):
    """The fp32 (out, lse) of the point's queries over the cache slots `slots`."""
    from sparkinfer.attention import attention_reference

    return attention_reference(p.q, p.k, p.v, slots, p.q_pos, sm_scale=p.scale)


def check(p: Point) -> dict:
    """One eager call with the default splits, before anything is timed."""
    from sparkinfer.attention import decode_attention

    out, lse = decode_attention(p.q, p.k, p.v, p.slots[0], p.q_pos, sm_scale=p.scale)
    ref_out, ref_lse = reference(p, p.slots[0])
    return dict(kind="check", **compare(out, ref_out, lse, ref_lse))


def check_timed(impl: str, value, ref) -> dict:
    """The timed graph's last output (`time_graph`) against `ref`, the reference of
    that call's slots: sparkinfer returns (out, lse) as [B, 1, Hq, D] / [B, 1, Hq],
    flash-attn out alone in the same layout, SDPA [B, Hq, 1, D]."""
    ref_out, ref_lse = ref
    if impl.startswith("sparkinfer"):
        return compare(value[0], ref_out, value[1], ref_lse)
    out = value.transpose(1, 2) if impl.startswith("torch_") else value
    return compare(out, ref_out)


def peer_calls(torch, p: Point, impl: str):
    """Callables of a peer over the same n calls (None where the peer is missing)."""
    if impl == "flash_attn":
        try:
            from flash_attn import flash_attn_with_kvcache
        except ImportError:
            return None
        seqlens = p.q_pos + 1
        return [lambda s=s: flash_attn_with_kvcache(p.q, p.k, p.v, cache_seqlens=seqlens, cache_batch_idx=s,
                                                    softmax_scale=p.scale, causal=True) for s in p.slots]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = p.q.transpose(1, 2)  # [B, Hq, 1, D]
    c = p.context
    if impl == "torch_gather_sdpa":
        def call(s):
            k = p.k.index_select(0, s)[:, :c].transpose(1, 2)  # [B, KVH, C, D]
            v = p.v.index_select(0, s)[:, :c].transpose(1, 2)
            return sdpa(q, k, v, scale=p.scale, enable_gqa=True)
        return [lambda s=s: call(s) for s in p.slots]
    kv = [(p.k[s.long(), :c].transpose(1, 2).contiguous(), p.v[s.long(), :c].transpose(1, 2).contiguous())
          for s in p.slots]
    return [lambda k=k, v=v: sdpa(q, k, v, scale=p.scale, enable_gqa=True) for k, v in kv]


def time_point(torch, p: Point, cuda: bool, lim: dict, args) -> list[dict]:
    from sparkinfer.attention import decode_attention, plan_call

    reps = 3 if args.dry_run else 20
    base = dict(kind="time", batch=p.b, context=p.context, capacity=p.k.shape[1], hq=p.hq, kvh=p.kvh,
                head_dim=p.d, kv_bytes=p.kv_bytes, calls_per_graph=p.n)
    ours = [("sparkinfer", None, True), ("sparkinfer-batch-dependent", None, False)]
    ours += [(f"sparkinfer-ns{ns}", ns, False) for ns in SWEEP_SPLITS if args.sweep and ns <= max(1, p.context // 64)]
    runs = [(impl, (ns, inv), [
        lambda s=s, ns=ns, inv=inv: decode_attention(p.q, p.k, p.v, s, p.q_pos, sm_scale=p.scale, out=p.out,
                                                     lse=p.lse, num_splits=ns, batch_invariant=inv)
        for s in p.slots]) for impl, ns, inv in ours]
    if not args.no_peers:
        runs += [(impl, None, peer_calls(torch, p, impl)) for impl in PEERS]
    ref = reference(p, p.slots[-1])  # every impl's last call reads these slots
    rows = []
    for impl, ns, calls in runs:
        if calls is None:
            continue
        try:
            sec, last = time_graph(torch, calls, cuda, reps)
        except Exception as exc:  # noqa: BLE001 - a peer may not support a shape; say so in the row
            if "CUDA error" in str(exc):
                raise  # the context is poisoned: nothing after this would be measured
            rows.append(dict(base, impl=impl, ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        gbs = p.kv_bytes / sec / 1e9
        ns_used = plan_call(p.q, p.k, num_splits=ns[0], batch_invariant=ns[1]).num_splits if ns else None
        verdict = check_timed(impl, last, ref)
        if not verdict["ok"]:
            print(f"check FAILED on the timed graph: B={p.b} C={p.context} {impl} rel_norm "
                  f"{verdict['out_rel_norm']:.2e} max_err {verdict['out_max_err']:.2e}", flush=True)
        rows.append(dict(base, impl=impl, num_splits=ns_used, us=sec * 1e6, kv_gbs=gbs,
                         frac_copy=gbs / lim["copy_gbs"],
                         **({"frac_spec_hbm": gbs / lim["spec_hbm_gbs"]} if "spec_hbm_gbs" in lim else {}),
                         **{f"check_{k}": v for k, v in verdict.items() if k != "ok"},
                         ok=verdict["ok"]))
    return rows


def print_summary(rows: list[dict], caption: str) -> None:
    from sparkinfer.bench.report import fmt, print_table

    t = {(r["model"], r["batch"], r["context"], r["impl"]): r for r in rows if r.get("kind") == "time" and "us" in r}

    def us(key, impl):
        return t.get((*key, impl), {}).get("us")

    body = []
    for (model, b, c, impl), r in sorted(t.items()):
        if impl == "sparkinfer":
            key = (model, b, c)
            spec = fmt(100 * r["frac_spec_hbm"], 1) if "frac_spec_hbm" in r else "–"
            body.append([model, b, c, r["num_splits"], fmt(r["us"], 1), fmt(r["kv_gbs"], 0),
                         f"{spec} ({fmt(100 * r['frac_copy'], 1)})", fmt(us(key, "sparkinfer-batch-dependent"), 1),
                         *(fmt(us(key, peer), 1) for peer in PEERS)])
    print_table("decode attention, us per call", ["model", "B", "C", "NS", "us", "KV GB/s", "% HBM (% copy)",
                                                  "batch-dependent us", "flash_attn us", "sdpa+gather us", "sdpa us"],
                body, caption=caption)
    swept = sorted(r for r in t if r[3].startswith("sparkinfer-ns"))
    if swept:
        body = [[m, b, c, t[(m, b, c, i)]["num_splits"], fmt(t[(m, b, c, i)]["us"], 1),
                 fmt(us((m, b, c), "sparkinfer"), 1)] for m, b, c, i in swept]
        print_table("split sweep, us per call", ["model", "B", "C", "NS", "us", "heuristic us"], body)


def main(args) -> int:
    from sparkinfer.bench.report import progress
    from sparkinfer.errors import DeviceError

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        raise DeviceError("sparkinfer bench attention: no CUDA device; use --dry-run to run it on the CPU")
    dev = "cuda" if cuda else "cpu"
    t0 = time.time()
    meta = common.metadata(args)
    out = Path(args.out) if args.out else common.default_out("attention", meta, 1, dry_run=args.dry_run,
                                                              sweep=args.sweep)
    lim = {"copy_gbs": copy_gbs(torch, dev, cuda), **common.spec_peaks(meta.get("gpu"))}
    print(f"device: {meta.get('gpu')}, copy {lim['copy_gbs']:.0f} GB/s (read + write)", flush=True)
    models = DRY["models"] if args.dry_run else {m: MODELS[m] for m in args.models}
    batches = DRY["batches"] if args.dry_run else args.batches
    contexts = DRY["contexts"] if args.dry_run else args.contexts
    head_dim = DRY["head_dim"] if args.dry_run else HEAD_DIM
    all_rows = [dict(kind="device", bench="attention", **lim)]
    common.append_rows(out, all_rows, meta)
    with progress(len(models) * len(batches) * len(contexts), "attention") as advance:
        for model, heads in models.items():
            for b in batches:
                for c in contexts:
                    p = Point(torch, dev, heads, b, c, args.capacity, head_dim)
                    rows = [check(p)] + time_point(torch, p, cuda, lim, args)
                    rows = [dict(r, bench="attention", model=model, batch=b, context=c) for r in rows]
                    common.append_rows(out, rows, meta)  # point by point: a crash keeps what was measured
                    all_rows += rows
                    del p
                    if cuda:
                        torch.cuda.empty_cache()
                    advance(f"{model} B={b} C={c}")
    print_summary(all_rows, f"{meta['gpu']}, commit {str(meta.get('commit'))[:10]}")
    failed = [r for r in all_rows if r["kind"] in ("check", "time") and not r["ok"]]
    checks = sum(r["kind"] == "check" for r in failed)
    ours = sum(r["kind"] == "time" and r["impl"].startswith("sparkinfer") for r in failed)
    print(f"checks failed: {checks}; sparkinfer timings failed: {ours}; peer timings failed: "
          f"{len(failed) - checks - ours}; {time.time() - t0:.0f} s; rows appended to {out}", flush=True)
    return 1 if checks or ours else 0
