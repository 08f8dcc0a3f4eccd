"""`sparkinfer bench decode --model`: our decoder timed on a checkpoint of one's own (a
directory, or a Hugging Face id from the Hub's cache), end to end on the CPU; the options
a checkpoint cannot take are refused in one line before anything is built."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import constants

from sparkinfer.cli import main
from sparkinfer.models.presets import make_checkpoint

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("qwen3_moe-tiny", tmp_path_factory.mktemp("bench_ckpt") / "tiny-moe")


def _rows(out):
    return json.loads(out.read_text())


def test_a_checkpoint_directory_is_timed_at_its_own_depth(ckpt, tmp_path, capsys):
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--dry-run", "--model", str(ckpt), "--impls", "sparkinfer", "--batches", "1",
            "--replays", "1", "--context", "4", "--out", str(out)]
    assert main(argv) == 0
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    (r,) = _rows(out)
    assert (r["preset"], r["weights"], r["layers"], r["impl"], r["batch"]) == ("tiny-moe", "checkpoint", layers,
                                                                               "sparkinfer", 1), r
    assert r["ok"] and r["replay_equals_eager"] and r["us_per_step"] > 0, r
    assert "weights checkpoint" in capsys.readouterr().out


def test_a_checkpoint_on_two_ranks(ckpt, tmp_path):
    """--tp 2: each CPU rank reads its slices of the checkpoint; the ranks' logits the same bits."""
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--dry-run", "--model", str(ckpt), "--tp", "2", "--impls", "sparkinfer", "--batches",
            "1", "--replays", "1", "--context", "4", "--out", str(out)]
    assert main(argv) == 0
    (r,) = _rows(out)
    assert (r["preset"], r["weights"], r["tp"], r["batch"]) == ("tiny-moe", "checkpoint", 2, 1), r
    assert r["ok"] and r["ranks_same_logits"] and len(r["us_per_rank"]) == 2, r


def test_a_hub_id_is_timed_under_its_name(ckpt, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--org--tiny-moe"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "snapshots" / COMMIT).symlink_to(ckpt, target_is_directory=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--dry-run", "--model", "org/tiny-moe", "--impls", "torch", "--batches", "2",
            "--replays", "1", "--context", "4", "--out", str(out)]
    assert main(argv) == 0
    (r,) = _rows(out)
    assert (r["preset"], r["weights"], r["impl"], r["batch"], r["ok"]) == ("org/tiny-moe", "checkpoint", "torch", 2,
                                                                          True), r


REFUSED = [(["--presets", "qwen3_moe-tiny"], "--presets"), (["--layers", "2"], "--layers"),
           (["--weights", "random-direct"], "--weights"), (["--spec-k", "2"], "--spec-k")]


@pytest.mark.parametrize("extra,named", REFUSED)
def test_what_a_checkpoint_cannot_take_is_refused_first(extra, named, ckpt, tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--dry-run", "--model", str(ckpt), *extra, "--out", str(out)]) == 2
    said = capsys.readouterr().out
    assert f"--model with {named}" in said and "a checkpoint runs with its own weights and depth" in said, said
    assert not out.exists()
