"""Run a test helper module that compiles kernels for the H200 (sm_90) on a CPU
machine: in a subprocess without TRITON_INTERPRET (interpreted kernels cannot be
compiled), with a private Triton cache (no races with other runs). Skips the
test where ptxas is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_sm90_module(module: str, *argv: str):
    """`python -m module *argv`; returns its last stdout line parsed as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        res = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this environment")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
