"""Host side of `decode_attention`: check, allocate unless given, launch.

Legend: B batch rows, Q queries per row, Hq query heads, KVH KV heads,
G = Hq / KVH, D head dim, S cache slots, L local positions per slot,
NS programs per row's keys, NSS partials kept per output row, N = B * Q * Hq
output rows.
"""

from __future__ import annotations

import math

import torch

from sparkinfer import envs
from sparkinfer.attention.config import H200_SMS, MAX_SPLITS, AttentionConfig, attention_config
from sparkinfer.attention.kernel import attention_combine_kernel, attention_kernel
from sparkinfer.errors import CapacityError, CaptureError, DeviceError, DTypeError, LayoutError, ShapeError
from sparkinfer.runtime.devices import cuda_sm_count

__all__ = ["decode_attention", "attention_workspace", "plan_call"]

# The combine pass of a split call is launched with programmatic dependent launch:
# its programs are scheduled while the attention kernel's last programs finish and
# wait (griddepcontrol.wait) for their partials. Measured for the MoE kernels'
# chains (moe/runner.py MICRO_PDL: 23 of 24 H200 points faster); not yet
# measured here (`sparkinfer bench attention` runs with it on).
COMBINE_PDL = True
# Attention launched early behind rope (which lets its successor launch at entry): the
# kernel reads each row's slot and position, then waits (WAIT). On since an
# H100 A/B in two calls (sweeps/decode_pdl_chain_ab_h100.json, with COMBINE_LETS_NEXT and
# moe.runner.FC1_PDL; 3 runs each of all three off / on, bench decode 8 layers bf16, medians, us a step):
# batch 1 Qwen3-30B-A3B 798.4 -> 789.4, GLM-4.5-Air 2,138.7 -> 2,117.1, Mixtral 2,563.4 -> 2,546.5 (every
# run with them faster than every run without); batch 8 1,900 / 5,603 / 6,874 -> 1,897 / 5,596 / 6,974, within
# the runs' spread (Mixtral 6,761-7,304).
ATTENTION_PDL = True
# The combine lets its successor (the o projection, which loads its weights before its
# wait) launch at entry instead of at its end. On since the A/B above.
COMBINE_LETS_NEXT = True
# A split call merges its partials in the attention kernel itself: the last of a tile's
# programs to finish (an atomic count per tile) runs the merge, instead of a second
# launch (`attention_combine_kernel`) that waits for the whole grid. The same code on
# the same rows, so the same bits either way (tests/attention/test_merge.py). On since
# an H100 A/B (sweeps/decode_attention_merge_ab_h100.json; bench decode, 8 layers, bf16,
# 3 runs on / 2 of the per-tile combine / 2 of eda67c8's per-row combine, interleaved,
# us a step at batch 1): Qwen3-30B-A3B 777.2 median against 781.0-787.8, GLM-4.5-Air 2,112.4
# against 2,116.2-2,120.8, Mixtral 2,520.4 against 2,530.3-2,553.2, every run with it faster
# than every run without; batch 8 within the runs' spread (Mixtral 6,515-7,000 over all).
MERGE_IN_ATTENTION = True
# Split workspaces kept by the launcher when the caller passes none, keyed by
# (device, fp32 elements); never freed, so a captured graph's buffer stays valid.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}
# The merging kernel's per-tile counters (int32 zeros, set back to zero by each merge),
# kept likewise, keyed by (device, tiles). A call during capture without its counters
# (a shape not run before) launches the combine kernel instead.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _device_ok(device: torch.device) -> bool:
    """CUDA tensors, or CPU tensors when Triton interprets (CPU CI)."""
    return device.type == "cuda" or (device.type == "cpu" and envs.triton_interpret())


def _num_sms(device: torch.device) -> int:
    """The device's SM count (host-side, cached; no sync); the H200's off CUDA."""
    if device.type != "cuda":
        return H200_SMS
    return cuda_sm_count(device)


