"""`sparkinfer bench comm|fused|moe|decode|broadcast|scheduler --dry-run` end to end on the CPU (tiny sizes, CPU
ranks through the Triton interpreter), so a GPU run never dies on a Python error,
and the result rows carry their provenance without machine paths; decode's in-process
dry run sets the interpreter itself, as the README promises a CPU-only host."""

from __future__ import annotations

import json
import os
import re

import pytest

from sparkinfer.cli import main

ABS_PATH = re.compile(r"/(root|work|home|tmp|Users)/")


def _run(tmp_path, name: str, *options: str) -> list[dict]:
    out = tmp_path / "results" / f"{name}.json"
    assert main(["bench", name, "--dry-run", "--out", str(out), *options]) == 0
    rows = json.loads(out.read_text())
    for r in rows:
        assert r["command"] == " ".join(["sparkinfer", "bench", name, "--dry-run", "--out", f"{name}.json", *options])
        assert not ABS_PATH.search(json.dumps(r)), r
        assert {"gpu", "driver", "torch", "triton", "commit", "date"} <= set(r)
    return rows


@pytest.mark.slow
def test_bench_comm_dry_run(tmp_path, capsys):
    rows = _run(tmp_path, "comm")
    measured = [r for r in rows if "us" in r]
    assert {(r["op"], r["impl"]) for r in measured} >= {
        ("all_reduce", a) for a in ("ll", "oneshot", "twoshot", "auto", "nccl")} | {
        (op, i) for op in ("reduce_scatter", "all_gather") for i in ("ours", "nccl")}
    assert all(r["correct"] and r["us"] > 0 and len(r["us_per_rank"]) == 2 for r in measured)
    # the timed graph's own output checked exactly (in-place NCCL: sum * 2^(ops - 1))
    assert all(r["correct_eager"] and r["correct_graph"] for r in measured)
    assert {r["size_bytes"] for r in measured} == {4096}
    symm = [r for r in rows if r.get("impl", "").startswith("symm")]
    assert symm and all("unavailable" in r["error"] for r in symm)
    shown = capsys.readouterr().out
    assert "all_reduce bf16, us per op" in shown and "wrong results: none" in shown


@pytest.mark.slow
def test_bench_fused_dry_run(tmp_path, capsys):
    rows = _run(tmp_path, "fused")
    timed = [r for r in rows if "us" in r]
    assert {(r["op"], r["impl"]) for r in timed} == {
        *(("fused_norm", i) for i in ("fused", "fused_flag", "ar_auto", "ar_oneshot", "ar+torch", "nccl+torch")),
        ("dcp_merge", "dcp_kernel"), ("dcp_merge", "dcp_nccl"), ("dcp_merge", "dcp_ag_rs"),
        ("dcp_merge", "dcp_nccl_compiled")}
    assert all(len(r["us_per_rank"]) == 2 and r["us"] == max(r["us_per_rank"]) for r in timed)  # slowest rank
    assert all(r["ok"] and r["replay_bitwise"] for r in timed)
    assert all(r["ranks_bitwise"] for r in timed if r["impl"] in ("fused", "fused_flag", "ar_auto"))
    summary = [r for r in rows if r.get("kind") == "summary"]
    assert {r["op"] for r in summary} == {"fused_norm", "dcp_merge"}
    assert "checks failed: 0" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_moe_dry_run(tmp_path, capsys):
    # a budget no host reaches: every row is asserted below, and the default 120 s (a GPU
    # run's guard) skipped rows on a busy 2-core host
    rows = _run(tmp_path, "moe", "--m", "2,20", "--budget-s", "1800")
    checks = [r for r in rows if r["kind"] == "check"]
    assert checks and all(r["ok"] and r["rel_norm"] <= r["tol_rel_norm_max"] for r in checks)
    assert {r["family"] for r in checks} == {"micro", "grouped"}
    assert {r["format"] for r in checks} == {"nvfp4", "bf16", "fp8_block"}
    times = [r for r in rows if r["kind"] == "time" and "us" in r]
    assert {(r["impl"], r["format"]) for r in times} >= {("sparkinfer", "nvfp4"), ("sparkinfer", "bf16"),
                                                          ("sparkinfer", "fp8_block"),
                                                          ("torch_grouped_mm", "bf16"), ("torch_loop", "bf16")}
    assert {r["M"] for r in times} == {2, 20}
    assert all(r["weight_bytes"] > 0 and r["us"] > 0 for r in times)
    # the layer's bytes count the weights and more (x, the activation, FC2's rows, the output)
    assert all(r["layer_bytes_us"] > r["floor_us"] for r in times if r["impl"] == "sparkinfer")
    # every timing checked on the outputs of the run that was timed, baselines included
    assert all(r["ok"] and r["check_rel_norm"] <= r["tol_rel_norm_max"] for r in times)
    assert "MoE layer, us per call" in capsys.readouterr().out


