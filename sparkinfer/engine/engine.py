"""Static-slot generation: prefill, then decode steps replayed from CUDA graphs.

Legend: B rows in a decode step (a bucket size), S cache slots, V vocabulary.

    engine = Engine(decoder, max_batch=8, comm=comm)
    result = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16))

Each sequence owns a cache slot for its lifetime; slot S - 1 is the padding
slot, which padded rows of a bucket read and write. Prefill runs eagerly in
chunks of at most `decoder.max_tokens` tokens. A decode step runs the rows of
the unfinished sequences, padded up to the next bucket; on a GPU each bucket is
one CUDA graph captured on the communicator's channel (`channel`, "target" for
a target model), so a step is: copy the inputs into the graph's buffers,
replay, read the sampled ids (the step's one host sync).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparkinfer.engine.sampling import SamplingParams, sample
from sparkinfer.errors import CapacityError, ShapeError
from sparkinfer.models.decoder import Step

__all__ = ["Engine", "GenerationResult", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class GenerationResult:
    """tokens: the new tokens of each sequence; prefill_s, decode_s: wall seconds;
    decode_steps: decode steps run; decode_tokens: tokens they produced; logits:
    with keep_logits, each sequence's fp32 logits [new tokens, V] (row 0 from
    the prefill), on the CPU."""

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class _Buffers:
    """Fixed-address inputs of one bucket's step (B rows of q_len queries)."""

    def __init__(self, rows: int, q_len: int, device):
        t = rows * q_len
        self.tokens = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int32, device=device)
        self.slots = torch.zeros(t, dtype=torch.int32, device=device)
        self.row_slots = torch.zeros(rows, dtype=torch.int32, device=device)
        self.q_pos = torch.zeros(rows, dtype=torch.int32, device=device)
        self.step = Step(self.tokens, self.positions, self.slots, self.row_slots, self.q_pos, q_len)

    def fill(self, tokens: list[int], positions: list[int], slots: list[int], q_len: int, pad_slot: int) -> None:
        """Rows given as flat lists of T = rows * q_len; padded to the bucket with the padding slot."""
        t = self.tokens.shape[0]
        n = len(tokens)
        dev = self.tokens.device
        self.tokens.copy_(torch.tensor(tokens + [0] * (t - n), dtype=torch.int64), non_blocking=dev.type == "cuda")
        pos = positions + [i % q_len for i in range(t - n)]
        self.positions.copy_(torch.tensor(pos, dtype=torch.int32))
        self.slots.copy_(torch.tensor(slots + [pad_slot] * (t - n), dtype=torch.int32))
        self.row_slots.copy_(self.slots[::q_len])
        self.q_pos.copy_(self.positions[::q_len])


