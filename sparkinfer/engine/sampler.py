"""Per-row sampling inside a captured step: greedy or seeded draws, each row with its
own temperature, top-p, top-k and seed.

Legend: N rows (tokens whose next token is drawn), V vocabulary.

Row r's token is argmax_v (logits[r, v] / T_r + g(seed_r, n_r, v)) over the tokens
its top-k / top-p filter keeps (greedy rows, T_r = 0: argmax of the logits, no
noise), with g a Gumbel variate from a counter-based hash of (seed, position n of
the drawn token, v, stream). That is an exact draw from softmax(logits / T)
restricted to the kept set (the Gumbel-max trick), and it depends on the row
alone: a seeded request draws the same tokens whatever runs beside it, on every
rank, eager or replayed, with no generator state to advance.

    rows = RowSampling.alloc(n, device)          # fixed-address inputs (graph-safe)
    rows.fill([params, ...], counters)           # host -> device, before a replay
    ids = sample_rows(logits, rows, filtered=True)

`filtered=False` skips the top-k / top-p pass (a sort of each row): the engine
captures that variant for steps in which no row filters.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from sparkinfer.engine.plan import SamplingColumns
from sparkinfer.engine.request import SamplingParams
from sparkinfer.errors import ShapeError

__all__ = ["RowSampling", "sample_rows", "filter_thresholds", "row_probabilities", "uniforms",
           "STREAM_TARGET", "STREAM_DRAFT", "STREAM_ACCEPT", "STREAM_RESIDUAL"]

# Independent streams of uniforms for one (seed, position): the target's draw, the
# draft's proposal, the speculative acceptance test and the residual draw after a
# rejection must not share variates.
STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive counters over the hash's input


@triton.jit
def _mix32(x):
    """murmur3's 32-bit finalizer: every input bit flips each output bit with p ~ 1/2."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return x