def test_bench_moe_times_a_padded_shape_against_its_unpadded_floor(tmp_path, capsys):
    """I = 48 (as glm_air_tp8's 176) runs padded to 64: checked against the reference, timed,
    and its floor counts the 48 the checkpoint holds (48/64 of what the layer reads);
    fp8_block, whose blocks cannot be padded, is skipped with a line saying so."""
    rows = _run(tmp_path, "moe", "--shapes", "tiny_padded", "--m", "2", "--no-baselines")
    checks = [r for r in rows if r["kind"] == "check"]
    times = [r for r in rows if r["kind"] == "time"]
    assert {r["format"] for r in checks} == {r["format"] for r in times} == {"nvfp4", "bf16"}
    assert all(r["ok"] for r in checks + times)
    for r in times:
        assert (r["I"], r["I_padded"]) == (48, 64) and r["weight_bytes"] * 64 == pytest.approx(r["read_bytes"] * 48)
        assert r["floor_us"] == pytest.approx(r["weight_bytes"] / (r["copy_gbs"] * 1e9) * 1e6)
    assert "fp8_block skipped: H=128, I=48 are not multiples of 128" in capsys.readouterr().out


def test_moe_failed_checks_counts_timed_graphs_too():
    """A time row whose timed graph failed its own check counts as a failed check, as a
    check row does; probe rows and timings that raised carry no verdict."""
    from sparkinfer.bench.moe import failed_checks

    rows = [dict(kind="device"), dict(kind="check", ok=True), dict(kind="check", ok=False),
            dict(kind="time", ok=True), dict(kind="time", ok=False), dict(kind="probe", ok=False),
            dict(kind="time", error="OutOfResources: shared memory")]
    assert failed_checks(rows) == [rows[2], rows[4]]


def test_bench_moe_exits_nonzero_when_only_a_timed_graph_fails(tmp_path, monkeypatch, capsys):
    """`bench moe` end to end with the GPU work replaced by rows: every check row passes,
    one timed graph's output check fails, so the run exits 1 and says so."""
    from sparkinfer.bench import moe, moe_cases, moe_report

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for --dry-run; restored after the test
    monkeypatch.setattr(moe, "device_limits", lambda ctx: {"copy_gbs": 1.0, "bf16_tflops": 1.0})
    monkeypatch.setattr(moe_cases, "Layer", lambda ctx, name, shape, m: None)
    monkeypatch.setattr(moe_cases, "checks", lambda ctx, layer, f, ms, decode: [dict(kind="check", format=f, ok=True)])

    def time_ours(ctx, layer, lim, f, ms, decode, advance):
        return [dict(kind="time", impl="sparkinfer", format=f, M=m, us=1.0, ok=(f, m) != ("bf16", 3)) for m in ms]

    monkeypatch.setattr(moe_cases, "time_ours", time_ours)
    monkeypatch.setattr(moe_report, "print_tables", lambda rows, caption: None)
    monkeypatch.setattr(moe_report, "plot", lambda rows, path: None)
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--dry-run", "--no-baselines", "--out", str(out)]) == 1
    assert "checks failed: 1 (0 check rows, 1 timed graphs)" in capsys.readouterr().out
    assert [r["M"] for r in json.loads(out.read_text()) if r.get("ok") is False] == [3]


