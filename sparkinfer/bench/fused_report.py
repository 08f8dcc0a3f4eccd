"""The parent side of `sparkinfer bench fused`: target verdicts, link-bandwidth
fractions, the terminal tables and the plot."""

from __future__ import annotations

from sparkinfer.bench.report import fmt, print_table, save_plot

__all__ = ["verdicts", "sweep_table", "add_fractions", "print_tables", "plot", "TARGET_NORM_RATIO"]

TARGET_NORM_RATIO = 1.15  # fused <= 1.15x our bare all-reduce of the same tensor
TARGET_DCP_SPEEDUP, TARGET_DCP_MAX_T = 2.0, 64  # dcp_merge >= 2x the NCCL composition at T <= 64
# dcp_merge's torch compositions: all-gather of o and lse + torch merge (eager, and
# compiled: fused_cases.ag_compiled_merge), and all-gather of lse + one compiled
# correction + reduce-scatter (fused_cases.ag_correct_rs)
DCP_BASELINES = ("dcp_nccl", "dcp_nccl_compiled", "dcp_ag_rs")
NORM_IMPLS = ("fused", "fused_flag", "ar_auto", "ar_oneshot", "ar+torch", "nccl+torch")


def verdicts(rows) -> list[dict]:
    """Target verdicts: fused / ar_auto per (H, T); the faster of DCP_BASELINES / dcp_kernel per config."""
    t = {}
    for r in rows:
        if "us" in r:
            key = (r["op"], r.get("H"), r.get("D"), r["T"], r.get("scatter"))
            t.setdefault(key, {})[r["impl"]] = r["us"]
    out = []
    for (op, H, D, T, scatter), us in sorted(t.items(), key=str):
        if op == "fused_norm" and "fused" in us and "ar_auto" in us:
            ratio = us["fused"] / us["ar_auto"]
            out.append(dict(kind="summary", op=op, H=H, T=T, fused_over_ar_auto=ratio,
                            fused_over_ar_oneshot=us["fused"] / us.get("ar_oneshot", float("nan")),
                            fused_flag_over_ar_oneshot=(us.get("fused_flag", float("nan"))
                                                        / us.get("ar_oneshot", float("nan"))),
                            speedup_vs_nccl_torch=us.get("nccl+torch", float("nan")) / us["fused"],
                            speedup_vs_ar_torch=us.get("ar+torch", float("nan")) / us["fused"],
                            target=f"<= {TARGET_NORM_RATIO}", meets_target=ratio <= TARGET_NORM_RATIO))
        base = {k: us[k] for k in DCP_BASELINES if k in us}
        if op == "dcp_merge" and "dcp_kernel" in us and base:
            best = min(base, key=base.get)  # the target is against the strongest composition measured
            sp = base[best] / us["dcp_kernel"]
            out.append(dict(kind="summary", op=op, H=H, D=D, T=T, scatter=scatter, best_baseline=best,
                            speedup_vs_best=sp, speedup_vs_nccl=us.get("dcp_nccl", float("nan")) / us["dcp_kernel"],
                            speedup_vs_ag_rs=us.get("dcp_ag_rs", float("nan")) / us["dcp_kernel"],
                            target=f">= {TARGET_DCP_SPEEDUP} at T <= {TARGET_DCP_MAX_T}",
                            meets_target=sp >= TARGET_DCP_SPEEDUP if T <= TARGET_DCP_MAX_T else None))
    return out


def add_fractions(rows, gbs):
    for r in rows:
        if "us" in r and r.get("link_bytes"):
            r["link_gbs"] = r["link_bytes"] / (r["us"] * 1e-6) / 1e9
            r["frac_p2p"] = r["link_gbs"] / gbs if gbs else None


def print_tables(rows, title: str) -> None:
    """The verdict rows as two tables: fused norm per (H, T), dcp_merge per (H, D, scatter) and T."""
    yes = {True: "met", False: "missed", None: "–"}
    norm = [r for r in rows if r.get("kind") == "summary" and r["op"] == "fused_norm"]
    if norm:
        print_table(f"fused all-reduce + residual + RMSNorm, {title}",
                    ["H", "T", "fused / ar_auto", "fused / ar_oneshot", "flag / oneshot", "x vs NCCL + torch",
                     "x vs ar + torch", f"target <= {TARGET_NORM_RATIO}"],
                    [[r["H"], r["T"], fmt(r["fused_over_ar_auto"]), fmt(r["fused_over_ar_oneshot"]),
                      fmt(r["fused_flag_over_ar_oneshot"]), fmt(r["speedup_vs_nccl_torch"]),
                      fmt(r["speedup_vs_ar_torch"]), yes[r["meets_target"]]] for r in norm])
    dcp = [r for r in rows if r.get("kind") == "summary" and r["op"] == "dcp_merge"]
    if dcp:
        ts = sorted({r["T"] for r in dcp})
        keys = sorted({(r["H"], r["D"], r["scatter"]) for r in dcp})
        by = {(r["H"], r["D"], r["scatter"], r["T"]): r for r in dcp}
        cells = [[h, d, sc] + [fmt(by[(h, d, sc, t)]["speedup_vs_best"], 1) + ("" if by[(h, d, sc, t)]["meets_target"]
                                                                                is not False else " missed")
                               if (h, d, sc, t) in by else "–" for t in ts] for h, d, sc in keys]
        print_table(f"dcp_merge: the faster torch composition / ours (target >= {TARGET_DCP_SPEEDUP}x at T <= "
                    f"{TARGET_DCP_MAX_T}), {title}", ["H", "D", "scatter", *(f"T={t}" for t in ts)], cells)


