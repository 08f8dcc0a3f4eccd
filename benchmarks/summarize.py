"""Print the README's result tables (markdown) from benchmarks/results/*.json.

    python3 benchmarks/summarize.py > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> list:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else []


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def comm_tables(rows: list) -> str:
    t: dict = defaultdict(dict)
    for r in rows:
        if r.get("op") in ("all_reduce", "reduce_scatter", "all_gather") and "us" in r:
            t[(r["op"], r["size_bytes"])][r["impl"]] = r["us"]
    meta = next((r for r in rows if "commit" in r), {})
    out = [f"All-reduce, bf16, µs per op inside a CUDA graph, 2x {meta.get('gpu', '?')} (NV18), "
           f"commit {meta.get('commit')}, {meta.get('date', '')[:10]}, `{meta.get('command', '')}` "
           f"(torch {meta.get('torch')}, triton {meta.get('triton')}, NCCL {meta.get('nccl')}, driver {meta.get('driver')}):",
           "", "| size | ours auto | LL | one-shot | two-shot | NCCL | symm one_shot | symm two_shot | auto / NCCL | target |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    targets = {2 << 10: 4, 32 << 10: 4, 128 << 10: 5, 512 << 10: 6.5, 2 << 20: 10, 8 << 20: 26, 32 << 20: 95}
    for (op, size), d in sorted(t.items()):
        if op != "all_reduce":
            continue
        f = lambda k: f"{d[k]:.2f}" if k in d else "–"  # noqa: E731
        tgt = targets.get(size)
        mark = "" if tgt is None else (" ✓" if d.get("auto", 1e9) <= tgt else " ✗")
        out.append(f"| {_size(size)} | {f('auto')} | {f('ll')} | {f('oneshot')} | {f('twoshot')} | {f('nccl')} | "
                   f"{f('symm_one_shot')} | {f('symm_two_shot')} | {d['auto'] / d['nccl']:.2f} | "
                   f"{'–' if tgt is None else f'≤ {tgt}'}{mark} |")
    out += ["", "Reduce-scatter and all-gather, bf16, µs per op (same run):", "",
            "| size | reduce_scatter ours | NCCL | all_gather ours | NCCL |", "| --- | --- | --- | --- | --- |"]
    for size in sorted({s for (_, s) in t}):
        rs, ag = t.get(("reduce_scatter", size), {}), t.get(("all_gather", size), {})
        if rs or ag:
            out.append(f"| {_size(size)} | {rs.get('ours', 0):.2f} | {rs.get('nccl', 0):.2f} | "
                       f"{ag.get('ours', 0):.2f} | {ag.get('nccl', 0):.2f} |")
    return "\n".join(out)


def _meta(rows: list) -> str:
    """Commit, date, versions and every distinct command the rows came from (one run may be in parts)."""
    m = next((r for r in rows if "commit" in r), {})
    cmds = list(dict.fromkeys(r["command"] for r in rows if r.get("command")))
    shown = " and ".join(f"`{c}`" for c in cmds) or "command not recorded"
    return (f"commit {m.get('commit')}, {m.get('date', '')[:10]}, {shown} "
            f"(torch {m.get('torch')}, triton {m.get('triton')}, driver {m.get('driver')})")


def fused_tables(rows: list) -> str:
    t: dict = defaultdict(dict)
    for r in rows:
        if r.get("op") == "fused_norm" and "us" in r and r.get("dtype", "bfloat16") == "bfloat16":
            t[(r["H"], r["T"])][r["impl"]] = r["us"]
    norm = [r for r in rows if r.get("op") == "fused_norm"]
    out = [f"Fused all-reduce + residual + RMSNorm, bf16, 2x H200, µs per op in a CUDA graph, {_meta(norm)}:", "",
           "| H | T | fused | our all_reduce (auto) | fused / all_reduce (target ≤ 1.15) | our AR + torch | NCCL + torch |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for (h, tk), d in sorted(t.items()):
        if "fused" in d and "ar_auto" in d:
            out.append(f"| {h} | {tk} | {d['fused']:.2f} | {d['ar_auto']:.2f} | {d['fused'] / d['ar_auto']:.2f} | "
                       f"{d.get('ar+torch', 0):.2f} | {d.get('nccl+torch', 0):.2f} |")
    t = defaultdict(dict)
    for r in rows:
        if r.get("op") == "dcp_merge" and "us" in r:
            t[(r["H"], r["D"], r["T"], r["scatter"])][r["impl"]] = r["us"]
    dcp_meta = [r for r in rows if "--only dcp" in str(r.get("command", ""))]  # a separate run, appended
    ts = sorted({k[2] for k in t})
    out += ["", f"dcp_merge (2 ranks, bf16), µs per op in a CUDA graph, ours / NCCL composition (all_gather + "
            f"local merge) and the speedup (target ≥ 2x at T ≤ 64), "
            f"{_meta(dcp_meta) if dcp_meta else 'same run'}:", "",
            "| H | D | scatter | " + " | ".join(f"T = {tk}" for tk in ts) + " |",
            "| --- | --- | --- | " + " | ".join("---" for _ in ts) + " |"]
    for h, dd, sc in sorted({(k[0], k[1], k[3]) for k in t}):
        cells = []
        for tk in ts:
            d = t.get((h, dd, tk, sc), {})
            ok = "dcp_kernel" in d and "dcp_nccl" in d
            cells.append(f"{d['dcp_kernel']:.1f} / {d['dcp_nccl']:.1f} ({d['dcp_nccl'] / d['dcp_kernel']:.1f}x)"
                         if ok else "–")
        out.append(f"| {h} | {dd} | {sc} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def moe_tables(rows: list) -> str:
    t: dict = defaultdict(dict)
    for r in rows:
        if r.get("kind") == "time" and "us" in r:
            t[(r["shape"], r["M"])][(r["impl"], r.get("format"))] = r
    devs = [r for r in rows if r.get("kind") == "device"] or [{}]
    gbs = " / ".join(f"{d.get('copy_gbs', 0):.0f}" for d in devs)
    tfl = " / ".join(f"{d.get('bf16_tflops', 0):.0f}" for d in devs)
    out = [f"MoE layer, one H200, µs per call in a CUDA graph; floor = active experts' weight bytes at the copy "
           f"bandwidth measured in the same run ({gbs} GB/s counting read + write{', one per part' if len(devs) > 1 else ''}); "
           f"tc = fraction of the measured bf16 matmul rate ({tfl} TFLOP/s); {_meta(rows)}:", "",
           "| shape | M | nvfp4 µs | nvfp4 % floor | bf16 µs | bf16 % floor | bf16 % tc | torch._grouped_mm bf16 µs | nvfp4 speedup vs grouped_mm |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (shape, m), d in sorted(t.items()):
        n, b, g = d.get(("sparkinfer", "nvfp4")), d.get(("sparkinfer", "bf16")), d.get(("torch_grouped_mm", "bf16"))
        if not (n and b):
            continue
        gus = g["us"] if g else float("nan")
        out.append(f"| {shape} | {m} | {n['us']:.1f} | {100 * n['frac_floor']:.0f}% | {b['us']:.1f} | "
                   f"{100 * b['frac_floor']:.0f}% | {100 * b['frac_tc']:.1f}% | {gus:.1f} | {gus / n['us']:.2f}x |")
    return "\n".join(out)


def main() -> int:
    print(comm_tables(_load("comm_2xh200.json")))
    print()
    print(fused_tables(_load("fused_2xh200.json")))
    print()
    print(moe_tables(_load("moe_h200.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
