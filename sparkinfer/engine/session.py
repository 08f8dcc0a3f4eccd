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

__all__ = ["GenerateRequest", "ModelSession", "decoder_tokens", "generate_on_rank"]


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
    """Communicator + decoder + engine of one rank (+ the draft's, when speculative).
    close() is collective."""

    def __init__(self, world, req: GenerateRequest, progress=None):
        self._build(world, req.path, batch=max(1, len(req.prompts)), max_len=req.max_len, moe_format=req.moe_format,
                    dcp=req.dcp, draft=req.draft, self_draft=req.self_draft, spec_k=req.spec_k, graphs=req.graphs,
                    progress=progress)

    @classmethod
    def for_config(cls, world, cfg, max_context: int, progress=None) -> ModelSession:
        """The session of a serving engine's rank (`EngineConfig`), holding requests of up
        to max_context positions."""
        self = cls.__new__(cls)
        self._build(world, cfg.model, batch=cfg.max_batch, max_len=max_context, moe_format=cfg.moe_format,
                    dcp=cfg.dcp, draft=cfg.draft, self_draft=cfg.self_draft, spec_k=cfg.spec_k, graphs=cfg.graphs,
                    progress=progress, chunk=cfg.prefill_chunk, step_tokens=cfg.step_tokens,
                    batch_invariant=cfg.batch_invariant, mixed=cfg.mixed_steps)
        return self

    def _build(self, world, path, *, batch, max_len, moe_format, dcp, draft, self_draft, spec_k, graphs,
               progress, chunk=None, step_tokens=0, batch_invariant=True, mixed=False):
        from sparkinfer.models.build import PREFILL_CHUNK, build_decoder, comm_capacity
        from sparkinfer.models.config import load_spec
        from sparkinfer.models.weights import Sharding

        w = world.world_size
        speculative = draft is not None or self_draft > 0
        self.spec_k = spec_k if speculative else 0
        self.max_context = max_len
        max_len = max_len + (spec_k + 2 if speculative else 0)
        # serving: a prefill forward runs up to step_tokens // chunk rows of a chunk each,
        # padded to whole chunks, so the cache holds whole chunks (a padded row stays inside)
        self.chunk = chunk or PREFILL_CHUNK
        if chunk is not None:
            max_len = -(-max_len // self.chunk) * self.chunk
        tokens = decoder_tokens(self.chunk, step_tokens, batch, mixed=mixed and not speculative, spec_k=spec_k)
        self.comm = None
        if w > 1:
            from sparkinfer.comm import Communicator

            spec = load_spec(path)
            cap = comm_capacity(spec, w, batch, tokens)
            channels = ("draft", "target") if speculative else ("target",)
            self.comm = Communicator(device=world.device, capacity_bytes=cap, channel_ids=channels)
        sharding = Sharding(world.rank, w, dcp)
        self.decoder = build_decoder(path, sharding, comm=self.comm, device=world.device,
                                     moe_format=moe_format, max_batch=batch, max_len=max_len,
                                     max_tokens=tokens, progress=progress, batch_invariant=batch_invariant)
        self.engine = Engine(self.decoder, max_batch=batch, comm=self.comm, graphs=graphs)
        self.speculative = None
        if speculative:
            from sparkinfer.engine.speculative import SpeculativeEngine
            from sparkinfer.models.build import self_draft as make_self_draft

            if draft is not None:
                dft = build_decoder(draft, sharding, comm=self.comm, device=world.device,
                                    moe_format=moe_format, max_batch=batch, max_len=max_len,
                                    max_tokens=tokens, batch_invariant=batch_invariant)
            else:
                dft = make_self_draft(self.decoder, self_draft, max_batch=batch, max_len=max_len)
            draft_engine = Engine(dft, max_batch=batch, comm=self.comm, graphs=graphs, channel="draft")
            self.speculative = SpeculativeEngine(self.engine, draft_engine, spec_k)

    def runner(self, *, keep_logits: bool = False, mixed: bool = False):
        """A ModelRunner over this session's engines (speculative when it has a draft);
        mixed: mixed steps (`ModelRunner`)."""
        from sparkinfer.engine.runner import ModelRunner

        opts = dict(keep_logits=keep_logits, max_context=self.max_context, prefill_chunk=self.chunk, mixed=mixed)
        if self.speculative is None:
            return ModelRunner(self.engine, **opts)
        return ModelRunner(self.engine, self.speculative.draft, self.spec_k, **opts)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def decoder_tokens(chunk: int, step_tokens: int, batch: int, *, mixed: bool, spec_k: int = 0) -> int:
    """Tokens a serving rank's decoder holds (its largest step): a prefill forward of
    step_tokens // chunk rows of a chunk (at least one), beside `batch` decode rows where
    a mixed step (`Engine.launch_mixed`) holds both; and a verify of batch x (spec_k + 1)."""
    return max(chunk * max(1, step_tokens // chunk) + (batch if mixed else 0), batch * (spec_k + 1))


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
