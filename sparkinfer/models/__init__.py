"""Whole models from Hugging Face checkpoints: config, loading, tensor-parallel decoder.

Nothing runs at import; `transformers` is imported only by `presets.make_checkpoint`.
"""

from sparkinfer.models.checkpoint import Checkpoint
from sparkinfer.models.config import ModelSpec, load_spec
from sparkinfer.models.loader import HeadShard, head_shard, load_weights, vocab_shard
from sparkinfer.models.presets import make_checkpoint, preset_config, write_nvfp4_checkpoint
from sparkinfer.models.weights import (
                                       AttentionWeights,
                                       DenseMLPWeights,
                                       ExpertWeights,
                                       LayerWeights,
                                       ModelWeights,
                                       Sharding,
)

__all__ = ["Checkpoint", "ModelSpec", "load_spec", "load_weights", "HeadShard", "head_shard",
           "vocab_shard", "make_checkpoint", "preset_config", "write_nvfp4_checkpoint",
           "Sharding", "AttentionWeights", "DenseMLPWeights", "ExpertWeights", "LayerWeights",
           "ModelWeights"]
