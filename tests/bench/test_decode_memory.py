"""`bench decode`'s memory check: the weights it counts are the bytes the loader returns,
and it refuses, before anything is built, a model that cannot fit (GLM-4.5-Air at its
46 layers in bf16 on one H200), naming the bytes needed and the bytes free."""

from __future__ import annotations

import argparse

import pytest
import torch

from sparkinfer.bench import decode
from sparkinfer.bench.decode_memory import check_fits, memory_need
from sparkinfer.errors import CapacityError
from sparkinfer.models.config import load_spec
from sparkinfer.models.loader import load_weights
from sparkinfer.models.presets import preset_config
from sparkinfer.models.random_source import RandomSource
from sparkinfer.models.weights import Sharding
from sparkinfer.quant.nvfp4 import NVFP4Tensor

H200_FREE = 140_000_000_000  # an idle H200 reports about 149e9 bytes free (139 GiB); with margin


def _args(*argv: str):
    p = argparse.ArgumentParser()
    decode.add_arguments(p)
    args = p.parse_args(list(argv))
    assert decode.resolve(args) is None
    return args


def _bytes(x, seen) -> int:
    if isinstance(x, torch.Tensor):
        if x.data_ptr() in seen:  # lm_head may be embed
            return 0
        seen.add(x.data_ptr())
        return x.numel() * x.element_size()
    if isinstance(x, NVFP4Tensor):
        return sum(_bytes(t, seen) for t in (x.packed, x.scales, x.global_scale))
    if isinstance(x, list):
        return sum(_bytes(t, seen) for t in x)
    if hasattr(x, "__dataclass_fields__"):
        return sum(_bytes(getattr(x, f), seen) for f in x.__dataclass_fields__)
    return 0


@pytest.mark.parametrize("preset", ["qwen3_moe-tiny", "glm4_moe-tiny", "mixtral-tiny"])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("world", [1, 2])
def test_weights_counted_are_the_bytes_loaded(preset, fmt, world):
    cfg = preset_config(preset)
    spec, sh = load_spec(cfg), Sharding(world - 1, world)
    loaded = _bytes(load_weights(RandomSource(cfg), spec, sh, moe_format=fmt), set())
    assert memory_need(spec, fmt, source="random-direct", batch=1, max_len=16, sharding=sh).weights == loaded


def test_glm_air_at_full_depth_in_bf16_is_refused_naming_both_numbers():
    args = _args("--presets", "glm-4.5-air", "--full-depth", "--weights", "random-direct", "--formats", "bf16")
    with pytest.raises(CapacityError, match=r"glm-4\.5-air at 46 layers with bf16 experts and --weights random-direct "
                                            r"needs about 2\d\d\.\d GB on one device \(weights 213\.8, .*\), but "
                                            r"the device has 140\.0 GB free; use --formats nvfp4"):
        decode.check_memory(args, H200_FREE)


def test_full_depth_rows_that_fit_one_h200():
    # Qwen3-30B-A3B 61 GB and Mixtral-8x7B 93 GB of bf16; GLM-4.5-Air's experts in NVFP4: 71 GB
    decode.check_memory(_args("--presets", "qwen3-30b-a3b,mixtral-8x7b", "--full-depth", "--weights",
                              "random-direct", "--formats", "bf16", "--batches", "1,8"), H200_FREE)
    decode.check_memory(_args("--presets", "glm-4.5-air", "--full-depth", "--weights", "random-direct",
                              "--formats", "nvfp4", "--batches", "1,8"), H200_FREE)
    # the transformers path holds a second copy: Mixtral at full depth no longer fits
    with pytest.raises(CapacityError, match=r"mixtral-8x7b at 32 layers .* transformers model 93\.4"):
        decode.check_memory(_args("--presets", "mixtral-8x7b", "--full-depth", "--formats", "bf16"), H200_FREE)


def test_glm_air_nvfp4_at_full_depth_fits_an_h100_since_quantizing_goes_a_few_experts_at_a_time():
    """quant.nvfp4.QUANTIZE_CHUNK_BYTES: a layer's experts are quantized a few at a time, so
    the build's temporaries are about 6 GB (the largest drawn tensor) where the whole layer's
    fp32 temporaries counted 34 GB, and the 81.6 GB fit the 84.5 GB an H100 had free; a
    refusal of NVFP4 experts does not suggest NVFP4."""
    args = _args("--presets", "glm-4.5-air", "--full-depth", "--weights", "random-direct", "--formats", "nvfp4",
                 "--batches", "1,8")
    decode.check_memory(args, 84_500_000_000)
    with pytest.raises(CapacityError, match=r"build temporaries 6\.2, .* use fewer --layers") as e:
        decode.check_memory(args, 80_000_000_000)
    assert "--formats nvfp4" not in str(e.value)


def test_the_refusal_counts_every_part():
    need = memory_need(load_spec(preset_config("mixtral-8x7b")), "bf16", source="random-direct", batch=8,
                       max_len=576)
    check_fits(need, need.total, "fits exactly")
    with pytest.raises(CapacityError, match=r"x needs about .* \(weights 93\.4, build temporaries .*, KV cache .*, "
                                            r"reserve 4\.0 GB\)"):
        check_fits(need, need.total - 1, "x")


@pytest.mark.parametrize("argv, why", [
    (("--full-depth", "--layers", "4"), "--full-depth with --layers 4"),
    (("--weights", "random-direct", "--hf-batches", "1"), "there is no transformers model"),
    (("--impls", "sparkinfer,vllm"), "--impls sparkinfer,vllm"),
], ids=["depth-and-layers", "no-transformers-rows", "unknown-impl"])
def test_refused_option_combinations(argv, why):
    p = argparse.ArgumentParser()
    decode.add_arguments(p)
    assert why in decode.resolve(p.parse_args(list(argv)))
