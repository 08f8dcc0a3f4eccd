"""The terminal tables and the plot of `sparkinfer bench moe`."""

from __future__ import annotations

from sparkinfer.bench.report import fmt, print_table, save_plot

__all__ = ["print_tables", "plot"]


def _pct(x) -> str:
    return fmt(None if x is None else 100 * x, 1)


def print_tables(rows, title: str) -> None:
    """sparkinfer per (shape, M, format) against the baselines; with --sweep, every
    candidate config against the planned one."""
    t = {(r["shape"], r["M"], r["format"], r["impl"]): r for r in rows if r.get("kind") == "time" and "us" in r}
    sweep = [[shape, m, f, impl[len("sparkinfer:"):], fmt(r["us"], 1),
              fmt(t[(shape, m, f, "sparkinfer")]["us"] / r["us"]), _pct(r["frac_floor"]), _pct(r["frac_tc"])]
             for (shape, m, f, impl), r in sorted(t.items())
             if impl.startswith("sparkinfer:") and (shape, m, f, "sparkinfer") in t]
    if sweep:
        print_table("launch configs against the plan (x > 1: faster than planned)",
                    ["shape", "M", "format", "config", "us", "x vs planned", "% floor", "% tc"], sweep)
    main = []
    for (shape, m, f, impl), r in sorted(t.items()):
        if impl != "sparkinfer":
            continue
        g = t.get((shape, m, "bf16", "torch_grouped_mm"), {}).get("us")
        lp = t.get((shape, m, "bf16", "torch_loop"), {}).get("us")
        best = min((u for u in (g, lp) if u), default=None)
        main.append([shape, m, f, r["family"], fmt(r["us"], 1), _pct(r.get("frac_spec_hbm")), _pct(r["frac_floor"]),
                     _pct(r.get("frac_spec_tc")), _pct(r.get("max_frac_spec_tc")),
                     fmt(g, 1), fmt(lp, 1), fmt(best / r["us"] if best else None),
                     {True: "ok", False: "FAILED", None: "–"}[r.get("ok")]])
    print_table(f"MoE layer, us per call, {title}",
                ["shape", "M", "format", "family", "us", "% HBM spec", "% copy", "% tc spec", "% tc max",
                 "grouped_mm us", "loop us (setup timed)", "x vs best torch", "graph check"], main)


def plot(rows, path):
    trows = [r for r in rows if r.get("kind") == "time" and "us" in r and ":" not in r["impl"]]
    shapes = sorted({r["shape"] for r in trows})
    if not shapes:
        return None

    def draw(plt):
        fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            sr = [r for r in trows if r["shape"] == shape]
            for key in sorted({(r["impl"], r["format"]) for r in sr}):
                pts = sorted((r["M"], r["us"]) for r in sr if (r["impl"], r["format"]) == key)
                ax.plot(*zip(*pts), marker="o", label=f"{key[0]} {key[1]}")
            for f, style in (("nvfp4", ":"), ("bf16", "--"), ("fp8_block", "-.")):
                pts = sorted((r["M"], r["floor_us"]) for r in sr if r["impl"] == "sparkinfer" and r["format"] == f)
                if pts:
                    ax.plot(*zip(*pts), linestyle=style, color="gray", label=f"HBM floor {f}")
            ax.set(xscale="log", yscale="log", title=shape, xlabel="M (tokens)", ylabel="us")
            ax.legend(fontsize=7)
        return fig

    return save_plot(draw, path)
