#!/usr/bin/env python3
"""The MoE top-k reduce kernel alone, by width BH: the numbers behind
`sparkinfer.moe.runner.REDUCE_BLOCKS_H`.

Legend: T tokens, K top-k, H hidden, S FC2 splits (fp32 partials; S 1 with
bf16 rows is the grouped family's input).

For each case, poisons the output, checks it against an fp32 torch sum (every
element, bf16 tolerance), then times 20 launches in a CUDA graph (median of
5). Rows (with GPU, driver, versions, commit, date, command) go to --out.

    python3 benchmarks/sweeps/moe_reduce_bench.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

CASES = ((1, 8, 7168, 256, 1, "fp32"), (8, 8, 7168, 256, 1, "fp32"), (1, 8, 2048, 128, 2, "fp32"),
         (64, 8, 7168, 256, 1, "bf16"), (4096, 8, 7168, 256, 1, "bf16"),
         (4096, 8, 2048, 128, 1, "bf16"))
WIDTHS = (128, 256, 512, 1024)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe_reduce_h200.json")
    a = ap.parse_args(argv)
    _common.ensure_repo_on_path()
    import torch
    import triton

    from sparkinfer.moe.kernels.reduce import moe_reduce_kernel
    from sparkinfer.moe.runner import REDUCE_BLOCKS_H

    meta = _common.metadata(sys.argv if argv is None else [__file__, *argv])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for t, k, h, e, s, dt in CASES:
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        part = torch.randn(s, t * k, h, device="cuda").to(dtype)
        ids = torch.randint(0, e, (t, k), device="cuda", dtype=torch.int32)
        ids[0, -1] = -1  # a route that adds nothing
        tw = torch.rand(t, k, device="cuda")
        out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
        w = torch.where(ids >= 0, tw, 0.0)
        ref = (part.float().sum(0).view(t, k, h) * w[..., None]).sum(1)
        chosen = next((bh for bh in REDUCE_BLOCKS_H if 2 * t * triton.cdiv(h, bh) >= sms),
                      REDUCE_BLOCKS_H[-1])
        for bh in WIDTHS:
            def call(bh=bh):
                moe_reduce_kernel[(t, triton.cdiv(h, bh))](
                    part, ids, tw, out, h, s, part.stride(0), part.stride(1), out.stride(0),
                    E=e, K=k, KP=triton.next_power_of_2(k), BH=bh, WEIGHT_AFTER=True)
            out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            ok = bool(torch.isfinite(out.float()).all()) and err <= 0.01 * ref.abs().max().item()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    call()
            us = _common.median(_common.time_calls(g.replay, 5, cuda=True)) * 1e6 / 20
            rows.append(dict(kind="reduce", T=t, K=k, H=h, S=s, dtype=dt, BH=bh, us=us,
                             max_abs_err=err, ok=ok, chosen=bh == chosen))
            print(f"reduce T={t:<5d} H={h:<5d} S={s} {dt} BH={bh:<5d} {us:8.2f} us  err "
                  f"{err:.3g} {'ok' if ok else 'FAIL'}{'  <- runner' if bh == chosen else ''}",
                  flush=True)
    _common.append_rows(a.out, rows, meta)
    print(f"wrote {a.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
