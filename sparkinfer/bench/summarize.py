"""Print the docs' results tables (markdown) from the result files.

    sparkinfer bench summarize                  # every table, for docs/performance.md
    sparkinfer bench summarize --brief          # one short table per op, for the README
    sparkinfer bench summarize --junit FILE     # GPU test log (pytest --junitxml) -> results JSON

Reads `<bench>_<machine>.json` in --results (the latest run of each benchmark on
each machine; sweeps live in results/sweeps/ and are not tabulated). Rows whose
correctness check failed are refused: they never reach a table, and the refusal
is reported on stderr with the rows it dropped.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

from sparkinfer.bench.common import RESULTS_DIR, load_rows, spec_peaks

__all__ = ["add_arguments", "main", "tables"]

_FILE = re.compile(r"^(comm|fused|moe|decode)_([a-z0-9]+)\.json$")
ALL_REDUCE_TARGET_US = {2 << 10: 4, 32 << 10: 4, 128 << 10: 5, 512 << 10: 6.5, 2 << 20: 10, 8 << 20: 26,
                        32 << 20: 95}
# --brief: the rows of one short table per op (fused norm at the largest H, dcp at D 128 replicated)
BRIEF_T = (1, 8, 64, 256)
BRIEF_M = (1, 8, 64, 1024, 4096)


def add_arguments(p) -> None:
    p.add_argument("--results", default=str(RESULTS_DIR), help="directory of result files (default %(default)s)")
    p.add_argument("--brief", action="store_true", help="one short table per op (the README's)")
    p.add_argument("--junit", default=None, metavar="FILE",
                   help="instead: convert pytest's JUnit XML (GPU tests) into JSON rows with this machine's GPU, "
                   "driver and commit (see sparkinfer.bench.junit), and print the counts")
    p.add_argument("--out", default=None, help="with --junit: the JSON file (default "
                   "benchmarks/results/gpu_tests_<machine>.json)")


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def _f(d: dict, k, digits: int = 2) -> str:
    return f"{d[k]:.{digits}f}" if k in d else "–"


def _md(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def provenance(rows: list, machine: str, brief: bool = False) -> str:
    """Machine, commit, date, versions and every distinct command the rows came from."""
    m = next((r for r in rows if "commit" in r), {})
    commits = list(dict.fromkeys(str(r["commit"])[:7] for r in rows if r.get("commit")))
    where = f"{m.get('gpu', '?')} ({machine}), commit {' / '.join(commits) or '?'}, {str(m.get('date', ''))[:10]}"
    if brief:
        return where
    cmds = list(dict.fromkeys(r["command"] for r in rows if r.get("command")))
    shown = " and ".join(f"`{c}`" for c in cmds) or "command not recorded"
    nccl = f", NCCL {m['nccl']}" if m.get("nccl") else ""
    return (f"{where}, {shown} (torch {m.get('torch')}, triton {m.get('triton')}{nccl}, "
            f"driver {m.get('driver')})")


def refuse_failed(bench: str, rows: list) -> tuple[list, list]:
    """(rows to tabulate, refused rows): comm rows with correct=False, fused rows with
    ok=False, MoE timings whose own output check failed (ok=False: the timed
    graph's outputs against the reference) or of a (shape, format) whose check
    failed in the same run."""
    if bench == "moe":
        bad = {(r.get("shape"), r.get("format"), r.get("commit")) for r in rows
               if r.get("kind") == "check" and r.get("ok") is False}
        failed = lambda r: r.get("kind") == "time" and (  # noqa: E731
            r.get("ok") is False or (r.get("shape"), r.get("format"), r.get("commit")) in bad)
    else:
        key = "correct" if bench == "comm" else "ok"
        failed = lambda r: r.get(key) is False  # noqa: E731
    keep = [r for r in rows if not failed(r)]
    return keep, [r for r in rows if failed(r)]


def comm_tables(rows: list, machine: str, brief: bool) -> list[str]:
    t: dict = defaultdict(dict)
    for r in rows:
        if r.get("op") in ("all_reduce", "reduce_scatter", "all_gather") and "us" in r:
            t[(r["op"], r["size_bytes"])][r["impl"]] = r["us"]
    ar = sorted((s, d) for (op, s), d in t.items() if op == "all_reduce")
    out = [f"All-reduce, bf16, µs per op inside a CUDA graph, {provenance(rows, machine, brief)}:", ""]
    if brief:
        body = [[_size(s), _f(d, "auto"), _f(d, "nccl"), f"{d['auto'] / d['nccl']:.2f}" if "nccl" in d else "–"]
                for s, d in ar if "auto" in d]
        out += _md(["size", "sparkinfer", "NCCL", "sparkinfer / NCCL"], body)
        return out
    body = []
    for s, d in ar:
        tgt = ALL_REDUCE_TARGET_US.get(s)
        mark = "" if tgt is None else (" ✓" if d.get("auto", 1e9) <= tgt else " ✗")
        body.append([_size(s)] + [_f(d, k) for k in ("auto", "ll", "oneshot", "twoshot", "nccl", "symm_one_shot",
                                                     "symm_two_shot")]
                    + [f"{d['auto'] / d['nccl']:.2f}" if "auto" in d and "nccl" in d else "–",
                       "–" if tgt is None else f"≤ {tgt}{mark}"])
    out += _md(["size", "ours auto", "LL", "one-shot", "two-shot", "NCCL", "symm one_shot", "symm two_shot",
                "auto / NCCL", "target"], body)
    out += ["", "Reduce-scatter and all-gather, bf16, µs per op (same run):", ""]
    body = [[_size(s), _f(t.get(("reduce_scatter", s), {}), "ours"), _f(t.get(("reduce_scatter", s), {}), "nccl"),
             _f(t.get(("all_gather", s), {}), "ours"), _f(t.get(("all_gather", s), {}), "nccl")]
            for s in sorted({s for (_, s) in t}) if ("reduce_scatter", s) in t or ("all_gather", s) in t]
    return out + _md(["size", "reduce_scatter ours", "NCCL", "all_gather ours", "NCCL"], body)


def _whose_time(rows: list) -> str:
    """Runs since the fused benchmark merged its ranks record every rank's time."""
    timed = [r for r in rows if "us" in r]
    return "slowest rank" if timed and all("us_per_rank" in r for r in timed) else "rank 0's time"


def fused_tables(rows: list, machine: str, brief: bool) -> list[str]:
    t: dict = defaultdict(dict)
    top_h = max((r["H"] for r in rows if r.get("op") == "fused_norm"), default=0)
    for r in rows:
        if r.get("op") == "fused_norm" and "us" in r and (not brief or (r["T"] in BRIEF_T and r["H"] == top_h)):
            t[(r["H"], r["T"])][r["impl"]] = r["us"]
    norm = [r for r in rows if r.get("op") == "fused_norm"]
    out = [f"Fused all-reduce + residual + RMSNorm, bf16, µs per op in a CUDA graph ({_whose_time(norm)}), "
           f"{provenance(norm, machine, brief)}:", ""]
    body = [[h, tk, _f(d, "fused"), _f(d, "ar_auto"), f"{d['fused'] / d['ar_auto']:.2f}", _f(d, "ar+torch"),
             _f(d, "nccl+torch")] for (h, tk), d in sorted(t.items()) if "fused" in d and "ar_auto" in d]
    out += _md(["H", "T", "fused", "our all_reduce (auto)", "fused / all_reduce (target ≤ 1.15)", "our AR + torch",
                "NCCL + torch"], body)
    t = defaultdict(dict)
    for r in rows:
        if r.get("op") == "dcp_merge" and "us" in r and (
                not brief or (r["T"] in BRIEF_T and not r["scatter"] and r["D"] == 128)):
            t[(r["H"], r["D"], r["T"], r["scatter"])][r["impl"]] = r["us"]
    dcp = [r for r in rows if r.get("op") == "dcp_merge"]
    ts = sorted({k[2] for k in t})
    has_ag_rs = any(r.get("impl") == "dcp_ag_rs" for r in dcp)
    base = ("the fastest torch composition: n = all_gather of o and lse + torch merge, c = the same with the merge "
            "torch.compile'd, a = all_gather of lse + one compiled correction + reduce-scatter" if has_ag_rs else
            "NCCL composition (all_gather of o and lse + torch merge; the stronger all_gather-of-lse + correction "
            "+ reduce-scatter composition was not in this run)")
    out += ["", f"dcp_merge (2 ranks, bf16), µs per op in a CUDA graph ({_whose_time(dcp)}), ours / {base}, and the "
            f"speedup (target ≥ 2x at T ≤ 64), {provenance(dcp, machine, brief)}:", ""]
    body = []
    for h, dd, sc in sorted({(k[0], k[1], k[3]) for k in t}):
        cells = []
        for tk in ts:
            d = t.get((h, dd, tk, sc), {})
            bs = [(d[k], tag) for k, tag in (("dcp_nccl", "n"), ("dcp_nccl_compiled", "c"), ("dcp_ag_rs", "a"))
                  if k in d]
            if "dcp_kernel" in d and bs:
                us, tag = min(bs)
                cells.append(f"{d['dcp_kernel']:.1f} / {us:.1f}{' ' + tag if has_ag_rs else ''} "
                             f"({us / d['dcp_kernel']:.1f}x)")
            else:
                cells.append("–")
        body.append([h, dd, sc, *cells])
    return out + _md(["H", "D", "scatter", *(f"T = {tk}" for tk in ts)], body)


def _spec(r: dict, rows: list) -> dict:
    """The GPU's specified peaks for a row: the row's own where it records them (newer
    runs do), else looked up by the GPU name its file records."""
    peaks = spec_peaks(next((x.get("gpu") for x in rows if x.get("gpu")), None))
    return {**peaks, **{k: r[k] for k in peaks if k in r}}


def _pct_flag(frac: float, over: str) -> str:
    """A percentage, flagged with `over` when it passes 100%."""
    return f"{100 * frac:.0f}%{over if frac > 1.0 else ''}"


def moe_tables(rows: list, machine: str, brief: bool) -> list[str]:
    t: dict = defaultdict(dict)
    for r in rows:
        if r.get("kind") == "time" and "us" in r and (not brief or r["M"] in BRIEF_M):
            t[(r["shape"], r["M"])][(r["impl"], r.get("format"))] = r
    devs = [r for r in rows if r.get("kind") == "device"] or [{}]
    gbs = " / ".join(f"{d.get('copy_gbs', 0):.0f}" for d in devs)
    tfl = " / ".join(f"{d.get('bf16_tflops', 0):.0f}" for d in devs)
    peaks = _spec(devs[0], rows)
    hbm, tc, tc8 = peaks.get("spec_hbm_gbs"), peaks.get("spec_bf16_tflops"), peaks.get("spec_fp8_tflops")
    hbm_s = f"{hbm / 1000:g} TB/s" if hbm else "? GB/s"
    tc_s = f"{tc:g}" if tc else "?"
    tc8_s = f"{tc8:g}" if tc8 else "?"
    parts = ", one per part" if len(devs) > 1 else ""
    out = [f"MoE layer, µs per call in a CUDA graph; HBM = active experts' weight bytes at the GPU's specified "
           f"{hbm_s}, as a fraction of the time taken (in brackets: at the copy rate measured in the same "
           f"run, {gbs} GB/s counting read + write{parts}); tc = fraction of the specified {tc_s} TFLOP/s dense "
           f"bf16 (in brackets: of the {tfl} TFLOP/s an 8192³ matmul reached in the same run), for fp8 of the "
           f"specified {tc8_s} TFLOP/s dense FP8, for nvfp4 (bf16 MMAs on Hopper) of the bf16 rate; torch = the faster "
           f"of `torch._grouped_mm` (g) and a per-expert loop (l), bf16; {provenance(rows, machine, brief)}:", ""]
    body, over = [], set()

    def hbm_cell(r: dict) -> str:
        """'% HBM (% copy)' of one timed row; notes the flags it used in `over`."""
        spec_frac = r["weight_bytes"] / (hbm * 1e9) / (r["us"] * 1e-6) if hbm else None
        over.update(f for f, x in (("†", r["frac_floor"]), ("‡", spec_frac or 0.0)) if x > 1.0)
        copy = _pct_flag(r["frac_floor"], "†")
        return f"{_pct_flag(spec_frac, '‡')} ({copy})" if spec_frac else f"– ({copy})"

    def tc_cell(r: dict, peak) -> str:
        return f"{100 * r['tflops'] / peak:.1f}%" if peak and "tflops" in r else "–"

    for (shape, m), d in sorted(t.items()):
        n, b = d.get(("sparkinfer", "nvfp4")), d.get(("sparkinfer", "bf16"))
        if not (n and b):
            continue
        base = [(r["us"], tag) for tag, key in (("g", "torch_grouped_mm"), ("l", "torch_loop"))
                if (r := d.get((key, "bf16")))]
        best, tag = min(base) if base else (float("nan"), "")
        cells = [shape, m]
        cells += [f"{n['us']:.1f}", hbm_cell(n), tc_cell(n, tc), f"{b['us']:.1f}", hbm_cell(b)]
        spec_tc = b["tflops"] / tc if tc and "tflops" in b else None
        measured = f"({100 * b['frac_tc']:.1f}%)"
        cells.append(f"{100 * spec_tc:.1f}% {measured}" if spec_tc else f"– {measured}")
        cells += [f"{best:.1f} {tag}", f"{best / b['us']:.2f}x", f"{best / n['us']:.2f}x"]
        f8 = d.get(("sparkinfer", "fp8_block"))
        cells += ([f"{f8['us']:.1f}", hbm_cell(f8), tc_cell(f8, tc8), f"{b['us'] / f8['us']:.2f}x"] if f8
                  else ["–"] * 4)
        body.append(cells)
    over_copy, over_spec = "†" in over, "‡" in over
    out += _md(["shape", "M", "nvfp4 µs", "nvfp4 % HBM (% copy)", "nvfp4 % tc", "bf16 µs", "bf16 % HBM (% copy)",
                "bf16 % tc (% measured)", "torch bf16 µs", "bf16 vs torch", "nvfp4 vs torch", "fp8 µs",
                "fp8 % HBM (% copy)", "fp8 % tc", "fp8 vs bf16"], body)
    notes = []
    if any(r.get("impl") == "torch_loop" and r.get("mode") == "graph" for r in rows):
        notes.append("l: in this run the loop's routing setup (which experts, which rows) ran on the host outside "
                     "the timed graph, so its times are a lower bound for the loop (newer runs time the setup, "
                     "eagerly)")
    if over_copy:
        notes.append("† above the copy rate measured in the same run: that rate is a 2 GiB copy's read + write "
                     "traffic, and a kernel that only reads its weights can beat it; the specified HBM rate is the "
                     "bound")
    if over_spec:
        notes.append("‡ above the specified HBM rate: some weights were served from L2 (50 MiB; the graph replays "
                     "G calls whose routings share experts), so the HBM fraction does not apply")
    return out + ([""] + [f"{x}." for x in notes] if notes else [])


def decode_tables(rows: list, machine: str, brief: bool) -> list[str]:
    """Decode step time and tokens/s per preset and batch, ours against the torch-ops build
    of the same model and transformers; the shared-expert overlap, batch invariance and
    speculative rows."""
    steps = defaultdict(dict)
    for r in rows:
        if r.get("bench") == "decode" and r.get("overlap_shared", True) is not False and \
                r.get("batch_invariant", True) is not False and (not brief or r["batch"] in (1, 8, 64)):
            steps[(r["preset"], r.get("dcp", 1), r["batch"])][(r["impl"], r["experts"])] = r
    tp = max((r.get("tp", 1) for r in rows if r.get("bench") == "decode"), default=1)
    dcps = {k[1] for k in steps}
    # each run measured its own copy rate, and its rows' % copy use it
    rates = sorted({round(r["copy_bandwidth_Bps"] / 1e9) for r in rows if r.get("copy_bandwidth_Bps")})
    bw_s = ("? GB/s" if not rates else f"{rates[0]} GB/s" if len(rates) == 1 else
            f"{rates[0]}-{rates[-1]} GB/s across its runs")
    layers = next((r["layers"] for r in rows if r.get("layers")), "?")
    # The floor against the part's specified HBM rate leads, the copy rate measured in
    # the same run in brackets, as in the MoE table: that copy counts read + write
    # traffic, which a step that mostly reads can beat, so it is no bound.
    hbm = _spec({}, rows).get("spec_hbm_gbs")
    hbm_s = f"{hbm / 1000:g} TB/s" if hbm else "? GB/s"
    out = [f"Decode step, TP = {tp}, {layers} decoder layers of the preset's dimensions with random weights, context "
           f"512; µs per step (CUDA graph); HBM = the step's weight and KV bytes (the experts uniform routing would "
           f"hit) at the GPU's specified {hbm_s}, as a fraction of the time taken (in brackets: at the copy rate "
           f"measured in the same run, {bw_s}, counting read + write); {provenance(rows, machine, brief)}:", ""]
    body, over_copy, over_spec = [], False, False

    def floor(r):
        nonlocal over_copy, over_spec
        if not (r and r.get("frac_floor")):
            return "–"
        copy = r["frac_floor"]
        over_copy |= copy > 1.0
        if not (hbm and r.get("copy_bandwidth_Bps")):
            return f"– ({_pct_flag(copy, '†')})"
        spec = copy * r["copy_bandwidth_Bps"] / 1e9 / hbm  # the same bytes at the specified rate
        over_spec |= spec > 1.0
        return f"{_pct_flag(spec, '‡')} ({_pct_flag(copy, '†')})"

    for (preset, dcp, b), d in sorted(steps.items()):
        ours, nv, tor, hf = (d.get(k) for k in (("sparkinfer", "bf16"), ("sparkinfer", "nvfp4"), ("torch", "bf16"),
                                                ("transformers", "bf16")))
        if not ours:
            continue
        body.append([preset, *([dcp] if dcps != {1} else []), b, f"{ours['us_per_step']:.0f}", floor(ours),
                     f"{nv['us_per_step']:.0f}" if nv else "–", floor(nv),
                     f"{tor['us_per_step']:.0f}" if tor else "–",
                     f"{hf['us_per_step']:.0f}" if hf else "–",
                     f"{tor['us_per_step'] / ours['us_per_step']:.2f}x" if tor else "–",
                     f"{b / ours['us_per_step'] * 1e6:.0f}"])
    out += _md(["preset", *(["DCP"] if dcps != {1} else []), "B", "ours bf16 µs", "bf16 % HBM (% copy)",
                "ours NVFP4 µs", "NVFP4 % HBM (% copy)", "torch ops bf16 µs", "transformers µs", "torch ops / ours",
                "ours bf16 tokens/s"], body)
    notes = []
    if over_copy:
        notes.append("† above the copy rate measured in the same run: that rate is a device copy's read + write "
                     "traffic, which a step that mostly reads its weights can beat, and above batch 1 the floor "
                     "may count more expert bytes than the step reads (see ‡)")
    if over_spec:
        notes.append("‡ above the specified HBM rate: the step read fewer bytes than its floor counts. Above batch 1 "
                     "the floor counts the experts that uniform routing would hit, and the benchmark's random "
                     "routers concentrate tokens on fewer experts; only batch 1 (its top-k experts per layer, "
                     "exactly) is a clean comparison")
    out += [""] + [f"{x}." for x in notes] if notes else []
    pairs = defaultdict(dict)
    for r in rows:
        if r.get("bench") == "decode" and "overlap_shared" in r and r["impl"] == "sparkinfer" and \
                r.get("batch_invariant", True) is not False:
            pairs[(r["preset"], r["experts"], r["batch"])][r["overlap_shared"]] = r["us_per_step"]
    both = [(k, v) for k, v in sorted(pairs.items()) if len(v) == 2]
    if both and not brief:
        out += ["", "Shared experts on an auxiliary stream, µs per decode step with the overlap on / off:", ""]
        out += _md(["preset", "experts", "B", "on", "off", "gain"],
                   [[p, e, b, f"{v[True]:.0f}", f"{v[False]:.0f}", f"{100 * (1 - v[True] / v[False]):.1f}%"]
                    for (p, e, b), v in both])
    inv = defaultdict(dict)
    for r in rows:
        if r.get("bench") == "decode" and "batch_invariant" in r and r.get("overlap_shared", True) is not False:
            inv[(r["preset"], r.get("tp", 1), r["experts"], r["batch"])][r["batch_invariant"]] = r["us_per_step"]
    both = [(k, v) for k, v in sorted(inv.items()) if len(v) == 2]
    if both and not brief:
        out += ["", "Batch invariance (a row's logits the same bits beside any rows), µs per decode step of our "
                    "decoder invariant / batch-dependent, timed in the same run (`bench decode --invariance "
                    "both`):", ""]
        out += _md(["preset", "TP", "experts", "B", "invariant", "batch-dependent", "cost"],
                   [[p, tp, e, b, f"{v[True]:.0f}", f"{v[False]:.0f}", f"{100 * (v[True] / v[False] - 1):+.1f}%"]
                    for (p, tp, e, b), v in both])
    spec = [r for r in rows if r.get("bench") == "decode_speculative"]
    if spec and not brief:
        out += ["", "Speculative decoding, batch 1, generation tokens/s (host loop included), self-draft of the "
                    "first half of the layers on a model whose later layers are zeroed (the draft agrees by "
                    "construction):", ""]
        out += _md(["preset", "k", "plain tok/s", "speculative tok/s", "speedup", "acceptance"],
                   [[r["preset"], r["k"], f"{r['plain_tokens_per_s']:.0f}", f"{r['spec_tokens_per_s']:.0f}",
                     f"{r['speedup']:.2f}x", f"{r['acceptance']:.2f}"] for r in spec])
    return out


_TABLES = {"comm": comm_tables, "fused": fused_tables, "moe": moe_tables, "decode": decode_tables}


def tables(results: Path, brief: bool = False) -> tuple[str, list[str]]:
    """(markdown of every table, one line per refused group of rows)."""
    parts, refused = [], []
    for path in sorted(results.glob("*.json"), key=lambda p: (list(_TABLES).index(_FILE.match(p.name)[1])
                                                             if _FILE.match(p.name) else 9, p.name)):
        m = _FILE.match(path.name)
        if not m:
            continue
        rows, bad = refuse_failed(m[1], load_rows(path))
        if bad:
            refused.append(f"{path.name}: refused {len(bad)} rows whose correctness check failed, e.g. "
                           + "; ".join(str({k: r.get(k) for k in ("op", "impl", "shape", "format", "M", "T", "H",
                                                                     "size_bytes") if k in r}) for r in bad[:3]))
        parts.append("\n".join(_TABLES[m[1]](rows, m[2], brief)))
    return "\n\n".join(parts), refused


def main(args) -> int:
    if args.junit:
        from sparkinfer.bench.junit import convert

        path, summary = convert(args.junit, args.out, args)
        print(f"{summary['tests']} tests: {summary['passed']} passed, {summary['failed']} failed, "
              f"{summary['error']} errors, {summary['skipped']} skipped; rows appended to {path}")
        return 0 if summary["ok"] else 1
    results = Path(args.results)
    if not results.is_dir():
        print(f"sparkinfer bench summarize: no results directory {results}; pass --results DIR", file=sys.stderr)
        return 2
    text, refused = tables(results, args.brief)
    print(text)
    for line in refused:
        print(line, file=sys.stderr)
    return 0