@triton.jit
def _row_key(seed, counter, STREAM: tl.constexpr):
    """uint32 key of (seed int64, counter int64, stream): the per-row part of the hash."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c = (counter & 0xFFFFFFFF).to(tl.uint32)
    k = _mix32(hi ^ (STREAM * 0x27D4EB2F + 0x165667B1))
    k = _mix32(lo ^ k)
    return _mix32(c * 0x9E3779B9 + k)


@triton.jit
def _uniform(key, o_v):
    """U(0, 1) (open interval, 24 bits) for vocabulary indices o_v under a row key."""
    h = _mix32(key + o_v.to(tl.uint32) * 0x9E3779B9)
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _gumbel_argmax_kernel(logits, stride_l, temp, thr, seed, counter, part_s, part_i, V, CHUNK,
                          HAS_THR: tl.constexpr, STREAM: tl.constexpr, BLOCK_V: tl.constexpr):
    """grid (N, C): program (r, c) scores row r's tokens [c * CHUNK, (c + 1) * CHUNK):
    logits / T plus Gumbel noise over the kept ones (T = 0: no noise), and writes its
    best score and the lowest index holding it to part_*[r, c]."""
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    t = tl.load(temp + i_r)
    key = _row_key(tl.load(seed + i_r), tl.load(counter + i_r), STREAM)
    lo = tl.load(thr + i_r) if HAS_THR else -float("inf")
    inv_t = tl.where(t > 0, 1.0 / tl.maximum(t, 1e-30), 1.0)
    best = tl.full((BLOCK_V,), -float("inf"), tl.float32)
    best_i = tl.full((BLOCK_V,), 0, tl.int32)
    c0 = i_c * CHUNK
    for start in range(c0, tl.minimum(c0 + CHUNK, V), BLOCK_V):
        o_v = start + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        x = tl.load(logits + i_r * stride_l + o_v, mask=m_v, other=-float("inf")).to(tl.float32)
        keep = m_v & (x >= lo)
        # greedy rows (T = 0) take no noise; computing it anyway keeps one code path
        g = -tl.log(-tl.log(_uniform(key, o_v)))
        s = tl.where(keep, x * inv_t + tl.where(t > 0, g, 0.0), -float("inf"))
        take = s > best  # strict: an earlier block (lower index) keeps a tie
        best_i = tl.where(take, o_v, best_i)
        best = tl.where(take, s, best)
    top = tl.max(best, axis=0)
    pick = tl.min(tl.where(best == top, best_i, V), axis=0)  # V: nothing kept (all -inf or NaN)
    nc = tl.num_programs(1)
    tl.store(part_s + i_r * nc + i_c, top)
    tl.store(part_i + i_r * nc + i_c, pick)


@triton.jit
def _argmax_partials_kernel(part_s, part_i, out, C, BLOCK_C: tl.constexpr):
    """Row r's token: the best of its C chunks' scores, the lowest index among equal ones
    (the chunks are in index order), 0 when no chunk kept a token."""
    i_r = tl.program_id(0)
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    s = tl.load(part_s + i_r * C + o_c, mask=m_c, other=-float("inf"))
    idx = tl.load(part_i + i_r * C + o_c, mask=m_c, other=2147483647)
    top = tl.max(s, axis=0)
    pick = tl.min(tl.where((s == top) & m_c, idx, 2147483647), axis=0)
    best = tl.where(top == -float("inf"), 0, pick)
    tl.store(out + i_r, tl.where(best == 2147483647, 0, best).to(tl.int64))


# Tokens per program of a sampling step: one program per row took 69 us for Qwen3's
# 151,936 tokens at batch 1 on an H200 (3c3e10b, bench decode --profile), the whole step
# waiting on one SM's stream of 300 KB; chunks of 4096 give a row 38 programs. Chunk
# boundaries follow V alone, so a row's draw does not depend on the batch.
SAMPLE_CHUNK = 4096
MAX_CHUNKS = 128


class RowSampling:
    """Fixed-address per-row sampling inputs of N rows: temperature fp32, top_p fp32,
    top_k int32, seed int64, counter int64 (the position of the token each row
    draws), and the filter's fp32 thresholds (written by `sample_rows`). Views into
    a caller's packed buffer, or `alloc`ated. Keep them at one address per captured
    step and write them before each replay (`write`)."""

    FIELDS = (("seed", torch.int64), ("counter", torch.int64), ("top_k", torch.int32),
              ("temperature", torch.float32), ("top_p", torch.float32), ("thr", torch.float32))

    def __init__(self, **views):
        for name, _ in self.FIELDS:
            setattr(self, name, views[name])
        self.n = self.seed.shape[0]

    @classmethod
    def alloc(cls, n: int, device) -> RowSampling:
        return cls(**{name: torch.zeros(n, dtype=dt, device=device) for name, dt in cls.FIELDS})

    @staticmethod
    def write(host: dict, params: list[SamplingParams] | SamplingColumns, counters) -> None:
        """Fill host-side arrays (numpy, N long; keys as FIELDS) for `params` rows (a list, or
        columns: written in bulk), the rest padding (greedy, seed 0). counters: int [k]."""
        cols = params if isinstance(params, SamplingColumns) else SamplingColumns.of(params)
        k = len(cols)
        with np.errstate(over="ignore"):  # past fp32's range a temperature is inf: uniform over the kept tokens
            host["temperature"][:k] = cols.temperature  # fp64 -> fp32, rounded as from a list of floats
        host["top_p"][:k] = cols.top_p
        host["top_k"][:k] = cols.top_k
        host["seed"][:k] = cols.seed
        host["counter"][:k] = counters
        if k < len(host["seed"]):
            for name, value in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("seed", 0), ("counter", 0)):
                host[name][k:] = value

    def fill(self, params: list[SamplingParams], counters: list[int]) -> None:
        """Write the device tensors directly (eager use; one small copy per field)."""
        if len(params) > self.n or len(counters) != len(params):
            raise ShapeError(f"RowSampling.fill: {len(params)} rows' params and {len(counters)} counters for "
                             f"{self.n} rows")
        host = {name: getattr(self, name).new_zeros(self.n, device="cpu").numpy() for name, _ in self.FIELDS}
        self.write(host, params, counters)
        for name, _ in self.FIELDS[:-1]:
            getattr(self, name).copy_(torch.from_numpy(host[name]))

    @staticmethod
    def needs_filter(params: list[SamplingParams]) -> bool:
        return any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in params)


def filter_thresholds(logits: torch.Tensor, rows: RowSampling, out: torch.Tensor) -> torch.Tensor:
    """fp32 [N]: each row's smallest kept logit under its top-k and top-p (-inf where
    the row keeps all). Sorts every row; capture-legal; allocates its temporaries."""
    x = logits.float()
    srt, _ = x.sort(dim=-1, descending=True)  # [N, V]
    v = srt.shape[-1]
    ninf = torch.full_like(rows.top_p, -math.inf)
    k = rows.top_k.clamp(min=0, max=v).to(torch.int64)
    kth = srt.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
    thr_k = torch.where(k > 0, kth, ninf)
    t = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    p = torch.softmax(srt / t[:, None], dim=-1)
    before = p.cumsum(dim=-1) - p  # mass of the tokens ranked above each one
    kept = (before < rows.top_p[:, None]).sum(dim=-1).clamp(min=1)  # the smallest set reaching top_p
    thr_p = srt.gather(1, (kept - 1)[:, None])[:, 0]
    thr_p = torch.where(rows.top_p < 1, thr_p, ninf)
    out.copy_(torch.maximum(thr_k, thr_p))
    return out


def sample_rows(logits: torch.Tensor, rows: RowSampling, *, filtered: bool, stream: int = STREAM_TARGET,
                out: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Token ids int64 [N] drawn from logits [N, V] (any float dtype, unit last
    stride) per `rows`. filtered: apply top-k / top-p (else every row keeps all
    tokens, whatever its top_p / top_k say). Allocates `out` unless given; no host
    sync; capture-legal. chunk: tokens per program (default SAMPLE_CHUNK on a GPU, a whole
    row under the interpreter); any chunk gives the same ids."""
    n, v = logits.shape
    if n > rows.n or logits.stride(-1) != 1:
        raise ShapeError(f"sample_rows: logits [{n}, {v}] (unit last stride) for {rows.n} rows of sampling inputs")
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    thr = filter_thresholds(logits, rows, rows.thr) if filtered else rows.thr
    if chunk is None:  # the interpreter runs programs one by one: one a row there
        chunk = v if logits.device.type == "cpu" else max(SAMPLE_CHUNK, triton.cdiv(v, MAX_CHUNKS))
    chunk = max(1, min(chunk, v))
    c = triton.cdiv(v, chunk)
    block_v = min(1024, triton.next_power_of_2(chunk))
    part_s = torch.empty((n, c), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((n, c), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(n, c)](logits, logits.stride(0), rows.temperature, thr, rows.seed, rows.counter, part_s,
                                  part_i, v, chunk, HAS_THR=filtered, STREAM=stream, BLOCK_V=block_v, num_warps=4)
    _argmax_partials_kernel[(n,)](part_s, part_i, out, c, BLOCK_C=max(2, triton.next_power_of_2(c)), num_warps=1)
    return out


def row_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 [N, V]: the distribution `sample_rows` draws from for rows sampled with
    `params` (temperature > 0): softmax(logits / T) over the top-k / top-p set,
    renormalized. Host-side helper of speculative acceptance."""
    x = logits.float()
    if params.top_k > 0 or params.top_p < 1:
        rows = RowSampling.alloc(x.shape[0], x.device)
        rows.temperature.fill_(params.temperature)
        rows.top_p.fill_(params.top_p)
        rows.top_k.fill_(params.top_k)
        thr = filter_thresholds(x, rows, rows.thr)
        x = x.masked_fill(x < thr[:, None], -math.inf)
    return torch.softmax(x / params.temperature, dim=-1)


def uniforms(seed: int, counter: int, stream: int, n: int) -> torch.Tensor:
    """fp32 [n] CPU: the uniforms the kernel uses for indices 0..n-1 of (seed, counter,
    stream): the same hash in int64 arithmetic (host-side draws of speculative
    acceptance, and the tests' reference)."""
    def mix(x):
        x = x ^ (x >> 16)
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x = x ^ (x >> 13)
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    m = 0xFFFFFFFF
    k = mix(((seed >> 32) & m) ^ ((stream * 0x27D4EB2F + 0x165667B1) & m))
    k = mix((seed & m) ^ k)
    k = mix(((counter & m) * _GOLDEN + k) & m)
    idx = torch.arange(n, dtype=torch.int64)
    h = mix((k + idx * _GOLDEN) & m)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
