"""A `Checkpoint` over tensors already in memory (a state dict), for the loader.

    src = TensorSource(model.state_dict())       # e.g. random weights made on the GPU
    weights = load_weights(src, spec, Sharding(0, 1), device="cuda")

The benchmark builds realistic models this way: no checkpoint is written, and
the loader, slicing and expert stacking are the same code that reads files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparkinfer.errors import CheckpointError
from sparkinfer.models.checkpoint import Checkpoint

__all__ = ["TensorSource"]


class TensorSource(Checkpoint):
    """tensors: name -> tensor (any device). Reads slice, cast and move like `Checkpoint.read`."""

    def __init__(self, tensors: dict, label: str = "<memory>"):
        self.path = Path(label)
        self._where = label
        self._tensors = dict(tensors)
        self._file_of = {name: self.path for name in self._tensors}
        self._handles = {}

    def shape(self, name: str) -> tuple[int, ...]:
        self.file_of(name)
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        self.file_of(name)
        return self._tensors[name].dtype

    def read(self, name: str, *, dim: int = 0, span: tuple[int, int] | None = None,
             dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        self.file_of(name)
        t = self._tensors[name]
        if span is not None:
            if not 0 <= dim < t.dim() or not 0 <= span[0] <= span[1] <= t.shape[dim]:
                raise CheckpointError(f"tensor {name!r} in {self._where}: slice {span} along dim {dim} "
                                      f"is outside its shape {tuple(t.shape)}")
            t = t.narrow(dim, span[0], span[1] - span[0])
        return t.to(device=device, dtype=dtype or t.dtype).contiguous()