def plot(rows, path):
    def draw(plt):
        fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
        norm = [r for r in rows if r.get("op") == "fused_norm" and "us" in r]
        for H in sorted({r["H"] for r in norm}):
            for impl, style in zip(NORM_IMPLS, ("-o", "-^", "--", ":", "-.", "-s")):
                pts = sorted((r["T"], r["us"]) for r in norm if r["H"] == H and r["impl"] == impl)
                if pts:
                    axes[0].plot(*zip(*pts), style, label=f"{impl} H={H}")
        axes[0].set(xscale="log", yscale="log", xlabel="T", ylabel="us per op", title="all-reduce + residual + RMSNorm")
        summ = [r for r in rows if r.get("kind") == "summary"]
        for H in sorted({r["H"] for r in summ if r["op"] == "fused_norm"}):
            pts = sorted((r["T"], r["fused_over_ar_auto"]) for r in summ if r["op"] == "fused_norm" and r["H"] == H)
            axes[1].plot(*zip(*pts), "-o", label=f"fused / ar_auto, H={H}")
        axes[1].axhline(TARGET_NORM_RATIO, color="gray", ls="--", label=f"target {TARGET_NORM_RATIO}")
        axes[1].set(xscale="log", xlabel="T", ylabel="ratio", title="fused norm cost over bare all-reduce")
        dcp = [r for r in summ if r["op"] == "dcp_merge"]
        for key in sorted({(r["H"], r["D"], r["scatter"]) for r in dcp}):
            pts = sorted((r["T"], r["speedup_vs_nccl"]) for r in dcp if (r["H"], r["D"], r["scatter"]) == key)
            axes[2].plot(*zip(*pts), "-o" if key[2] else "--o",
                         label=f"H={key[0]} D={key[1]}{' scatter' if key[2] else ''}")
        axes[2].axhline(TARGET_DCP_SPEEDUP, color="gray", ls="--", label=f"target {TARGET_DCP_SPEEDUP}x")
        axes[2].set(xscale="log", xlabel="T", ylabel="NCCL composition / ours", title="dcp_merge speedup")
        for ax in axes:
            ax.legend(fontsize=6)
        return fig

    return save_plot(draw, path)


def sweep_table(rows) -> list[dict]:
    """Per (H, T): every shape's us, fastest first, and the best / auto over ar_auto; kind="sweep_best" rows."""
    out, rows = [], [r for r in rows if r.get("op") == "fused_norm_sweep" and "us" in r]
    for H, T in sorted({(r["H"], r["T"]) for r in rows}):
        ranked = sorted((r for r in rows if (r["H"], r["T"]) == (H, T)), key=lambda r: r["us"])
        ar = next((r["us"] for r in ranked if r["impl"] == "ar_auto"), float("nan"))
        fused = [r for r in ranked if r["impl"] != "ar_auto"] or [dict(impl="-", us=float("nan"))]
        best, auto = fused[0], next((r for r in fused if r["impl"].startswith("auto")), fused[0])
        out.append(dict(kind="sweep_best", H=H, T=T, ar_auto_us=ar, best=best["impl"], best_us=best["us"],
                        best_over_ar_auto=best["us"] / ar, auto=auto["impl"], auto_over_ar_auto=auto["us"] / ar,
                        best_config={k: best.get(k) for k in ("algorithm", "grid", "pieces", "per", "num_warps")}))
    if out:
        print_table(f"fused norm launch shapes: best and auto over ar_auto (target <= {TARGET_NORM_RATIO})",
                    ["H", "T", "ar_auto us", "best", "best config", "best / ar_auto", "auto", "auto / ar_auto"],
                    [[r["H"], r["T"], fmt(r["ar_auto_us"]), r["best"], r["best_config"], fmt(r["best_over_ar_auto"]),
                      r["auto"], fmt(r["auto_over_ar_auto"])] for r in out])
    return out
