"""One rank's model steps: prefill chunks, and decode steps replayed from CUDA graphs
with per-row sampling.

Legend: B rows in a decode step (a bucket size), Q queries per row, T = B * Q,
S cache slots, V vocabulary.

    engine = Engine(decoder, max_batch=8, comm=comm)
    result = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16))
    logits, ids = engine.step([[7], [9]], [3, 2], [0, 1], [params_a, params_b])

Each sequence owns a cache slot; slot S - 1 is the padding slot, which padded rows
of a bucket read and write. A decode step runs the rows padded up to the next
bucket; on a GPU each (bucket, Q, filtered) is one CUDA graph captured on the
communicator's channel (`channel`: "target", or "draft" for a draft model), and a
step is: write the rows into a pinned host buffer, one host-to-device copy into
the graph's packed inputs, replay, read the sampled ids (the step's one host sync).
Every row samples with its own parameters inside the graph (`sampler.py`);
`filtered` graphs also apply top-k / top-p.

`generate` is a thin caller of the continuous-batching scheduler
(`engine.core.EngineCore`) with every request submitted at once.
"""

from __future__ import annotations

import numpy as np
import torch

from sparkinfer.engine.plan import SamplingColumns
from sparkinfer.engine.request import SamplingParams
from sparkinfer.engine.sampler import STREAM_DRAFT, STREAM_TARGET, RowSampling, sample_rows
from sparkinfer.errors import CapacityError, ShapeError
from sparkinfer.models.decoder import Step