def _check(name: str, t, dims: str, shape: tuple | None, dtype: torch.dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"decode_attention: {name} is {type(t).__name__}; pass a {dtype} tensor {dims}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ShapeError(f"decode_attention: {name} has shape {tuple(t.shape)}; expected {dims} = {tuple(shape)}")
    if t.dtype != dtype:
        raise DTypeError(f"decode_attention: {name} dtype is {t.dtype}; expected {dtype}")
    if device is not None and t.device != device:
        raise DeviceError(f"decode_attention: {name} is on {t.device}; expected {device} (where q lives)")


def _shapes(q, k_cache, v_cache, slots, q_pos) -> None:
    """Checks of the inputs' ranks, dtypes, devices and layouts (no values read)."""
    _check("q", q, "[B, Q, Hq, D]", None, torch.bfloat16, None)
    if q.dim() != 4:
        raise ShapeError(f"decode_attention: q has shape {tuple(q.shape)}; expected 4 dims [B, Q, Hq, D]")
    if not _device_ok(q.device):
        raise DeviceError(f"decode_attention: q is on {q.device}; the kernel runs on CUDA devices (CPU "
                          "tensors only under TRITON_INTERPRET=1)")
    B, Q, Hq, D = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, c, "[S, L, KVH, D]", None, torch.bfloat16, q.device)
        if c.dim() != 4 or c.shape[3] != D:
            raise ShapeError(f"decode_attention: {name} has shape {tuple(c.shape)}; expected [S, L, KVH, D] "
                             f"with D = {D} (q's head dim)")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ShapeError(f"decode_attention: v_cache shape {tuple(v_cache.shape)} differs from k_cache "
                         f"{tuple(k_cache.shape)}")
    kvh = k_cache.shape[2]
    if kvh == 0 or Hq % kvh:
        raise ShapeError(f"decode_attention: Hq = {Hq} query heads over KVH = {kvh} KV heads; Hq must be a "
                         "positive multiple of KVH")
    if not 16 <= D <= 256:
        raise ShapeError(f"decode_attention: head dim D = {D}; supported 16 <= D <= 256")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(3) != 1:
            raise LayoutError(f"decode_attention: {name} has strides {t.stride()}; the head dim D must be "
                              "contiguous (stride 1); other strides are free")
    for name, t in (("slots", slots), ("q_pos", q_pos)):
        _check(name, t, "[B]", (B,), torch.int32, q.device)
        if not t.is_contiguous():
            raise LayoutError(f"decode_attention: {name} has strides {t.stride()}; pass a contiguous [B] tensor")


