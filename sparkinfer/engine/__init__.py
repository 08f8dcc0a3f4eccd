"""Generation: static cache slots, prefill, decode steps in CUDA graphs, sampling."""

from sparkinfer.engine.engine import DEFAULT_BUCKETS, Engine, GenerationResult
from sparkinfer.engine.sampling import SamplingParams, sample

__all__ = ["Engine", "GenerationResult", "SamplingParams", "sample", "DEFAULT_BUCKETS"]
