"""Triton kernels of paged-slot attention over a KV cache (decode, verify, prefill).

Legend: B batch rows, Q queries per row, Hq query heads, KVH KV heads,
G = Hq / KVH (GQA group), D head dim, S cache slots, L local positions per slot,
NS KV splits, N = B * Q * Hq output rows.

`attention_kernel`: one program per (row b, KV head, block of QB queries, split).
Its tile has BLOCK_M rows = QB queries x the G heads of one KV head (row r is
query r // G, head r % G), so each K/V block is read once for the whole group.
Online softmax in the exp2 domain, fp32 accumulation. SPLIT=False writes the
bf16 output and the natural-log lse; SPLIT=True cuts the block's keys into
splits (`_split_plan`), and a program walks a contiguous run of them in one
pipelined loop, writing each split's normalized fp32 partial and log2 lse into
the workspace as it ends (a split is always computed from a fresh state, so its
bits do not depend on which program computes it: the shape of the grid can
follow the batch while the results do not). The partials of a tile are merged
in split order by `_merge_rows`: with MERGE, by the last of the tile's programs
to finish (a counter per tile, taken atomically), so a split call is one launch;
else by `attention_combine_kernel`, one program a tile after the attention grid.
Both run the same code on the same rows, so the two give the same bits.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log2 lse -> natural lse


@triton.jit
def _dot_operand(x, INTERPRET: tl.constexpr):
    """bf16 tensor-core operand on the GPU; fp32 under the interpreter, whose
    `tl.dot` on bf16 inputs returns garbage."""
    if INTERPRET:
        return x.to(tl.float32)
    return x


@triton.jit
def _load_rows(base, stride, start, hi, o_d, m_d, BLOCK_N: tl.constexpr):
    """Cache rows [BLOCK_N, BLOCK_D] of positions [start, min(start + BLOCK_N, hi)) (0 past hi)."""
    o_n = start + tl.arange(0, BLOCK_N)
    o_n64 = o_n.to(tl.int64)[:, None]  # L * stride may pass 2^31 in a long cache
    return tl.load(base + o_n64 * stride + o_d[None, :], mask=(o_n < hi)[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _attend_block(b_q, k_base, v_base, stride_kl, stride_vl, start, hi, row_pos, b_m, b_l, b_acc, qk_scale,
                  kv_stride, kv_offset, o_d, m_d, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """One online-softmax step over cache positions [start, min(start + BLOCK_N, hi)).

    b_q: [BLOCK_M, BLOCK_D] rows; row_pos: [BLOCK_M] global query positions;
    b_m / b_l: [BLOCK_M] running max (log2 units) / sum; b_acc: [BLOCK_M, BLOCK_D]."""
    o_n = start + tl.arange(0, BLOCK_N)
    m_n = o_n < hi
    b_k = _load_rows(k_base, stride_kl, start, hi, o_d, m_d, BLOCK_N)
    b_s = tl.dot(b_q, tl.trans(_dot_operand(b_k, INTERPRET))) * qk_scale  # [BLOCK_M, BLOCK_N]
    key_pos = o_n * kv_stride + kv_offset
    b_s = tl.where(m_n[None, :] & (key_pos[None, :] <= row_pos[:, None]), b_s, float("-inf"))
    m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # a row with no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(b_m - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    b_l = b_l * alpha + tl.sum(b_p, 1)
    b_v = _load_rows(v_base, stride_vl, start, hi, o_d, m_d, BLOCK_N)
    b_pv = tl.dot(_dot_operand(b_p.to(b_v.dtype), INTERPRET), _dot_operand(b_v, INTERPRET))
    return m_new, b_l, b_acc * alpha[:, None] + b_pv


@triton.jit
def _attend_step(b_q, k_base, v_base, stride_kl, stride_vl, start, hi, per, row_pos, b_m, b_l, b_acc, qk_scale,
                 kv_stride, kv_offset, o_d, m_d, ws_ptr, o_row, m_r, m_o, n_rows, ws_lse_off,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """`_attend_block` at `start`; SPLIT: where a split ends (every `per` keys, and at
    hi), store its partial and start the next split from a fresh state."""
    b_m, b_l, b_acc = _attend_block(b_q, k_base, v_base, stride_kl, stride_vl, start, hi, row_pos, b_m, b_l, b_acc,
                                    qk_scale, kv_stride, kv_offset, o_d, m_d, BLOCK_N, INTERPRET)
    if SPLIT:
        end = start + BLOCK_N
        if (end % per == 0) | (end >= hi):
            _store_split(ws_ptr, b_m, b_l, b_acc, start // per, o_row, m_r, m_o, o_d, n_rows, ws_lse_off, HEAD_DIM)
            b_m = tl.full(b_m.shape, float("-inf"), dtype=tl.float32)
            b_l = tl.zeros(b_l.shape, dtype=tl.float32)
            b_acc = tl.zeros(b_acc.shape, dtype=tl.float32)
    return b_m, b_l, b_acc


@triton.jit
def _row_keys(pos_max, L, kv_stride, kv_offset):
    """Local keys j < n whose global position j * kv_stride + kv_offset is <= pos_max
    (kv_offset < kv_stride, so the numerator is > 0 once pos_max >= kv_offset)."""
    return tl.minimum(tl.maximum((pos_max - kv_offset + kv_stride) // kv_stride, 0), L)


@triton.jit
def _split_plan(n_keys, n_split, split_keys, BLOCK_N: tl.constexpr, MAX_NS: tl.constexpr):
    """(keys per split, splits holding keys) of a query block with n_keys keys.

    split_keys > 0: min(MAX_NS, cdiv(n_keys, split_keys)) splits, a function of the
    row alone; 0: the n_split programs' even shares (depends on the grid). Splits
    are equal runs of whole BLOCK_N steps, so no step straddles two. (Ceilings
    written out: tl.cdiv is a nested jit call, which the interpreter pays for.)"""
    sk = tl.maximum(split_keys, 1)
    ns = tl.maximum(tl.where(split_keys > 0, tl.minimum((n_keys + sk - 1) // sk, MAX_NS), n_split), 1)
    per = tl.maximum(((n_keys + BLOCK_N - 1) // BLOCK_N + ns - 1) // ns, 1) * BLOCK_N
    return per, (n_keys + per - 1) // per


@triton.jit
def _store_split(ws_ptr, b_m, b_l, b_acc, i_s, o_row, m_r, m_o, o_d, n_rows, ws_lse_off,
                 HEAD_DIM: tl.constexpr):
    """Split i_s's normalized fp32 partial [BLOCK_M, BLOCK_D] and its log2 lse
    (-inf, o = 0 for rows that saw no key) into the workspace."""
    has = b_l > 0.0
    b_l1 = tl.where(has, b_l, 1.0)
    o_ws = i_s.to(tl.int64) * n_rows + o_row
    tl.store(ws_ptr + o_ws[:, None] * HEAD_DIM + o_d[None, :], b_acc / b_l1[:, None], mask=m_o)
    tl.store(ws_ptr + ws_lse_off + o_ws, tl.where(has, b_m + tl.log2(b_l1), float("-inf")), mask=m_r)


@triton.jit
def _tile_rows(i_bhq, n_q_blocks, Q, KVH, G: tl.constexpr, QB: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of tile i_bhq (a batch row, a KV head and a block of QB queries): (batch
    row, KV head, query block, each row's query index, query head, mask, output row)."""
    # the last query blocks see the most keys under the causal rule: launch them first
    i_qb = n_q_blocks - 1 - i_bhq % n_q_blocks
    i_bh = i_bhq // n_q_blocks
    i_b = i_bh // KVH
    i_kvh = i_bh % KVH
    o_r = tl.arange(0, BLOCK_M)
    o_qi = i_qb * QB + o_r // G  # query index of each row
    o_h = i_kvh * G + o_r % G  # query head of each row
    m_r = (o_r < QB * G) & (o_qi < Q)
    o_row = (i_b.to(tl.int64) * Q + o_qi) * (KVH * G) + o_h  # [BLOCK_M] output row
    return i_b, i_kvh, i_qb, o_qi, o_h, m_r, o_row


