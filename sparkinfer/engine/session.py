"""One rank's whole serving setup, and the function every rank runs to generate.

    results = run_ranks(generate_on_rank, 2, args=(GenerateRequest(path, prompts),))

`generate_on_rank` builds the communicator (W > 1), loads this rank's weights,
builds the decoder and engine, generates, closes the communicator collectively,
and returns the `GenerationResult` (every rank's tokens and logits are the same
bits; callers may check that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkinfer.engine.core import GenerationResult
from sparkinfer.engine.engine import Engine
from sparkinfer.engine.sampling import SamplingParams

__all__ = ["GenerateRequest", "ModelSession", "generate_on_rank"]


@dataclass(frozen=True)
class GenerateRequest:
    """path: checkpoint directory; prompts: token ids per sequence; params: sampling;
    moe_format: "bf16" | "nvfp4"; dcp: 1 or the world size; max_len: cache
    positions per sequence; keep_logits: return every step's logits; graphs:
    CUDA graphs for decode (None: on a GPU); stream: print rank 0's new tokens
    as they come, decoded by the checkpoint's tokenizer. Speculative decoding:
    draft (a checkpoint directory sharing the tokenizer) or self_draft (the
    target's first N layers), spec_k draft tokens per round."""

    path: str
    prompts: list = field(default_factory=list)
    params: SamplingParams = SamplingParams()
    moe_format: str = "bf16"
    dcp: int = 1
    max_len: int = 512
    keep_logits: bool = False
    graphs: bool | None = None
    stream: bool = False
    draft: str | None = None
    self_draft: int = 0
    spec_k: int = 3


class ModelSession:
    """Communicator + decoder + engine of one rank. close() is collective."""

    def __init__(self, world, req: GenerateRequest, progress=None):
        from sparkinfer.models.build import PREFILL_CHUNK, build_decoder, comm_capacity
        from sparkinfer.models.config import load_spec
        from sparkinfer.models.weights import Sharding

        w = world.world_size
        batch = max(1, len(req.prompts))
        speculative = req.draft is not None or req.self_draft > 0
        max_len = req.max_len + (req.spec_k + 2 if speculative else 0)
        self.comm = None
        if w > 1:
            from sparkinfer.comm import Communicator

            spec = load_spec(req.path)
            cap = comm_capacity(spec, w, batch, max(PREFILL_CHUNK, batch * (req.spec_k + 1)))
            channels = ("draft", "target") if speculative else ("target",)
            self.comm = Communicator(device=world.device, capacity_bytes=cap, channel_ids=channels)
        sharding = Sharding(world.rank, w, req.dcp)
        tokens = max(PREFILL_CHUNK, batch * (req.spec_k + 1))
        self.decoder = build_decoder(req.path, sharding, comm=self.comm, device=world.device,
                                     moe_format=req.moe_format, max_batch=batch, max_len=max_len,
                                     max_tokens=tokens, progress=progress)
        self.engine = Engine(self.decoder, max_batch=batch, comm=self.comm, graphs=req.graphs)
        self.speculative = None
        if speculative:
            from sparkinfer.engine.speculative import SpeculativeEngine
            from sparkinfer.models.build import self_draft

            if req.draft is not None:
                draft = build_decoder(req.draft, sharding, comm=self.comm, device=world.device,
                                      moe_format=req.moe_format, max_batch=batch, max_len=max_len,
                                      max_tokens=tokens)
            else:
                draft = self_draft(self.decoder, req.self_draft, max_batch=batch, max_len=max_len)
            draft_engine = Engine(draft, max_batch=batch, comm=self.comm, graphs=req.graphs, channel="draft")
            self.speculative = SpeculativeEngine(self.engine, draft_engine, req.spec_k)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def _printer(path: str):
    """on_token(seq, token) that prints sequence 0's text as it grows."""
    from sparkinfer.models.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    shown = {"ids": [], "text": ""}

    def on_token(seq: int, token: int) -> None:
        if seq != 0:
            return
        shown["ids"].append(token)
        text = tok.decode(shown["ids"])
        print(text[len(shown["text"]):], end="", flush=True)
        shown["text"] = text
    return on_token


def generate_on_rank(world, req: GenerateRequest) -> GenerationResult:
    """Build, generate, close (collective); the result of this rank."""
    session = ModelSession(world, req)
    try:
        on_token = _printer(req.path) if req.stream and world.rank == 0 else None
        if session.speculative is not None:
            return session.speculative.generate(req.prompts, req.params, on_token=on_token)
        return session.engine.generate(req.prompts, req.params, keep_logits=req.keep_logits,
                                       on_token=on_token)
    finally:
        session.close()
