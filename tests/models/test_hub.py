"""`--model` as a Hugging Face Hub id (`models.hub`): resolved from a Hub cache laid out as
huggingface_hub writes it, offline (no test reaches the network); every failure is one
typed line that says what to do; `generate` and `serve` hand the ranks the snapshot
directory, and `serve` names the model by its id."""

import fnmatch
import json

import huggingface_hub
import pytest
from huggingface_hub import constants

import sparkinfer.runtime.ranks as ranks
from sparkinfer.cli import main
from sparkinfer.errors import ModelFetchError, UnsupportedModelError
from sparkinfer.models.config import load_spec
from sparkinfer.models.hub import META, ModelRef, resolve_model
from sparkinfer.models.presets import make_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OVERRIDES = dict(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hub cache holding org/tiny at `main` and at branch `v1` (the same snapshot)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--org--tiny"
    make_checkpoint("qwen3_moe-tiny", repo / "snapshots" / COMMIT, **OVERRIDES)
    (repo / "refs").mkdir()
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache / "models--org--tiny" / "snapshots" / COMMIT


def test_a_directory_is_taken_as_it_is(tmp_path):
    assert resolve_model(str(tmp_path)) == ModelRef(str(tmp_path))


@pytest.mark.parametrize("ref,rev", [("org/tiny", None), ("org/tiny@v1", "v1"), (f"org/tiny@{COMMIT}", COMMIT)])
def test_a_hub_id_resolves_to_its_cached_snapshot(ref, rev, offline):
    got = resolve_model(ref)
    assert got == ModelRef(str(offline), "org/tiny", rev)
    assert load_spec(got.path).num_layers >= 1


def test_an_uncached_id_offline_says_what_to_do(offline):
    with pytest.raises(ModelFetchError, match=r"--draft org/other is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("org/other", what="--draft")


@pytest.mark.parametrize("ref", ["nowhere", "./org/tiny", "/abs/org/tiny", "a/b/c", "org/", "-x/y"])
def test_a_missing_path_that_is_no_hub_id_is_refused_without_fetching(ref, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("fetched"))
    with pytest.raises(UnsupportedModelError, match=f"--model {ref} does not exist; pass a Hugging Face"):
        resolve_model(ref)


def _raising(exc):
    def fetch(*args, **kwargs):
        raise exc
    return fetch


def _http_error(cls):
    import httpx

    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))
    return cls("the Hub's message", response=response)


@pytest.mark.parametrize("cls,says", [
    ("GatedRepoError", "--model org/x: the repository is gated; accept its terms on huggingface.co and set HF_TOKEN"),
    ("RepositoryNotFoundError", "--model org/x: no such directory here, and no such model on the Hub (or a "
                                "private one: set HF_TOKEN)"),
    ("RevisionNotFoundError", "--model org/x: the repository has no revision 'main'"),
    ("HfHubHTTPError", "--model org/x: fetching from the Hub failed (HfHubHTTPError: the Hub's message)"),
])
def test_each_hub_failure_is_one_typed_line(cls, says, monkeypatch):
    from huggingface_hub import errors

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(_http_error(getattr(errors, cls))))
    with pytest.raises(ModelFetchError) as info:
        resolve_model("org/x")
    assert str(info.value).startswith(says) and "\n" not in str(info.value)


@pytest.mark.parametrize("indexed", [True, False], ids=["index", "no-index"])
def test_only_the_files_a_rank_reads_are_fetched(indexed, monkeypatch, tmp_path):
    """The config, tokenizer and index first; then the weights the index names (not a
    consolidated copy beside them), or without an index the top folder's safetensors;
    both at the commit the first fetch resolved."""
    snap = tmp_path / COMMIT
    snap.mkdir()
    if indexed:
        shards = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
                  "c.weight": "model-00001-of-00002.safetensors"}
        (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    calls = []

    def fetch(repo, revision=None, allow_patterns=None, ignore_patterns=None):
        calls.append((repo, revision, allow_patterns, ignore_patterns))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    assert resolve_model("org/x@v2") == ModelRef(str(snap), "org/x", "v2")
    (repo, rev, meta, no), (repo2, rev2, weights, skip) = calls
    assert (repo, rev, meta, no) == ("org/x", "v2", list(META), None) and (repo2, rev2) == ("org/x", COMMIT)
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "tokenizer.model", "hf_quant_config.json", "chat_template.jinja"):
        assert any(fnmatch.fnmatch(name, p) for p in meta), name

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in weights) and not any(fnmatch.fnmatch(name, p)
                                                                          for p in skip or ())
    assert not any(fnmatch.fnmatch(w, p) for w in ("model.safetensors", "x.bin") for p in meta)
    wanted = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] if indexed else \
        ["model.safetensors", "model-00001-of-00002.safetensors"]
    for name in wanted:
        assert fetched(name), name
    unwanted = ["pytorch_model.bin", "model.gguf", "original/model.safetensors"]
    for name in unwanted + (["consolidated.safetensors"] if indexed else []):
        assert not fetched(name), name


def _no_ranks(*args, **kwargs):
    raise AssertionError("a rank was started")


def test_generate_checks_a_hub_checkpoint_before_any_rank(offline, monkeypatch, capsys):
    monkeypatch.setattr(ranks, "run_ranks", _no_ranks)
    assert main(["generate", "--model", "org/tiny", "--prompt", "hello", "--tp", "3"]) == 2
    _, err = capsys.readouterr()
    assert "--model org/tiny: " + str(offline) in err
    assert err.strip().splitlines()[-1].startswith("sparkinfer generate: ShapeError: tp=3: num_attention_heads=8")


def test_generate_refuses_an_uncached_draft_in_one_line(offline, monkeypatch, capsys):
    monkeypatch.setattr(ranks, "run_ranks", _no_ranks)
    assert main(["generate", "--model", "org/tiny", "--draft", "org/none", "--prompt", "hello"]) == 2
    _, err = capsys.readouterr()
    assert err.strip().splitlines()[-1].startswith(
        "sparkinfer generate: ModelFetchError: --draft org/none is not in the Hugging Face cache"), err


def test_serve_hands_the_ranks_the_snapshot_and_serves_the_id(offline, monkeypatch):
    from sparkinfer.engine import serving

    seen = {}

    def launch(config):
        seen["config"] = config
        raise ModelFetchError("stop here")  # one line from cli.main; no engine starts

    monkeypatch.setattr(serving.ServingEngine, "launch", staticmethod(launch))
    assert main(["serve", "--model", "org/tiny@v1", "--backend", "cpu"]) == 2
    assert seen["config"].model == str(offline) and seen["config"].name == "org/tiny"
