"""Every environment variable the library reads, in one place.

| variable | effect |
| --- | --- |
| TRITON_INTERPRET=1 | Triton runs kernels on the CPU (CPU ranks, CI). Read by Triton; we only query it. |
| SPARKINFER_TIMEOUT_S | default device-side wait deadline in seconds (default 10; `generate`'s CPU ranks 300) |
| SPARKINFER_LOG | `debug` prints pool/channel lifecycle events, and failed ranks' tracebacks, to stderr |
| SPARKINFER_COMMIT | commit recorded in benchmark rows, for trees copied without their `.git` |
| OPENAI_API_KEY | the key `sparkinfer bench serve --url` sends, as OpenAI's clients read it |
| SPARKINFER_API_KEY | `sparkinfer serve`'s API key without `--api-key` (a flag shows in `ps`, the environment not) |
| SPARKINFER_FLAGS | `module.path.NAME=value,...`: module flags set by the command line, every rank and the |
| | serving engine's process (`apply_flags`), for A/B runs (`benchmarks/sweeps/flags_ab.py`); rows record it |
"""

from __future__ import annotations

import math
import os
import sys

from sparkinfer.errors import SetupError


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_timeout_s() -> float:
    """SPARKINFER_TIMEOUT_S as a positive finite float (10 when unset or empty);
    SetupError quoting the value otherwise."""
    raw = os.environ.get("SPARKINFER_TIMEOUT_S", "").strip()
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SetupError(f"SPARKINFER_TIMEOUT_S={raw!r} is not a positive number of seconds; set it to e.g. 10, "
                         "or unset it for the default (10 s)")
    return value


# Device-side wait deadline given to CPU ranks unless SPARKINFER_TIMEOUT_S is set: the
# default 10 s is a GPU's. Under Triton's interpreter one rank may still be preparing its
# MoE weights while another waits at the first all-reduce: `generate --tp 4` of an
# 8-head tiny checkpoint on a loaded 2-core host failed with CollectiveTimeout at 10 s.
CPU_TIMEOUT_S = 300


def cpu_rank_env(backend: str) -> dict[str, str]:
    """The environment a launcher gives its ranks: SPARKINFER_TIMEOUT_S=CPU_TIMEOUT_S on CPU
    ranks unless it is set; nothing on a GPU."""
    return {"SPARKINFER_TIMEOUT_S": str(CPU_TIMEOUT_S)} if backend == "cpu" and not timeout_s_set() else {}


def timeout_s_set() -> bool:
    """True when SPARKINFER_TIMEOUT_S is set (non-empty): a launcher then leaves it to the ranks."""
    return bool(os.environ.get("SPARKINFER_TIMEOUT_S", "").strip())


def debug_log() -> bool:
    return os.environ.get("SPARKINFER_LOG", "") == "debug"


def bench_commit() -> str | None:
    """The commit benchmark rows record instead of `git rev-parse HEAD`, if set."""
    return os.environ.get("SPARKINFER_COMMIT") or None


def serve_api_key() -> str | None:
    """SPARKINFER_API_KEY, or None when unset or empty."""
    return os.environ.get("SPARKINFER_API_KEY") or None


def flags_text() -> str:
    """SPARKINFER_FLAGS as set ('' when unset)."""
    return os.environ.get("SPARKINFER_FLAGS", "").strip()


def parse_flags(text: str) -> dict[str, object]:
    """'module.path.NAME=value,...' -> {'module.path.NAME': value}; a value is a Python
    literal (4, True, 'ptx'), else its text. SetupError naming a malformed item."""
    import ast

    flags = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        path, eq, raw = item.partition("=")
        if not eq or "." not in path.strip("."):
            raise SetupError(f"SPARKINFER_FLAGS item {item!r}: write module.path.NAME=value, comma-separated "
                             "(e.g. sparkinfer.attention.launch.MERGE_IN_ATTENTION=False)")
        try:
            flags[path] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            flags[path] = raw
    return flags


_FLAGS_APPLIED: list[str] = []  # the SPARKINFER_FLAGS text this process has applied


def apply_flags(text: str | None = None) -> dict[str, object]:
    """Set the module flags of `text` (default SPARKINFER_FLAGS), each on a module that
    exists and already has the attribute (SetupError naming it otherwise); once per
    process and text. Called where a process starts its work (the command line, a rank,
    the serving engine's process), never at import. Returns the flags set."""
    text = flags_text() if text is None else text
    if text in _FLAGS_APPLIED:
        return parse_flags(text)
    flags = check_flags(text)
    for path, value in flags.items():
        mod, _, attr = path.rpartition(".")
        setattr(sys.modules[mod], attr, value)
    _FLAGS_APPLIED.append(text)
    return flags


def check_flags(text: str) -> dict[str, object]:
    """The flags of `text` when each names an existing module attribute (importing the
    modules, setting nothing); SetupError naming the first that does not."""
    import importlib

    flags = parse_flags(text)
    for path in flags:
        mod, _, attr = path.rpartition(".")
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise SetupError(f"SPARKINFER_FLAGS {path}: module {mod!r} does not import ({e})") from None
        if not hasattr(module, attr):
            raise SetupError(f"SPARKINFER_FLAGS {path}: {mod} has no flag {attr!r}")
    return flags


def client_api_key() -> str | None:
    """OPENAI_API_KEY, or None when unset or empty."""
    return os.environ.get("OPENAI_API_KEY") or None
