"""Tiny checkpoints of the continuous-batching tests (CPU and GPU)."""

import pytest

from sparkinfer.models.presets import make_checkpoint

FAMILIES = ("qwen3_moe-tiny", "glm4_moe-tiny", "mixtral-tiny")


@pytest.fixture(scope="session")
def paths(tmp_path_factory):
    # a dense and a MoE layer where the family has dense layers (qwen3, glm), one MoE layer for mixtral
    layers = {"qwen3_moe-tiny": 2, "glm4_moe-tiny": 2, "mixtral-tiny": 1}
    return {fam: make_checkpoint(fam, tmp_path_factory.mktemp(fam), num_hidden_layers=layers[fam])
            for fam in FAMILIES}
