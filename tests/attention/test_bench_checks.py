"""`sparkinfer bench attention` takes each timed row's `ok` from the output of the
graph it timed (was: ok=True on every timing): a kernel that computes a wrong
answer only when timed must fail its row, and the run's exit status."""

from __future__ import annotations

import types

import pytest
import torch

from sparkinfer.bench import attention as bench


def _point():
    torch.manual_seed(0)
    return bench.Point(torch, "cpu", (4, 2), 2, 40, 0, 32)


def test_compare_passes_bf16_rounding_and_fails_a_scale_error_or_nan():
    p = _point()
    ref_out, ref_lse = bench.reference(p, p.slots[0])
    assert bench.compare(ref_out.bfloat16(), ref_out, ref_lse, ref_lse)["ok"]
    scaled = bench.compare(ref_out * 1.5, ref_out)
    assert not scaled["ok"] and scaled["out_rel_norm"] == pytest.approx(0.5, rel=1e-4)
    nan = bench.compare(torch.full_like(ref_out, float("nan")), ref_out)
    assert not nan["ok"] and not nan["finite"]


def test_timed_rows_take_ok_from_the_timed_output(monkeypatch):
    """Ours scaled by 1.5 inside the timed calls only: the eager check passes, our
    timed row fails, the torch peers' rows pass on their own outputs."""
    import sparkinfer.attention as attn

    real = attn.decode_attention

    def scaled(*a, **k):
        out, lse = real(*a, **k)
        if k.get("out") is not None:  # the timed calls pass out=; the eager check does not
            out.mul_(1.5)
        return out, lse

    p = _point()
    assert bench.check(p)["ok"]
    monkeypatch.setattr(attn, "decode_attention", scaled)
    args = types.SimpleNamespace(dry_run=True, sweep=False, no_peers=False)
    rows = bench.time_point(torch, p, False, {"copy_gbs": 1.0}, args)
    verdicts = {r["impl"]: r["ok"] for r in rows}
    assert verdicts == {"sparkinfer": False, "sparkinfer-batch-dependent": False, "torch_gather_sdpa": True,
                        "torch_sdpa_pregathered": True}
    ours = next(r for r in rows if r["impl"] == "sparkinfer")
    assert ours["check_out_rel_norm"] == pytest.approx(0.5, abs=1e-2) and ours["check_lse_max_err"] <= 1e-3


def test_table_shows_the_specified_hbm_rate_beside_the_measured_copy_rate(capsys):
    """On a GPU with a specified peak (H200: 4.8 TB/s) the '% HBM (% copy)' cell carries
    both fractions; on an unknown part only the measured one."""
    row = dict(kind="time", model="qwen3", batch=1, context=512, impl="sparkinfer", num_splits=4, us=10.0,
               kv_gbs=4500.0, frac_copy=4500.0 / 4200.0, frac_spec_hbm=4500.0 / 4800.0)
    bench.print_summary([row], "")
    out = capsys.readouterr().out
    assert "% HBM (% copy)" in out and "93.8 (107.1)" in out
    bench.print_summary([{k: v for k, v in row.items() if k != "frac_spec_hbm"}], "")
    assert "– (107.1)" in capsys.readouterr().out
