"""The tensor-parallel decoder: one rank's share of a MoE model's forward.

Legend: T tokens in a step, B rows (sequences) of Q queries each (T = B * Q),
H hidden, D head dim, Hq_l / KVH_l this rank's query / KV heads, V vocabulary,
W tensor-parallel ranks.

    dec = Decoder(spec, weights, sharding, comm=comm, cache=cache, max_tokens=256)
    logits = dec(step)              # [rows of step.logit_rows, V], bitwise equal on every rank

One layer at a step: qkv projection -> q/k norm + rotary + KV-cache write (one
kernel) -> attention over the cache (with DCP: all heads over this rank's
token share, merged by log-sum-exp) -> o projection (a partial sum per rank)
-> all-reduce + residual + RMSNorm (one kernel) -> routed experts (+ shared
experts) or a dense MLP, partial per rank -> all-reduce + residual + RMSNorm
with the next layer's input norm (the final norm after the last layer; on one
rank the MoE layer's top-k sum runs inside that norm, `RouteSum`).
Every rank holds bitwise the same hidden state after each layer.

Batch invariance (`batch_invariant=True`, the default): a row's logits are the
same bits whatever the other rows of its step hold and however many there are
(decode and verify steps, and prefill forwards of several requests' chunks):
attention cuts a row's keys by its own context, the fused norm keeps rows whole,
the MoE plan never splits a route's reductions, and the projections and routers
run `sparkinfer.linear` in decode and verify steps and `sparkinfer.linear.gemm` in
prefill forwards, the LM head `linear` in every step (each a sum order per weight
at any row count). With
`batch_invariant=False` the projections take cuBLAS instead, whose kernel (and sum
order) follows the row count: on an H200 at 3c3e10b the invariant projections cost
+48 us of a 795 us Qwen3-30B-A3B step at batch 1 and most of its +41% at batch 64
(`bench decode --invariance both`, benchmarks/results/decode_h200.json).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparkinfer.attention import decode_attention
from sparkinfer.errors import CapacityError, ShapeError
from sparkinfer.layers.aux_stream import CudaStreamOps, moe_with_shared_experts
from sparkinfer.linear import gemm, linear, linear_sync
from sparkinfer.models.torch_ops import TorchOps
from sparkinfer.models.weights import DenseMLPWeights, ExpertWeights, ModelWeights, Sharding
from sparkinfer.moe import MoECaps, MoELayer, MoESpec, RouteSum, plan_supports_aux_stream_overlap
from sparkinfer.norm import add_rms_norm, rms_norm
from sparkinfer.rope import rope_qk_cache, rotary_table
from sparkinfer.runtime.devices import cuda_sm_count

__all__ = ["Step", "KVCache", "Decoder", "moe_layer", "prepare_moe"]


@dataclass(frozen=True)
class Step:
    """The inputs of one forward: B rows of Q consecutive positions each.

    tokens: int64 [T]; positions, slots: int32 [T] (global position and cache slot
    of each token); row_slots, q_pos: int32 [B] (each row's slot and first
    position); q_len: Q; logit_rows: int64 [N] rows of T whose logits are wanted,
    or None for all T. decode_rows: D > 0 makes a mixed step: the first D tokens are
    D decode rows of one token, then (B - D) rows of Q (logit_rows given, its first D
    the decode rows); each kind of row gets the bits it gets in a step of its own kind.
    For CUDA graphs keep every tensor at a fixed address.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    row_slots: torch.Tensor
    q_pos: torch.Tensor
    q_len: int
    logit_rows: torch.Tensor | None = None
    decode_rows: int = 0


