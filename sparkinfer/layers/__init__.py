"""Blocks that use both halves the way a serving engine does."""

from sparkinfer.layers.tp_moe import TPMoEBlock

__all__ = ["TPMoEBlock"]
