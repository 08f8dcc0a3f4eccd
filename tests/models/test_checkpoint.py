"""Checkpoint: slices equal the full tensor's, and every damaged input names tensor and file."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparkinfer.errors import CheckpointError
from sparkinfer.models import Checkpoint, Sharding, load_spec, load_weights


def test_headers_and_slices_match_the_full_tensors(ckpt_dir):
    path = ckpt_dir("glm4_moe-tiny")
    full = load_file(str(path / "model.safetensors"))
    ckpt = Checkpoint(path)
    assert set(ckpt.names) == set(full)
    name = "model.layers.1.self_attn.o_proj.weight"
    assert ckpt.has(name) and not ckpt.has("model.layers.9.self_attn.o_proj.weight")
    assert ckpt.shape(name) == tuple(full[name].shape) and ckpt.dtype(name) == torch.bfloat16
    # transformers keeps GLM's router in fp32 (_keep_in_fp32_modules_strict)
    assert ckpt.dtype("model.layers.1.mlp.gate.weight") == torch.float32
    assert torch.equal(ckpt.read(name, dim=1, span=(32, 96)), full[name][:, 32:96])
    assert torch.equal(ckpt.read(name, dim=0, span=(8, 9)), full[name][8:9])
    got = ckpt.read(name, dim=0, span=(0, 4), dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, full[name][:4].float())
    with pytest.raises(CheckpointError, match=r"slice \(0, 999\) along dim 1 is outside"):
        ckpt.read(name, dim=1, span=(0, 999))


def test_sharded_index_maps_names_to_files(ckpt_dir):
    path = ckpt_dir("glm4_moe-tiny", max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    ckpt = Checkpoint(path)
    assert set(ckpt.names) == set(index)
    for name in ("lm_head.weight", "model.layers.2.mlp.experts.7.down_proj.weight"):
        assert ckpt.file_of(name) == path / index[name]
        assert torch.equal(ckpt.read(name), load_file(str(path / index[name]))[name])


def copy_without(src, dst, drop=(), replace=None):
    tensors = load_file(str(src / "model.safetensors"))
    for n in drop:
        del tensors[n]
    tensors.update(replace or {})
    dst.mkdir(exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_missing_tensor_names_tensor_and_file(ckpt_dir, tmp_path):
    src = ckpt_dir("qwen3_moe-tiny")
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    path = copy_without(src, tmp_path / "c", drop=[gone])
    with pytest.raises(CheckpointError, match=rf"{gone.replace('.', '[.]')}.* missing from "
                                              rf".*c/model\.safetensors"):
        load_weights(Checkpoint(path), load_spec(path), Sharding(1, 2))


def test_misshaped_tensor_names_tensor_file_and_expectation(ckpt_dir, tmp_path):
    src = ckpt_dir("mixtral-tiny")
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = torch.zeros(190, 64, dtype=torch.bfloat16)
    path = copy_without(src, tmp_path / "c", replace={name: bad})
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' in .*c/model\.safetensors has "
                                              r"shape \(190, 64\); expected \(192, 64\)"):
        load_weights(Checkpoint(path), load_spec(path), Sharding())


def test_wrong_dtype_names_tensor_and_file(ckpt_dir, tmp_path):
    src = ckpt_dir("mixtral-tiny")
    name = "model.layers.0.input_layernorm.weight"
    path = copy_without(src, tmp_path / "c", replace={name: torch.ones(64, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=r"input_layernorm\.weight' in .*model\.safetensors "
                                              r"has dtype torch\.int32; expected one of"):
        load_weights(Checkpoint(path), load_spec(path), Sharding())


@pytest.mark.parametrize("keep", [4, 1000, -100], ids=["header", "metadata", "body"])
def test_truncated_single_file(ckpt_dir, tmp_path, keep):
    path = copy_without(ckpt_dir("qwen3_moe-tiny"), tmp_path / "c")
    f = path / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(keep if keep > 0 else size + keep)
    with pytest.raises(CheckpointError, match=r"file .*c/model\.safetensors is truncated"):
        Checkpoint(path)


def test_truncated_shard_fails_at_first_read_naming_tensor(ckpt_dir, tmp_path):
    src = ckpt_dir("glm4_moe-tiny", max_shard_size="60KB")
    path = tmp_path / "c"
    shutil.copytree(src, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / index["model.layers.1.self_attn.q_proj.weight"]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 64)
    ckpt = Checkpoint(path)  # the index alone opens nothing
    with pytest.raises(CheckpointError, match=rf"tensor '.*': file .*{shard.name} is truncated"):
        load_weights(ckpt, load_spec(path), Sharding())


def test_missing_shard_file_and_empty_directory(ckpt_dir, tmp_path):
    src = ckpt_dir("glm4_moe-tiny", max_shard_size="60KB")
    path = tmp_path / "c"
    shutil.copytree(src, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    (path / index["lm_head.weight"]).unlink()
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight': file .* does not exist"):
        Checkpoint(path).read("lm_head.weight")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nowhere")
