"""`sparkinfer bench decode --dry-run --weights random-direct` end to end on the CPU: the
weights drawn through the loader, our decoder and the torch-ops baseline timed, rows
that name their weight source and depth, no transformers rows."""

from __future__ import annotations

import json

from sparkinfer.cli import main


def test_bench_decode_dry_run_with_weights_drawn_directly(tmp_path, capsys):
    out = tmp_path / "decode.json"
    # one MoE layer, one batch, one replay, no speculative rows: about 5 s in the interpreter
    argv = ["bench", "decode", "--dry-run", "--weights", "random-direct", "--presets", "mixtral-tiny",
            "--layers", "1", "--batches", "1", "--replays", "1", "--spec-k", "0", "--context", "4", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert {(r["impl"], r["batch"]) for r in rows} == {("sparkinfer", 1), ("torch", 1)}
    for r in rows:
        assert r["weights"] == "random-direct" and r["layers"] == 1 and r["context"] == 4, r
        assert r["ok"] and r["replay_equals_eager"] and r["prefill_rel_err_vs_hf"] is None, r
    assert "weights random-direct" in capsys.readouterr().out