__all__ = ["Engine", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Chunk rows a mixed step holds at most (`launch_mixed`): a served prompt of up to 4 chunks
# joins the decode step that reads the experts anyway; more runs as its own forward.
MIXED_ROWS = 4


class _Inputs:
    """Fixed-address inputs of one bucket's step (B rows of Q queries, T = B * Q tokens),
    views into one packed device buffer that one copy from a pinned host twin fills.

    int64: tokens, seed, counter [T], logit_rows [B]; int32: positions, slots, top_k [T],
    row_slots, q_pos [B]; fp32: temperature, top_p, thr [T]. `step` is the decoder's Step
    over them (every token's logits), `prefill` the same with the logits of logit_rows
    only, `sampling` the sampler's RowSampling, `ids` the sampled ids [T]."""

    _LAYOUT = (("tokens", torch.int64, "t"), ("seed", torch.int64, "t"), ("counter", torch.int64, "t"),
               ("logit_rows", torch.int64, "b"),
               ("positions", torch.int32, "t"), ("slots", torch.int32, "t"), ("top_k", torch.int32, "t"),
               ("row_slots", torch.int32, "b"), ("q_pos", torch.int32, "b"),
               ("temperature", torch.float32, "t"), ("top_p", torch.float32, "t"), ("thr", torch.float32, "t"))

    def __init__(self, rows: int, q_len: int, device, decode_rows: int = 0):
        t, b = decode_rows + rows * q_len, decode_rows + rows
        self.rows, self.q_len, self.t, self.d = rows, q_len, t, decode_rows
        spans, off = {}, 0
        for name, dt, n in self._LAYOUT:
            size = (t if n == "t" else b) * dt.itemsize
            spans[name] = (off, size, dt)
            off += -(-size // 8) * 8  # 8-byte aligned fields
        cuda = torch.device(device).type == "cuda"
        self.dev = torch.zeros(off, dtype=torch.uint8, device=device)
        # Two pinned host twins, used in turn: a step may be filled while the previous
        # fill's copy still waits in the stream (the runner launches the next decode step
        # before it reads this one's ids); a twin is written only once its last copy ran.
        self._hosts = [torch.zeros(off, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self._copied = [None, None]
        self._turn = 0
        self._cuda = cuda
        self._views = []
        for host in self._hosts:
            host_np = host.numpy()
            self._views.append({name: host_np[o:o + size].view(torch.empty(0, dtype=dt).numpy().dtype)
                                for name, (o, size, dt) in spans.items()})
        for name, (o, size, dt) in spans.items():
            setattr(self, name, self.dev[o:o + size].view(dt))
        self.h = self._views[0]
        self.step = Step(self.tokens, self.positions, self.slots, self.row_slots, self.q_pos, q_len)
        self.prefill = Step(self.tokens, self.positions, self.slots, self.row_slots, self.q_pos, q_len,
                            self.logit_rows)
        self.sampling = RowSampling(seed=self.seed, counter=self.counter, top_k=self.top_k,
                                    temperature=self.temperature, top_p=self.top_p, thr=self.thr)
        # a mixed step (decode_rows D > 0): D decode rows, then rows of Q; its logit rows draw
        # with the first D + rows entries of the sampling fields
        self.mixed = Step(self.tokens, self.positions, self.slots, self.row_slots, self.q_pos, q_len,
                          self.logit_rows, decode_rows) if decode_rows else None
        self.row_sampling = RowSampling(**{name: getattr(self, name)[:b] for name, _ in RowSampling.FIELDS})
        self.ids = torch.zeros(t, dtype=torch.int64, device=device)
        self._pad_positions = np.arange(t, dtype=np.int32) % q_len  # padding tokens: positions 0..Q-1 a row

    def _begin(self) -> dict:
        """The host twin to write next (its last copy done), as numpy views by field."""
        ev = self._copied[self._turn]
        if ev is not None:
            ev.synchronize()
        self.h = self._views[self._turn]
        return self.h

    def _commit(self) -> None:
        self.dev.copy_(self._hosts[self._turn], non_blocking=self._cuda)
        if self._cuda:
            ev = self._copied[self._turn] or torch.cuda.Event()
            ev.record()
            self._copied[self._turn] = ev
        self._turn ^= 1

    def fill(self, tokens, positions, slots, params: list[SamplingParams] | SamplingColumns, pad_slot: int) -> None:
        """Flat per-token values (n <= T: lists or int arrays, written in bulk; tokens None:
        zeros, for tokens copied in on the device), padded with the padding slot; params
        one a token. One copy to the device. Each token draws the token after it: counter =
        its position + 1."""
        h, n, q = self._begin(), len(positions), self.q_len
        h["tokens"][:n] = 0 if tokens is None else tokens
        h["positions"][:n] = positions
        h["slots"][:n] = slots
        if n < self.t:  # padding
            h["tokens"][n:] = 0
            h["positions"][n:] = self._pad_positions[:self.t - n]
            h["slots"][n:] = pad_slot
        h["row_slots"][:] = h["slots"][::q]
        h["q_pos"][:] = h["positions"][::q]
        RowSampling.write(h, params, h["positions"][:n] + 1)
        self._commit()

    def fill_chunks(self, chunks: list[tuple[list[int], int, int]], pad_slot: int) -> None:
        """Row r <- chunk r (tokens, start, slot): its tokens at start.., padded to Q with
        tokens that write the padding slot (at positions start + len.., so every row's
        positions stay consecutive); rows past the chunks pad whole. logit_rows: each row's
        last real token. One copy to the device."""
        h, q = self._begin(), self.q_len
        tokens, positions, slots = h["tokens"], h["positions"], h["slots"]
        tokens[:] = 0
        slots[:] = pad_slot
        h["row_slots"][:] = pad_slot
        h["q_pos"][:] = 0
        for r in range(self.rows):
            toks, start, slot = chunks[r] if r < len(chunks) else ((), 0, pad_slot)
            n, o = len(toks), r * q
            tokens[o:o + n] = toks
            positions[o:o + q] = range(start, start + q)
            slots[o:o + n] = slot
            h["row_slots"][r], h["q_pos"][r] = slot, start
            h["logit_rows"][r] = o + max(n, 1) - 1
        self._commit()

    def fill_mixed(self, decode: tuple, chunks: list[tuple[list[int], int, int]], chunk_sampling: SamplingColumns,
                   pad_slot: int) -> None:
        """A mixed step: decode = (tokens or None, positions, slots, sampling) of n <= D rows
        (padded to D with the padding slot at position 0), then `fill_chunks`' rows after
        them; logit rows: the D decode rows, then each chunk's last token, drawing with the
        decode rows' sampling (counter: position + 1) and the chunks' (counter: the prompt
        position after the chunk). One copy to the device."""
        h, q, d = self._begin(), self.q_len, self.d
        tokens, positions, slots, sampling = decode
        n = len(positions)
        tok, pos, slot, rs, qp, lr = (h[k] for k in ("tokens", "positions", "slots", "row_slots", "q_pos",
                                                    "logit_rows"))
        tok[:] = 0
        pos[:d] = 0
        slot[:] = pad_slot
        rs[:] = pad_slot
        qp[:] = 0
        tok[:n] = 0 if tokens is None else tokens
        pos[:n], slot[:n], rs[:n], qp[:n] = positions, slots, slots, positions
        lr[:d] = np.arange(d)
        for r in range(self.rows):
            toks, start, s = chunks[r] if r < len(chunks) else ((), 0, pad_slot)
            m, o = len(toks), d + r * q
            tok[o:o + m] = toks
            pos[o:o + q] = range(start, start + q)
            slot[o:o + m] = s
            rs[d + r], qp[d + r] = s, start
            lr[d + r] = o + max(m, 1) - 1
        pad = np.repeat(SamplingColumns.of([SamplingParams(temperature=0.0)]).words, d - n, axis=0)
        cols = SamplingColumns(np.concatenate([sampling.words, pad, chunk_sampling.words]))
        ends = [c[1] + len(c[0]) for c in chunks]
        RowSampling.write(h, cols, np.concatenate([np.asarray(positions, dtype=np.int64) + 1,
                                                   np.zeros(d - n, dtype=np.int64), np.asarray(ends, dtype=np.int64)]))
        self._commit()


class Engine:
    """Model steps over one rank's `Decoder` (every rank runs the same calls).

    max_batch: sequences at once (<= the cache's slots - 1); comm: the decoder's
    Communicator (None for one rank); graphs: capture decode steps in CUDA graphs
    (default: on a GPU); buckets: decode batch sizes to capture; channel: the pool
    channel the graphs are captured on ("draft" also gives the draft's own stream
    of random draws). Graphs are captured on a bucket's first use, or all at once
    by `capture_all`.
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
        self.stream_id = STREAM_DRAFT if channel == "draft" else STREAM_TARGET
        self._steps: dict[tuple[int, int, bool], tuple] = {}
        self._rows: dict[int, RowSampling] = {}
        self.launches = 0  # forwards launched: an output of launch() is current while this holds

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        """Cache entries of positions [0, tokens) from slot src to slot dst, every layer (with
        decode-context parallelism, this rank's share: position p lives at p // W on rank
        p % W). Stream-ordered after what was launched before, before what is launched after."""
        cache, sh = self.dec.cache, self.dec.sh
        n = -(-(tokens - sh.rank) // sh.dcp) if sh.dcp > 1 else tokens
        for t in (cache.k, cache.v):
            t[:, dst, :n].copy_(t[:, src, :n])

    # ------------------------------------------------------------------ steps
    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise CapacityError(f"{rows} rows exceed max_batch={self.max_batch}")

    def _eager_step(self, inp: _Inputs, filtered: bool):
        logits = self.dec(inp.step)
        return logits, sample_rows(logits, inp.sampling, filtered=filtered, stream=self.stream_id, out=inp.ids)

    def _graph_step(self, rows: int, q_len: int, params=False):
        """(inputs, run) of a bucket: run() replays (or runs eagerly) and returns (logits, ids).
        params: whether the step filters (top-k / top-p), or SamplingParams to decide by."""
        filtered = RowSampling.needs_filter([params]) if isinstance(params, SamplingParams) else bool(params)
        key = (rows, q_len, filtered)
        if key not in self._steps:
            inp = _Inputs(rows, q_len, self.device)
            inp.fill([], [], [], [], self.pad_slot)
            forward = lambda: self._eager_step(inp, filtered)  # noqa: E731
            self._steps[key] = (inp, self._capture(forward) if self.graphs else forward)
        return self._steps[key]

    def _capture(self, forward):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        pool = self.comm.pool if self.comm is not None else None
        mark = pool.checkpoint() if pool is not None else None
        try:
            # every bucket's graph shares the channel; they replay in one stream order
            scope = pool.capture(stream, self.channel, reuse=True) if pool is not None else _nothing()
            with torch.cuda.stream(stream), scope:
                forward()  # warm-up: compiles, plans, on the scope's channel
                with torch.cuda.graph(graph, stream=stream):
                    out = forward()
        except BaseException:
            if pool is not None:
                pool.rollback(mark)  # a failed capture leaves no channel behind
            raise
        torch.cuda.current_stream(self.device).wait_stream(stream)

        def run():
            graph.replay()
            return out
        return run

    def capture_all(self, q_lens=(1,), prefill_len: int | None = None, mixed: bool = False) -> None:
        """Capture (or, without graphs, warm up) every bucket's step for each Q, plain and
        filtered, and with prefill_len every prefill bucket's forward of rows of that many
        tokens, so serving never compiles or captures mid-stream; mixed: also every mixed
        step (`launch_mixed`) of decode buckets beside rows of prefill_len. Collective."""
        for q in q_lens:
            for b in self.buckets:
                if b * q > self.dec.max_tokens:
                    continue
                for filtered in (False, True):
                    self._graph_step(b, q, filtered)
        if prefill_len is not None and self.graphs:  # eager forwards need no warm-up (compiles aside)
            for r in self.prefill_buckets(prefill_len):
                self._prefill_step(r, prefill_len)
            if mixed:
                for b in self.buckets:
                    for r in self.mixed_rows(b, prefill_len):
                        for filtered in (False, True):
                            self._mixed_step(b, r, prefill_len, filtered)

    def step(self, tokens: list[list[int]], first_pos: list[int], slots: list[int],
             params: SamplingParams | list[SamplingParams]) -> tuple[torch.Tensor, list[int]]:
        """One forward of len(tokens) rows of Q tokens each (row r at positions first_pos[r]..,
        in slots[r]) padded to a bucket; row r samples with params[r] (or all with one
        SamplingParams). Returns (logits [rows * Q, V], the sampled ids of every token:
        the draw for the position after it). A CUDA graph replay per (bucket, Q, filtered)
        on a GPU; the one host sync is reading the ids."""
        logits, ids = self.launch(tokens, first_pos, slots, params)
        return logits, ids.tolist()

    def launch(self, tokens: list[list[int]], first_pos: list[int], slots: list[int],
               params: SamplingParams | list[SamplingParams],
               device_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` without the host sync: (logits [rows * Q, V], ids [rows * Q]) on the device,
        valid until this bucket's next launch. device_tokens: int64 [rows] on the device
        that replace `tokens` (rows of one token; the ids of an earlier launch, so a step
        can follow the one before it without the host reading its ids in between)."""
        q, n = len(tokens[0]), len(tokens)
        per_row = params if isinstance(params, list) else [params] * n
        if len(per_row) != n:
            raise ShapeError(f"step: {n} rows and {len(per_row)} SamplingParams")
        positions = (np.asarray(first_pos, dtype=np.int64)[:, None] + np.arange(q)).ravel()
        return self._launch(q, np.asarray(tokens, dtype=np.int64).ravel(), positions, np.repeat(slots, q),
                            SamplingColumns.of(per_row).repeat(q), device_tokens)

    def launch_decode(self, slots: np.ndarray, positions: np.ndarray, sampling: SamplingColumns, *,
                      tokens: np.ndarray | None = None,
                      device_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`launch` of R rows of one token from columns, written in bulk: row r's token
        (tokens[r], or device_tokens[r]) at positions[r] in slots[r] (int [R]), drawn with
        sampling row r. Returns (logits [R, V], ids [R]) on the device; no host sync."""
        return self._launch(1, tokens, positions, slots, sampling, device_tokens)

    def _launch(self, q: int, tokens, positions, slots, sampling: SamplingColumns, device_tokens):
        n = len(positions) // q
        if device_tokens is not None and (q != 1 or device_tokens.shape != (n,)):
            raise ShapeError(f"launch: device_tokens of shape {tuple(device_tokens.shape)} for {n} rows of {q} "
                             "tokens; they replace rows of one token")
        inp, run = self._graph_step(self.bucket(n), q, sampling.filtered)
        inp.fill(tokens, positions, slots, sampling, self.pad_slot)
        if device_tokens is not None:
            inp.tokens[:n].copy_(device_tokens)
        self.launches += 1
        logits, ids = run()
        return logits[:n * q], ids[:n * q]

    # ------------------------------------------------------------------ prefill
    def prefill_buckets(self, q_len: int) -> tuple[int, ...]:
        """Row counts of the prefill forwards of rows of q_len tokens: powers of two up to
        the decoder's max_tokens // q_len (at least 1)."""
        most = max(1, self.dec.max_tokens // q_len)
        return tuple(1 << i for i in range(most.bit_length()) if 1 << i <= most)

    def _prefill_step(self, rows: int, q_len: int):
        key = ("prefill", rows, q_len)
        if key not in self._steps:
            inp = _Inputs(rows, q_len, self.device)
            inp.fill_chunks([], self.pad_slot)
            forward = lambda: self.dec(inp.prefill)  # noqa: E731
            self._steps[key] = (inp, self._capture(forward) if self.graphs else forward)
        return self._steps[key]

    # ------------------------------------------------------------------ mixed steps
    def mixed_rows(self, decode_rows: int, q_len: int) -> tuple[int, ...]:
        """Chunk-row buckets of a mixed step beside `decode_rows` decode rows (padded to their
        bucket): powers of two up to MIXED_ROWS that fit max_tokens; () where mixed steps do
        not run (DCP > 1, the torch ops, or a batch-dependent decoder)."""
        dec = self.dec
        if not (dec.batch_invariant and dec.sh.dcp == 1 and dec.torch_ops is None):
            return ()
        room = dec.max_tokens - self.bucket(decode_rows)
        return tuple(r for r in (1, 2, 4, 8) if r <= MIXED_ROWS and r * q_len <= room)

    def _mixed_step(self, d: int, rows: int, q_len: int, filtered: bool):
        key = ("mixed", d, rows, q_len, filtered)
        if key not in self._steps:
            inp = _Inputs(rows, q_len, self.device, decode_rows=d)
            inp.fill_mixed((None, [], [], SamplingColumns.of([])), [], SamplingColumns.of([]), self.pad_slot)

            def forward():
                logits = self.dec(inp.mixed)
                return logits, sample_rows(logits, inp.row_sampling, filtered=filtered, stream=self.stream_id,
                                           out=inp.ids[:d + rows])
            self._steps[key] = (inp, self._capture(forward) if self.graphs else forward)
        return self._steps[key]

    def launch_mixed(self, slots: np.ndarray, positions: np.ndarray, sampling: SamplingColumns,
                     chunks: list[tuple[list[int], int, int]], chunk_sampling: SamplingColumns, q_len: int, *,
                     tokens: np.ndarray | None = None,
                     device_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of R decode rows (as `launch_decode`) and prompt chunks (tokens, start,
        slot; rows of q_len, as `prefill_rows`): the decode rows' expert weights are read
        once for both. Each row gets the bits it gets in a step of its own kind. Returns
        (logits, ids) [D + C] on the device: the decode rows' draws at 0..R-1 (D = R's
        bucket), chunk c's draw (from its last token) at D + c. No host sync."""
        n, d = len(positions), self.bucket(len(positions))
        fits = [r for r in self.mixed_rows(n, q_len) if r >= len(chunks)]
        if not fits or any(len(c[0]) > q_len or not c[0] for c in chunks):
            raise CapacityError(f"launch_mixed: {len(chunks)} chunks of 1..{q_len} tokens beside {n} decode rows "
                                f"do not fit a mixed step (buckets {self.mixed_rows(n, q_len)})")
        filtered = sampling.filtered or chunk_sampling.filtered
        inp, run = self._mixed_step(d, fits[0], q_len, filtered)
        inp.fill_mixed((tokens, positions, slots, sampling), chunks, chunk_sampling, self.pad_slot)
        if device_tokens is not None:
            inp.tokens[:n].copy_(device_tokens)
        self.launches += 1
        logits, ids = run()
        return logits, ids

    def prefill_rows(self, chunks: list[tuple[list[int], int, int]], q_len: int) -> torch.Tensor:
        """One forward of prompt chunks (tokens, start, slot), a row each padded to q_len
        tokens, the rows padded to a prefill bucket; the logits [len(chunks), V] of each
        chunk's last token. A CUDA graph per (bucket, q_len) on a GPU. A row's logits and
        cache entries are the same bits in any bucket beside any rows (batch invariance:
        see `Decoder`); the padding writes the padding slot, at positions up to the row's
        start + q_len, which must lie in the cache."""
        n = len(chunks)
        fits = [r for r in self.prefill_buckets(q_len) if r >= n]
        if not fits or any(len(c[0]) > q_len or not c[0] for c in chunks):
            raise CapacityError(f"prefill_rows: {n} chunks of 1..{q_len} tokens; at most "
                                f"{self.prefill_buckets(q_len)[-1]} rows of {q_len} fit max_tokens="
                                f"{self.dec.max_tokens}")
        inp, run = self._prefill_step(fits[0], q_len)
        inp.fill_chunks(chunks, self.pad_slot)
        self.launches += 1
        return run()[:n]

    def sample_many(self, logits: torch.Tensor, params: list[SamplingParams], counters: list[int],
                    *, on_device: bool = False) -> list[int] | torch.Tensor:
        """The tokens drawn from logits [N, V], row i by params[i] for position counters[i] (the
        draws a decode step makes for those rows); on_device: as an int64 tensor, no sync."""
        n = len(params)
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = RowSampling.alloc(n, self.device)
        rows.fill(params, counters)
        ids = sample_rows(logits[:n], rows, filtered=RowSampling.needs_filter(params), stream=self.stream_id)
        return ids if on_device else ids.tolist()

    def prefill_chunk(self, tokens: list[int], start: int, slot: int, *, last: bool = True):
        """Run tokens at positions start.. into `slot`'s cache (eager); the logits [1, V] of the
        chunk's last token when `last`, else None (no LM head)."""
        dev, n = self.device, len(tokens)
        t = torch.tensor(tokens, dtype=torch.int64).to(dev)
        pos = torch.arange(start, start + n, dtype=torch.int32).to(dev)
        slots = torch.full((n,), slot, dtype=torch.int32, device=dev)
        keep = torch.tensor([n - 1] if last else [], dtype=torch.int64).to(dev)
        step = Step(t, pos, slots, slots[:1], pos[:1], n, keep)
        logits = self.dec(step)
        return logits if last else None

    def prefill(self, prompt: list[int], slot: int):
        """Run a prompt into `slot`'s cache in chunks of the decoder's max_tokens; returns the
        logits [1, V] of its last token."""
        chunk = self.dec.max_tokens
        logits = None
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            logits = self.prefill_chunk(part, start, slot, last=start + chunk >= len(prompt))
        return logits

    def sample_one(self, logits: torch.Tensor, params: SamplingParams, counter: int) -> int:
        """The token drawn from logits [1, V] by `params` for position `counter` (the same draw
        a decode step makes for that row)."""
        return self.sample_many(logits, [params], [counter])[0]

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, *,
                 keep_logits: bool = False, on_token=None):
        """New tokens for each prompt (greedy or sampled per `params`), every rank alike;
        a `GenerationResult`. keep_logits copies every step's logits to the host (for
        checks; slow); on_token(seq, token) is called for each new token as it is sampled."""
        from sparkinfer.engine.core import generate_static
        from sparkinfer.engine.runner import ModelRunner

        runner = ModelRunner(self, keep_logits=keep_logits)
        return generate_static(runner, prompts, params or SamplingParams(), on_token=on_token)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
