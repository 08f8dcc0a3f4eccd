"""Host side of `rope_qk_cache`: the rotary table, checks, launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from sparkinfer.envs import triton_interpret
from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.rope.kernel import rope_qk_cache_kernel

_MIN_PROGRAMS = 128  # about one per SM of an H200 (132)
# A program takes at most MAX_BLOCK_ROWS (token, head) rows, fewer while the grid would
# have under _MIN_PROGRAMS programs (a decode step's few tokens: one row a program at
# batch 1, so 36 programs run Qwen3-30B-A3B's 32 + 4 heads side by side). The rows run on
# across tokens (kernel.py), so a wider block wastes no lanes on a head count that is not
# a power of two. 8: on an H100 at 4a616ae (benchmarks/sweeps/prefill_tiles_sweep.py,
# sweeps/rope_halves_ab_h100.json; Qwen3-30B-A3B's heads, CUDA graphs of 20 calls), us at
# 64 / 256 / 1,088 / 2,112 tokens in blocks of 8: 2.2 / 4.0 / 13.2 / 26.8; of 16: 2.2 /
# 4.1 / 12.8 / 27.8; of 4: 2.1 / 5.2 / 17.9 / 34.8; of 32: 3.3 / 4.7 / 14.2 / 34.1; of 1:
# 4.7 / 15.2 / 62.2 / 121.0; 1.4-1.6 us at one token in blocks of 1 (the rule's) to 16. The
# kernel before (lo and hi loaded twice, f86765d), in blocks of 8 at the same sizes: 6.7 /
# 9.6 / 33.8 / 64.0 (blocks of 1 were its best at 64 tokens: 4.4). The same bits in every case.
MAX_BLOCK_ROWS = 8
# Under the interpreter, which runs programs one after another at a fixed cost each (the
# front end's, per operation), up to 4,096 elements a program: an 8-token chunk of 4 + 2
# heads (D 64) took 141 ms in 6 programs of 8 rows, 31 ms in one of 64, the same bits
# (the head norm's sum is exact: kernel.py).
INTERPRETED_BLOCK_ROWS = 64
# Programmatic dependent launch (kernel.py): the qkv projection before it (`linear`) lets
# its successor launch at entry, so rope's programs could be resident, with their
# positions, slots and rotary rows read, when the projection ends (compiled for sm_90 on
# the CPU: tests/models/test_compile_sm90.py).
# On since an H100 A/B (moe/routing/launch.py has its numbers).
ROPE_PDL = True

__all__ = ["RotaryTable", "rotary_table", "rope_qk_cache", "rope_block_rows", "MAX_BLOCK_ROWS"]


def _min_programs(device: torch.device) -> int:
    """Programs a call should at least have: about one per SM on a GPU; one for the
    interpreter, which runs programs one after another (more only cost CI time)."""
    return _MIN_PROGRAMS if device.type == "cuda" else 1


def _max_block_rows(device: torch.device) -> int:
    """Rows a program may take: MAX_BLOCK_ROWS on a GPU, INTERPRETED_BLOCK_ROWS on the CPU."""
    return INTERPRETED_BLOCK_ROWS if device.type == "cpu" else MAX_BLOCK_ROWS


def rope_block_rows(rows: int, block_d: int, min_programs: int, max_rows: int | None = None) -> int:
    """(token, head) rows a program takes: max_rows (default MAX_BLOCK_ROWS; at most
    4,096 elements), halved while fewer than min_programs programs would cover `rows`. Pure."""
    block = max(1, min(MAX_BLOCK_ROWS if max_rows is None else max_rows, 4096 // block_d))
    while block > 1 and triton.cdiv(rows, block) < min_programs:
        block //= 2
    return block


@dataclass(frozen=True)
class RotaryTable:
    """cos, sin: fp32 [P, R/2] for positions 0..P-1 (rotate_half pairs dims i and
    i + R/2, which share frequency i). rotary_dim: R."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int


