"""Per-rank loading: the ranks' shards put back together are transformers' weights, exactly."""

import json

import pytest
import torch
from safetensors.torch import save_file

from sparkinfer.errors import CheckpointError, ShapeError
from sparkinfer.models import Checkpoint, HeadShard, Sharding, head_shard, load_spec, load_weights
from sparkinfer.models.experts import load_routed
from sparkinfer.models.presets import preset_config
from tests.models.conftest import PRESETS

SHARDINGS = [(1, 1), (2, 1), (3, 1), (2, 2), (3, 3)]  # (world, dcp)


def load_all(path, world, dcp=1, **kw):
    spec = load_spec(path)
    with Checkpoint(path) as ckpt:
        return spec, [load_weights(ckpt, spec, Sharding(r, world, dcp), **kw) for r in range(world)]


def split_qkv(attn, spec, q_heads):
    d = spec.head_dim
    q, k, v = attn.qkv.split([q_heads * d, attn.kv_heads * d, attn.kv_heads * d])
    return q, k, v


def check_dense(mlp_ranks, hf_mlp):
    gates, ups = zip(*(m.gate_up.chunk(2) for m in mlp_ranks))
    assert torch.equal(torch.cat(gates), hf_mlp.gate_proj.weight)
    assert torch.equal(torch.cat(ups), hf_mlp.up_proj.weight)
    assert torch.equal(torch.cat([m.down for m in mlp_ranks], dim=1), hf_mlp.down_proj.weight)


