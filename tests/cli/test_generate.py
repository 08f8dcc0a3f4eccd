"""`sparkinfer generate` refuses what cannot run in one line on stderr (exit 2), before
any rank starts: no traceback, no prompt echoed, no rank launched, no /dev/shm file
left. Errors raised inside ranks print one line per distinct cause with its ranks;
SPARKINFER_LOG=debug adds the tracebacks."""

import os
import re

import pytest
from safetensors.torch import load_file, save_file

import sparkinfer.runtime.ranks as ranks
from sparkinfer.cli import main
from sparkinfer.errors import RankFailed
from sparkinfer.models.presets import make_checkpoint
from tests.faults._util import shm_files

# 8 query heads over 4 KV heads: tp 3 splits neither; 256 positions
OVERRIDES = dict(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("qwen3_moe-tiny", tmp_path_factory.mktemp("gen"), **OVERRIDES)


@pytest.fixture(scope="module")
def truncated(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("truncated")
    for f in ckpt.iterdir():
        data = f.read_bytes()
        (out / f.name).write_bytes(data[:len(data) // 2] if f.suffix == ".safetensors" else data)
    return out


def _shm() -> list:
    """This process's /dev/shm names (the refusals start no rank; the other test worker's come and go)."""
    return shm_files(os.getpid())


def _no_ranks(*args, **kwargs):
    raise AssertionError("a rank was started")


REFUSALS = [  # id, checkpoint, arguments, what the one line says
    ("tp3-heads", "ok", ["--tp", "3"], "ShapeError: tp=3: num_attention_heads=8 does not divide over 3 ranks; "
                                       "tp values that work: 1, 2, 4, 8"),
    ("tp4-dcp3", "ok", ["--tp", "4", "--dcp", "3"], "dcp=3 with tp=4: dcp is 1, or tp (4)"),
    ("tp17", "ok", ["--tp", "17"], "SetupError: tp=17: SparkInfer runs 1 to 16 tensor-parallel ranks"),
    ("empty-prompt", "ok", ["--prompt", ""], "CapacityError: the prompt is empty (0 tokens)"),
    ("long-prompt", "ok", ["--prompt", "x" * 319], "the prompt has 319 tokens, more than the model's "
                                                  "max_position_embeddings (256); shorten it"),
    ("too-many-new", "ok", ["--prompt", "x" * 200], "200 prompt tokens + max_new_tokens=64 = 264 exceed the "
                                                   "model's max_position_embeddings (256); ask for at most 56 new"),
    ("self-draft", "ok", ["--self-draft", "3"], "self_draft=3: a self-draft takes 1 to 2 of the model's 3 layers"),
    ("missing-dir", "missing", [], "nowhere does not exist; pass a Hugging Face checkpoint directory"),
    ("truncated", "truncated", [], "CheckpointError: file "),
]


@pytest.mark.parametrize("which,args,message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refused_in_one_line_before_any_rank(which, args, message, ckpt, truncated, tmp_path, monkeypatch,
                                             capsys):
    monkeypatch.setattr(ranks, "run_ranks", _no_ranks)
    model = {"ok": ckpt, "missing": tmp_path / "nowhere", "truncated": truncated}[which]
    prompt = [] if "--prompt" in args else ["--prompt", "hello"]
    before = _shm()
    assert main(["generate", "--model", str(model), *prompt, *args]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("sparkinfer generate: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err, err
    if which == "truncated":
        assert "is truncated or corrupt" in err
    assert out == "" and _shm() == before


def test_rank_errors_print_one_line_per_cause_and_tracebacks_under_debug(ckpt, monkeypatch, capsys):
    failure = RankFailed(0, "Traceback (most recent call last):\n  ...\nsparkinfer.errors.ShapeError: a",
                         causes=(("ShapeError: a", (0, 2)), ("RuntimeError: connection closed", (1,))))

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(ranks, "run_ranks", fail)
    argv = ["generate", "--model", str(ckpt), "--prompt", "hello", "--tp", "4", "--backend", "cpu"]
    for debug in (False, True):
        monkeypatch.setenv("SPARKINFER_LOG", "debug" if debug else "")
        assert main(argv) == 2
        out, err = capsys.readouterr()
        lines = [ln for ln in err.splitlines() if ln.startswith("sparkinfer generate:")]
        assert lines == ["sparkinfer generate: ranks 0, 2: ShapeError: a" +
                         ("" if debug else " (SPARKINFER_LOG=debug shows the tracebacks)"),
                         "sparkinfer generate: rank 1: RuntimeError: connection closed (likely because of the above)"]
        assert ("Traceback" in err) == debug and out == ""


def test_the_summary_says_what_it_counted(ckpt, monkeypatch, capsys):
    """--max-new-tokens 12 gives 12 new tokens, the first from the prefill and 11 from decode
    steps (it used to say "11 tokens")."""
    from sparkinfer.engine import GenerationResult

    res = GenerationResult([list(range(12))], prefill_s=0.5, decode_s=2.0, decode_steps=11, decode_tokens=11)
    monkeypatch.setattr(ranks, "run_ranks", lambda *args, **kwargs: [res])
    assert main(["generate", "--model", str(ckpt), "--prompt", "hello", "--max-new-tokens", "12"]) == 0
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "12 new tokens (the first from the prefill, 0.50 s; 11 by decode steps at 5.5 tokens/s)" in err, err


@pytest.mark.slow
def test_a_checkpoint_error_in_the_ranks_is_one_line(ckpt, tmp_path, capsys):
    """Two CPU ranks load a checkpoint missing a router (a tensor, not config.json: only the
    ranks see it). About 10 s: the ranks fail while loading, before any kernel runs."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.2.mlp.gate.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    before = _shm()
    assert main(["generate", "--model", str(broken), "--prompt", "hello", "--tp", "2", "--backend", "cpu"]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("sparkinfer generate:")]
    assert len(lines) == 1 and "Traceback" not in err and out == "", err
    assert re.fullmatch(r"sparkinfer generate: ranks? [01](, 1)?: CheckpointError: tensor "
                        r"'model\.layers\.2\.mlp\.gate\.weight' is missing from .*", lines[0]), lines[0]
    assert _shm() == before