def rotary_table(rotary_dim: int, theta: float, positions: int, device) -> RotaryTable:
    """The transformers default rope: inv_freq_i = theta^(-2i/R), angle = p * inv_freq
    in fp32. Allocates; call once per model."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ShapeError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return RotaryTable(ang.cos().to(device), ang.sin().to(device), rotary_dim)


def rope_qk_cache(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: RotaryTable,
                  caches: tuple, heads: tuple, *, norms: tuple | None = None, eps: float = 1e-6,
                  kv_stride: int = 1, kv_offset: int = 0, q_out: torch.Tensor | None = None):
    """Rotate q and k of one layer and write k, v into the cache.

    qkv: [T, (Hq + 2 KVH) D] (q heads, k heads, v heads; bias already added);
    positions, slots: int32 [T] global position and cache slot of each token;
    caches: (k_cache, v_cache) [S, L, KVH, D], last dim contiguous; heads: (Hq, KVH, D);
    norms: (q_norm [D], k_norm [D]) or None. Position p is stored at local index
    p // kv_stride, on the rank with p % kv_stride == kv_offset only (decode-context
    parallelism; 1, 0 stores every position). Returns q [T, Hq, D] (rotated; into
    q_out when given). Allocates only q when q_out is None; no host sync;
    capture-legal.
    """
    hq, kvh, d = heads
    t = qkv.shape[0]
    k_cache, v_cache = caches
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * kvh) * d or qkv.stride(1) != 1:
        raise ShapeError(f"qkv must be [T, (Hq + 2 KVH) D] = [T, {(hq + 2 * kvh) * d}] with a contiguous "
                         f"last dim; got {tuple(qkv.shape)} strides {qkv.stride()}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != (kvh, d):
            raise ShapeError(f"{name} must be [S, L, KVH={kvh}, D={d}]; got {tuple(c.shape)}")
        if c.stride(3) != 1 or c.dtype != qkv.dtype:
            raise LayoutError(f"{name} needs a contiguous D axis and qkv's dtype {qkv.dtype}; got "
                              f"strides {c.stride()}, {c.dtype}")
    for name, v in (("positions", positions), ("slots", slots)):
        if v.dtype != torch.int32 or v.shape != (t,):
            raise DTypeError(f"{name} must be int32 [T={t}]; got {v.dtype} {tuple(v.shape)}")
    if table.rotary_dim > d:
        raise ShapeError(f"rotary_dim {table.rotary_dim} exceeds head_dim {d}")
    if q_out is None:
        q_out = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    if tuple(q_out.shape) != (t, hq, d) or q_out.stride(2) != 1:
        raise ShapeError(f"q_out must be [T, Hq, D] = {(t, hq, d)}; got {tuple(q_out.shape)}")
    if t == 0:
        return q_out
    # the kernel's offsets into qkv, q and the rotary table are int32
    for name, x in (("qkv", qkv), ("q_out", q_out), ("the rotary table", table.cos)):
        if x.stride(0) * x.shape[0] >= 2 ** 31:
            raise ShapeError(f"{name} spans {x.stride(0) * x.shape[0]} elements; rope_qk_cache indexes "
                             "qkv, q and the table in int32 (below 2**31): split the step")
    block_d = triton.next_power_of_2(d)
    rows = t * (hq + kvh)
    block_rows = rope_block_rows(rows, block_d, _min_programs(qkv.device), _max_block_rows(qkv.device))
    qw, kw = norms if norms is not None else (table.cos, table.cos)
    pdl = ROPE_PDL and qkv.device.type != "cpu" and not triton_interpret()
    rope_qk_cache_kernel[(triton.cdiv(rows, block_rows),)](
        qkv, positions, slots, table.cos, table.sin, qw, kw, q_out, k_cache, v_cache,
        qkv.stride(0), table.cos.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        t, hq, kvh, d, table.rotary_dim, k_cache.shape[1], kv_stride, kv_offset, float(eps),
        HAS_NORM=norms is not None, HAS_PASS=table.rotary_dim < d, BLOCK_ROWS=block_rows,
        BLOCK_H=triton.next_power_of_2(max(table.rotary_dim // 2, 1)),
        BLOCK_P=triton.next_power_of_2(max(d - table.rotary_dim, 1)), BLOCK_D=block_d, PDL=pdl,
        num_warps=4, **(dict(launch_pdl=True) if pdl else {}))
    return q_out
