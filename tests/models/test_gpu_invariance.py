"""Batch invariance on a GPU (skipped without CUDA or under the interpreter; run
with `TRITON_INTERPRET=0 pytest -q tests/models/test_gpu_invariance.py`): a probe
row's bits alone and beside random rows, at every decode bucket.

Kernels, at the H200 decode shapes: attention (Qwen3-30B-A3B and GLM-4.5-Air
heads, a cache of 4096 positions: the probe's 3000 keys in 12 splits; decode and
verify queries; forced program counts), the MoE layer (Qwen3-30B-A3B and Mixtral
dims, bf16 and NVFP4, T = 1..256: micro, grouped at block_m 16 / 32 / 64, the wide
bf16 tiles), the fused norm over the LL and the flag kernel (one rank), rope.
The decoder: Qwen3-30B-A3B dimensions, 8 layers, random weights as `bench decode`
makes them, TP 1, one CUDA graph per bucket 1..64, a 300-token probe (2 attention
splits) over 4 decode steps beside random rows and padding rows, in two variants:
"rowwise", the projections and the LM head one row at a time (cuBLAS at M = 1),
which checks every other kernel alone; "decoder", everything as the decoder runs
it (`sparkinfer.linear` for every projection, router and the LM head up to 128
rows).
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from sparkinfer.attention import decode_attention
from sparkinfer.models.decoder import Step
from sparkinfer.moe import MoECaps, MoELayer, MoESpec

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _diff(a, b) -> str:
    bad = _bits(a) != _bits(b)
    return f"{int(bad.sum())} of {bad.numel()} differ, max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("heads,q_len", [((32, 4), 1), ((96, 8), 1), ((32, 4), 4)],
                         ids=["qwen3-decode", "glm-air-decode", "qwen3-verify-q4"])
def test_attention_probe_row(heads, q_len):
    hq, kvh = heads
    d, length, slots = 128, 4096, max(BUCKETS) + 1
    g = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(slots, length, kvh, d, generator=g, device="cuda").bfloat16()
    v = torch.randn(slots, length, kvh, d, generator=g, device="cuda").bfloat16()
    probe_q = torch.randn(q_len, hq, d, generator=g, device="cuda").bfloat16()

    def run(b, seed, **kw):
        gg = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(b, q_len, hq, d, generator=gg, device="cuda").bfloat16()
        row = seed % b
        q[row] = probe_q
        slot = torch.randperm(slots - 1, generator=gg, device="cuda")[:b].int() + 1
        slot[row] = 0
        pos = torch.randint(0, length - q_len, (b,), generator=gg, device="cuda").int()
        pos[row] = 3000
        out, lse = decode_attention(q, k, v, slot, pos, sm_scale=d ** -0.5, **kw)
        return out[row], lse[row]

    want = run(1, 0)
    bad = [(b, n, _diff(x, y)) for b in BUCKETS for n, x, y in zip(("out", "lse"), run(b, b + 7), want)
           if not torch.equal(_bits(x), _bits(y))]
    bad += [(f"B 8 forced {ns}", n, _diff(x, y)) for ns in (1, 3, 12)
            for n, x, y in zip(("out", "lse"), run(8, 15, num_splits=ns), want) if not torch.equal(_bits(x), _bits(y))]
    assert not bad, bad


# ---------------------------------------------------------------- MoE layer


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("dims", [(128, 8, 2048, 768), (8, 2, 4096, 14336)], ids=["qwen3", "mixtral"])
def test_moe_probe_token(dims, fmt):
    """T = 1..4096 cross micro (<= 16) and grouped tiles (Mixtral bf16: block_m 16, 32, then
    the wide 64 tiles; NVFP4 16..128 at BN1 128 from BM 64) and, for NVFP4, the bf16 tiles on
    decoded copies (forced at T 4096; planned from 2,048 routed rows an expert); fp8_block: micro, then grouped
    (BM 128 under plan.FP8_RESCALE); the probe token's output must not move."""
    from sparkinfer.quant import quantize_nvfp4
    from sparkinfer.quant.fp8 import quantize_fp8_block

    e, k, h, i = dims
    caps = MoECaps(max_tokens=4096, num_experts=e, top_k=k, hidden=h, intermediate=i)
    g = torch.Generator(device="cuda").manual_seed(2)
    w1 = torch.randn(e, 2 * i, h, generator=g, device="cuda") / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g, device="cuda") / i ** 0.5
    quantize = {"nvfp4": quantize_nvfp4, "fp8_block": quantize_fp8_block}.get(fmt, torch.Tensor.bfloat16)
    ws = (quantize(w1), quantize(w2))
    del w1, w2
    layer = MoELayer(caps, MoESpec(weight_format=fmt), ws, device="cuda")
    probe = (torch.randn(h, generator=g, device="cuda").bfloat16(),
             (2 * torch.randn(e, generator=g, device="cuda")).bfloat16())

    def run(t):
        gg = torch.Generator(device="cuda").manual_seed(t)
        x = torch.randn(t, h, generator=gg, device="cuda").bfloat16()
        logits = (2 * torch.randn(t, e, generator=gg, device="cuda")).bfloat16()
        x[t // 2], logits[t // 2] = probe
        return layer(x, logits)[t // 2]

    want = run(1)
    tiles = {t: (c.family, c.block_m, c.block_k, c.dequant_experts) for t, c in layer.plan.buckets}
    bad = [(t, tiles.get(t), _diff(got, want)) for t in (2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
           if not torch.equal(_bits(got := run(t)), _bits(want))]
    assert not bad, bad
    if fmt == "nvfp4":  # and the copies (planned from 2,048 rows an expert) at T 4096
        from sparkinfer.moe import allocate_scratch
        from sparkinfer.moe.tuning import _other_nvfp4_path

        name, cfg = _other_nvfp4_path(layer.plan, 4096)
        assert name == "dequant" and cfg.dequant_experts > 0
        layer.plan = layer.plan.forced(cfg)
        layer.scratch = allocate_scratch(layer.plan, "cuda")
        got = run(4096)
        assert torch.equal(_bits(got), _bits(want)), _diff(got, want)


# ---------------------------------------------------------------- fused norm (one rank), rope


def _norm_rows(world, hidden: int) -> list:
    """On one rank: the last row of x [T, H] at each T over the LL and the flag kernel;
    what differs from T = 1, auto."""
    from sparkinfer.comm import Communicator

    comm = Communicator(capacity_bytes=64 << 20)
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        n = 256
        x, res = (torch.randn(n, hidden, generator=g, device="cuda").bfloat16() for _ in range(2))
        w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).bfloat16()
        runs = {(t, a): comm.all_reduce_add_rms_norm(x[n - t:], res[n - t:], w, 1e-6, algorithm=a)
                for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) for a in ("auto", "fused", "fused_ll")
                if not (a == "fused_ll" and t * hidden * 2 > 512 << 10)}
        want = runs[(1, "auto")]
        return [(key, name, _diff(o[-1], ref[-1])) for key, outs in runs.items()
                for name, o, ref in zip(("out", "residual_out"), outs, want)
                if not torch.equal(_bits(o[-1]), _bits(ref[-1]))]
    finally:
        comm.close()


@pytest.mark.parametrize("hidden", [2048, 4096])
def test_fused_norm_probe_row_over_both_kernels(hidden):
    """Whole rows at every T, over the flag kernel and the LL one (the byte size picks
    between them): one rank, so the sum over ranks is the row itself."""
    from sparkinfer.runtime import run_ranks

    (bad,) = run_ranks(_norm_rows, 1, backend="cuda", args=(hidden,), timeout_s=300)
    assert not bad, bad


def test_rope_token_at_every_step_size():
    from sparkinfer.rope import rope_qk_cache, rotary_table

    hq, kvh, d, t = 32, 4, 128, 64
    g = torch.Generator(device="cuda").manual_seed(4)
    qkv = torch.randn(t, (hq + 2 * kvh) * d, generator=g, device="cuda").bfloat16()
    pos = torch.arange(t, device="cuda").int()
    table = rotary_table(d, 1e6, t, "cuda")
    norms = tuple((1 + 0.1 * torch.randn(d, generator=g, device="cuda")).bfloat16() for _ in range(2))
    caches = [torch.zeros(2, t, kvh, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    q_all = rope_qk_cache(qkv, pos, torch.zeros(t, dtype=torch.int32, device="cuda"), table, caches,
                          (hq, kvh, d), norms=norms)
    for n in (1, 2, 8):  # 1 or 2 heads a program against the 32 of T = 64 (launch.py)
        one = [torch.zeros_like(c) for c in caches]
        q = rope_qk_cache(qkv[:n], pos[:n], torch.ones(n, dtype=torch.int32, device="cuda"), table, one,
                          (hq, kvh, d), norms=norms)
        assert torch.equal(_bits(q), _bits(q_all[:n])), n
        assert torch.equal(_bits(one[0][1, :n]), _bits(caches[0][0, :n])), n


# ---------------------------------------------------------------- the decoder, CUDA graphs


PROMPT, STEPS, MAX_BATCH, MAX_LEN = 300, 4, max(BUCKETS), 320
PROBE_SLOT, PAD_SLOT = 0, max(BUCKETS)


@pytest.fixture(scope="module")
def qwen3():
    """Our decoder on Qwen3-30B-A3B dims, 8 layers, random weights (bench decode's model)."""
    from sparkinfer.bench.decode_model import hf_model
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.decoder import Decoder, KVCache
    from sparkinfer.models.loader import load_weights
    from sparkinfer.models.tensor_source import TensorSource
    from sparkinfer.models.weights import Sharding

    model, cfg = hf_model("qwen3-30b-a3b", 8, torch.device("cuda"))
    spec = load_spec(cfg)
    weights = load_weights(TensorSource(model.state_dict()), spec, Sharding(), device="cuda", moe_format="bf16")
    del model
    torch.cuda.empty_cache()
    cache = KVCache(spec.num_layers, MAX_BATCH + 1, MAX_LEN, weights.layers[0].attn.kv_heads, spec.head_dim,
                    Sharding(), "cuda")
    return Decoder(spec, weights, Sharding(), cache=cache, max_tokens=512)


class _Graph:
    """One bucket's decode step captured with fixed input buffers (padding rows while warming up)."""

    def __init__(self, dec, b: int):
        i32 = dict(dtype=torch.int32, device="cuda")
        self.tokens = torch.zeros(b, dtype=torch.int64, device="cuda")
        self.pos, self.slots = torch.zeros(b, **i32), torch.full((b,), PAD_SLOT, **i32)
        step = Step(tokens=self.tokens, positions=self.pos, slots=self.slots, row_slots=self.slots, q_pos=self.pos,
                    q_len=1)
        dec(step)  # compiles, keeps the attention workspace; writes only the padding slot
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = dec(step)

    def __call__(self, tokens, pos, slots):
        self.tokens.copy_(torch.as_tensor(tokens))
        self.pos.copy_(torch.as_tensor(pos, dtype=torch.int32))
        self.slots.copy_(torch.as_tensor(slots, dtype=torch.int32))
        self.graph.replay()
        return self.out


def _rowwise(x, w, bias=None, **_):
    """x @ w.T one row at a time (cuBLAS at M = 1 for every row: a row-invariant projection)."""
    return torch.cat([F.linear(x[i:i + 1], w, bias) for i in range(x.shape[0])])


class _RowwiseF:
    """torch.nn.functional with a row-at-a-time linear (the decoder's LM head)."""

    linear = staticmethod(_rowwise)

    def __getattr__(self, name):
        return getattr(F, name)


@pytest.mark.parametrize("projections", ["rowwise", "decoder"])
def test_decoder_probe_logits_at_every_bucket(qwen3, monkeypatch, projections):
    dec = qwen3
    mod = sys.modules["sparkinfer.models.decoder"]
    if projections == "rowwise":
        monkeypatch.setattr(mod, "linear", _rowwise)
    if projections != "decoder":
        monkeypatch.setattr(mod, "F", _RowwiseF())
    buckets = BUCKETS
    g = torch.Generator().manual_seed(5)
    vocab = dec.spec.vocab_size
    prompt = torch.randint(0, vocab, (PROMPT,), generator=g)
    tokens = torch.randint(0, vocab, (STEPS,), generator=g).tolist()
    with torch.no_grad():
        i32 = dict(dtype=torch.int32, device="cuda")
        dec(Step(tokens=prompt.cuda(), positions=torch.arange(PROMPT, **i32), slots=torch.zeros(PROMPT, **i32),
                 row_slots=torch.zeros(1, **i32), q_pos=torch.zeros(1, **i32), q_len=PROMPT,
                 logit_rows=torch.tensor([PROMPT - 1], device="cuda")))
        saved = [c[:, PROBE_SLOT].clone() for c in (dec.cache.k, dec.cache.v)]
        graphs = {b: _Graph(dec, b) for b in buckets}
        alone = [graphs[1]([t], [PROMPT + i], [PROBE_SLOT])[0].clone() for i, t in enumerate(tokens)]
        bad = []
        for b in buckets[1:]:
            for c, s in zip((dec.cache.k, dec.cache.v), saved):
                c[:, PROBE_SLOT].copy_(s)
            pad = int(torch.randint(0, b // 4 + 1, (1,), generator=g))
            others = (1 + torch.randperm(MAX_BATCH - 1, generator=g))[: b - 1 - pad].tolist()
            for c in (dec.cache.k, dec.cache.v):  # the neighbours' contexts: random keys and values
                c[:, others] = torch.randn(c[:, others].shape, device="cuda").bfloat16()
            row = int(torch.randint(0, b, (1,), generator=g))
            slots = others + [PAD_SLOT] * pad
            q_pos = torch.randint(1, MAX_LEN - STEPS, (len(others),), generator=g).tolist() + [0] * pad
            slots.insert(row, PROBE_SLOT)
            q_pos.insert(row, PROMPT)
            for i, t in enumerate(tokens):
                toks = torch.randint(0, vocab, (b,), generator=g).tolist()
                toks[row] = t
                got = graphs[b](toks, [p + (i if s != PAD_SLOT else 0) for p, s in zip(q_pos, slots)], slots)
                if not torch.equal(_bits(got[row]), _bits(alone[i])):
                    bad.append((b, row, pad, i, _diff(got[row], alone[i])))
        del graphs
    assert not bad, f"(B, probe row, padding rows, step, logits): {bad}"
