"""The parent side of `sparkinfer bench comm`: merge the ranks' rows, bandwidths and
targets, the terminal tables and the plot."""

from __future__ import annotations

from pathlib import Path

from sparkinfer.bench.report import fmt, print_table, save_plot

__all__ = ["merge", "target_us", "print_tables", "plot", "fmt_size", "AR_IMPLS"]

KiB, MiB = 1 << 10, 1 << 20
# Targets for `auto` on 2x H200 (issue 3), microseconds by size: <= 4 us up to 32 KiB.
TARGET_US = {128 * KiB: 5.0, 512 * KiB: 6.5, 2 * MiB: 10.0, 8 * MiB: 26.0, 32 * MiB: 95.0}
AR_IMPLS = ("auto", "ll", "oneshot", "twoshot", "nccl", "symm_one_shot", "symm_two_shot")


def target_us(size: int) -> float | None:
    return 4.0 if size <= 32 * KiB else TARGET_US.get(size)


def fmt_size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def merge(per_rank: list, world_size: int, peak_GBps: float | None) -> list:
    """One row per measurement: the slower rank's latency, bandwidths, ratio to NCCL, target."""
    rows = []
    for rs in zip(*per_rank):
        row = dict(rs[0])
        if "us" in row:
            row["us_per_rank"] = [round(r.get("us", float("nan")), 3) for r in rs]
            row["us"] = max(r["us"] for r in rs if "us" in r)
            row["correct"] = all(r.get("correct", False) for r in rs)  # eager and the timed graph, every rank
            for k in ("correct_eager", "correct_graph"):
                vals = [r.get(k) for r in rs]
                row[k] = None if None in vals else all(vals)
            algbw = row["size_bytes"] / (row["us"] * 1e-6) / 1e9
            factor = 2 * (world_size - 1) / world_size if row["op"] == "all_reduce" else (world_size - 1) / world_size
            row.update(algbw_GBps=round(algbw, 2), busbw_GBps=round(algbw * factor, 2))
            if peak_GBps:
                row["frac_of_peer_copy"] = round(algbw * factor / peak_GBps, 3)
        rows.append(row)
    nccl = {(r["op"], r["size_bytes"]): r["us"] for r in rows if r.get("impl") == "nccl" and "us" in r}
    for r in rows:
        ref = nccl.get((r["op"], r.get("size_bytes")))
        if "us" in r and ref:
            r["ratio_vs_nccl"] = round(r["us"] / ref, 3)
        if r["op"] == "all_reduce" and r.get("impl") == "auto" and "us" in r:
            t = target_us(r["size_bytes"])
            r["target_us"] = t
            r["meets_target"] = (t is None or r["us"] <= t) and r.get("ratio_vs_nccl", 0) <= 1.0
    return rows


def _find(rows, op, impl, size) -> dict:
    return next((r for r in rows if r["op"] == op and r.get("impl") == impl and r.get("size_bytes") == size), {})


def _cell(rows, op, impl, size) -> str:
    r = _find(rows, op, impl, size)
    if "us" not in r:
        return "err" if r else "–"
    return fmt(r["us"]) + ("" if r.get("correct", True) else " WRONG")


def print_tables(rows: list, title: str) -> None:
    sizes = sorted({r["size_bytes"] for r in rows if r["op"] == "all_reduce"})
    table = []
    for s in sizes:
        a = _find(rows, "all_reduce", "auto", s)
        verdict = {True: "met", False: "missed"}.get(a.get("meets_target"), "–")
        table.append([fmt_size(s)] + [_cell(rows, "all_reduce", i, s) for i in AR_IMPLS]
                     + [fmt(a.get("ratio_vs_nccl")), fmt(a.get("busbw_GBps"), 1),
                        f"{fmt(a.get('target_us'), 1)} {verdict}"])
    print_table(f"all_reduce bf16, us per op in a CUDA graph, {title}", ["size", *AR_IMPLS, "auto/NCCL", "auto GB/s",
                                                                         "target"], table)
    pairs = [(op, i) for op in ("reduce_scatter", "all_gather") for i in ("ours", "nccl")]
    table = [[fmt_size(s)] + [_cell(rows, op, i, s) for op, i in pairs] for s in sizes]
    print_table("reduce_scatter (input bytes) and all_gather (output bytes), bf16, us per op",
                ["size", "RS ours", "RS NCCL", "AG ours", "AG NCCL"], table)


def plot(rows: list, path: Path) -> Path | None:
    def draw(plt):
        import matplotlib.ticker

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, ops in ((axes[0], ("all_reduce",)), (axes[1], ("reduce_scatter", "all_gather"))):
            for op in ops:
                for impl in sorted({r["impl"] for r in rows if r["op"] == op and "us" in r}):
                    pts = sorted((r["size_bytes"], r["us"]) for r in rows
                                 if r["op"] == op and r.get("impl") == impl and "us" in r)
                    ax.plot(*zip(*pts), marker="o", ms=3, label=impl if len(ops) == 1 else f"{op}:{impl}")
            xs = sorted({r["size_bytes"] for r in rows if r["op"] in ops and "us" in r})
            if ops == ("all_reduce",):
                tg = [(s, target_us(s)) for s in xs if target_us(s)]
                if tg:
                    ax.scatter(*zip(*tg), marker="_", s=200, c="k", label="target (auto)")
            ax.set_xscale("log")
            ax.set_xticks(xs, [fmt_size(x) for x in xs], rotation=45, fontsize=7)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set(yscale="log", xlabel="bytes", ylabel="us per op (CUDA graph)", title=" / ".join(ops) + " bf16")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        return fig

    return save_plot(draw, path)
