#!/usr/bin/env python3
"""Prefill-sized tiles of attention and of rope_qk_cache: time the candidates against the planned one.

Legend: T tokens of a step, Q queries of a chunk, G query heads per KV head, BM rows of an
attention program (queries x G heads), W its warps, BR (token, head) rows of a rope program.

- attention: chunks of Q queries at a context (`--chunks`), each with BM in {128, 64} and
  W in {8, 4} (`attention.config.PREFILL_BLOCK_M` and the config's warps replaced);
- rope: `rope_qk_cache` over T tokens (`--tokens`) in blocks of {32, 16, 8, 4, 1} (token, head)
  rows (`rope.launch.MAX_BLOCK_ROWS`, and the narrowing floor lifted so the block holds).

Each call is timed in a CUDA graph of 20 calls (`timing.graph_op_us`) on random inputs and
checked bitwise against the planned launch (a row's bits must not follow the tile, or the
batch would change them); the planned attention against the fp32 reference as well. JSON
rows with `sparkinfer.bench.common.metadata` go to --out; exit status 1 when a check failed.
--dry-run: tiny shapes through the Triton interpreter (logic only).

    python3 benchmarks/sweeps/prefill_tiles_sweep.py --preset qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import types
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # sparkinfer without an install


def _attention_rows(heads, chunks, dev, cuda):
    import torch

    import sparkinfer.attention.config as acfg
    import sparkinfer.attention.launch as alaunch
    from sparkinfer.attention import decode_attention
    from sparkinfer.attention.reference import attention_reference
    from sparkinfer.bench.timing import sweep_op_us

    hq, kvh, d = heads
    planned_cfg = alaunch.attention_config
    rows, bad = [], 0
    g = torch.Generator().manual_seed(0)
    for b, q_len, ctx in chunks:
        kc, vc = (torch.randn(b, ctx, kvh, d, generator=g).to(torch.bfloat16).to(dev) for _ in range(2))
        q = torch.randn(b, q_len, hq, d, generator=g).to(torch.bfloat16).to(dev)
        slots = torch.arange(b, dtype=torch.int32, device=dev)
        q_pos = torch.full((b,), ctx - q_len, dtype=torch.int32, device=dev)
        planned = decode_attention(q, kc, vc, slots, q_pos, sm_scale=d ** -0.5)[0]
        ref = attention_reference(q, kc, vc, slots, q_pos, sm_scale=d ** -0.5)[0]
        # tests/attention/_util.py's bound: P rounded to bf16 before P @ V, the output to bf16
        ref_ok = bool(((planned.float() - ref).abs() <= 1e-2 + 2 * 2 ** -7 * ref.abs()).all())
        bad += not ref_ok
        for bm in (128, 64):  # wgmma tiles (32 rows take mma.sync: other bits)
            for warps in (8, 4):
                cfg = (lambda w: lambda **kw: dataclasses.replace(planned_cfg(**kw), num_warps=w))(warps)
                with mock.patch.dict(acfg.__dict__, PREFILL_BLOCK_M=bm), \
                        mock.patch.object(alaunch, "attention_config", cfg):
                    out = torch.full_like(planned, float("nan"))
                    lse = torch.empty(b, q_len, hq, dtype=torch.float32, device=dev)
                    fn = functools.partial(decode_attention, q, kc, vc, slots, q_pos, sm_scale=d ** -0.5,
                                           out=out, lse=lse)
                    fn()
                    same = torch.equal(out, planned)
                    us = sweep_op_us(fn, cuda)
                bad += not same
                rows.append(dict(kernel="attention", batch=b, q_len=q_len, context=ctx, block_m=bm, warps=warps,
                                 us=us, bitwise_equal_planned=same, planned_matches_fp32=ref_ok,
                                 ok=same and ref_ok))
                print(f"attention B={b} Q={q_len} ctx={ctx} BM={bm:3d} W={warps}: {us:8.1f} us  same bits {same}")
    return rows, bad


def _rope_rows(heads, tokens, dev, cuda):
    import torch

    import sparkinfer.rope.launch as rlaunch
    from sparkinfer.bench.timing import sweep_op_us
    from sparkinfer.rope import rope_qk_cache, rotary_table

    hq, kvh, d = heads
    table = rotary_table(d, 1e6, max(tokens), dev)
    rows, bad = [], 0
    g = torch.Generator().manual_seed(1)
    for t in tokens:
        qkv = torch.randn(t, (hq + 2 * kvh) * d, generator=g).to(torch.bfloat16).to(dev)
        pos = torch.arange(t, dtype=torch.int32, device=dev)
        slots = torch.zeros(t, dtype=torch.int32, device=dev)
        norms = tuple(torch.randn(d, generator=g).to(torch.bfloat16).to(dev) for _ in range(2))

        def run(q_out, qkv=qkv, pos=pos, slots=slots, norms=norms, t=t):
            caches = tuple(torch.zeros(1, t, kvh, d, dtype=torch.bfloat16, device=dev) for _ in range(2))
            fn = functools.partial(rope_qk_cache, qkv, pos, slots, table, caches, (hq, kvh, d), norms=norms,
                                   q_out=q_out)
            fn()
            return fn, (q_out.clone(), caches[0].clone(), caches[1].clone())

        _, planned = run(torch.empty(t, hq, d, dtype=torch.bfloat16, device=dev))
        for br in (32, 16, 8, 4, 1):
            with mock.patch.dict(rlaunch.__dict__, MAX_BLOCK_ROWS=br, _MIN_PROGRAMS=1):
                fn, got = run(torch.full((t, hq, d), float("nan"), dtype=torch.bfloat16, device=dev))
                same = all(torch.equal(a, b) for a, b in zip(got, planned))
                us = sweep_op_us(fn, cuda)
            bad += not same
            rows.append(dict(kernel="rope_qk_cache", tokens=t, block_rows=br, us=us, bitwise_equal_planned=same,
                             ok=same))
            print(f"rope T={t:5d} BR={br:2d}: {us:8.1f} us  same bits {same}")
    return rows, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--chunks", default="1x256@512,4x256@512,1x512@512",
                    help="attention calls, each BxQ@context")
    ap.add_argument("--tokens", default="64,256,1024")
    ap.add_argument("--out", default=None, help="default benchmarks/results/sweeps/prefill_tiles_sweep_<machine>.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from sparkinfer.bench.common import append_rows, default_out, metadata
    from sparkinfer.models.presets import preset_config

    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    if args.dry_run:
        heads, chunks, tokens = (4, 2, 16), [(1, 80, 96)], [5]  # 160 rows: prefill tiles
    else:
        c = preset_config(args.preset)
        heads = (c["num_attention_heads"], c["num_key_value_heads"],
                 c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        chunks = [(int(b), int(q), int(ctx)) for b, rest in (s.split("x") for s in args.chunks.split(","))
                  for q, ctx in [rest.split("@")]]
        tokens = [int(t) for t in args.tokens.split(",")]
    a_rows, a_bad = _attention_rows(heads, chunks, dev, cuda)
    r_rows, r_bad = _rope_rows(heads, tokens, dev, cuda)
    rows = [dict(bench="prefill_tiles_sweep", preset=args.preset, heads=list(heads), **r) for r in a_rows + r_rows]
    meta = metadata(types.SimpleNamespace(argv=["python3", "benchmarks/sweeps/prefill_tiles_sweep.py", *sys.argv[1:]]))
    out = args.out or default_out("prefill_tiles", meta, 1, dry_run=args.dry_run, sweep=True)
    bad = a_bad + r_bad
    print(f"rows -> {append_rows(out, rows, meta)}; {bad} checks failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
