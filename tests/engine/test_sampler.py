"""Per-row sampling: the kernel against its host reference, filters, and a row's draw
depending on that row alone."""

import math

import pytest
import torch

from sparkinfer.engine.request import SamplingParams as SP
from sparkinfer.engine.sampler import (
    STREAM_DRAFT,
    STREAM_TARGET,
    RowSampling,
    filter_thresholds,
    row_probabilities,
    sample_rows,
    uniforms,
)
from sparkinfer.errors import ShapeError

V = 300


def _draw(logits, params, counters, filtered=None, stream=STREAM_TARGET, chunk=None):
    rows = RowSampling.alloc(logits.shape[0], "cpu")
    rows.fill(params, counters)
    out = torch.full((logits.shape[0],), -7, dtype=torch.int64)  # poisoned
    filt = RowSampling.needs_filter(params) if filtered is None else filtered
    return sample_rows(logits, rows, filtered=filt, stream=stream, out=out, chunk=chunk).tolist()


def _reference(x, p: SP, counter, stream=STREAM_TARGET):
    """The draw by definition: argmax over kept tokens of x / T + Gumbel(uniforms)."""
    x = x.float()
    if p.temperature == 0:
        return int(x.argmax())
    keep = torch.ones_like(x, dtype=torch.bool)
    srt = x.sort(descending=True).values
    if p.top_k:
        keep &= x >= srt[p.top_k - 1]
    if p.top_p < 1:
        pr = torch.softmax(srt / p.temperature, -1)
        n = int(((pr.cumsum(-1) - pr) < p.top_p).sum())
        keep &= x >= srt[max(n, 1) - 1]
    g = -torch.log(-torch.log(uniforms(p.seed, counter, stream, x.shape[0])))
    return int(torch.where(keep, x / p.temperature + g, -math.inf).argmax())


def test_kernel_matches_the_reference_per_row():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, V, generator=gen) * 3).to(torch.bfloat16)
    params = [SP(), SP(temperature=1.0, seed=5), SP(temperature=0.7, top_k=5, seed=9),
              SP(temperature=1.3, top_p=0.5, seed=3), SP(temperature=0.5, top_p=0.9, top_k=40, seed=2**62 + 7),
              SP(temperature=2.0, top_k=1, seed=11)]
    counters = [10, 11, 12, 13, 14, 15]
    got = _draw(logits, params, counters)
    want = [_reference(logits[i], params[i], counters[i]) for i in range(6)]
    assert got == want
    # the GPU's split of a row over programs (chunks of 64 and 100 tokens here) draws the same
    assert _draw(logits, params, counters, chunk=64) == want == _draw(logits, params, counters, chunk=100)
    assert got[0] == int(logits[0].float().argmax()) and got[5] == int(logits[5].float().argmax())
    # another stream draws other variates (the draft's proposals vs the target's draws)
    other = _draw(logits, params, counters, stream=STREAM_DRAFT)
    assert other[0] == got[0] and other[1:5] != got[1:5]


def test_a_row_draws_the_same_whatever_its_neighbours_and_place():
    gen = torch.Generator().manual_seed(2)
    probe = (torch.randn(V, generator=gen) * 2).to(torch.bfloat16)
    p = SP(temperature=0.9, top_p=0.95, seed=1234)
    alone = _draw(probe[None], [p], [40])[0]
    for n in (2, 5, 8):
        rows = (torch.randn(n, V, generator=gen) * 2).to(torch.bfloat16)
        at = int(torch.randint(0, n, (1,), generator=gen))
        rows[at] = probe
        others = [SP(temperature=float(t), top_k=int(k), seed=int(s))
                  for t, k, s in zip(torch.rand(n, generator=gen) * 2, torch.randint(0, 9, (n,), generator=gen),
                                     torch.randint(0, 10**6, (n,), generator=gen))]
        others[at] = p
        counters = torch.randint(0, 500, (n,), generator=gen).tolist()
        counters[at] = 40
        assert _draw(rows, others, counters, filtered=True)[at] == alone