@triton.jit
def _merge_rows(ws_ptr, o_ptr, lse_ptr, o_row, m_r, o_d, n_act, n_rows, ws_lse_off, HEAD_DIM: tl.constexpr):
    """Merge the partials of output rows o_row (mask m_r) over their n_act splits, one
    split at a time in split order with a running max m: o = sum_s 2^(lse_s - m) o_s /
    sum_s 2^(lse_s - m). The bits do not depend on the tile's layout or on which kernel
    runs it. A split with lse -inf (no key) adds exact zeros; a row with none gives o = 0,
    lse = -inf. Loads skip L1 (.cg): with MERGE the partials were written by other
    programs of the same grid."""
    m_o = m_r[:, None] & (o_d < HEAD_DIM)[None, :]
    b_m = tl.full(o_row.shape, float("-inf"), dtype=tl.float32)
    b_den = tl.zeros(o_row.shape, dtype=tl.float32)
    b_acc = tl.zeros(m_o.shape, dtype=tl.float32)
    s = 0
    while s < n_act:  # a while loop: the interpreter's range() rejects tensor bounds (numpy >= 2.3)
        # a split's lse and partial loaded together, one round trip a split (every split
        # below n_act was stored); two passes (the max first) took three
        o_ws = s * n_rows + o_row
        b_lse = tl.load(ws_ptr + ws_lse_off + o_ws, mask=m_r, other=float("-inf"), cache_modifier=".cg")
        b_o = tl.load(ws_ptr + o_ws[:, None] * HEAD_DIM + o_d[None, :], mask=m_o, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(b_m, b_lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_a = tl.exp2(b_m - m_use)
        b_w = tl.exp2(b_lse - m_use)
        b_den = b_den * b_a + b_w
        b_acc = b_acc * b_a[:, None] + tl.where((b_w > 0.0)[:, None], b_o, 0.0) * b_w[:, None]
        b_m = m_new
        s += 1
    has = b_den > 0.0
    b_den1 = tl.where(has, b_den, 1.0)
    tl.store(o_ptr + o_row[:, None] * HEAD_DIM + o_d[None, :], (b_acc / b_den1[:, None]).to(o_ptr.dtype.element_ty),
             mask=m_o)
    tl.store(lse_ptr + o_row, tl.where(has, (b_m + tl.log2(b_den1)) * LN2, float("-inf")), mask=m_r)


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, q_pos_ptr, o_ptr, lse_ptr, ws_ptr, cnt_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_ks, stride_kl, stride_kh,
    stride_vs, stride_vl, stride_vh,
    Q, L, KVH, n_q_blocks, n_rows, ws_lse_off, qk_scale, kv_stride, kv_offset, split_keys,
    G: tl.constexpr, QB: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MAX_NS: tl.constexpr,
    SPLIT: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False, WAIT: tl.constexpr = False,
    MERGE: tl.constexpr = False,
):
    """q: [B, Q, Hq, D] bf16 (D contiguous); k, v: [S, L, KVH, D] bf16 (D contiguous);
    slots, q_pos: [B] int32; o: [B, Q, Hq, D] bf16 and lse: [B, Q, Hq] fp32, contiguous;
    ws: fp32 [NSS, N, D] partials then [NSS, N] log2 lse at ws_lse_off (SPLIT only;
    NSS the most splits a block can have). split_keys: see `_split_plan`.
    qk_scale = sm_scale * log2(e). Grid: (B * KVH * n_q_blocks, NS). PDL: let the
    successor's programs launch once the loops end (the combine kernel, or with MERGE
    the o projection; they wait for this grid). WAIT: launched early itself (behind
    rope, which writes q and this step's keys): the row's slot and position are read,
    then it waits before reading q or the cache. MERGE (SPLIT only): the tile's last
    program to finish merges its partials (`_merge_rows`); cnt_ptr: int32 [B * KVH *
    n_q_blocks] zeros, a tile's count of finished programs, set back to 0 by its merge."""
    i_bhq = tl.program_id(0)
    i_split = tl.program_id(1)
    n_split = tl.num_programs(1)
    i_b, i_kvh, i_qb, o_qi, o_h, m_r, o_row = _tile_rows(i_bhq, n_q_blocks, Q, KVH, G, QB, BLOCK_M)

    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    pos0 = tl.load(q_pos_ptr + i_b)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    n_keys = _row_keys(pos0 + tl.minimum(i_qb * QB + QB, Q) - 1, L, kv_stride, kv_offset)
    per = n_keys  # SPLIT: keys per split; a contiguous run of splits per program
    lo = 0
    hi = n_keys
    if SPLIT:
        per, n_act = _split_plan(n_keys, n_split, split_keys, BLOCK_N, MAX_NS)
        run = (n_act + n_split - 1) // n_split * per
        lo = i_split * run
        hi = tl.minimum(lo + run, n_keys)
    k_base = k_ptr + slot * stride_ks + i_kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + i_kvh * stride_vh
    if WAIT:
        gdc_wait()

    row_pos = pos0 + o_qi  # global position of each row's query

    p_q = (q_ptr + i_b.to(tl.int64) * stride_qb + o_qi[:, None] * stride_qq
           + o_h[:, None] * stride_qh + o_d[None, :])
    b_q = _dot_operand(tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0), INTERPRET)

    m_o = m_r[:, None] & m_d[None, :]
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if INTERPRET:
        # a while loop: the interpreter's range() takes int() of 1-element arrays,
        # which numpy >= 2.3 refuses; compiled, the for loop is software-pipelined
        start = lo
        while start < hi:
            b_m, b_l, b_acc = _attend_step(
                b_q, k_base, v_base, stride_kl, stride_vl, start, hi, per, row_pos, b_m, b_l, b_acc, qk_scale,
                kv_stride, kv_offset, o_d, m_d, ws_ptr, o_row, m_r, m_o, n_rows, ws_lse_off, HEAD_DIM, BLOCK_N,
                SPLIT, INTERPRET)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            b_m, b_l, b_acc = _attend_step(
                b_q, k_base, v_base, stride_kl, stride_vl, start, hi, per, row_pos, b_m, b_l, b_acc, qk_scale,
                kv_stride, kv_offset, o_d, m_d, ws_ptr, o_row, m_r, m_o, n_rows, ws_lse_off, HEAD_DIM, BLOCK_N,
                SPLIT, INTERPRET)

    if PDL:
        gdc_launch_dependents()
    if SPLIT:
        if MERGE:
            # every thread's partial stored before the count: the barrier orders them before
            # the one thread's atomic, whose release (acq_rel, GPU scope) publishes them
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr + i_bhq, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                tl.store(cnt_ptr + i_bhq, 0)  # the tile's programs have all counted: ready for the next launch
                _merge_rows(ws_ptr, o_ptr, lse_ptr, o_row, m_r, o_d, n_act, n_rows, ws_lse_off, HEAD_DIM)
    else:
        has = b_l > 0.0
        b_l1 = tl.where(has, b_l, 1.0)
        b_o = b_acc / b_l1[:, None]  # rows with no key: acc = 0 -> o = 0
        b_lse2 = tl.where(has, b_m + tl.log2(b_l1), float("-inf"))
        tl.store(o_ptr + o_row[:, None] * HEAD_DIM + o_d[None, :], b_o.to(o_ptr.dtype.element_ty),
                 mask=m_o)
        tl.store(lse_ptr + o_row, b_lse2 * LN2, mask=m_r)


