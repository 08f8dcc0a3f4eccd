"""Provenance and result files of the benchmarks.

Every row a benchmark writes carries `metadata()`: GPU name and count, driver,
versions (python, torch, CUDA, triton, NCCL, numpy, cuda-bindings), commit and
whether the tree was dirty, UTC date, host and the command line without
machine-specific paths. `append_rows()` appends rows to a JSON list and strips
absolute paths from every string it writes (commands, error messages,
tracebacks), so a result file never names the machine's directories.

Nothing here imports torch at import time: rank processes re-import this
module, and CPU ranks must set TRITON_INTERPRET before Triton is imported.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkinfer import envs

__all__ = ["metadata", "command_line", "scrub_paths", "append_rows", "load_rows", "default_out",
           "machine_label", "gpu_info", "versions", "git_commit", "RESULTS_DIR",
           "SPEC_PEAKS", "spec_peaks"]

# Where result files live, relative to the repository root (the current directory of a run).
RESULTS_DIR = Path("benchmarks") / "results"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
# An absolute path: "/" at a boundary (not inside a word, a URL or a relative path),
# then components. Only its last component is kept.
_ABS_PATH = re.compile(r"(?<![\w.:/~-])(?:/[^\s/\"'`:,;=()\[\]]+)+/(?=[^\s/\"'`:,;=()\[\]]+)")


# Specified peaks, shown beside the rates each run measures (a measured rate is
# a floor a kernel may beat; the specified one is the part's bound). NVIDIA
# H200 SXM datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16 (1,979 sparse), 1,979
# TFLOP/s dense FP8 (3,958 sparse). H100 SXM5 ("NVIDIA H100 80GB HBM3"; the PCIe part is
# "NVIDIA H100 PCIe"): 3.35 TB/s HBM3, the same tensor-core rates.
SPEC_PEAKS = {"NVIDIA H200": dict(spec_hbm_gbs=4800.0, spec_bf16_tflops=989.0, spec_fp8_tflops=1979.0),
              "NVIDIA H100 80GB HBM3": dict(spec_hbm_gbs=3350.0, spec_bf16_tflops=989.0, spec_fp8_tflops=1979.0)}


def spec_peaks(gpu: str | None) -> dict:
    """{"spec_hbm_gbs", "spec_bf16_tflops", "spec_fp8_tflops"} for a GPU name starting with a known
    part ("NVIDIA H200", "NVIDIA H200 NVL" ...), else {}."""
    for name, peaks in SPEC_PEAKS.items():
        if gpu and gpu.startswith(name):
            return dict(peaks)
    return {}


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=_PACKAGE_DIR)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def gpu_info() -> dict:
    """{"gpu": name of GPU 0 or "cpu", "gpu_count", "driver"}, from nvidia-smi when it
    answers (so the calling process creates no CUDA context), else from torch."""
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        rows = [[f.strip() for f in line.split(",")] for line in smi.splitlines() if line.strip()]
        return {"gpu": rows[0][0], "gpu_count": len(rows), "driver": rows[0][-1]}
    import torch

    if not torch.cuda.is_available():
        return {"gpu": "cpu", "gpu_count": 0, "driver": None}
    return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(), "driver": None}


def versions() -> dict:
    """Versions of python, torch, CUDA, triton, cuda-bindings, numpy and NCCL (None where absent)."""
    import importlib.metadata as im

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("triton", "cuda-bindings", "numpy"):
        try:
            out[dist] = im.version(dist)
        except im.PackageNotFoundError:
            out[dist] = None
    try:
        v = torch.cuda.nccl.version() if torch.version.cuda else None
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else v
    except Exception:  # noqa: BLE001 - provenance only
        out["nccl"] = None
    return out


def git_commit() -> dict:
    """{"commit": SPARKINFER_COMMIT if set (a copied tree may carry no or a stale .git),
    else the HEAD of the repository holding this package; "dirty": bool, or None when
    the commit came from the environment or there is no repository}."""
    forced = envs.bench_commit()
    if forced:
        return {"commit": forced, "dirty": None}
    head = _run(["git", "rev-parse", "HEAD"])
    if head is None:
        return {"commit": None, "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"commit": head, "dirty": bool(status)}


def scrub_paths(value):
    """`value` (str, or dicts and lists of them) with every absolute path cut to its
    last component: "/data/me/out/x.json" -> "x.json". Other values pass through."""
    if isinstance(value, str):
        return _ABS_PATH.sub("", value)
    if isinstance(value, dict):
        return {k: scrub_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_paths(v) for v in value]
    return value


def command_line(argv) -> str:
    """The command as a user would retype it, without machine paths: paths inside the
    current directory become relative to it, other absolute paths keep their last
    component. argv: ["sparkinfer", "bench", "comm", "--out", "/abs/x.json", ...]."""
    cwd = os.getcwd()

    def one(arg: str) -> str:
        key, eq, val = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if os.path.isabs(val):
            rel = os.path.relpath(val, cwd)
            val = rel if not rel.startswith("..") else os.path.basename(val.rstrip("/"))
        return key + eq + val

    return shlex.join([one(str(a)) for a in argv])


def metadata(args=None) -> dict:
    """Everything a result row needs to be traced back to a machine and a commit.

    args: the parsed arguments of a `sparkinfer bench` run; the CLI stores the
    command it parsed in `args.argv`. Without it, the process's sys.argv is used."""
    argv = getattr(args, "argv", None) or ["python3", *sys.argv]
    return {
        **gpu_info(),
        **versions(),
        **git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "host": os.uname().nodename,
        **({"flags": flags} if (flags := envs.flags_text()) else {}),  # SPARKINFER_FLAGS of the run
    }


def machine_label(meta: dict, world_size: int) -> str:
    """"2xh200" for 2 ranks on NVIDIA H200s, "h200" for one, "cpu" for CPU ranks: the model's
    first word of letters then digits ("NVIDIA H100 80GB HBM3" -> "h100", as the files in
    benchmarks/results are named), else the name without vendor words and separators."""
    name = str(meta.get("gpu") or "cpu").lower()
    for word in ("nvidia", "geforce", "tesla"):
        name = name.replace(word, "")
    model = next((w for w in re.split(r"[^a-z0-9]+", name) if re.fullmatch(r"[a-z]+\d+", w)), None)
    name = model or re.sub(r"[^a-z0-9]+", "", name) or "gpu"
    return name if world_size <= 1 or name == "cpu" else f"{world_size}x{name}"


def default_out(bench: str, meta: dict, world_size: int, *, dry_run: bool, sweep: bool = False) -> Path:
    """benchmarks/results/<bench>_<machine>.json, or results/sweeps/<bench>_sweep_<machine>.json
    for a sweep; a dry run writes under the system's temporary directory instead, so
    it never touches the results tree."""
    name = f"{bench}_sweep" if sweep else bench
    if dry_run:
        return Path(tempfile.gettempdir()) / "sparkinfer_bench" / f"{name}_dry_run.json"
    return (RESULTS_DIR / "sweeps" if sweep else RESULTS_DIR) / f"{name}_{machine_label(meta, world_size)}.json"


def append_rows(path: str | os.PathLike, rows: list[dict], meta: dict) -> Path:
    """Append `rows` (each merged with `meta`, paths scrubbed) to the JSON list at
    `path`, atomically; creates the file and its directory. Earlier runs in the file
    are kept (a run may be written in parts). Returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = load_rows(path)
    new = [scrub_paths({**meta, **r}) for r in rows]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(old + new, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def load_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a result file; [] when it does not exist or does not parse."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else [data]
