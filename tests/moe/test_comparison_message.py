"""A failed MoE check's message names the bounds that were applied, as written in
`TOLERANCES` (a stored GPU failure once read "max_rel ... (<= 1e-01)" for a bound of
0.15, because the bounds were printed with one significant digit)."""

from __future__ import annotations

import pytest
import torch

from sparkinfer.moe.reference import TOLERANCES, Comparison, Tolerance, compare_to_reference


@pytest.mark.parametrize("row, shown", [
    ("interpreter", ("(>= 0.9999)", "(<= 0.015)", "(<= 0.03)")),
    ("gpu", ("(>= 0.9999)", "(<= 0.01)", "(<= 0.03)")),
    ("gpu_fp8", ("(>= 0.9999)", "(<= 0.01)", "(<= 0.15)")),
])
def test_message_prints_each_bound_exactly(row, shown):
    c = Comparison(cosine=0.99995, rel_norm=1.01e-2, max_rel=2.58e-2, finite=True, tol=TOLERANCES[row])
    text = str(c)
    for s in shown:
        assert s in text, text
    assert "rel_norm 1.01e-02" in text and "max_rel 2.58e-02" in text


def test_message_of_a_real_comparison_matches_its_verdict():
    ref = torch.ones(4, 8)
    tol = Tolerance(cosine_min=0.9, rel_norm_max=0.125, max_rel_max=0.25)
    c = compare_to_reference(ref * 1.2, ref, tol)  # rel_norm 0.2 > 0.125: fails, and says which bound
    assert not c.ok
    assert "rel_norm 2.00e-01 (<= 0.125)" in str(c) and "max_rel 1.00e-01 (<= 0.25)" in str(c)
