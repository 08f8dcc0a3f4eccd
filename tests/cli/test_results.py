"""Result files: provenance without machine paths, and `sparkinfer bench summarize`,
which tabulates only rows whose correctness check passed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sparkinfer.bench.common import append_rows, command_line, default_out, machine_label, scrub_paths
from sparkinfer.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("text, want", [
    ('File "/srv/wt/x/sparkinfer/comm/pool.py", line 3', 'File "pool.py", line 3'),
    ("--out /opt/out/comm_2xh200.json --budget-s 90", "--out comm_2xh200.json --budget-s 90"),
    ("--out=/data/me/r.json", "--out=r.json"),
    ("16 GB/s, 2/3 of https://example.org/a/b, benchmarks/results/x.json", None),
])
def test_scrub_paths_keeps_only_the_last_component_of_absolute_paths(text, want):
    assert scrub_paths(text) == (text if want is None else want)
    assert scrub_paths({"a": [text]}) == {"a": [text if want is None else want]}


def test_command_line_is_relative_to_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["sparkinfer", "bench", "comm", "--out", str(tmp_path / "r" / "c.json"), "--x=/elsewhere/d.json",
            "--sizes", "2,4"]
    assert command_line(argv) == "sparkinfer bench comm --out r/c.json --x=d.json --sizes 2,4"


def test_machine_labels_and_default_outputs():
    assert machine_label({"gpu": "NVIDIA H200"}, 2) == "2xh200"
    assert machine_label({"gpu": "NVIDIA H200"}, 1) == "h200"
    assert machine_label({"gpu": "NVIDIA H100 80GB HBM3"}, 1) == "h100"  # the H100 files' name
    assert machine_label({"gpu": "NVIDIA A100-SXM4-80GB"}, 2) == "2xa100"
    assert machine_label({"gpu": "NVIDIA GeForce RTX 4090"}, 1) == "rtx4090"
    assert machine_label({"gpu": "cpu"}, 2) == "cpu"
    assert str(default_out("moe", {"gpu": "NVIDIA H200"}, 1, dry_run=False, sweep=True)) == os.path.join(
        "benchmarks", "results", "sweeps", "moe_sweep_h200.json")
    assert default_out("comm", {"gpu": "NVIDIA H200"}, 2, dry_run=False).name == "comm_2xh200.json"


def test_append_rows_keeps_earlier_runs_and_scrubs_paths(tmp_path):
    path = tmp_path / "r.json"
    append_rows(path, [{"op": "a", "error": "at /var/x/y.py"}], {"command": "c"})
    append_rows(path, [{"op": "b"}], {"command": "c2"})
    assert json.loads(path.read_text()) == [{"command": "c", "op": "a", "error": "at y.py"},
                                            {"command": "c2", "op": "b"}]


def _comm_row(impl, size, us, correct=True):
    return {"op": "all_reduce", "impl": impl, "size_bytes": size, "us": us, "correct": correct, "commit": "abc1234",
            "gpu": "NVIDIA H200", "date": "2026-12-01T00:00:00", "command": "sparkinfer bench comm --quick"}


def test_summarize_refuses_rows_whose_check_failed(tmp_path, capsys):
    rows = [_comm_row("auto", 2048, 3.9), _comm_row("nccl", 2048, 10.9),
            _comm_row("auto", 4096, 1.0, correct=False), _comm_row("nccl", 4096, 11.0)]
    (tmp_path / "comm_2xh200.json").write_text(json.dumps(rows))
    moe = [{"kind": "check", "shape": "qwen3", "format": "nvfp4", "ok": False, "commit": "c"},
           {"kind": "time", "shape": "qwen3", "format": "nvfp4", "impl": "sparkinfer", "M": 1, "us": 1.0,
            "frac_floor": 0.5, "frac_tc": 0.1, "commit": "c"}]
    (tmp_path / "moe_h200.json").write_text(json.dumps(moe))
    assert main(["bench", "summarize", "--results", str(tmp_path), "--brief"]) == 0
    out = capsys.readouterr()
    assert "| 2 KiB | 3.90 | 10.90 | 0.36 |" in out.out
    assert "4 KiB" not in out.out and "qwen3" not in out.out
    assert "comm_2xh200.json: refused 1 rows" in out.err and "moe_h200.json: refused 1 rows" in out.err


def _moe_time(impl, fmt, m, us, **kw):
    return {"kind": "time", "shape": "mixtral", "format": fmt, "impl": impl, "M": m, "us": us,
            "weight_bytes": 2.4e6 * us, "frac_floor": 0.9, "frac_tc": 0.01, "tflops": 1.0, "commit": "c",
            "gpu": "NVIDIA H200", **kw}


def test_summarize_refuses_a_moe_timing_whose_graph_output_failed_its_check(tmp_path, capsys):
    """A timed graph's own check (row ok=False) refuses that row alone; the best
    torch baseline and the spec fractions (H200: 4.8 TB/s) are tabulated."""
    moe = [_moe_time("sparkinfer", "nvfp4", 1, 10.0), _moe_time("sparkinfer", "bf16", 1, 20.0, frac_floor=1.02),
           _moe_time("torch_grouped_mm", "bf16", 1, 50.0), _moe_time("torch_loop", "bf16", 1, 40.0),
           _moe_time("sparkinfer", "nvfp4", 8, 10.0, ok=False), _moe_time("sparkinfer", "bf16", 8, 20.0)]
    (tmp_path / "moe_h200.json").write_text(json.dumps(moe))
    assert main(["bench", "summarize", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert ("| mixtral | 1 | 10.0 | 50% (90%) | 0.1% | 20.0 | 50% (102%†) | 0.1% (1.0%) | 40.0 l | 2.00x | 4.00x |"
            in out.out)
    assert "| mixtral | 8 |" not in out.out and "† above the copy rate measured" in out.out
    assert "moe_h200.json: refused 1 rows" in out.err


def _decode_step(batch, us, frac, **kw):
    return {"bench": "decode", "preset": "p", "impl": "sparkinfer", "experts": "bf16", "batch": batch,
            "layers": 8, "us_per_step": us, "frac_floor": frac, "copy_bandwidth_Bps": 4.0e12, "ok": True,
            "commit": "c", "gpu": "NVIDIA H200", **kw}


def test_summarize_decode_floors_against_the_specified_rate_and_refuses_failed_steps(tmp_path, capsys):
    """The decode floor at the H200's specified 4.8 TB/s leads, the run's own copy rate in
    brackets (4000 GB/s here: 130% of it is 108% of 4.8 TB/s), each mark explained; a step
    whose check failed (ok=False) is refused."""
    rows = [_decode_step(1, 100.0, 0.6), _decode_step(8, 200.0, 1.3), _decode_step(64, 300.0, 0.9, ok=False)]
    (tmp_path / "decode_h200.json").write_text(json.dumps(rows))
    assert main(["bench", "summarize", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "at the GPU's specified 4.8 TB/s" in out.out and "4000 GB/s, counting read + write" in out.out
    assert "| p | 1 | 100 | 50% (60%) | – | – |" in out.out
    assert "| p | 8 | 200 | 108%‡ (130%†) | – | – |" in out.out
    assert "† above the copy rate measured" in out.out and "‡ above the specified HBM rate" in out.out
    assert "| p | 64 |" not in out.out and "decode_h200.json: refused 1 rows" in out.err


def test_summarize_pairs_the_invariance_modes_and_keeps_the_invariant_step_in_the_main_table(tmp_path, capsys):
    """`bench decode --invariance both` rows: the main table shows the invariant step
    (the decoder's default), a second table the pair and the invariance's cost."""
    rows = [_decode_step(1, 103.0, 0.6, batch_invariant=True), _decode_step(1, 100.0, 0.62, batch_invariant=False),
            _decode_step(64, 250.0, 0.9, batch_invariant=True)]
    (tmp_path / "decode_h200.json").write_text(json.dumps(rows))
    assert main(["bench", "summarize", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| p | 1 | 103 | 50% (60%) |" in out and "| p | 1 | 100 |" not in out
    assert "| p | 1 | bf16 | 1 | 103 | 100 | +3.0% |" in out  # preset, TP, experts, B, both times, cost
    assert "| p | 1 | bf16 | 64 |" not in out  # timed one way only


def test_summarize_tabulates_the_committed_results(capsys):
    assert main(["bench", "summarize", "--results", str(RESULTS)]) == 0
    out = capsys.readouterr()
    for title in ("All-reduce, bf16", "Reduce-scatter and all-gather", "Fused all-reduce + residual + RMSNorm",
                  "dcp_merge (2 ranks, bf16)", "MoE layer"):
        assert title in out.out
    assert "refused" not in out.err


def test_gpu_test_evidence_summaries_count_the_rows_of_their_run():
    """Each summary row of a committed GPU test evidence file counts the test rows of its
    run (one conversion: the same command, commit and date), and each run has one: rows
    replaced by a newer run of the same files must not leave a summary that counts them."""
    from collections import Counter

    files = sorted(RESULTS.glob("gpu_tests_*.json"))
    assert files
    for path in files:
        rows = json.loads(path.read_text())
        run = lambda r: (r.get("command"), r.get("commit"), r.get("date"))  # noqa: E731
        counts: dict = {}
        for r in rows:
            if r["kind"] == "test":
                counts.setdefault(run(r), Counter())[r["outcome"]] += 1
        summaries = [r for r in rows if r["kind"] == "summary"]
        assert sorted(map(run, summaries)) == sorted(counts), path.name
        for sm in summaries:
            c = counts[run(sm)]
            assert (sm["tests"], sm["passed"], sm["failed"], sm["error"], sm["skipped"]) == (
                sum(c.values()), c["passed"], c["failed"], c["error"], c["skipped"]), (path.name, sm["junit_file"])
            assert sm["ok"] == (c["failed"] == 0 and c["error"] == 0)


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="1" tests="3" time="9.1" timestamp="2026-12-01T16:00:00" hostname="gpu-host">
<testcase classname="tests.moe.test_gpu" name="test_gpu_layer_matches_reference_and_replays_bitwise[nvfp4-T1]"
 time="4.2"/>
<testcase classname="tests.moe.test_gpu" name="test_gpu_mixtral_micro_nvfp4_repeats_bitwise[ptx]" time="3.0">
<failure message="AssertionError: MoE output vs fp32 reference: cosine 0.99">trace</failure></testcase>
<testcase classname="tests.attention.test_gpu.TestDecode" name="test_x" time="0.0">
<skipped message="needs a CUDA GPU"/></testcase><testcase time="0.000" /></testsuite></testsuites>"""


def test_junit_xml_becomes_evidence_rows_with_provenance(tmp_path, capsys):
    xml = tmp_path / "gpu.xml"
    xml.write_text(JUNIT)
    out = tmp_path / "gpu_tests_h200.json"
    assert main(["bench", "summarize", "--junit", str(xml), "--out", str(out)]) == 1  # a test failed
    rows = json.loads(out.read_text())
    tests = [r for r in rows if r["kind"] == "test"]
    assert [(r["test_id"], r["outcome"]) for r in tests] == [
        ("tests/moe/test_gpu.py::test_gpu_layer_matches_reference_and_replays_bitwise[nvfp4-T1]", "passed"),
        ("tests/moe/test_gpu.py::test_gpu_mixtral_micro_nvfp4_repeats_bitwise[ptx]", "failed"),
        ("tests/attention/test_gpu.py::TestDecode::test_x", "skipped"),
        ("(interrupted)", "error")]  # the empty case pytest writes for a test a timeout stopped
    assert "cosine 0.99" in tests[1]["message"] and "interrupted" in tests[3]["message"]
    summary = rows[-1]
    assert (summary["passed"], summary["failed"], summary["skipped"], summary["error"], summary["ok"]) == (
        1, 1, 1, 1, False)
    assert summary["junit_hostname"] == "gpu-host"
    assert all({"gpu", "driver", "commit", "torch", "triton", "date", "command"} <= set(r) for r in rows)
    assert "4 tests: 1 passed, 1 failed" in capsys.readouterr().out
