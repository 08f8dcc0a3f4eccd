"""Every environment variable the library reads, in one place (debug switches only).

| variable | effect |
| --- | --- |
| TRITON_INTERPRET=1 | Triton runs kernels on the CPU (CPU ranks, CI). Read by Triton; we only query it. |
| SPARKINFER_TIMEOUT_S | default device-side wait deadline in seconds (default 10) |
| SPARKINFER_LOG | `debug` prints pool/channel lifecycle events to stderr |
| SPARKINFER_COMMIT | commit recorded in benchmark rows, for trees copied without their `.git` |
"""

from __future__ import annotations

import os


def triton_interpret() -> bool:
    """True when Triton kernels run in the interpreter (CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_timeout_s() -> float:
    return float(os.environ.get("SPARKINFER_TIMEOUT_S", "10"))


def debug_log() -> bool:
    return os.environ.get("SPARKINFER_LOG", "") == "debug"


def bench_commit() -> str | None:
    """The commit benchmark rows record instead of `git rev-parse HEAD`, if set."""
    return os.environ.get("SPARKINFER_COMMIT") or None
