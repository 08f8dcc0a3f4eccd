"""`Checkpoint`: the tensors of a safetensors checkpoint directory, read by slices.

    ckpt = Checkpoint("/models/Qwen3-30B-A3B")        # reads the index, opens nothing yet
    ckpt.shape("model.embed_tokens.weight")            # (151936, 2048), from the header
    w = ckpt.read("model.layers.0.self_attn.q_proj.weight", dim=0, span=(0, 1024),
                  dtype=torch.bfloat16, device="cuda:0")   # only rows [0, 1024) are read

A directory holds `model.safetensors.index.json` (sharded; its `weight_map`
names the file of each tensor), or `model.safetensors`, or other `*.safetensors`
files (their headers name the tensors). Files are opened (memory-mapped) on
first use; safetensors checks each header and that the file covers every
tensor it lists, so a truncated file fails at open, before any read.

Every failure raises `CheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from sparkinfer.errors import CheckpointError

__all__ = ["Checkpoint", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
              "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Checkpoint:
    """The tensors of one checkpoint directory. Host-side only until `read` moves
    a slice to a device. Use as a context manager, or call `close()`, to drop the
    memory maps."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self._handles: dict[Path, object] = {}
        index = self.path / INDEX
        if index.is_file():
            self._where = str(index)
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index with a weight_map "
                                      f"({exc!r}); re-save the checkpoint") from exc
            self._file_of = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = [self.path / SINGLE] if (self.path / SINGLE).is_file() else \
                sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no {SINGLE}, {INDEX} or *.safetensors file")
            self._where = str(files[0]) if len(files) == 1 else f"{self.path}/*.safetensors"
            self._file_of = {}
            for f in files:
                for name in self._open(f, None).keys():  # noqa: SIM118 (a safe_open handle)
                    self._file_of[name] = f

    # -- lookup ---------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor name, sorted."""
        return tuple(sorted(self._file_of))

    def has(self, name: str) -> bool:
        """True when the checkpoint lists `name`."""
        return name in self._file_of

    def file_of(self, name: str) -> Path:
        """The file holding `name` (CheckpointError when it is not listed)."""
        f = self._file_of.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name!r} is missing from {self._where}; the checkpoint "
                                  "does not match its config.json (re-download or re-convert it)")
        return f

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header; reads no data."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """torch dtype from the file header; reads no data."""
        st = self._slice(name).get_dtype()
        if st not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self.file_of(name)} has safetensors dtype "
                                  f"{st}, which this loader does not read")
        return _ST_DTYPES[st]

    def expect(self, name: str, shape: tuple[int, ...], dtypes=FLOAT_DTYPES, *, what: str = ""):
        """Check `name`'s header against an expected shape and allowed dtypes.

        Raises CheckpointError naming the tensor, its file, what was found and what
        was expected (`what` says where the expectation comes from).
        """
        got, dt = self.shape(name), self.dtype(name)
        why = f" ({what})" if what else ""
        if got != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.file_of(name)} has shape {got}; "
                                  f"expected {tuple(shape)}{why}")
        if dt not in dtypes:
            raise CheckpointError(f"tensor {name!r} in {self.file_of(name)} has dtype {dt}; "
                                  f"expected one of {[str(d) for d in dtypes]}{why}")

    # -- reads ----------------------------------------------------------------------------

    def read(self, name: str, *, dim: int = 0, span: tuple[int, int] | None = None,
             dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        """Read `name`, or only indices [span[0], span[1]) along `dim`, without
        materialising the rest; cast to `dtype` (None keeps the stored dtype) and
        move to `device`. Returns a contiguous tensor. Allocates; reads from disk.
        """
        f = self.file_of(name)
        sl = self._slice(name)
        try:
            if span is None:
                t = self._open(f, name).get_tensor(name)
            else:
                ndim = len(sl.get_shape())
                if not 0 <= dim < ndim or not 0 <= span[0] <= span[1] <= sl.get_shape()[dim]:
                    raise CheckpointError(f"tensor {name!r} in {f}: slice {span} along dim {dim} "
                                          f"is outside its shape {tuple(sl.get_shape())}")
                t = sl[(slice(None),) * dim + (slice(span[0], span[1]),)]
        except SafetensorError as exc:
            raise CheckpointError(f"reading tensor {name!r} from {f} failed ({exc}); the file is "
                                  "damaged: re-download it") from exc
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device).contiguous()

    def open_all(self) -> None:
        """Open every file of the checkpoint (headers and memory maps only; reads no
        tensor data): a missing, truncated or corrupt file raises CheckpointError
        now, naming it, instead of when a rank first reads from it."""
        for f in sorted(set(self._file_of.values())):
            self._open(f, None)

    def close(self):
        """Drop the open file handles (memory maps). Reads after close reopen files."""
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Checkpoint({str(self.path)!r}, {len(self._file_of)} tensors)"

    # -- internals ------------------------------------------------------------------------

    def _slice(self, name: str):
        f = self.file_of(name)
        try:
            return self._open(f, name).get_slice(name)
        except SafetensorError as exc:
            raise CheckpointError(f"tensor {name!r} is listed for {f} but the file does not hold "
                                  f"it ({exc}); the index and the shards disagree") from exc

    def _open(self, f: Path, name: str | None):
        h = self._handles.get(f)
        if h is None:
            who = f"tensor {name!r}: " if name else ""
            if not f.is_file():
                raise CheckpointError(f"{who}file {f} does not exist (listed by {self._where}); "
                                      "download every shard")
            try:
                h = safe_open(str(f), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{who}file {f} is truncated or corrupt ({exc}); "
                                      "re-download it") from exc
            self._handles[f] = h
        return h
