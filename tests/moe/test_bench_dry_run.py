"""benchmarks/bench_moe.py runs end to end on CPU (--dry-run: tiny shape,
interpreter), so a GPU run never dies on a Python error."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_moe_dry_run_writes_rows(tmp_path):
    out = tmp_path / "moe.json"
    res = subprocess.run([sys.executable, "benchmarks/bench_moe.py", "--dry-run", "--m", "2,20",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())
    checks = [r for r in rows if r["kind"] == "check"]
    assert checks and all(r["ok"] for r in checks)
    assert {r["family"] for r in checks} == {"micro", "grouped"}
    assert {r["format"] for r in checks} == {"nvfp4", "bf16", "fp8_block"}
    times = [r for r in rows if r["kind"] == "time" and "us" in r]
    assert {(r["impl"], r["format"]) for r in times} >= {("sparkinfer", "nvfp4"),
                                                          ("sparkinfer", "bf16"),
                                                          ("sparkinfer", "fp8_block"),
                                                          ("torch_grouped_mm", "bf16"),
                                                          ("torch_loop", "bf16")}
    assert all(r["weight_bytes"] > 0 and r["us"] > 0 for r in times)
    assert "command" in rows[0] and "date" in rows[0]