class Engine:
    """Generation over one rank's `Decoder` (every rank runs the same calls).

    max_batch: sequences at once (<= the cache's slots - 1); comm: the decoder's
    Communicator (None for one rank); graphs: capture decode steps in CUDA graphs
    (default: on a GPU); buckets: decode batch sizes to capture; channel: the
    pool channel the graphs are captured on. Graphs are captured lazily, on a
    bucket's first use.
    """

    def __init__(self, decoder, *, max_batch: int, comm=None, graphs: bool | None = None,
                 buckets=DEFAULT_BUCKETS, channel: str = "target"):
        self.dec, self.comm, self.channel = decoder, comm, channel
        self.device = decoder.device
        if max_batch > decoder.cache.slots - 1:
            raise CapacityError(f"max_batch={max_batch} needs {max_batch + 1} cache slots (one for padding); "
                                f"the cache has {decoder.cache.slots}")
        if max_batch > decoder.max_tokens:
            raise CapacityError(f"max_batch={max_batch} exceeds the decoder's max_tokens={decoder.max_tokens}")
        self.max_batch = max_batch
        self.pad_slot = decoder.cache.slots - 1
        self.buckets = tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))
        self.graphs = (self.device.type == "cuda") if graphs is None else graphs
        self._steps: dict[tuple[int, int], tuple] = {}

    # ------------------------------------------------------------------ steps
    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise CapacityError(f"{rows} rows exceed max_batch={self.max_batch}")

    def _eager_step(self, bufs: _Buffers, params: SamplingParams):
        logits = self.dec(bufs.step)
        return logits, sample(logits, params)

    def _graph_step(self, rows: int, q_len: int, params: SamplingParams):
        """(buffers, run) of a bucket: run() replays (or runs eagerly) and returns (logits, ids)."""
        key = (rows, q_len)
        if key not in self._steps:
            bufs = _Buffers(rows, q_len, self.device)
            bufs.fill([], [], [], q_len, self.pad_slot)
            if not self.graphs:
                self._steps[key] = (bufs, lambda p: self._eager_step(bufs, p))
            else:
                self._steps[key] = (bufs, self._capture(bufs, params))
        return self._steps[key]

    def _capture(self, bufs: _Buffers, params: SamplingParams):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        pool = self.comm.pool if self.comm is not None else None
        mark = pool.checkpoint() if pool is not None else None
        try:
            # every bucket's graph shares the channel; they replay in one stream order
            scope = pool.capture(stream, self.channel, reuse=True) if pool is not None else _nothing()
            with torch.cuda.stream(stream), scope:
                self._eager_step(bufs, params)  # warm-up: compiles, plans, on the scope's channel
                with torch.cuda.graph(graph, stream=stream):
                    out = self._eager_step(bufs, params)
        except BaseException:
            if pool is not None:
                pool.rollback(mark)  # a failed capture leaves no channel behind
            raise
        torch.cuda.current_stream(self.device).wait_stream(stream)
        captured = params

        def run(p: SamplingParams):
            if p.temperature != captured.temperature or p.top_p != captured.top_p:
                raise ShapeError("a captured decode step samples with the parameters it was captured with; "
                                 "use one Engine per sampling configuration")
            graph.replay()
            return out
        return run

    def step(self, tokens: list[list[int]], first_pos: list[int], slots: list[int],
             params: SamplingParams) -> tuple[torch.Tensor, list[int]]:
        """One forward of len(tokens) rows of Q tokens each (row r at positions first_pos[r]..,
        in slots[r]), padded to a bucket: (logits [rows * Q, V], sampled ids of every
        token). A CUDA graph replay per (bucket, Q) on a GPU; the one host sync is
        reading the ids."""
        q, n = len(tokens[0]), len(tokens)
        bufs, run = self._graph_step(self.bucket(n), q, params)
        bufs.fill([t for row in tokens for t in row], [p + j for p in first_pos for j in range(q)],
                  [s for s in slots for _ in range(q)], q, self.pad_slot)
        logits, ids = run(params)
        return logits[:n * q], ids[:n * q].tolist()

    # ------------------------------------------------------------------ generation
    def prefill(self, prompt: list[int], slot: int):
        """Run a prompt into `slot`'s cache (eager, in chunks); returns the logits [1, V] of its last token."""
        chunk = self.dec.max_tokens
        logits = None
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            bufs = _Buffers(1, len(part), self.device)
            bufs.fill(part, list(range(start, start + len(part))), [slot] * len(part), len(part), self.pad_slot)
            last = torch.tensor([len(part) - 1], dtype=torch.int64, device=self.device)
            step = Step(bufs.tokens, bufs.positions, bufs.slots, bufs.row_slots, bufs.q_pos, len(part), last)
            logits = self.dec(step)
        return logits

    def check_prompts(self, prompts: list[list[int]], extra: int = 1) -> None:
        """CapacityError unless 1..max_batch prompts each fit the cache with `extra` positions to spare."""
        if not prompts or len(prompts) > self.max_batch:
            raise CapacityError(f"{len(prompts)} prompts; this engine takes 1 to max_batch={self.max_batch}")
        max_len = self.dec.cache.max_len
        for p in prompts:
            if not p or len(p) + extra > max_len:
                raise CapacityError(f"a prompt of {len(p)} tokens does not fit the cache of {max_len} positions "
                                    f"with {extra} to spare; build the engine with a larger max_len")

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, *,
                 keep_logits: bool = False, on_token=None) -> GenerationResult:
        """New tokens for each prompt (greedy or sampled per `params`), every rank alike.
        keep_logits copies every step's logits to the host (for checks; slow);
        on_token(seq, token) is called for each new token as it is sampled."""
        params = params or SamplingParams()
        self.check_prompts(prompts)
        max_len = self.dec.cache.max_len
        torch.manual_seed(params.seed)  # every rank draws the same numbers (CPU and CUDA generators)
        res = GenerationResult([[] for _ in prompts])
        t0 = time.perf_counter()
        nxt, kept = [], [[] for _ in prompts]
        for i, p in enumerate(prompts):
            logits = self.prefill(p, i)
            if keep_logits:
                kept[i].append(logits[0].float().cpu())
            nxt.append(int(sample(logits, params)[0]))
        res.prefill_s = time.perf_counter() - t0
        lengths = [len(p) for p in prompts]
        live = list(range(len(prompts)))
        t0 = time.perf_counter()
        while True:
            for i in list(live):
                res.tokens[i].append(nxt[i])
                if on_token is not None:
                    on_token(i, nxt[i])
                if (nxt[i] in params.stop_ids or len(res.tokens[i]) >= params.max_new_tokens
                        or lengths[i] + 1 >= max_len):
                    live.remove(i)
            if not live:
                break
            logits, ids = self.step([[nxt[i]] for i in live], [lengths[i] for i in live], live, params)
            for r, i in enumerate(live):
                nxt[i] = ids[r]
                lengths[i] += 1
                if keep_logits:
                    kept[i].append(logits[r].float().cpu())
            res.decode_steps += 1
            res.decode_tokens += len(live)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        res.decode_s = time.perf_counter() - t0
        if keep_logits:
            res.logits = [torch.stack(k) for k in kept]
        if self.comm is not None:
            self.comm.check()
        return res


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