@triton.jit
def attention_combine_kernel(
    ws_ptr, o_ptr, lse_ptr, q_pos_ptr, n_q_blocks, n_rows, ws_lse_off, n_split, split_keys, Q, KVH, L, kv_stride,
    kv_offset, G: tl.constexpr, QB: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MAX_NS: tl.constexpr, PDL: tl.constexpr = False,
    LET_NEXT: tl.constexpr = False,
):
    """Merge the split partials of one tile's rows (grid: B * KVH * n_q_blocks programs, the
    attention grid's tiles) in split order: `_merge_rows`, as a MERGE attention kernel's
    last program does. The tile's splits are those `attention_kernel` cut for it (the same
    `_split_plan` of the same query block's context). PDL: launched early (programmatic
    dependent launch), so wait for the partials; the row's context is not the attention
    kernel's output, so it is read before the wait. LET_NEXT: lets its successor (the o
    projection, launched with PDL) launch at entry, to load its weights while the merge runs."""
    if LET_NEXT:
        gdc_launch_dependents()
    i_b, i_kvh, i_qb, o_qi, o_h, m_r, o_row = _tile_rows(tl.program_id(0), n_q_blocks, Q, KVH, G, QB, BLOCK_M)
    pos_max = tl.load(q_pos_ptr + i_b) + tl.minimum(i_qb * QB + QB, Q) - 1
    per, n_act = _split_plan(_row_keys(pos_max, L, kv_stride, kv_offset), n_split, split_keys, BLOCK_N, MAX_NS)
    if PDL:
        gdc_wait()
    _merge_rows(ws_ptr, o_ptr, lse_ptr, o_row, m_r, tl.arange(0, BLOCK_D), n_act, n_rows, ws_lse_off, HEAD_DIM)
