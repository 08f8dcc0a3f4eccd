"""What a serving engine is built from: the checkpoint, the ranks, the capacities.

    config = EngineConfig(model="ckpt/", tp=2, max_batch=16, max_context=4096)
    engine = ServingEngine.launch(config)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig", "GPU_STALL_S"]

# How long a GPU rank may go without publishing a step's result or a heartbeat before the
# engine fails and names it: far beyond any step (milliseconds), short enough to end a hang.
GPU_STALL_S = 60.0


@dataclass(frozen=True)
class EngineConfig:
    """model: checkpoint directory (config.json, *.safetensors, tokenizer files).
    tp: tensor-parallel ranks; dcp: 1, or tp to split the KV cache over the ranks.
    moe_format: expert weights as "bf16", "nvfp4" or "fp8_block".
    draft: a draft checkpoint directory (same tokenizer), or self_draft: the
    target's first N layers as the draft; spec_k: draft tokens per round.
    max_batch: requests decoding at once (cache slots). max_context: cache
    positions per request (prompt + new tokens); None: the checkpoint's
    max_position_embeddings, capped at 4096. max_waiting: requests queued beyond
    max_batch before submit refuses (EngineOverloaded). prefill_chunk: prompt
    tokens per prefill row (a request's chunks start at multiples of it). step_tokens:
    prompt tokens prefilled per engine step at most (at least one chunk), so running
    requests keep decoding while a long prompt comes in; a step's chunks run as rows
    of one forward (step_tokens // prefill_chunk rows at most; a forward reads every
    expert's weights once however many rows it has). prefill_wait_steps: while
    requests decode, a step's prompt chunks may wait up to this many steps for a
    fuller forward (0, the default: prefill every step; 8 measured no faster under
    load on an H200, docs/serving.md). backend: "auto" | "cpu" | "cuda" |
    "cuda_shared" (`sparkinfer.runtime.run_ranks`). timeout_s: how long a rank may
    stall before the engine fails every request and names it (None: 60 s, and
    `envs.CPU_TIMEOUT_S` on CPU ranks, whose interpreted steps are slow). graphs: decode steps
    in CUDA graphs (None: on a GPU). name: the model name served (None: the
    directory's name). batch_invariant: a request's logits are the same bits
    whatever runs beside it (every kernel's sums follow the row alone); False takes
    cuBLAS for the projections, faster by the margin `bench decode --invariance
    both` measures (docs/performance.md). mixed_steps: run the prompt chunks a plan
    announces beside the next step's decode rows in one forward (`Engine.launch_mixed`),
    where the ranks can (a GPU, no draft, DCP 1, batch-invariant; elsewhere this
    changes nothing). On one H200 (Qwen3-30B-A3B, 8 layers, 512-token prompts, steady
    window of `bench serve`, b7e0718) it took C = 32 / 64 from 0.79 / 0.73 to 0.83 /
    0.78 of the static step, C = 1 / 8 unchanged (docs/serving.md). prefix_reuse: a
    request may start after the whole prompt chunks its slot's last request left
    (a chat's next turn; the same bits as computing them, `engine/scheduler.py`);
    never with a draft model."""

    model: str
    tp: int = 1
    dcp: int = 1
    moe_format: str = "bf16"
    draft: str | None = None
    self_draft: int = 0
    spec_k: int = 3
    max_batch: int = 8
    max_context: int | None = None
    max_waiting: int = 64
    prefill_chunk: int = 256
    step_tokens: int = 2048
    prefill_wait_steps: int = 0
    backend: str = "auto"
    timeout_s: float | None = None
    graphs: bool | None = None
    name: str | None = None
    batch_invariant: bool = True
    mixed_steps: bool = True
    prefix_reuse: bool = True

    def stall_s(self, backend: str) -> float:
        """timeout_s, or its default on `backend` (the resolved one: "cpu", "cuda", ...)."""
        from sparkinfer.envs import CPU_TIMEOUT_S

        if self.timeout_s is not None:
            return self.timeout_s
        return float(CPU_TIMEOUT_S) if backend == "cpu" else GPU_STALL_S

    @property
    def speculative(self) -> bool:
        return self.draft is not None or self.self_draft > 0
