"""The launch configuration is a pure function of shapes: tiles per GQA group
and query count, the KV-split heuristic at the H200's decode shapes, and the
batch-invariant splits (the cut by a row's own context, the grid by B)."""

import pytest

from sparkinfer.attention import attention_config, num_splits_heuristic
from sparkinfer.attention.config import MAX_SPLITS, SPLIT_KEYS

# (Hq, KVH) of the models the decoder serves at TP = 1, D = 128
QWEN3, GLM_AIR, MIXTRAL = (32, 4), (96, 8), (32, 8)

TILES = {  # Q, Hq, KVH -> block_m, queries per block, query blocks
    "decode-g8": ((1, *QWEN3), (16, 2, 1)),
    "decode-g12": ((1, *GLM_AIR), (16, 1, 1)),
    "decode-g4": ((1, *MIXTRAL), (16, 4, 1)),
    "decode-g1": ((1, 8, 8), (16, 16, 1)),
    "verify-q4-g8": ((4, *QWEN3), (32, 4, 1)),
    "verify-q4-g12": ((4, *GLM_AIR), (64, 5, 1)),
    "prefill-q512-g8": ((512, *QWEN3), (64, 8, 64)),
    "prefill-q512-g12": ((512, *GLM_AIR), (64, 5, 103)),
    "group-128": ((3, 128, 1), (128, 1, 3)),
}


@pytest.mark.parametrize("shape,want", TILES.values(), ids=TILES.keys())
def test_tiles(shape, want):
    q, hq, kvh = shape
    c = attention_config(batch=2, q_len=q, num_q_heads=hq, num_kv_heads=kvh, head_dim=128, cache_len=4096)
    assert (c.block_m, c.queries_per_block, c.q_blocks) == want
    assert c.queries_per_block * (hq // kvh) <= c.block_m and c.q_blocks * c.queries_per_block >= q
    assert c.grid == (2 * kvh * c.q_blocks, c.num_splits)
    one_warpgroup = c.block_m == 16 or (c.q_blocks > 1 and c.block_m <= 64)  # decode and prefill tiles
    assert c.num_warps == (4 if one_warpgroup else 8) and c.block_n == 64 and c.block_d == 128


SPLITS = {  # B, (Hq, KVH), L -> splits on 132 SMs
    "b1-qwen3-8k": (1, QWEN3, 8192, 33),
    "b1-qwen3-1k": (1, QWEN3, 1024, 8),  # capped at L // 128
    "b1-qwen3-100": (1, QWEN3, 100, 1),
    "b8-qwen3-4k": (8, QWEN3, 4096, 5),
    "b32-qwen3-4k": (32, QWEN3, 4096, 2),
    "b64-qwen3-4k": (64, QWEN3, 4096, 1),
    "b1-glm-8k": (1, GLM_AIR, 8192, 17),
    "b16-glm-8k": (16, GLM_AIR, 8192, 2),
    "b17-glm-8k": (17, GLM_AIR, 8192, 1),
    "b1-mixtral-4k": (1, MIXTRAL, 4096, 17),
}


@pytest.mark.parametrize("b,heads,cache_len,want", SPLITS.values(), ids=SPLITS.keys())
def test_decode_splits_fill_the_sms(b, heads, cache_len, want):
    c = attention_config(batch=b, q_len=1, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=128,
                         cache_len=cache_len, batch_invariant=False)
    assert c.num_splits == want and c.split_slots == want and c.split_keys == 0
    programs = c.grid[0] * c.grid[1]
    assert programs < 2 * 132 or c.num_splits == 1  # never more than two programs per SM from splitting
    rows = b * heads[0]
    assert c.workspace_numel == (want * rows * 129 if want > 1 else 0)


def test_heuristic_edges():
    assert num_splits_heuristic(0, 8192) == 1
    assert num_splits_heuristic(1, 1 << 20) == MAX_SPLITS
    assert num_splits_heuristic(131, 8192) == 2 and num_splits_heuristic(132, 8192) == 1
    assert num_splits_heuristic(4, 8192, num_sms=78) == 20  # another GPU's SM count
    assert num_splits_heuristic(4, 127) == 1  # under MIN_SPLIT_KEYS: never split
    assert num_splits_heuristic(4, 8192, q_blocks=2) == 1  # prefill: query blocks, no splits


def test_forced_splits_and_prefill_stays_unsplit():
    c = attention_config(batch=1, q_len=512, num_q_heads=32, num_kv_heads=4, head_dim=128, cache_len=4096)
    assert c.num_splits == 1 and c.grid == (256, 1)  # 4 heads x 64 query blocks
    f = attention_config(batch=1, q_len=1, num_q_heads=32, num_kv_heads=4, head_dim=64, cache_len=64,
                         num_splits=7, batch_invariant=False)
    assert f.num_splits == 7 and f.workspace_numel == 7 * 32 * 65 and f.block_d == 64


INVARIANT = {  # B, (Hq, KVH), L -> (programs per row, partials per row) on 132 SMs
    "b1-qwen3-8k": (1, QWEN3, 8192, (32, 32)),  # 8192 / 256 splits, each its own program
    "b8-qwen3-4k": (8, QWEN3, 4096, (5, 16)),  # the heuristic's 5 programs walk 16 splits
    "b64-qwen3-4k": (64, QWEN3, 4096, (1, 16)),  # one program walks them all; the combine still runs
    "b64-qwen3-576": (64, QWEN3, 576, (1, 3)),  # the decode benchmark's cache (context 512 + 64)
    "b1-glm-32k": (1, GLM_AIR, 32768, (17, MAX_SPLITS)),
    "b4-mixtral-256": (4, MIXTRAL, 256, (1, 1)),  # a cache of one split: never split, at any B
}


@pytest.mark.parametrize("b,heads,cache_len,want", INVARIANT.values(), ids=INVARIANT.keys())
def test_invariant_splits_depend_on_the_cache_not_on_b(b, heads, cache_len, want):
    c = attention_config(batch=b, q_len=1, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=128,
                         cache_len=cache_len)
    assert (c.num_splits, c.split_slots) == want
    assert c.split_keys == (SPLIT_KEYS if want[1] > 1 else 0)
    assert c.workspace_numel == (want[1] * b * heads[0] * 129 if want[1] > 1 else 0)
    for other in (1, 2, 16, 64, 128):  # what a row's partials need is the same at every B
        o = attention_config(batch=other, q_len=1, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=128,
                             cache_len=cache_len)
        assert (o.split_keys, o.split_slots, o.block_m, o.block_n, o.num_warps) == \
            (c.split_keys, c.split_slots, c.block_m, c.block_n, c.num_warps)


def test_invariant_forced_splits_and_query_blocks():
    """A forced split count is capped at a row's partials; prefill (query blocks > 1)
    never splits, so its rows are invariant too."""
    f = attention_config(batch=2, q_len=1, num_q_heads=32, num_kv_heads=4, head_dim=128, cache_len=600,
                         num_splits=7)
    assert (f.num_splits, f.split_slots) == (3, 3)
    p = attention_config(batch=1, q_len=512, num_q_heads=32, num_kv_heads=4, head_dim=128, cache_len=8192,
                         num_splits=4)
    assert (p.num_splits, p.split_slots, p.workspace_numel) == (1, 1, 0)
