"""What a CUDA device has, asked once per device: its SM count (host-side, cached, no sync)."""

from __future__ import annotations

import functools

import torch

__all__ = ["cuda_sm_count"]


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_sm_count(device: torch.device) -> int:
    """SMs of CUDA device `device` (its index, or the current device when it has none)."""
    return _sms(device.index if device.index is not None else torch.cuda.current_device())
