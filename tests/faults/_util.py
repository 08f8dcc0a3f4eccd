"""Shared helpers of the fault suite: rank-encoded payloads and a case runner
that records, per case, "ok" or what went wrong (so one launch checks many cases)."""

from __future__ import annotations

import re

import torch

CAP = 8192  # bytes of staging: small, so capacity edges are cheap in the interpreter


def payload(rank: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Small integers: every partial sum is exact in bf16/fp16/fp32."""
    return ((torch.arange(n) * 5 + rank * 3 + salt) % 11).to(dtype)


def expected_sum(world: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    return sum(payload(r, n, torch.float32, salt) for r in range(world)).to(dtype)


def expect_raises(cases) -> list:
    """cases: (id, exception type, message regex, thunk). Returns the failures only."""
    bad = []
    for cid, exc, match, fn in cases:
        try:
            fn()
            bad.append((cid, "no error"))
        except exc as e:
            if not re.search(match, str(e)):
                bad.append((cid, f"wrong message: {e}"))
        except Exception as e:  # noqa: BLE001 - the point is to report the wrong type
            bad.append((cid, f"{type(e).__name__}: {e}"))
    return bad
