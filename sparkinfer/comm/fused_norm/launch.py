"""Host side of all_reduce_add_rms_norm: validate, choose tiles, launch (or compose).

Symbols: T rows (tokens), H hidden size, W ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkinfer.comm import nccl
from sparkinfer.comm.channel import MAX_BLOCKS
from sparkinfer.comm.dispatch import check_overlap, check_tensor, launch, use_kernel
from sparkinfer.comm.fused_norm.kernel import all_reduce_add_rms_norm_kernel, all_reduce_add_rms_norm_ll_kernel
from sparkinfer.comm.fused_norm.reference import add_rms_norm
from sparkinfer.comm.topology import LL_MAX_BYTES, TopologyCaps, grid_config
from sparkinfer.errors import CapacityError, DTypeError, LayoutError, PlanError, ShapeError

__all__ = ["NormConfig", "norm_config", "split_pieces", "check_config", "candidate_configs", "all_reduce_add_rms_norm",
           "ALGORITHMS"]

OP = "all_reduce_add_rms_norm"
ALGORITHMS = ("auto", "fused", "fused_ll", "nccl")
# Widest hidden tile kept in registers. 8192 bf16 per row at 8 warps is 32
# elements (four 16-byte vectors) per thread; rows up to H = 8192 fit one tile.
# The interpreter uses 4096 so that CPU tests with H = 7168 take the piece path.
MAX_TILE_GPU = 8192
MAX_TILE_INTERP = 4096
# Rows that fit one tile go whole to a block (ONE_PASS: the norm needs no other
# block) unless the tensor is smaller than SPLIT_MAX_BYTES, where rows are split
# into pieces of >= MIN_PIECE_BYTES over more blocks, whose sums of squares then
# meet through a cross-block exchange (publish_local / wait_local).
# 2x H200 `sparkinfer bench fused --sweep` at 426b41a (benchmarks/results/sweeps/
# fused_sweep_2xh200_426b41a.json): whole rows beat split rows at every measured T: T = 1, H = 4096:
# ll_row 5.01 us vs ll_pieces 6.53 us; H = 7168: 6.06 vs 7.94; T = 8: 5.08 vs
# 7.17 and 6.53 vs 8.80. So 0: never split a row that fits a tile.
SPLIT_MAX_BYTES = 0
# The LL kernel's split path posts partial sums as LL words polled with one
# vector load (kernel.py), not through atomics. It splits rows (split_pieces)
# below LL_SPLIT_MAX_BYTES of x when T = 1 or a row has >= LL_SPLIT_ROW_BYTES.
# 2x H200 piece sweep at aae5660 (one-piece blocks with private partial lines;
# benchmarks/results/sweeps/fused_ll_variants_2xh200.json, "hsweep"), us, whole
# rows vs pieces: H = 4096
# (8 KiB rows): T = 2: 4.97 vs 4.44 (4 pieces) / 4.62 (8); T = 4: 5.01 vs 4.83
# / 4.85; T = 8: 5.18 vs 4.96 (8); T = 16: 5.75 vs 5.41 (8). Before that change
# whole 8 KiB rows won at T >= 8 (e9512d3: 5.25 vs 5.89, sweeps/
# fused_sweep_2xh200_e9512d3.json), hence the old "> 8 KiB". Checked at 3ced22a
# (sweeps/fused_ll_pieces_2xh200.json): H = 7168, T = 1 / 8 / 16: 4.49 / 5.41 / 6.18 with
# 1 KiB pieces vs 4.56 / 5.43 / 6.21 with 7; H = 4096, T = 2: 4.60 vs 4.49 with 4.
LL_SPLIT_MAX_BYTES = 256 << 10
LL_SPLIT_ROW_BYTES = 8 << 10
# Smallest piece of a split row on the GPU, with at most one piece per SM.
# Flag kernel: the 2x H200 all-reduce sweep (topology.PER_BLOCK_BYTES: 32 KiB
# on 16 blocks 5.2 us, on 1 block 9.3 us) put ~2 KiB of stage per block.
# LL kernel, same hsweep, 1 KiB vs 2 KiB pieces: H = 4096, T = 1: 4.37 vs 4.53;
# T = 16: 5.41 vs 5.62; H = 7168, T = 2: 4.74 vs 4.83; T = 4: 4.94 vs 5.11.
# The interpreter splits rows above 4 KiB (one block keeps every piece of a row
# there: its blocks run one after another, so none may wait on a later one),
# always, so CPU tests cover the piece path.
MIN_PIECE_BYTES_GPU = 2 << 10
MIN_PIECE_BYTES_LL = 1 << 10
MIN_PIECE_BYTES_INTERP = 4 << 10
PIECE_ALIGN = 64  # elements: piece starts stay 16-byte aligned
# LL kernel warps. Pieces: 4 (2x H200 LL sweep, topology.ll_grid_config:
# 512-word tiles at 4 warps won). Whole rows (up to 4096 words): one warp per
# LL_ROW_WORDS_PER_WARP words, 4..16 warps. Same sweep: 8 warps for 2048-word
# rows (H = 4096) won at T = 8 (5.08 vs 5.40 us at 16) and tied at T = 1 (5.12
# vs 5.01); 4096-word rows (H = 7168) tied (T = 1: 6.17 vs 6.06; T = 8: 6.53 both).
# ptxas -v, sm_90a, bf16, no spills either way: 4096-word rows 121 registers at
# 16 warps, 227 at 8; 2048-word rows 118 / 127.
LL_PIECE_WARPS = 4
# algorithm="auto" takes the LL kernel up to this many bytes of x: all_reduce's
# LL limit (topology.LL_MAX_BYTES, 2x H200: LL 4.91 us vs one-shot 6.12 us at
# 128 KiB, tied at 512 KiB). Same sweep at T = 64 (512 / 896 KiB): the flag
# kernel's whole rows win (7.46 vs 8.09 us; 9.02 vs 11.35 us).
FUSED_LL_MAX_BYTES = LL_MAX_BYTES
LL_MAX_ROW_WORDS = 4096  # 8192 bf16: 64 B of LL words per thread at 16 warps
LL_ROW_WORDS_PER_WARP = 256
# batch_invariant=True (the default) keeps every row that fits a tile whole: a
# split row sums fp32 partials per piece, and the pieces per row follow the row
# count (split_pieces, LL_SPLIT_*), so a row's bits would follow the batch. Whole
# rows take the exact sum of squares (kernel.py), the same bits over the flag and
# the LL kernel, so the byte-size choice between them (FUSED_LL_MAX_BYTES) keeps
# them too. What whole rows cost where the heuristic splits, 2x H200 hsweep above
# (fused_ll_variants_2xh200.json), us whole vs split, H = 4096: T = 1 5.06 (4
# warps) vs 4.37 (8 pieces); T = 2 4.97 vs 4.44; T = 4 5.01 vs 4.83; T = 8 5.18
# vs 4.96; T = 16 5.75 vs 5.41. H = 7168 at T = 2: 8.56 at 4 warps vs 4.74 (14
# pieces); its whole rows take 16 warps (LL_ROW_WORDS_PER_WARP), timed only at
# T = 32 (8.78 us). Rows wider than a tile (H > 8192 bf16) still split, by H alone
# where the flag kernel serves them; invariance is not promised there.


@dataclass(frozen=True)
class NormConfig:
    """Launch shape of the fused kernel (see kernel.py for pieces).

    grid: blocks (<= num_sms, <= MAX_BLOCKS: co-resident). block: elements per
    push tile of the flag kernel (one_pass: block_h). pieces: S, pieces per row;
    chunk: CH, elements per piece (a multiple of PIECE_ALIGN); per: pieces per
    block. block_h: row tile, block_c: piece tile (powers of two). one_pass:
    S = 1 and a row fits block_h (and, built with ll=True, LL_MAX_ROW_WORDS):
    whole rows per block, no cross-block exchange. block_w: the LL kernel's tile
    in int32 words (one_pass: a whole row; else a piece's words, <= 1024).
    num_warps: warps per block (the LL kernel's when built with ll=True).
    """

    grid: int
    block: int
    pieces: int
    chunk: int
    per: int
    block_h: int
    block_c: int
    one_pass: bool
    num_warps: int
    block_w: int


def _piece_chunk(hidden: int, pieces: int) -> int:
    """Elements per piece: hidden / pieces rounded up to PIECE_ALIGN."""
    per_piece = -(-hidden // pieces)
    return -(-per_piece // PIECE_ALIGN) * PIECE_ALIGN


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def split_pieces(caps: TopologyCaps, rows: int, hidden: int, itemsize: int, ll: bool = False) -> int:
    """Pieces per row when rows are split: pieces of >= MIN_PIECE_BYTES(_LL) while
    there are fewer rows than blocks (the only GPU rule before ONE_PASS rows)."""
    interp = caps.interpret
    piece = MIN_PIECE_BYTES_INTERP if interp else MIN_PIECE_BYTES_LL if ll else MIN_PIECE_BYTES_GPU
    s = max(1, hidden * itemsize // piece)
    if not interp:
        s = min(s, max(1, min(caps.num_sms, MAX_BLOCKS) // rows))
    return s


def _default_pieces(caps: TopologyCaps, rows: int, hidden: int, itemsize: int, ll: bool,
                    batch_invariant: bool) -> int:
    """1 (whole rows) where a row fits a tile and the tensor is >= SPLIT_MAX_BYTES
    (the LL kernel: unless LL_SPLIT_* say split) or batch_invariant, else split_pieces."""
    tile = MAX_TILE_INTERP if caps.interpret else MAX_TILE_GPU
    if batch_invariant and hidden <= tile and (not ll or hidden * itemsize // 4 <= LL_MAX_ROW_WORDS):
        return 1
    split = (rows == 1 or hidden * itemsize >= LL_SPLIT_ROW_BYTES) and rows * hidden * itemsize < LL_SPLIT_MAX_BYTES
    whole = not split if ll else rows * hidden * itemsize >= SPLIT_MAX_BYTES
    if not caps.interpret and hidden <= MAX_TILE_GPU and whole:
        return 1
    return split_pieces(caps, rows, hidden, itemsize, ll)


def norm_config(caps: TopologyCaps, rows: int, hidden: int, itemsize: int = 2, *, ll: bool = False,
                pieces: int | None = None, num_warps: int | None = None,
                batch_invariant: bool = True) -> NormConfig:
    """Pure heuristic: the launch shape for x: [rows, hidden] of `itemsize`-byte
    elements, for the LL kernel if `ll`. pieces / num_warps override the
    heuristic's choice (benchmark sweeps, tests); pieces is rounded so that
    every piece is a multiple of PIECE_ALIGN elements. Pieces are spread over
    <= num_sms blocks (2 in the interpreter, with whole rows per block).
    batch_invariant: whole rows wherever a row fits a tile, so a row's bits do
    not depend on `rows` (see the constants above); False: split rows where the
    sweeps found pieces faster."""
    interp = caps.interpret
    g_max = 2 if interp else min(caps.num_sms, MAX_BLOCKS)
    s = (_default_pieces(caps, rows, hidden, itemsize, ll, batch_invariant) if pieces is None
         else max(1, min(pieces, hidden)))
    chunk = _piece_chunk(hidden, s)
    s = -(-hidden // chunk)
    if interp:  # whole rows per block
        per = s * -(-rows // min(rows, g_max))
    else:
        per = -(-rows * s // g_max)
    grid = -(-rows * s // per)
    block_h = min(_pow2(hidden), MAX_TILE_INTERP if interp else MAX_TILE_GPU)
    block_c = min(_pow2(chunk), block_h)
    # LL rows are 8 bytes in registers per 4 payload bytes: at most LL_MAX_ROW_WORDS
    one_pass = s == 1 and hidden <= block_h and (not ll or hidden * itemsize // 4 <= LL_MAX_ROW_WORDS)
    base = grid_config(caps, 0)
    words = (hidden if one_pass else chunk) * itemsize // 4
    block_w = _pow2(words) if one_pass else min(_pow2(words), 1024)
    if interp:
        warps = base.num_warps
    elif ll:
        warps = min(16, max(4, block_w // LL_ROW_WORDS_PER_WARP)) if one_pass else LL_PIECE_WARPS
    else:
        # one 16-byte vector per thread on the main tile (4..16 warps): ptxas -v for sm_90,
        # bf16: a 1024-wide piece tile at 8 warps loads 8-byte vectors; one_pass 8192: 84
        # registers at 16 warps, 152 at 8 (56 B spilled at 8 with the old 2048-element push tile)
        warps = min(16, max(4, (block_h if one_pass else block_c) * itemsize // 512))
        if one_pass:  # same sweep: whole rows at 8 warps beat 16 at T = 64 (7.46 vs 7.52 us,
            warps = min(warps, 8)  # H = 7168: 9.02 vs 9.99) and T = 256 (13.39 vs 14.89; 18.93 vs 19.99)
    warps = warps if num_warps is None else num_warps
    # one_pass pushes a row per tile: at T = 256 (2 rows per block) 2048-element push
    # tiles meant 4 dependent load -> store round trips per block where the bare
    # one-shot (4096-element tiles) has 2
    block = block_h if one_pass and not interp else base.block
    return NormConfig(grid, block, s, chunk, per, block_h, block_c, one_pass, warps, block_w)


def check_config(cfg: NormConfig, caps: TopologyCaps, *, rows: int, hidden: int, itemsize: int) -> None:
    """Raise PlanError unless `cfg` covers x: [rows, hidden] (`itemsize`-byte elements)
    on co-resident blocks, with a row tile that holds a row where one_pass."""
    g_max = 2 if caps.interpret else min(caps.num_sms, MAX_BLOCKS)
    if not isinstance(cfg, NormConfig):
        raise PlanError(f"config must be a fused_norm.launch.NormConfig (from norm_config), got {type(cfg).__name__}")
    n = rows * cfg.pieces
    ok = (
        1 <= cfg.grid <= g_max and (cfg.grid - 1) * cfg.per < n <= cfg.grid * cfg.per
        and cfg.pieces >= 1 and cfg.chunk == _piece_chunk(hidden, cfg.pieces)
        and (cfg.pieces - 1) * cfg.chunk < hidden <= cfg.pieces * cfg.chunk
        and (not cfg.one_pass or (cfg.pieces == 1 and hidden <= cfg.block_h and 4 * cfg.block_w >= hidden * itemsize))
        and (not caps.interpret or cfg.per % cfg.pieces == 0) and cfg.num_warps in (1, 2, 4, 8, 16, 32)
    )
    if not ok:
        raise PlanError(f"config {cfg!r} does not cover x: [{rows}, {hidden}] on <= {g_max} co-resident blocks; "
                        "build it with fused_norm.launch.norm_config(comm.caps, rows, hidden, itemsize, ...)")


def candidate_configs(caps: TopologyCaps, rows: int, hidden: int, itemsize: int = 2, *,
                      ll_max_bytes: int) -> dict:
    """name -> (algorithm, NormConfig): the launch shapes worth timing for x: [rows,
    hidden] (`sparkinfer bench fused --sweep`; at most 6). ll_max_bytes: the most
    the channel's LL lanes carry (layout.ll_lane_bytes // 2). "auto" is what
    all_reduce_add_rms_norm picks (batch-invariant), named "auto=<twin>" when it
    equals a candidate (left out then); "heuristic": what batch_invariant=False
    picks. ll_row_w8 / _w16: whole rows over LL; *_pieces: rows split by
    split_pieces (ll_pieces_half: twice as many pieces, still one per block);
    flag_row(_w8): whole rows over the flag kernel."""
    nbytes, s = rows * hidden * itemsize, split_pieces(caps, rows, hidden, itemsize, True)
    ll_ok = nbytes <= ll_max_bytes and nbytes % 4 == 0
    ll_auto = ll_ok and _auto_ll(nbytes)
    auto = ("fused_ll" if ll_auto else "fused", norm_config(caps, rows, hidden, itemsize, ll=ll_auto))

    def shape(ll, **kw):
        return "fused_ll" if ll else "fused", norm_config(caps, rows, hidden, itemsize, ll=ll, **kw)

    s2 = min(2 * s, max(1, min(caps.num_sms, MAX_BLOCKS) // rows))  # pieces of half the size
    cands = dict(heuristic=shape(ll_auto, batch_invariant=False))
    if ll_ok:
        cands.update(ll_row_w8=shape(True, pieces=1, num_warps=8), ll_row_w16=shape(True, pieces=1, num_warps=16),
                     ll_pieces=shape(True, pieces=s), ll_pieces_half=shape(True, pieces=s2))
    cands.update(flag_row=shape(False, pieces=1), flag_pieces=shape(False, pieces=s),
                 flag_row_w8=shape(False, pieces=1, num_warps=8))
    cands = {k: v for k, v in cands.items() if "pieces" not in k or v[1].pieces > 1}  # 1 piece: a row
    twin = next((k for k, v in cands.items() if v == auto), None)
    out = {f"auto={twin}" if twin else "auto": auto}
    for k, v in cands.items():
        if len(out) < 6 and k != twin and v not in out.values():
            out[k] = v
    return out


def _one_piece(cfg: NormConfig, itemsize: int, rows: int, lane_bytes: int) -> bool:
    """Whether the LL kernel's split path has exactly one piece per block, in one
    tile, and the blocks' private partial lines (rows * S lines of NPAD int64
    words, kernel.py) fit this rank's LL lane."""
    npad = max(_pow2(cfg.pieces), 16)
    return (not cfg.one_pass and cfg.per == 1 and cfg.chunk * itemsize <= 4 * cfg.block_w
            and rows * cfg.pieces * npad * 8 <= lane_bytes)


def _auto_ll(nbytes: int) -> bool:
    """Whether algorithm="auto" takes the LL kernel for x of `nbytes` (within the LL lanes)."""
    return nbytes <= FUSED_LL_MAX_BYTES and nbytes % 4 == 0


def _check_like(name: str, t, x, device) -> None:
    check_tensor(name, t, device)
    if t.dtype != x.dtype:
        raise DTypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; cast it with .to({x.dtype})")
    if tuple(t.shape) != tuple(x.shape):
        raise ShapeError(f"{name} must match x's shape {tuple(x.shape)}; got {tuple(t.shape)}")


def all_reduce_add_rms_norm(ctx, x, residual, weight, eps: float = 1e-6, *, out=None, residual_out=None,
                            algorithm: str = "auto", config: NormConfig | None = None,
                            batch_invariant: bool = True):
    """residual_out = all_reduce(x) + residual;  out = rmsnorm(residual_out) * weight.

    x, residual: [*, H] bf16/fp16/fp32, contiguous, same dtype. weight: [H] (any of
    those dtypes). out, residual_out: like x; may be x / residual (in place), but
    not the same tensor as each other. Sum in fp32 in rank order, not rounded
    before the residual add; the norm reads the rounded residual_out. Bitwise
    identical on every rank (given identical residual and weight).

    Returns (out, residual_out). Allocates only the outputs not given. No host
    sync. Legal in CUDA graph capture (inside pool.capture) once the same
    configuration ran eagerly. algorithm: "auto" (the fused kernel over the LL
    transport up to FUSED_LL_MAX_BYTES, else the flag-based one, within the
    staging capacity; NCCL above it eagerly or without peer access), "fused",
    "fused_ll", or "nccl": all_reduce through torch.distributed + torch norm, which
    rounds the sum to x's dtype before the residual add and allocates.
    ctx: the calling Communicator's OpContext (comm.context).
    config: an explicit launch shape (benchmark sweeps, tests) from
    norm_config(ctx.caps, T, H, itemsize, ll=...) with T = x.numel() // H (it
    must be built with ll=True for the LL kernel to get the LL kernel's warps);
    None: norm_config's heuristic. PlanError if it does not cover x. Every rank
    must pass the same config (it is part of the fingerprint).
    batch_invariant: a row's out and residual_out are the same bits whatever the
    other rows and T are, and whichever kernel the bytes pick (rows that fit a
    tile: H <= 8192 for 16-bit dtypes on GPUs); False lets norm_config split rows
    into pieces where that measured faster (up to 0.7 us at T = 1, H = 4096).
    """
    import torch

    dev = ctx.device
    check_tensor("x", x, dev)
    if x.dim() == 0:
        raise ShapeError("x must be [*, H] with a hidden dim; got a 0-dimensional tensor")
    _check_like("residual", residual, x, dev)
    check_tensor("weight", weight, dev)
    H = x.shape[-1]
    if tuple(weight.shape) != (H,):
        raise ShapeError(f"weight must have shape ({H},) to match x's hidden dim; got {tuple(weight.shape)}")
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    _check_like("out", out, x, dev)
    _check_like("residual_out", residual_out, x, dev)
    if out.numel() and out.data_ptr() == residual_out.data_ptr():
        raise LayoutError("out and residual_out are the same memory; pass distinct tensors "
                          "(out=x, residual_out=residual is fine)")
    check_overlap("out", out, "x", x, in_place=True)
    check_overlap("residual_out", residual_out, "residual", residual, in_place=True)
    check_overlap("out", out, "residual", residual, in_place=False)
    check_overlap("residual_out", residual_out, "x", x, in_place=False)
    check_overlap("out", out, "residual_out", residual_out, in_place=False)
    check_overlap("out", out, "weight", weight, in_place=False)  # every row's norm reads the whole weight
    check_overlap("residual_out", residual_out, "weight", weight, in_place=False)
    if algorithm not in ALGORITHMS:
        raise PlanError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}; pass 'auto' to let the "
                        "communicator choose")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise DTypeError(f"eps must be a non-negative Python float, got {eps!r}")
    n = x.numel()
    if n == 0:
        return out, residual_out
    if H * x.element_size() % 16:
        raise ShapeError(f"hidden size {H} x {x.element_size()} B is not a multiple of 16 bytes; "
                         f"pad H to a multiple of {16 // x.element_size()} (rows are moved in 16-byte vectors)")
    T, nbytes = n // H, n * x.element_size()
    if config is not None:
        check_config(config, ctx.caps, rows=T, hidden=H, itemsize=x.element_size())
    if not use_kernel(ctx, OP, nbytes, algorithm):
        o, r = add_rms_norm(nccl.all_reduce(ctx, x, torch.empty_like(x), op=OP), residual, weight, float(eps))
        residual_out.copy_(r)
        out.copy_(o)
        return out, residual_out
    ll_lane = ctx.layout.ll_lane_bytes
    ll = algorithm == "fused_ll" or (algorithm == "auto" and _auto_ll(nbytes))
    if ll and 2 * nbytes > ll_lane:
        if algorithm == "fused_ll":
            raise CapacityError(f"{OP} with algorithm='fused_ll' carries at most {ll_lane // 2} B on "
                                f"this channel, got {nbytes} B; use algorithm='auto' or 'fused'")
        ll = False
    cfg = norm_config(ctx.caps, T, H, x.element_size(), ll=ll, batch_invariant=batch_invariant) \
        if config is None else config
    args = (x, residual, weight, out, residual_out, T, H, cfg.pieces, cfg.chunk, cfg.per, float(eps))
    # every field that changes the exchanged words or the order of the norm's sums (bitwise agreement)
    facts = (T, H, str(x.dtype), cfg.grid, cfg.pieces, cfg.per, cfg.one_pass, cfg.num_warps, cfg.block_w,
             cfg.block_c, ll)
    if ll:
        half = x.element_size() == 2
        consts = dict(BLOCK_W=cfg.block_w, HALF=half, EPW=2 if half else 1, NP=_pow2(cfg.pieces),
                      ONE_PASS=cfg.one_pass, ONE_PIECE=_one_piece(cfg, x.element_size(), T, ll_lane),
                      SYNC=cfg.block_w < 32 * cfg.num_warps)
        launch(ctx, OP, all_reduce_add_rms_norm_ll_kernel, cfg=cfg, args=args, consts=consts, facts=facts,
               region="both")
    else:
        consts = dict(BLOCK=cfg.block, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ONE_PASS=cfg.one_pass)
        launch(ctx, OP, all_reduce_add_rms_norm_kernel, cfg=cfg, args=args, consts=consts, facts=facts)
    return out, residual_out