def test_draws_follow_the_filtered_distribution():
    """2000 seeds of one row through the host reference (which the kernel equals, above):
    frequencies against softmax(x / T) over the top-k set, and no token outside it
    (total variation < 0.05 at 2000 draws over 8 tokens)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, generator=gen) * 2
    p = SP(temperature=0.8, top_k=8, seed=0)
    n = 2000
    ids = torch.tensor([_reference(x[0], SP(temperature=0.8, top_k=8, seed=s), 5) for s in range(n)])
    assert _draw(x.expand(8, 64).contiguous(), [SP(temperature=0.8, top_k=8, seed=s) for s in range(8)],
                 [5] * 8) == ids[:8].tolist()
    want = row_probabilities(x, p)[0]
    freq = torch.bincount(ids, minlength=64).float() / n
    assert set(ids.tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert 0.5 * (freq - want).abs().sum() < 0.05


def test_write_from_columns_is_write_from_params():
    """The runner writes a step's sampling inputs from the plan's columns in bulk: the same
    bits as from the rows' SamplingParams (fp32 from fp64, padding rows greedy)."""
    import numpy as np

    from sparkinfer.engine.plan import SamplingColumns

    params = [SP(temperature=0.7, top_p=0.9, seed=2**62 + 5), SP(), SP(temperature=1 / 3, top_k=7, seed=1)]
    hosts = [{name: np.full(5, 99, dtype=torch.empty(0, dtype=dt).numpy().dtype) for name, dt in RowSampling.FIELDS}
             for _ in range(2)]
    RowSampling.write(hosts[0], params, [4, 5, 6])
    RowSampling.write(hosts[1], SamplingColumns.of(params), np.array([4, 5, 6]))
    for name, _ in RowSampling.FIELDS[:-1]:
        assert hosts[0][name].tobytes() == hosts[1][name].tobytes(), name
    assert hosts[1]["temperature"][3:].tolist() == [0.0, 0.0] and hosts[1]["top_p"][1] == 1.0


def test_thresholds():
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0], [3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rows = RowSampling.alloc(3, "cpu")
    rows.fill([SP(temperature=1.0, top_k=2), SP(temperature=1.0, top_p=0.6), SP(temperature=1.0)], [0, 0, 0])
    thr = filter_thresholds(x, rows, rows.thr).tolist()
    # top-2 keeps 3 and 2; p(3) = 0.64 >= 0.6 alone; the third row keeps all
    assert thr[0] == 2.0 and thr[1] == 3.0 and thr[2] == -math.inf


def test_uniforms_are_open_and_spread():
    u = uniforms(7, 3, 0, 4096)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02
    assert not torch.equal(u, uniforms(7, 4, 0, 4096)) and not torch.equal(u, uniforms(8, 3, 0, 4096))


def test_rejections():
    rows = RowSampling.alloc(2, "cpu")
    with pytest.raises(ShapeError, match="3 rows' params"):
        rows.fill([SP()] * 3, [0, 0, 0])
    with pytest.raises(ShapeError, match="logits \\[3, 8\\]"):
        sample_rows(torch.zeros(3, 8), rows, filtered=False)
    for bad, match in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"), (dict(max_new_tokens=0), "max_new"),
                       (dict(logprobs=21), "logprobs"), (dict(stop=("",)), "stop="),
                       (dict(temperature=float("nan")), "temperature")):
        with pytest.raises(ShapeError, match=match):
            SP(**bad)


def test_a_top_k_past_the_vocabulary_keeps_every_token():
    """top_k at or past the vocabulary keeps all, however large: stored as MAX_TOP_K, it
    fits the plan's int64 words and the device's int32 (2**32 + 1 wrapped to 1 there, and
    2**63 stopped the engine with an OverflowError) and draws what top_k = 0 draws."""
    import numpy as np

    from sparkinfer.engine.plan import SamplingColumns
    from sparkinfer.engine.request import MAX_TOP_K

    x = torch.randn(8, V, generator=torch.Generator().manual_seed(11))
    want = _draw(x, [SP(temperature=1.0, seed=s) for s in range(8)], [3] * 8)
    for k in (V, 2**32 + 1, 2**63, 2**70):
        params = [SP(temperature=1.0, top_k=k, seed=s) for s in range(8)]
        assert params[0].top_k == min(k, MAX_TOP_K)
        host = {name: np.zeros(8, dtype=torch.empty(0, dtype=dt).numpy().dtype) for name, dt in RowSampling.FIELDS}
        RowSampling.write(host, SamplingColumns.of(params), np.full(8, 3))
        assert host["top_k"].tolist() == [min(k, MAX_TOP_K)] * 8, k
        assert _draw(x, params, [3] * 8, filtered=True) == want, k
