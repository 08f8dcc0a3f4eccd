"""One rank's whole serving setup, and the function every rank runs to generate.

    results = run_ranks(generate_on_rank, 2, args=(GenerateRequest(path, prompts),))

`generate_on_rank` builds the communicator (W > 1), loads this rank's weights,
builds the decoder and engine, generates, closes the communicator collectively,
and returns the `GenerationResult` (every rank's tokens and logits are the same
bits; callers may check that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkinfer.engine.engine import Engine, GenerationResult
from sparkinfer.engine.sampling import SamplingParams

__all__ = ["GenerateRequest", "ModelSession", "generate_on_rank"]


@dataclass(frozen=True)
class GenerateRequest:
    """path: checkpoint directory; prompts: token ids per sequence; params: sampling;
    moe_format: "bf16" | "nvfp4"; dcp: 1 or the world size; max_len: cache
    positions per sequence; keep_logits: return every step's logits; graphs:
    CUDA graphs for decode (None: on a GPU); stream: print rank 0's new tokens
    as they come, decoded by the checkpoint's tokenizer."""

    path: str
    prompts: list = field(default_factory=list)
    params: SamplingParams = SamplingParams()
    moe_format: str = "bf16"
    dcp: int = 1
    max_len: int = 512
    keep_logits: bool = False
    graphs: bool | None = None
    stream: bool = False


class ModelSession:
    """Communicator + decoder + engine of one rank. close() is collective."""

    def __init__(self, world, req: GenerateRequest, progress=None):
        from sparkinfer.models.build import PREFILL_CHUNK, build_decoder, comm_capacity
        from sparkinfer.models.config import load_spec
        from sparkinfer.models.weights import Sharding

        w = world.world_size
        batch = max(1, len(req.prompts))
        self.comm = None
        if w > 1:
            from sparkinfer.comm import Communicator

            spec = load_spec(req.path)
            cap = comm_capacity(spec, w, batch, max(PREFILL_CHUNK, batch))
            self.comm = Communicator(device=world.device, capacity_bytes=cap, channel_ids=("target",))
        sharding = Sharding(world.rank, w, req.dcp)
        self.decoder = build_decoder(req.path, sharding, comm=self.comm, device=world.device,
                                     moe_format=req.moe_format, max_batch=batch, max_len=req.max_len,
                                     progress=progress)
        self.engine = Engine(self.decoder, max_batch=batch, comm=self.comm, graphs=req.graphs)

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
        return session.engine.generate(req.prompts, req.params, keep_logits=req.keep_logits,
                                       on_token=on_token)
    finally:
        session.close()