def _output(name: str, t, dims: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    if t is None:
        if _capturing(device):
            raise CaptureError(f"decode_attention: {name}=None during CUDA graph capture would allocate; pass a "
                               f"preallocated {name} {dims} = {shape}")
        return torch.empty(shape, dtype=dtype, device=device)
    _check(name, t, dims, shape, dtype, device)
    if not t.is_contiguous():
        raise LayoutError(f"decode_attention: {name} has strides {t.stride()}; pass a contiguous tensor")
    return t


def plan_call(q, k_cache, *, num_splits: int | None = None, batch_invariant: bool = True) -> AttentionConfig:
    """The `AttentionConfig` that `decode_attention(q, k_cache, ...)` launches with
    (shapes and the device's SM count only; no sync, no allocation)."""
    B, Q, Hq, D = q.shape
    return attention_config(batch=B, q_len=Q, num_q_heads=Hq, num_kv_heads=k_cache.shape[2], head_dim=D,
                            cache_len=k_cache.shape[1], num_sms=_num_sms(q.device), num_splits=num_splits,
                            batch_invariant=batch_invariant)


def attention_workspace(q, k_cache, *, num_splits: int | None = None, batch_invariant: bool = True) -> torch.Tensor:
    """A split workspace for calls with q's and k_cache's shapes (and num_splits,
    batch_invariant): fp32 [plan_call(q, k_cache).workspace_numel] on q's device,
    possibly empty. One buffer serves every call whose workspace_numel is no
    larger. Allocates; not capture-legal (CaptureError); no sync."""
    n = plan_call(q, k_cache, num_splits=num_splits, batch_invariant=batch_invariant).workspace_numel
    if _capturing(q.device):
        raise CaptureError("attention_workspace allocates; call it before CUDA graph capture")
    return torch.empty(n, dtype=torch.float32, device=q.device)


def _workspace(cfg: AttentionConfig, workspace, device) -> torch.Tensor | None:
    if cfg.split_slots == 1:
        return None
    n = cfg.workspace_numel
    if workspace is not None:
        _check("workspace", workspace, "[>= NS * N * (D + 1)]", None, torch.float32, device)
        if workspace.dim() != 1 or not workspace.is_contiguous():
            raise LayoutError(f"decode_attention: workspace has shape {tuple(workspace.shape)}, strides "
                              f"{workspace.stride()}; pass a contiguous 1-D fp32 tensor (attention_workspace)")
        if workspace.numel() < n:
            raise CapacityError(f"decode_attention: workspace holds {workspace.numel()} fp32 elements; this call "
                                f"needs {n} ({cfg.split_slots} splits); size it with attention_workspace(q, k_cache)")
        return workspace
    key = (device, n)
    if key not in _WORKSPACES:
        if _capturing(device):
            raise CaptureError(f"decode_attention: the split workspace of {n} fp32 elements is not allocated and "
                               "CUDA graph capture forbids it; run this shape once eagerly before capture, or "
                               "pass workspace=attention_workspace(q, k_cache)")
        _WORKSPACES[key] = torch.empty(n, dtype=torch.float32, device=device)
    return _WORKSPACES[key]


def _counters(cfg: AttentionConfig, device) -> torch.Tensor | None:
    """The merging kernel's per-tile counters for cfg's grid (allocated zeroed on first use);
    None during capture when not yet allocated (the call then launches the combine kernel)."""
    key = (device, cfg.grid[0])
    if key not in _COUNTERS:
        if _capturing(device):
            return None
        _COUNTERS[key] = torch.zeros(cfg.grid[0], dtype=torch.int32, device=device)
    return _COUNTERS[key]


def decode_attention(q, k_cache, v_cache, slots, q_pos, *, sm_scale: float, kv_stride: int = 1,
                     kv_offset: int = 0, out=None, lse=None, workspace=None, num_splits: int | None = None,
                     batch_invariant: bool = True):
    """Causal attention of Q new queries per batch row over its slot of a KV cache.

    q: [B, Q, Hq, D] bf16, D contiguous (other strides free). Q = 1 at decode,
        k + 1 at speculative verify, the prompt length at prefill.
    k_cache, v_cache: [S, L, KVH, D] bf16, D contiguous; Hq % KVH == 0 and query
        head h reads KV head h // (Hq / KVH). Local index j holds global position
        j * kv_stride + kv_offset (decode-context parallelism over W ranks:
        kv_stride = W, kv_offset = rank; else 1, 0).
    slots: int32 [B], each row's cache slot (in [0, S): not checked, it would sync).
    q_pos: int32 [B] >= 0, global position of row b's query 0; query i is at q_pos[b] + i.
        A query attends to the keys of its slot at global positions <= its own
        (the caller has written the current tokens' keys); positions >= L are never read.
    sm_scale: score scale (usually D ** -0.5).
    out: [B, Q, Hq, D] bf16, contiguous; lse: [B, Q, Hq] fp32, contiguous: the
        natural-log log-sum-exp of the scaled scores, what
        `Communicator.dcp_merge(out.view(B * Q, Hq, D), lse.view(B * Q, Hq), lse_base="e")`
        merges. A query with no key (a DCP rank holding none of its positions) gets
        out = 0, lse = -inf.
    workspace: fp32 1-D, >= `plan_call(q, k_cache).workspace_numel` elements, used
        when the call splits the cache over programs; None uses a buffer the
        launcher keeps per (device, size), allocated on the first call of that size.
    num_splits: None (heuristic, `num_splits_heuristic`) or a forced 1..64: the
        programs that share a row's keys.
    batch_invariant: True (default): a row's out and lse are the same bits whatever
        B is and whatever the other rows hold, and whatever num_splits is (the keys
        are cut by the row's own context, config.SPLIT_KEYS); False: the cut
        follows the heuristic's split count, which follows B (faster above B * KVH
        = 132 by the combine pass, config.py).

    Returns (out, lse). Allocates out / lse when None, and the kept workspace on a
    size's first call: never during capture (CaptureError). No host sync. Legal in
    CUDA graph capture once the shape ran eagerly (compiled, workspace kept) or with
    every buffer given; the grid depends on shapes only. Replays of graphs sharing a
    kept workspace (or the merge's kept counters, MERGE_IN_ATTENTION) must not run
    concurrently on different streams.
    """
    _shapes(q, k_cache, v_cache, slots, q_pos)
    if isinstance(kv_stride, bool) or not isinstance(kv_stride, int) or kv_stride < 1:
        raise LayoutError(f"decode_attention: kv_stride={kv_stride!r}; pass an int >= 1 (the DCP world size, or 1)")
    if isinstance(kv_offset, bool) or not isinstance(kv_offset, int) or not 0 <= kv_offset < kv_stride:
        raise LayoutError(f"decode_attention: kv_offset={kv_offset!r}; pass an int in [0, kv_stride = {kv_stride}) "
                          "(this rank's index in the DCP group)")
    B, Q, Hq, D = q.shape
    dev = q.device
    out = _output("out", out, "[B, Q, Hq, D]", (B, Q, Hq, D), torch.bfloat16, dev)
    lse = _output("lse", lse, "[B, Q, Hq]", (B, Q, Hq), torch.float32, dev)
    cfg = plan_call(q, k_cache, num_splits=num_splits, batch_invariant=batch_invariant)
    ws = _workspace(cfg, workspace, dev)
    if cfg.rows == 0:
        return out, lse
    interpret = dev.type == "cpu"
    wait = ATTENTION_PDL and not interpret
    S, L, KVH, _ = k_cache.shape
    ws_lse_off = cfg.split_slots * cfg.rows * D
    counters = _counters(cfg, dev) if ws is not None and MERGE_IN_ATTENTION else None
    merge = counters is not None
    # the attention grid lets its successor launch once its loops end: the combine, or with
    # the merge in the grid the o projection (as the combine does with COMBINE_LETS_NEXT)
    pdl = ws is not None and not interpret and (COMBINE_LETS_NEXT if merge else COMBINE_PDL)
    attention_kernel[cfg.grid](
        q, k_cache, v_cache, slots, q_pos, out, lse, ws if ws is not None else lse,
        counters if merge else slots,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        Q, L, KVH, cfg.q_blocks, cfg.rows, ws_lse_off, float(sm_scale) * math.log2(math.e), kv_stride, kv_offset,
        cfg.split_keys, G=Hq // KVH, QB=cfg.queries_per_block, HEAD_DIM=D, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, MAX_NS=MAX_SPLITS, SPLIT=ws is not None, INTERPRET=interpret,
        PDL=pdl, WAIT=wait, MERGE=merge, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **(dict(launch_pdl=True) if wait else {}))
    if ws is not None and not merge:
        attention_combine_kernel[(cfg.grid[0],)](
            ws, out, lse, q_pos, cfg.q_blocks, cfg.rows, ws_lse_off, cfg.num_splits, cfg.split_keys, Q, KVH, L,
            kv_stride, kv_offset, G=Hq // KVH, QB=cfg.queries_per_block, HEAD_DIM=D, BLOCK_M=cfg.block_m,
            BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, MAX_NS=MAX_SPLITS, PDL=pdl,
            LET_NEXT=pdl and COMBINE_LETS_NEXT, num_warps=4, **(dict(launch_pdl=True) if pdl else {}))
    return out, lse
