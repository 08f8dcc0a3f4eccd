import pytest
import torch

from sparkinfer.errors import DTypeError, LayoutError, ShapeError
from sparkinfer.rope import launch as rope_launch
from sparkinfer.rope import rope_qk_cache, rotary_table
from sparkinfer.rope.reference import rope_qk_cache_reference

# (T, Hq, KVH, D, R, norm, kv_stride, kv_offset)
CASES = [
    (1, 4, 2, 32, 32, True, 1, 0),
    (6, 4, 4, 64, 32, False, 1, 0),  # partial rotary (GLM-4.5 style)
    (5, 8, 2, 128, 128, True, 2, 1),  # decode-context parallel: odd positions here
    (7, 2, 1, 48, 24, True, 3, 0),
]


@pytest.mark.parametrize("narrow", [False, True], ids=["wide", "narrow"])
@pytest.mark.parametrize("t,hq,kvh,d,r,norm,stride,offset", CASES,
                         ids=[f"t{c[0]}_hq{c[1]}_kv{c[2]}_d{c[3]}_r{c[4]}_s{c[6]}o{c[7]}" for c in CASES])
def test_matches_reference(monkeypatch, t, hq, kvh, d, r, norm, stride, offset, narrow):
    """narrow: head blocks narrowed as on a GPU at few tokens (one head per program)."""
    if narrow:
        monkeypatch.setattr(rope_launch, "_min_programs", lambda device: 1 << 20)
    g = torch.Generator().manual_seed(t * 1000 + d)
    s, length = 3, 16
    qkv = torch.randn(t, (hq + 2 * kvh) * d, generator=g).bfloat16()
    pos = torch.randperm(length * stride, generator=g)[:t].int()
    slots = torch.randint(0, s, (t,), generator=g).int()
    table = rotary_table(r, 10000.0, length * stride, "cpu")
    norms = ((1 + 0.1 * torch.randn(d, generator=g)).bfloat16(),
             (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()) if norm else None
    kc = torch.full((s, length, kvh, d), float("nan"), dtype=torch.bfloat16)
    vc = kc.clone()
    q = rope_qk_cache(qkv, pos, slots, table, (kc, vc), (hq, kvh, d), norms=norms, kv_stride=stride,
                      kv_offset=offset)
    rq, rk, rv = rope_qk_cache_reference(qkv, pos, (hq, kvh, d), (table.cos, table.sin), norms)
    tol = dict(atol=2e-2, rtol=2e-2)
    assert torch.allclose(q.float(), rq, **tol)
    written = torch.zeros(s, length, dtype=torch.bool)
    for i in range(t):
        p = int(pos[i])
        if p % stride != offset:
            continue
        written[slots[i], p // stride] = True
        assert torch.allclose(kc[slots[i], p // stride].float(), rk[i], **tol)
        assert torch.equal(vc[slots[i], p // stride].float(), rv[i])
    assert kc[~written].isnan().all() and vc[~written].isnan().all()  # nothing else touched


def test_rejections():
    table = rotary_table(16, 1e4, 8, "cpu")
    kc = torch.zeros(2, 8, 1, 16, dtype=torch.bfloat16)
    qkv = torch.zeros(1, 64, dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ShapeError, match=r"qkv must be \[T, \(Hq \+ 2 KVH\) D\]"):
        rope_qk_cache(qkv[:, :32], one, one, table, (kc, kc), (2, 1, 16))
    with pytest.raises(DTypeError, match="positions must be int32"):
        rope_qk_cache(qkv, one.long(), one, table, (kc, kc), (2, 1, 16))
    with pytest.raises(LayoutError, match="k_cache"):
        rope_qk_cache(qkv, one, one, table, (kc.float(), kc), (2, 1, 16))
    with pytest.raises(ShapeError, match="rotary_dim must be even"):
        rotary_table(15, 1e4, 8, "cpu")


def test_rejects_what_int32_offsets_cannot_reach():
    """The kernel indexes qkv, q and the table in int32: a qkv whose rows span 2**31
    elements is refused before anything launches (meta tensors: nothing is allocated)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    hq, kvh, d = 2, 1, 16
    qkv = torch.empty_strided((2, (hq + 2 * kvh) * d), (2 ** 30, 1), **meta)
    kc = torch.empty(2, 8, kvh, d, **meta)
    one = torch.zeros(2, dtype=torch.int32, device="meta")
    table = rotary_table(d, 1e4, 8, "meta")
    with pytest.raises(ShapeError, match="qkv spans 2147483648 elements"):
        rope_qk_cache(qkv, one, one, table, (kc, kc), (hq, kvh, d))


def test_a_tokens_bits_do_not_depend_on_the_step(monkeypatch):
    """Head blocks narrowed as on a GPU, at a scale the interpreter runs fast (16
    programs wanted: 1 head a program at T = 1, 2 at T = 8): a token's q and its
    cached k are the same bits either way; the head norm's sum of squares is exact
    (norm.kernel.sum_squares), not a tree over the tile."""
    monkeypatch.setattr(rope_launch, "_min_programs", lambda device: 16)
    hq, kvh, d, t = 2, 1, 32, 8
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(t, (hq + 2 * kvh) * d, generator=g).bfloat16()
    pos = torch.randperm(t, generator=g).int()
    table = rotary_table(d, 10000.0, t, "cpu")
    norms = ((1 + 0.1 * torch.randn(d, generator=g)).bfloat16(), (1 + 0.1 * torch.randn(d, generator=g)).bfloat16())
    caches = [torch.full((2, t, kvh, d), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    q_all = rope_qk_cache(qkv, pos, torch.zeros(t, dtype=torch.int32), table, caches, (hq, kvh, d), norms=norms)
    probe = 5
    one = [torch.full((2, t, kvh, d), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    q_one = rope_qk_cache(qkv[probe:probe + 1], pos[probe:probe + 1], torch.ones(1, dtype=torch.int32), table, one,
                          (hq, kvh, d), norms=norms)
    p = int(pos[probe])
    assert torch.equal(q_one[0].view(torch.int16), q_all[probe].view(torch.int16))
    assert torch.equal(one[0][1, p].view(torch.int16), caches[0][0, p].view(torch.int16))


@pytest.mark.parametrize("block", [1, 4, 8])
def test_row_blocks_across_tokens_give_the_same_bits(monkeypatch, block):
    """Blocks of (token, head) rows that start and end inside a token (3 + 2 heads: a
    block of 4 or 8 holds parts of two or three tokens) give the bits of the widest
    block, q and both caches, every element, poisoned first."""
    hq, kvh, d, t, s = 3, 2, 32, 7, 2
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(t, (hq + 2 * kvh) * d, generator=g).bfloat16()
    pos = torch.randperm(t, generator=g).int()
    slots = torch.randint(0, s, (t,), generator=g).int()
    table = rotary_table(d, 10000.0, t, "cpu")
    norms = ((1 + 0.1 * torch.randn(d, generator=g)).bfloat16(), (1 + 0.1 * torch.randn(d, generator=g)).bfloat16())

    def run():
        caches = [torch.full((s, t, kvh, d), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
        q = rope_qk_cache(qkv, pos, slots, table, caches, (hq, kvh, d), norms=norms)
        return [x.view(torch.int16) for x in (q, *caches)]

    cpu = torch.device("cpu")
    monkeypatch.setattr(rope_launch, "INTERPRETED_BLOCK_ROWS", 32)
    assert rope_launch.rope_block_rows(t * (hq + kvh), d, 1, rope_launch._max_block_rows(cpu)) == 32  # every row
    wide = run()
    monkeypatch.setattr(rope_launch, "INTERPRETED_BLOCK_ROWS", block)
    assert rope_launch.rope_block_rows(t * (hq + kvh), d, 1, rope_launch._max_block_rows(cpu)) == block
    for a, b in zip(run(), wide):
        assert torch.equal(a, b)


def test_block_rows_rule(monkeypatch):
    """Full blocks where enough programs remain; halved toward one row a program at few tokens."""
    assert rope_launch.rope_block_rows(1024 * 36, 128, 128) == rope_launch.MAX_BLOCK_ROWS
    monkeypatch.setattr(rope_launch, "MAX_BLOCK_ROWS", 32)
    assert rope_launch.rope_block_rows(1024 * 36, 128, 128) == 32
    assert rope_launch.rope_block_rows(64 * 36, 128, 128) == 16  # 144 programs
    assert rope_launch.rope_block_rows(36, 128, 128) == 1  # batch 1: one head a program
    assert rope_launch.rope_block_rows(10, 256, 1) == 16  # at most 4,096 elements
    assert rope_launch.rope_block_rows(10 * 36, 64, 1, 64) == 64  # the interpreter's cap
    assert rope_launch._max_block_rows(torch.device("cpu")) == rope_launch.INTERPRETED_BLOCK_ROWS
    assert rope_launch._max_block_rows(torch.device("meta")) == rope_launch.MAX_BLOCK_ROWS