class KVCache:
    """k, v: [layers, S, L, KVH_l, D] bf16 for S slots of L local positions (with
    decode-context parallelism L = ceil(max_len / W): position p at p // W on rank
    p % W). Allocated once; zeroed so a stale read is finite."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 sharding: Sharding, device):
        self.max_len, self.slots = max_len, slots
        local = -(-max_len // sharding.dcp)
        shape = (layers, slots, local, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.v = torch.zeros(shape, dtype=torch.bfloat16, device=device)


def _moe_spec(spec, fmt: str) -> MoESpec:
    grouped = spec.routing == "sigmoid_grouped"
    return MoESpec(weight_format=fmt, activation="silu", gate_up_order="gate_up", routing=spec.routing,
                   renormalize=spec.renormalize, n_group=spec.n_group if grouped else 1,
                   topk_group=spec.topk_group if grouped else 1,
                   routed_scaling_factor=spec.routed_scaling_factor)


def moe_layer(spec, m: ExpertWeights, *, moe_format: str, max_tokens: int, num_sms: int,
              batch_invariant: bool, share_scratch: MoELayer | None = None) -> MoELayer:
    """The `MoELayer` of one layer's loaded experts `m` (plans, prepares a copy of the
    weights the kernels read; share_scratch: an earlier layer of the model, whose
    scratch it reuses). Allocates; not capture-legal."""
    caps = MoECaps(max_tokens=max_tokens, num_experts=spec.num_experts, top_k=spec.top_k,
                   hidden=spec.hidden, intermediate=_local_inter(m), tp_rank=0, tp_size=1,
                   num_sms=num_sms, batch_invariant=batch_invariant)
    bias = m.correction_bias.float() if m.correction_bias is not None else None
    return MoELayer(caps, _moe_spec(spec, moe_format), (m.w1, m.w2), device=m.router.device, bias=bias,
                    share_scratch=share_scratch)


def _fp32_routers(spec, weights: ModelWeights) -> None:
    """GLM-4.5's routers in fp32, as transformers routes them (sigmoid_grouped)."""
    for lw in weights.layers:
        if isinstance(lw.mlp, ExpertWeights) and spec.routing == "sigmoid_grouped":
            lw.mlp.router = lw.mlp.router.float()


def prepare_moe(spec, weights: ModelWeights, *, moe_format: str, max_tokens: int, batch_invariant: bool,
                release: bool = True) -> list:
    """Each layer's `MoELayer` (None for dense layers), made one layer at a time, for
    `Decoder(share_moe=...)`. release: after each, that layer's loaded experts become meta
    tensors of the same shapes (the MoE layer holds the copy its kernels read), so their
    memory returns before the next layer is prepared. Without it a model holds its experts
    twice: Mixtral-8x7B at 32 layers 93 GB of weights plus 60 GB of prepared gate/up
    copies, more than one H200. Released weights cannot build another decoder (ops="torch"
    reads them). The layers share one scratch (they run one after another; `allocate_scratch`).
    Allocates; not capture-legal."""
    dev = weights.final_norm.device
    # the interpreter runs programs one after another: on the CPU one "SM" plans the fewest programs
    num_sms = cuda_sm_count(dev) if dev.type == "cuda" else 1
    out, first = [], None  # first: the MoE layer whose scratch the later ones share
    for lw in weights.layers:
        m = lw.mlp
        if not isinstance(m, ExpertWeights):
            out.append(None)
            continue
        out.append(moe_layer(spec, m, moe_format=moe_format, max_tokens=max_tokens, num_sms=num_sms,
                             batch_invariant=batch_invariant, share_scratch=first))
        first = first or out[-1]
        if release:
            m.w1, m.w2 = _on_meta(m.w1), _on_meta(m.w2)
    _fp32_routers(spec, weights)
    return out


