"""Tiny checkpoints made once per session, and transformers' view of them."""

import pytest
import torch

from sparkinfer.models.presets import make_checkpoint, write_nvfp4_checkpoint

PRESETS = ("qwen3_moe-tiny", "glm4_moe-tiny", "mixtral-tiny")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny tensors run faster on one thread: quantize_nvfp4 of an [8, 96, 64] stack
    took 0.63 s with torch's 2 threads on a shared, loaded 2-core box and 1.2 ms
    with one (the second OpenMP thread waits on a core other processes hold)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """ckpt_dir(preset, **overrides) -> a saved tiny checkpoint directory (cached)."""
    made = {}

    def get(preset, **overrides):
        key = (preset, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_checkpoint(preset, tmp_path_factory.mktemp(preset), **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def nvfp4_dir(ckpt_dir, tmp_path_factory):
    """nvfp4_dir(preset, shared=...) -> the preset rewritten in the ModelOpt NVFP4 layout."""
    made = {}

    def get(preset, shared=True):
        if (preset, shared) not in made:
            made[preset, shared] = write_nvfp4_checkpoint(
                ckpt_dir(preset), tmp_path_factory.mktemp(f"{preset}-nvfp4"),
                shared_gate_up_scale=shared)
        return made[preset, shared]

    return get


@pytest.fixture(scope="session")
def hf_model(ckpt_dir):
    """hf_model(preset) -> transformers' model loaded from the tiny checkpoint (bf16)."""
    import transformers

    made = {}

    def get(preset, **overrides):
        key = (preset, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt_dir(preset, **overrides), dtype=torch.bfloat16)
        return made[key]

    return get