@pytest.mark.parametrize("world,dcp", SHARDINGS, ids=[f"W{w}-dcp{d}" for w, d in SHARDINGS])
@pytest.mark.parametrize("preset", PRESETS)
def test_shards_rebuild_transformers_weights(preset, world, dcp, ckpt_dir, hf_model):
    spec, ranks = load_all(ckpt_dir(preset), world, dcp)
    hf = hf_model(preset)
    v, h = spec.vocab_size, spec.hidden
    vl = -(-v // world)
    for r, w in enumerate(ranks):
        assert w.vocab_start == r * vl and w.embed.shape == (vl, h)
    for mine, theirs in ((torch.cat([w.embed for w in ranks]), hf.model.embed_tokens.weight),
                         (torch.cat([w.lm_head for w in ranks]), hf.lm_head.weight)):
        assert torch.equal(mine[:v], theirs)
        assert not mine[v:].any(), "vocabulary padding rows must be zero"
    assert all(torch.equal(w.final_norm, hf.model.norm.weight) for w in ranks)
    d, hq, kvh = spec.head_dim, spec.num_heads, spec.num_kv_heads
    group = hq // kvh
    for i, hl in enumerate(hf.model.layers):
        layer = [w.layers[i] for w in ranks]
        att = hl.self_attn
        qs, ks, vs = zip(*(split_qkv(lw.attn, spec, hq // world) for lw in layer))
        assert torch.equal(torch.cat(qs), att.q_proj.weight)
        assert torch.equal(torch.cat([lw.attn.o for lw in layer], dim=1), att.o_proj.weight)
        for r, (k, vv) in enumerate(zip(ks, vs)):
            if dcp == world and world > 1:
                want = slice(0, kvh * d)  # every rank projects every KV head
            elif kvh >= world:
                want = slice(r * kvh // world * d, (r + 1) * kvh // world * d)
            else:
                head = r * (hq // world) // group
                want = slice(head * d, (head + 1) * d)
            assert torch.equal(k, att.k_proj.weight[want])
            assert torch.equal(vv, att.v_proj.weight[want])
            if spec.attention_bias:
                bq, bk, bv = layer[r].attn.qkv_bias.split(
                    [hq // world * d, layer[r].attn.kv_heads * d, layer[r].attn.kv_heads * d])
                assert torch.equal(bq, att.q_proj.bias.chunk(world)[r])
                assert torch.equal(bk, att.k_proj.bias[want])
                assert torch.equal(bv, att.v_proj.bias[want])
            else:
                assert layer[r].attn.qkv_bias is None
        if spec.qk_norm:
            assert all(torch.equal(lw.attn.q_norm, att.q_norm.weight) for lw in layer)
            assert all(torch.equal(lw.attn.k_norm, att.k_norm.weight) for lw in layer)
        assert all(torch.equal(lw.input_norm, hl.input_layernorm.weight) for lw in layer)
        assert all(torch.equal(lw.post_attn_norm, hl.post_attention_layernorm.weight)
                   for lw in layer)
        if not spec.moe_layers[i]:
            assert not hasattr(hl.mlp, "experts")
            check_dense([lw.mlp for lw in layer], hl.mlp)
            continue
        experts, gate = hl.mlp.experts, hl.mlp.gate
        im = spec.moe_intermediate
        w1 = [lw.mlp.w1 for lw in layer]
        assert all(t.shape == (spec.num_experts, 2 * im // world, h) for t in w1)
        assert torch.equal(torch.cat([t.chunk(2, dim=1)[0] for t in w1], dim=1),
                           experts.gate_up_proj[:, :im])
        assert torch.equal(torch.cat([t.chunk(2, dim=1)[1] for t in w1], dim=1),
                           experts.gate_up_proj[:, im:])
        assert torch.equal(torch.cat([lw.mlp.w2 for lw in layer], dim=2), experts.down_proj)
        for lw in layer:
            assert torch.equal(lw.mlp.router.float(), gate.weight.float())
            if spec.routing == "sigmoid_grouped":
                assert lw.mlp.router.dtype == torch.float32
                assert lw.mlp.correction_bias.dtype == torch.float32
                assert torch.equal(lw.mlp.correction_bias, gate.e_score_correction_bias.float())
            else:
                assert lw.mlp.router.dtype == torch.bfloat16 and lw.mlp.correction_bias is None
        if spec.num_shared_experts:
            check_dense([lw.mlp.shared for lw in layer], hl.mlp.shared_experts)
        else:
            assert all(lw.mlp.shared is None for lw in layer)


def test_kv_head_mapping_when_world_exceeds_kv_heads(ckpt_dir, hf_model):
    over = dict(num_attention_heads=8, num_key_value_heads=2)  # W=4: ranks 0,1 -> head 0
    spec, ranks = load_all(ckpt_dir("qwen3_moe-tiny", **over), 4)
    k_proj = hf_model("qwen3_moe-tiny", **over).model.layers[0].self_attn.k_proj.weight
    d = spec.head_dim
    for r, w in enumerate(ranks):
        assert w.layers[0].attn.kv_heads == 1
        k = w.layers[0].attn.qkv[2 * d:3 * d]
        assert torch.equal(k, k_proj[r // 2 * d:(r // 2 + 1) * d])
    assert head_shard(spec, Sharding(3, 4)) == HeadShard(q_start=6, q_heads=2, kv_start=1,
                                                         kv_heads=1)


def test_tied_embeddings_share_one_tensor(ckpt_dir):
    path = ckpt_dir("mixtral-tiny", tie_word_embeddings=True)
    assert not Checkpoint(path).has("lm_head.weight")
    _, ranks = load_all(path, 2)
    assert all(w.lm_head is w.embed for w in ranks)


def test_sharded_checkpoint_loads_like_single_file(ckpt_dir):
    sharded = ckpt_dir("glm4_moe-tiny", max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    _, a = load_all(sharded, 2)
    _, b = load_all(ckpt_dir("glm4_moe-tiny"), 2)
    for wa, wb in zip(a, b):
        assert torch.equal(wa.layers[2].mlp.w1, wb.layers[2].mlp.w1)
        assert torch.equal(wa.layers[1].attn.qkv, wb.layers[1].attn.qkv)
        assert torch.equal(wa.lm_head, wb.lm_head)


def test_fused_expert_layout_reads_like_per_expert(ckpt_dir, tmp_path):
    src = ckpt_dir("mixtral-tiny")
    spec = load_spec(src)
    with Checkpoint(src) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.names if ".experts." not in n}
        for i in range(spec.num_layers):
            p = f"model.layers.{i}.block_sparse_moe"
            gu = [torch.cat([ckpt.read(f"{p}.experts.{e}.w1.weight"),
                             ckpt.read(f"{p}.experts.{e}.w3.weight")]) for e in range(8)]
            tensors[f"{p}.experts.gate_up_proj"] = torch.stack(gu)  # [E, 2I, H]
            tensors[f"{p}.experts.down_proj"] = torch.stack(
                [ckpt.read(f"{p}.experts.{e}.w2.weight") for e in range(8)])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    for r in range(3):
        fused = load_routed(Checkpoint(tmp_path), spec, Sharding(r, 3), 1)
        per_expert = load_routed(Checkpoint(src), spec, Sharding(r, 3), 1)
        assert torch.equal(fused.w1, per_expert.w1) and torch.equal(fused.w2, per_expert.w2)


def test_progress_reports_every_step(ckpt_dir):
    path = ckpt_dir("qwen3_moe-tiny")
    spec = load_spec(path)
    seen = []
    load_weights(Checkpoint(path), spec, Sharding(), progress=lambda *a: seen.append(a))
    assert [s[0] for s in seen] == list(range(1, spec.num_layers + 3))
    assert all(s[1] == spec.num_layers + 2 for s in seen)
    assert seen[1][2] == "layer 1/3"


DIVISION_CASES = [  # (preset overrides, world, what the message names)
    ({}, 5, "num_attention_heads=12 does not divide over 5"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 2,
     "num_key_value_heads=3 does not divide over 2"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2}, 3, "read KV heads 0 and 1"),
]


@pytest.mark.parametrize("over,world,match", DIVISION_CASES,
                         ids=["heads", "kv-heads", "kv-straddle"])
def test_heads_that_do_not_divide_raise(over, world, match):
    spec = load_spec(preset_config("qwen3_moe-tiny", **over))
    with pytest.raises(ShapeError, match=match):
        head_shard(spec, Sharding(1, world))


def test_experts_and_mlps_that_do_not_divide_raise(ckpt_dir):
    path = ckpt_dir("glm4_moe-tiny")
    spec = load_spec(path)
    with pytest.raises(ShapeError, match="moe_intermediate_size=192 does not divide over 5"):
        load_routed(Checkpoint(path), spec, Sharding(0, 5), 1)
    with pytest.raises(ShapeError, match="num_attention_heads=6 does not divide over 4"):
        load_weights(Checkpoint(path), spec, Sharding(0, 4))
    for key, match in (("moe_intermediate_size", "moe_intermediate_size=99"),
                       ("intermediate_size", "intermediate_size=99")):
        odd = load_spec(preset_config("glm4_moe-tiny", **{key: 99}))
        with pytest.raises(ShapeError, match=f"{match} does not divide over 2"):
            load_weights(Checkpoint(path), odd, Sharding(0, 2))  # refused before any read


def test_loader_checks_shapes_against_config(ckpt_dir, tmp_path):
    src = ckpt_dir("qwen3_moe-tiny")
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48  # the files hold 192
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight.*model\.safetensors"
                                              r".*shape \(192, 64\); expected \(48, 64\)"):
        load_weights(Checkpoint(tmp_path), load_spec(tmp_path), Sharding())