def _on_meta(t):
    """A tensor (or NVFP4Tensor) of t's shape and dtype on the meta device: no memory."""
    from sparkinfer.quant.nvfp4 import NVFP4Tensor

    if isinstance(t, NVFP4Tensor):
        return NVFP4Tensor(*(_on_meta(x) for x in (t.packed, t.scales, t.global_scale)))
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class Decoder:
    """One rank of a tensor-parallel decoder.

    spec: `ModelSpec`; weights: this rank's `ModelWeights`; sharding: its `Sharding`;
    comm: a `Communicator` over the W ranks (None when W = 1); cache: `KVCache`;
    max_tokens: the largest T of any step (sizes the MoE plan and scratch);
    moe_format: "bf16" or "nvfp4" (must match the loaded expert weights);
    ops: "sparkinfer" (our kernels) or "torch" (`TorchOps`: SDPA, `torch._grouped_mm`,
    torch norms, NCCL all-reduces; the benchmark's baseline, bf16 experts only);
    share_moe: another decoder's `moe` list whose layers this one reuses (a
    self-draft: the target's first layers, planned and prepared once; steps of
    the two must not run concurrently, as they share scratch).
    batch_invariant: True (default): a row's logits do not depend on the other rows
    of a step (module docstring); False: the faster batch-dependent choices of
    attention splits, norm pieces and MoE reduction splits. Shared MoE layers keep
    the choice of the decoder that planned them.
    Construction plans the MoE layers and prepares their weights: not capture-legal.
    """

    def __init__(self, spec, weights: ModelWeights, sharding: Sharding, *, comm=None, cache: KVCache,
                 max_tokens: int, moe_format: str = "bf16", ops: str = "sparkinfer", share_moe=None,
                 batch_invariant: bool = True):
        if sharding.world > 1 and comm is None:
            raise ShapeError(f"a decoder over {sharding.world} ranks needs a Communicator (comm=None given)")
        if ops not in ("sparkinfer", "torch") or (ops == "torch" and moe_format != "bf16"):
            raise ShapeError(f"ops={ops!r} with moe_format={moe_format!r}: use 'sparkinfer', or 'torch' with bf16")
        self.spec, self.w, self.sh, self.comm, self.cache = spec, weights, sharding, comm, cache
        self.torch_ops = TorchOps(spec, comm) if ops == "torch" else None
        self.max_tokens = max_tokens
        self.batch_invariant = batch_invariant
        dev = weights.final_norm.device
        self.device = dev
        d = spec.head_dim
        self.heads_l = weights.layers[0].attn.o.shape[1] // d  # Hq_l
        self.table = rotary_table(spec.rotary_dim, spec.rope_theta, cache.max_len, dev)
        self.scale = d ** -0.5
        if share_moe is not None:
            self.moe: list[MoELayer | None] = [share_moe[i] for i in range(len(weights.layers))]
        elif self.torch_ops is not None:
            self.moe = [None] * len(weights.layers)
            _fp32_routers(spec, weights)
        else:
            self.moe = prepare_moe(spec, weights, moe_format=moe_format, max_tokens=max_tokens,
                                   batch_invariant=batch_invariant, release=False)
        # split-K semaphores of the projections, one per weight (`linear_sync`)
        self._sync = {} if self.torch_ops is not None else \
            {w.data_ptr(): linear_sync(w) for w in _projections(weights)}
        self._moe_out = torch.empty((max_tokens, spec.hidden), dtype=torch.bfloat16, device=dev)
        # shared experts overlap the routed ones on an auxiliary stream (GPU only; the
        # switch is for A/B runs and debugging)
        self.overlap_shared = dev.type == "cuda"
        self._prefill = False  # set by each forward: prefill forwards take `gemm` (see `_linear`)
        self._split = 0  # set by each forward: a mixed step's decode rows (see `_linear`)
        self._aux = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._streams = CudaStreamOps(dev) if dev.type == "cuda" else None

    # ------------------------------------------------------------------ pieces
    def _norm(self, partial, residual, weight):
        """(normed, residual_out) = the all-reduce of the partial sums + residual, RMSNorm."""
        eps = self.spec.rms_eps
        if self.torch_ops is not None:
            return self.torch_ops.norm(partial, residual, weight, eps)
        if isinstance(partial, RouteSum):  # a MoE layer's top-k sum, run inside this norm
            return partial.add_rms_norm(residual, weight, eps)
        if self.sh.world == 1:
            return add_rms_norm(partial, residual, weight, eps)
        return self.comm.all_reduce_add_rms_norm(partial, residual, weight, eps, batch_invariant=self.batch_invariant)

    def _embed(self, tokens):
        w = self.w
        if self.sh.world == 1:
            h = F.embedding(tokens, w.embed)
            return rms_norm(h, w.layers[0].input_norm, self.spec.rms_eps), h
        local = tokens - w.vocab_start
        mine = (local >= 0) & (local < w.embed.shape[0])
        part = F.embedding(torch.where(mine, local, 0), w.embed) * mine[:, None].to(w.embed.dtype)
        return self._norm(part, torch.zeros_like(part), w.layers[0].input_norm)

    def _attention(self, i: int, x, step: Step):
        a, spec, sh = self.w.layers[i].attn, self.spec, self.sh
        d, t = spec.head_dim, x.shape[0]
        qkv = self._linear(x, a.qkv, a.qkv_bias)
        norms = (a.q_norm, a.k_norm) if a.q_norm is not None else None
        caches = (self.cache.k[i], self.cache.v[i])
        ops = self.torch_ops
        rope_fn = ops.rope_qk_cache if ops is not None else rope_qk_cache
        attend = ops.attention if ops is not None else decode_attention
        q = rope_fn(qkv, step.positions, step.slots, self.table, caches, (self.heads_l, a.kv_heads, d),
                          norms=norms, eps=spec.rms_eps, kv_stride=sh.dcp, kv_offset=sh.rank if sh.dcp > 1 else 0)
        b = step.row_slots.shape[0]
        if step.decode_rows:  # a mixed step: its decode rows, then its rows of Q, into one buffer
            n, h = step.decode_rows, self.heads_l
            out = torch.empty((t, h, d), dtype=torch.bfloat16, device=self.device)
            lse = torch.empty((t, h), dtype=torch.float32, device=self.device)
            for lo, hi, rows, ql in ((0, n, slice(0, n), 1), (n, t, slice(n, b), step.q_len)):
                r = rows.stop - rows.start
                attend(q[lo:hi].view(r, ql, h, d), *caches, step.row_slots[rows], step.q_pos[rows],
                       sm_scale=self.scale, out=out[lo:hi].view(r, ql, h, d), lse=lse[lo:hi].view(r, ql, h),
                       batch_invariant=self.batch_invariant)
            out = out.view(t, h * d)
        elif sh.dcp == 1:
            out, _ = attend(q.view(b, step.q_len, self.heads_l, d), *caches, step.row_slots, step.q_pos,
                            sm_scale=self.scale, **self._attn_out(b, step.q_len, self.heads_l))
            out = out.view(t, self.heads_l * d)
        else:
            nccl = dict(algorithm="nccl") if ops is not None else {}  # the baseline gathers and merges by NCCL
            q_all = self.comm.all_gather_heads(q, **nccl)  # [T, Hq, D]
            hq = q_all.shape[1]
            part, lse = attend(q_all.view(b, step.q_len, hq, d), *caches, step.row_slots, step.q_pos,
                               sm_scale=self.scale, kv_stride=sh.dcp, kv_offset=sh.rank,
                               **self._attn_out(b, step.q_len, hq))
            out = self.comm.dcp_merge(part.view(t, hq, d), lse.view(t, hq), scatter_heads=True, **nccl)
            out = out.reshape(t, self.heads_l * d)
        return self._linear(out, a.o)

    def _linear(self, x, w, bias=None):
        """A projection (attention, MLPs, routers), a row's result the same bits in
        any batch: `sparkinfer.linear` in decode and verify steps, `gemm` in prefill
        forwards (a 16-bit weight; GLM's fp32 router: `linear` on 128-row pieces, a few
        MB). cuBLAS for the torch ops and when batch_invariant is False (faster at every
        measured batch; its sums follow the row count)."""
        if self.torch_ops is not None or not self.batch_invariant:
            return F.linear(x.to(w.dtype), w, bias)
        if self._split and w.dtype != torch.float32:  # a mixed step: each kind of row as in its own step
            d = self._split
            out = torch.empty((x.shape[0], w.shape[0]), dtype=w.dtype, device=x.device)
            linear(x[:d], w, bias, out=out[:d], sync=self._sync.get(w.data_ptr()), invariant=True)
            gemm(x[d:], w, bias, out=out[d:])
            return out
        if self._prefill and w.dtype != torch.float32:
            return gemm(x, w, bias)
        return linear(x, w, bias, sync=self._sync.get(w.data_ptr()), invariant=True)

    def _head(self, x):
        """The LM head of the rows that want logits: `linear` in every kind of step. A
        prefill forward has one such row per chunk, decode-sized, and a mixed step's
        decode rows and chunk rows then share one pass over the head (Qwen3-30B-A3B's
        622 MB) instead of a second one by `gemm` for its chunks."""
        w = self.w.lm_head
        if self.torch_ops is not None or not self.batch_invariant:
            return F.linear(x.to(w.dtype), w)
        return linear(x, w, sync=self._sync.get(w.data_ptr()), invariant=True)

    def _attn_out(self, b: int, q: int, heads: int) -> dict:
        """out / lse buffers of one attention call (the kernel refuses to allocate them during
        a capture; here they come from the graph's pool), and the batch-invariance switch.
        Nothing for the torch ops."""
        if self.torch_ops is not None:
            return {}
        d = self.spec.head_dim
        return dict(out=torch.empty((b, q, heads, d), dtype=torch.bfloat16, device=self.device),
                    lse=torch.empty((b, q, heads), dtype=torch.float32, device=self.device),
                    batch_invariant=self.batch_invariant)

    def _dense(self, m: DenseMLPWeights, x):
        """SiLU-gated MLP: the down projection applies silu(gate) * up as it loads its input."""
        if self.torch_ops is not None or not self.batch_invariant:
            g, u = F.linear(x, m.gate_up).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, m.down)
        gate_up = self._linear(x, m.gate_up)  # [T, 2 I_l]
        d = self._split if self._prefill else gate_up.shape[0]  # rows of the gated decode kernel
        out = torch.empty((gate_up.shape[0], m.down.shape[0]), dtype=m.down.dtype, device=x.device)
        if d:
            linear(gate_up[:d], m.down, out=out[:d], sync=self._sync.get(m.down.data_ptr()), gated=True,
                   invariant=True)
        if d < gate_up.shape[0]:
            g, u = gate_up[d:].chunk(2, dim=-1)
            gemm(F.silu(g) * u, m.down, out=out[d:])  # rounded as `linear`'s gated load rounds it
        return out

    def _mlp(self, i: int, x):
        m = self.w.layers[i].mlp
        if isinstance(m, DenseMLPWeights):
            return self._dense(m, x)
        out = self._moe_out[:x.shape[0]]

        def router(h):  # GLM-4.5's fp32 router upcasts h inside the kernel
            return self._linear(h, m.router)

        def routed(h, logits):
            if self.torch_ops is not None:
                return self.torch_ops.moe(h, logits, m, m.correction_bias, out)
            # one rank: the top-k sum waits for the norm after the layer (`RouteSum`); ranks
            # all-reduce the summed output first
            return self.moe[i](h, logits, out=out, reduce=self.sh.world > 1)
        if m.shared is None:
            return routed(x, router(x))
        safe = self.torch_ops is not None or plan_supports_aux_stream_overlap(self.moe[i].plan)
        return moe_with_shared_experts(x, router=router, routed=routed, shared=lambda h: self._dense(m.shared, h),
                                       overlap_safe=safe, streams=self._streams, aux=self._aux,
                                       enabled=self.overlap_shared)

    # ------------------------------------------------------------------ forward
    def __call__(self, step: Step) -> torch.Tensor:
        """Logits [N, V] (bf16) of step.logit_rows (all T rows if None), the same bits
        on every rank. Writes this step's keys and values into the cache. No host
        sync; capture-legal (torch ops allocate from the graph's pool)."""
        t = step.tokens.shape[0]
        self._prefill = step.logit_rows is not None  # a prefill forward (chunks), not decode rows
        self._split = step.decode_rows
        if self._split and (self._prefill is False or self.sh.dcp > 1 or self.torch_ops is not None):
            raise ShapeError("a mixed step (decode_rows > 0) needs logit_rows, DCP 1 and our kernels")
        if t > self.max_tokens:
            raise CapacityError(f"step of {t} tokens exceeds the decoder's max_tokens={self.max_tokens}; "
                                "prefill in chunks or build the decoder with a larger max_tokens")
        layers = self.w.layers
        x, residual = self._embed(step.tokens)
        for i, lw in enumerate(layers):
            x, residual = self._norm(self._attention(i, x, step), residual, lw.post_attn_norm)
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm
            x, residual = self._norm(self._mlp(i, x), residual, nxt)
        if step.logit_rows is not None:
            if step.logit_rows.numel() == 0:  # a prefill chunk that is not its prompt's last: no LM head
                return x.new_empty((0, self.spec.vocab_size))
            x = x.index_select(0, step.logit_rows)
        logits = self._head(x)  # [N, V_l]
        if self.sh.world > 1:
            n, v_l = logits.shape
            logits = self.comm.all_gather(logits).view(self.sh.world, n, v_l).transpose(0, 1).reshape(n, -1)
        return logits[:, :self.spec.vocab_size]


def _projections(weights: ModelWeights):
    """The weights `Decoder._linear` multiplies by: attention, dense MLPs, routers, shared
    experts, the LM head."""
    yield weights.lm_head
    for lw in weights.layers:
        yield lw.attn.qkv
        yield lw.attn.o
        m = lw.mlp
        dense = [m] if isinstance(m, DenseMLPWeights) else [m.shared] if m.shared is not None else []
        if isinstance(m, ExpertWeights):
            yield m.router
        for d in dense:
            yield d.gate_up
            yield d.down


def _local_inter(m: ExpertWeights) -> int:
    """I_l of a rank's expert weights: w2 is [E, H, I_l] (an NVFP4Tensor reports its logical shape)."""
    return int(m.w2.shape[-1])
