"""Generation: cache slots, prefill chunks, decode steps in CUDA graphs with per-row
sampling, continuous batching, speculative decoding, and the serving engine."""

from sparkinfer.engine.client import EngineClient, RequestHandle
from sparkinfer.engine.config import EngineConfig
from sparkinfer.engine.core import EngineCore, GenerationResult
from sparkinfer.engine.engine import DEFAULT_BUCKETS, Engine
from sparkinfer.engine.request import (
    EngineStats,
    FinishReason,
    RequestOutput,
    RequestState,
    SamplingParams,
    TokenLogprob,
)
from sparkinfer.engine.sampling import sample

__all__ = ["Engine", "EngineCore", "GenerationResult", "SamplingParams", "sample", "DEFAULT_BUCKETS",
           "EngineClient", "RequestHandle", "EngineConfig", "EngineStats", "FinishReason", "RequestOutput",
           "RequestState", "TokenLogprob"]