def test_bench_rejects_unknown_names_and_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "moe", "--shapes", "dsv3,bogus"])
    assert "unknown shapes ['bogus']" in capsys.readouterr().err


def test_shared_gpu_rows_keep_their_checks_and_drop_their_timings():
    """Two ranks time-sliced on one GPU time the sharing, not the op: --shared-gpu rows keep
    only what was checked."""
    from sparkinfer.bench.fused import checks_only

    rows = [dict(kind="device", p2p_copy_gbs=None),
            dict(op="dcp_merge", impl="dcp_kernel", T=8, us=5.1, us_per_rank=[5.0, 5.1], speedup_vs_nccl=8.2,
                 frac_p2p=0.1, link_gbs=3.0, replay_bitwise=True, ok=True)]
    (kept,) = checks_only(rows)
    assert kept == dict(op="dcp_merge", impl="dcp_kernel", T=8, replay_bitwise=True, ok=True,
                        timing="not recorded (one GPU shared)")


@pytest.mark.slow
def test_bench_decode_dry_run_on_two_ranks_with_dcp(tmp_path, capsys):
    """`bench decode --tp 2 --dcp 2`: ours and the torch-ops baseline (NCCL gathers and merges,
    an explicit attention that returns its log-sum-exp) on two CPU ranks, every rank the same
    logits, the slowest rank's time, both near transformers' prefill."""
    rows = _run(tmp_path, "decode", "--tp", "2", "--dcp", "2")
    assert {(r["impl"], r["batch"]) for r in rows} == {(i, b) for i in ("sparkinfer", "torch") for b in (1, 2)}
    for r in rows:
        assert r["tp"] == 2 and r["dcp"] == 2 and r["ok"] and r["ranks_same_logits"], r
        assert len(r["us_per_rank"]) == 2 and r["us_per_step"] == max(r["us_per_rank"])
        assert r["argmax_agrees_hf"] and r["prefill_rel_err_vs_hf"] < 0.05, r
    assert "decode step (TP = 2, DCP = 2)" in capsys.readouterr().out


def test_bench_broadcast_dry_run(tmp_path, capsys):
    rows = _run(tmp_path, "broadcast")
    assert {(r["readers"], r["transport"], r["exchange"]) for r in rows} == {
        (n, t, x) for n in (1, 2) for t, x in (("ring", "broadcast"), ("ring", "round_trip"), ("pipe", "round_trip"))}
    assert all(r["correct"] and r["steps"] == 30 and 0 < r["median_us"] <= r["p99_us"] for r in rows)
    assert all(r["cores"] == os.cpu_count() and r["time_sliced"] == (r["readers"] + 1 > os.cpu_count()) for r in rows)
    assert "wrong records: none" in capsys.readouterr().out


def test_bench_scheduler_dry_run(tmp_path, capsys, monkeypatch):
    (tmp_path / "results").mkdir()
    monkeypatch.chdir(tmp_path / "results")  # --out and --decode-results both relative, as the command records
    decode = tmp_path / "results" / "decode.json"
    decode.write_text(json.dumps([{"preset": "qwen3-30b-a3b", "layers": 8, "batch": 1, "impl": "sparkinfer",
                                   "experts": "bf16", "us_per_step": 700.0}]))
    rows = _run(tmp_path, "scheduler", "--decode-results", "decode.json")
    assert {(r["batch"], r["detokenize"]) for r in rows} == {(b, d) for b in (1, 4) for d in (False, True)}
    for r in rows:
        assert 0 < r["scheduler_us"] <= r["loop_us"] and r["decode_step_us"] == 700.0
        assert r["scheduler_frac_of_step"] == r["scheduler_us"] / 700.0
    assert "% of a qwen3 batch-1 step" in capsys.readouterr().out


