"""`write_random_checkpoint`: a preset's checkpoint written tensor by tensor that the
real loader reads, sharded, with the stated distributions, reused when it exists."""

from __future__ import annotations

import json

import pytest
import torch

from sparkinfer.models.checkpoint import Checkpoint
from sparkinfer.models.config import load_spec
from sparkinfer.models.loader import load_weights
from sparkinfer.models.random_checkpoint import MARKER, write_random_checkpoint
from sparkinfer.models.weights import Sharding


@pytest.mark.parametrize("preset", ["qwen3_moe-tiny", "glm4_moe-tiny", "mixtral-tiny"])
def test_the_loader_reads_it_at_tp2(tmp_path, preset):
    path = write_random_checkpoint(preset, tmp_path / preset, layers=2, shard_bytes=64 << 10)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # cut into shards
    spec = load_spec(path)
    assert spec.num_layers == 2
    with Checkpoint(path) as ckpt:
        w = load_weights(ckpt, spec, Sharding(rank=1, world=2))
    assert len(w.layers) == 2 and torch.isfinite(w.lm_head.float()).all()


def test_values_follow_bench_decode(tmp_path):
    path = write_random_checkpoint("qwen3_moe-tiny", tmp_path / "c", layers=2)
    with Checkpoint(path) as ckpt:
        experts = ckpt.read("model.layers.1.mlp.experts.down_proj").float()  # [E, H, I]: std 1/sqrt(I)
        router = ckpt.read("model.layers.1.mlp.gate.weight").float()  # std 2/sqrt(H)
        norm = ckpt.read("model.layers.1.input_layernorm.weight").float()
    assert abs(experts.std().item() * experts.shape[-1] ** 0.5 - 1) < 0.05
    assert abs(router.std().item() * router.shape[-1] ** 0.5 / 2 - 1) < 0.1
    assert torch.equal(norm, torch.ones_like(norm))


def test_an_existing_checkpoint_of_the_same_preset_is_reused(tmp_path):
    path = write_random_checkpoint("mixtral-tiny", tmp_path / "c", layers=1)
    stamp = {f.name: f.stat().st_mtime_ns for f in path.glob("*.safetensors")}
    assert write_random_checkpoint("mixtral-tiny", path, layers=1) == path
    assert {f.name: f.stat().st_mtime_ns for f in path.glob("*.safetensors")} == stamp
    assert json.loads((path / MARKER).read_text()) == {"preset": "mixtral-tiny", "layers": 1, "seed": 0}