_DECODE_WITHOUT_INTERPRET = """
import sys

import sparkinfer.bench.decode as decode


def one_kernel(preset, args, dev, bw, say):  # stands in for the model rows (the whole dry run: ~100 s)
    import torch

    from sparkinfer.norm import rms_norm

    x = torch.randn(2, 64)
    y = rms_norm(x, torch.ones(64), 1e-6)
    ok = torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5)
    return [dict(bench="decode", preset=preset, impl="sparkinfer", experts="bf16", batch=1,
                 us_per_step=1.0, tokens_per_s=1.0, ok=bool(ok))]


decode._rows_for, decode._speculative = one_kernel, lambda *args: []
from sparkinfer.cli import main

sys.exit(main(["bench", "decode", "--dry-run", "--out", sys.argv[1]]))
"""


def test_bench_decode_dry_run_sets_the_interpreter_itself(tmp_path):
    """`sparkinfer bench decode --dry-run` on a CPU-only host without TRITON_INTERPRET=1 set
    by hand (it failed with "0 active drivers"): a fresh process with the variable unset
    runs a Triton kernel on the CPU inside the benchmark's main."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _DECODE_WITHOUT_INTERPRET, str(tmp_path / "decode.json")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "decode.json").read_text())[0]["ok"] is True


@pytest.mark.slow
def test_bench_prefill_dry_run(tmp_path):
    rows = _run(tmp_path, "prefill")
    fwd = [r for r in rows if r["kind"] == "prefill"]
    assert {(r["batch_invariant"], r["rows"]) for r in fwd} == {(i, n) for i in (True, False) for n in (1, 2)}
    assert all(r["row_equals_alone"] and r["ok"] for r in fwd if r["batch_invariant"])
    assert {r["name"] for r in rows if r["kind"] == "projection"} == {"qkv", "o", "lm_head"}
    assert all(r["rel_err_vs_torch"] < 1e-2 for r in rows if r["kind"] == "projection")


@pytest.mark.slow
def test_bench_prefill_mixed_dry_run(tmp_path):
    """Mixed steps (decode rows beside prompt chunks) against their parts: each decode
    row's logits equal the decode step's and each chunk's the prefill forward's, bitwise,
    and the marginal time is the mixed step's less the decode step's."""
    rows = _run(tmp_path, "prefill", "--beside", "3")
    assert {(r["decode_rows"], r["chunks"]) for r in rows} == {(3, 1), (3, 2)}
    for r in rows:
        assert r["kind"] == "mixed" and r["decode_equal"] and r["chunks_equal"] and r["ok"], r
        assert r["decode_ms"] > 0 and r["mixed_ms"] > 0 and r["prefill_ms"] > 0
        assert r["marginal_ms"] == pytest.approx(r["mixed_ms"] - r["decode_ms"])


def test_layer_bytes_bounds_the_deepseek_tp8_shard_by_bytes():
    """`moe_cases.layer_bytes` at the DeepSeek-V3 TP8 shard (E 256, K 8, H 7168, I 256), M 4096,
    bf16: every expert's weights (2.82 GB), FC2's routed rows there and back (0.94 GB), the
    activation there and back, x and the output: 3.91 GB, which at 4,275 GB/s take longer
    (915 us) than the MMAs at 989 TFLOP/s (365 us), so no call reaches 40% of the bf16 rate."""
    from sparkinfer.bench.moe_cases import layer_bytes

    m, k, h, i, e = 4096, 8, 7168, 256, 256
    weights = e * 3 * h * i * 2
    total = layer_bytes(m, k, h, i, weights, "bf16")
    assert total == weights + 4 * m * h + 4 * m * k * i + 4 * m * k * h
    assert total == pytest.approx(3.91e9, rel=1e-3)
    assert layer_bytes(m, k, h, i, weights, "fp8_block") == total - 2 * m * k * i  # e4m3 activation
    tc_us = 2.0 * m * k * 3 * h * i / 989e12 * 1e6
    bytes_us = total / 4275e9 * 1e6
    assert bytes_us == pytest.approx(915, abs=1) and tc_us == pytest.approx(365, abs=1)
    assert tc_us / bytes_us < 0.40
